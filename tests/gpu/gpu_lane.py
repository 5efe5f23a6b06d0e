"""Helpers of the GPU lane (tests/gpu, ``pytest -m gpu``): the lane's device and precision, tiny
recipes placed on it, a tracker that watches a run from inside, and run comparisons.

The lane runs on CUDA when torch sees a GPU; without one every test skips ("needs a CUDA
device"), unless ``FLOWRL_GPU_LANE_DEVICE=cpu`` runs it on the CPU (fp32 instead of bf16) so
that its logic is checked on a machine without a GPU. ``FLOWRL_GPU_LANE_DEVICE=cuda`` (or
``cuda:N``) insists on a GPU: the lane then fails, rather than skips, where torch sees none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from flowrl import hookimpl

#: the variable that moves the lane to the CPU ("cpu") or insists on a GPU ("cuda", "cuda:N")
DEVICE_VARIABLE = "FLOWRL_GPU_LANE_DEVICE"
NEEDS_CUDA = "needs a CUDA device"
#: bf16 runs of the tiny models: re-scoring in another batch shape may round a velocity by one
#: bf16 ulp. The self-test's bound for a 1024-element latent (flowrl/diagnostics/selftest.py,
#: docs/distributed.md "Mixed precision and the on-policy check"); fp32 keeps flowrl's 1e-6.
BF16_ON_POLICY_TOLERANCE = 1e-3
#: Keys of a metrics row that are wall-clock times or memory: never compared between runs.
NOT_REPEATED = ("time/", "speed/", "memory/")


@dataclasses.dataclass(frozen=True)
class Lane:
    """Where the lane runs: ``device`` (``cuda`` or ``cpu``) and whether compute is bf16."""

    device: torch.device
    bf16: bool

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def precision(self) -> str:
        return "bf16" if self.bf16 else "fp32"

    def placed(self) -> list[str]:
        """``--set`` overrides that put a recipe of the embedded model on the lane's device, in
        its precision: bf16 compute with fp32 master weights on a GPU (``[distributed]
        mixed_precision``, and the on-policy tolerance bf16 needs), fp32 on the CPU."""
        sets = [f"run.device={str(self.device)!r}", "log.progress=false"]
        if self.bf16:
            sets += ["distributed.mixed_precision='bf16'", f"train.on_policy_tolerance={BF16_ON_POLICY_TOLERANCE}"]
        return sets

    def skip_on_cpu(self, reason: str) -> None:
        """Skip a check that means nothing on the CPU (``reason`` says why)."""
        if not self.cuda:
            import pytest

            pytest.skip(reason)


def resolve_lane(environ=os.environ) -> tuple[Lane | None, str]:
    """The lane's device from ``FLOWRL_GPU_LANE_DEVICE`` and what torch sees: ``(lane, "")``, or
    ``(None, why)`` when the lane cannot run (why starts with "skip:" or "fail:")."""
    wanted = environ.get(DEVICE_VARIABLE, "").strip()
    if wanted == "cpu":
        return Lane(torch.device("cpu"), bf16=False), ""
    if wanted and not (wanted == "cuda" or (wanted.startswith("cuda:") and wanted[5:].isdigit())):
        return None, f"fail: {DEVICE_VARIABLE}={wanted!r}: use 'cpu', 'cuda' or 'cuda:N' (or leave it unset)"
    if not torch.cuda.is_available():
        if wanted:
            return None, f"fail: {DEVICE_VARIABLE}={wanted}, but torch {torch.__version__} sees no CUDA device"
        return None, f"skip: {NEEDS_CUDA}"
    device = torch.device(wanted or "cuda")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return Lane(device, bf16=torch.cuda.is_bf16_supported(including_emulation=False)), ""


# ---- runs --------------------------------------------------------------------------------------


def quiet_console():
    from rich.console import Console

    return Console(file=open(os.devnull, "w"), width=200)


def train_run(recipe_path: Path, out: Path, *sets: str, resume: bool = False) -> Path:
    """``flowrl.train.train`` of ``recipe_path`` with ``sets`` into ``out`` (resumed from it when
    ``resume``); returns the run directory."""
    from flowrl.recipe import load_recipe
    from flowrl.train import train

    recipe = load_recipe(Path(recipe_path), [*sets, f"run.output_dir={str(out)!r}"])
    return train(recipe, resume=out if resume else None, console=quiet_console())


def with_tracker(text: str, name: str) -> str:
    return text + f'\n[[trackers]]\nuse = "{name}"\n'


class Watch:
    """A tracker plugin (``name``): ``on_metrics(step, metrics)`` is called inside the run at each
    logged row (so it sees the process group, the attention switches, the device as the loop has
    them); it may raise to stop the run there, as a kill would."""

    def __init__(self, name: str, on_metrics: Callable[[int, dict], None]):
        self.name, self.on_metrics = name, on_metrics

    @hookimpl
    def register_trackers(self, register):
        watch = self

        class Tracker:
            def log_metrics(self, step, metrics):
                watch.on_metrics(step, metrics)

            def log_image(self, step, name, image):
                pass

            def close(self):
                pass

        register(self.name, lambda: Tracker())


class Killed(BaseException):
    """A run dying as under ``kill -9``: a BaseException, so nothing in the loop catches it and
    checkpoints (the run keeps only what its periodic checkpoints saved)."""


def kill_after(iteration: int) -> Callable[[int, dict], None]:
    """``on_metrics`` for :class:`Watch` that kills the run when iteration ``iteration``'s row is
    logged: the loop writes the row first and then the checkpoint, so the latest checkpoint is the
    one after iteration ``iteration - 1`` (``iter_{iteration:06d}``)."""

    def on_metrics(step, metrics):
        if step == iteration:
            raise Killed(f"killed after iteration {iteration} was logged")

    return on_metrics


@contextlib.contextmanager
def deterministic(on: bool):
    """``torch.use_deterministic_algorithms(on)`` (and cuDNN's autotuner off) for the block; the
    previous settings after it. On CUDA, cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG`` (``:4096:8``) set
    before its first call: tests/gpu/conftest.py sets it at import."""
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    benchmark = torch.backends.cudnn.benchmark
    torch.use_deterministic_algorithms(on)
    if on:
        torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        torch.backends.cudnn.benchmark = benchmark


# ---- comparisons ---------------------------------------------------------------------------------


def read_rows(run_dir: Path) -> list[dict]:
    from flowrl.runlog import read_metrics

    return read_metrics(run_dir)


def finite_numbers(row: dict) -> dict[str, float]:
    """The numbers of a metrics row (lists flattened, keys ``key[i]``) that are not finite."""
    bad = {}
    for key, value in row.items():
        values = value if isinstance(value, list) else [value]
        flat = []
        for v in values:
            flat += v if isinstance(v, list) else [v]
        for i, v in enumerate(flat):
            if isinstance(v, float) and not math.isfinite(v):
                bad[f"{key}[{i}]" if isinstance(value, list) else key] = v
    return bad


def _numbers(x) -> list:
    if isinstance(x, list):
        out = []
        for v in x:
            out += _numbers(v)
        return out
    return [x]


def row_differences(got: list[dict], want: list[dict], rtol: float = 0.0, atol: float = 0.0,
                    ignore: tuple[str, ...] = ()) -> list[str]:
    """Where two runs' metrics rows differ, times and memory aside: ``iteration N: key a != b``.
    ``rtol = atol = 0`` asks for equal values, bit for bit."""
    its = [r.get("iteration") for r in got], [r.get("iteration") for r in want]
    if its[0] != its[1]:
        return [f"iterations {its[0]} != {its[1]}"]
    out = []
    for a, b in zip(got, want):
        keys = {k for k in a.keys() | b.keys() if not k.startswith(NOT_REPEATED + ignore)}
        for key in sorted(keys):
            x, y = a.get(key), b.get(key)
            if x == y:
                continue
            xs, ys = _numbers(x), _numbers(y)
            close = len(xs) == len(ys) and all(
                u == v or (isinstance(u, (int, float)) and isinstance(v, (int, float))
                           and (math.isclose(u, v, rel_tol=rtol, abs_tol=atol) or (math.isnan(u) and math.isnan(v))))
                for u, v in zip(xs, ys))
            if not close:
                out.append(f"iteration {a.get('iteration')}: {key} {x!r} != {y!r}")
    return out


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The trained weights of a run's latest checkpoint (sharded or not), full, on the CPU."""
    from flowrl.train.checkpoint import latest_checkpoint, read_model_weights

    return read_model_weights(latest_checkpoint(run_dir))


def weight_differences(got: dict, want: dict, atol: float = 0.0) -> list[str]:
    """Tensors of two weight dicts that differ by more than ``atol`` (0: any bit)."""
    if sorted(got) != sorted(want):
        return [f"different tensors: {sorted(set(got) ^ set(want))[:5]}"]
    out = []
    for key in sorted(got):
        a, b = got[key], want[key]
        if a.shape != b.shape or a.dtype != b.dtype:
            out.append(f"{key}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}")
        elif atol == 0.0:
            if not torch.equal(a, b):
                out.append(f"{key}: max |difference| {(a.float() - b.float()).abs().max().item():.3g} (bitwise asked)")
        else:
            diff = (a.float() - b.float()).abs().max().item()
            if not diff <= atol:
                out.append(f"{key}: max |difference| {diff:.3g} > {atol:g}")
    return out


# ---- a tiny FLUX run (the attention backends: the embedded model has no attention) -------------

def flux_recipe(pipeline: Path, prompts: Path, lane: Lane) -> dict:
    """The tiny-FLUX recipe on the lane's device and precision: ``flowrl selftest``'s
    (flowrl/diagnostics/selftest.py ``RECIPE``), trimmed to one iteration of one optimizer step,
    evaluated before and after, with grids and a checkpoint; no self-test probe."""
    import json
    import tomllib

    from flowrl.diagnostics.selftest import RECIPE

    data = tomllib.loads(RECIPE.format(
        device=json.dumps(str(lane.device)), output_dir=json.dumps("unused"), pipeline=json.dumps(str(pipeline)),
        dtype=json.dumps(lane.precision), tolerance=BF16_ON_POLICY_TOLERANCE if lane.bf16 else 1e-6,
        compile="false", prompts=json.dumps(str(prompts))))
    data["run"] = {"name": "lane_flux", "seed": data["run"]["seed"], "device": data["run"]["device"]}
    data.pop("trackers")
    data["checkpoint"].pop("keep_last")
    train = data["train"]
    train["iterations"] = 1
    for key in ("optimizer_steps_per_update", "update_mode", "fast_path", "compile"):
        train.pop(key)
    return data


def write_flux_recipe(directory: Path, pipeline: Path, lane: Lane) -> Path:
    """The tiny-FLUX recipe (1 iteration, evaluated before and after, grids and a checkpoint) on
    the lane's device and precision, written into ``directory``."""
    from flowrl.recipe import dump_toml
    from flowrl.testing.tiny_pipelines import TINY_PROMPTS

    directory = Path(directory)
    prompts = directory / "prompts.txt"
    prompts.write_text("\n".join(TINY_PROMPTS) + "\n", encoding="utf-8")
    path = directory / "flux.toml"
    path.write_text(dump_toml(flux_recipe(pipeline, prompts, lane)), encoding="utf-8")
    return path


SDPA_FLAGS = {"flash": "flash_sdp_enabled", "efficient": "mem_efficient_sdp_enabled", "math": "math_sdp_enabled",
              "cudnn": "cudnn_sdp_enabled"}


_DENOISER = f"diffusers{os.sep}models{os.sep}transformers{os.sep}"
_AUXILIARY = (f"diffusers{os.sep}models{os.sep}autoencoders{os.sep}", f"{os.sep}transformers{os.sep}models{os.sep}")


def _caller_kind() -> str | None:
    """``denoiser`` (a diffusers transformer), ``auxiliary`` (the VAE, a transformers text encoder)
    or None, from the frames that led to an attention call."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if _DENOISER in name:
            return "denoiser"
        if any(part in name for part in _AUXILIARY):
            return "auxiliary"
        frame = frame.f_back
    return None


def attention_run(recipe: Path, backend: str, out: Path) -> dict:
    """Train ``recipe`` with ``[train].attention_backend = backend`` into ``out``, recording at every
    scaled-dot-product attention call which backends torch may use there: the denoiser's calls
    (``calls``, ``allowed``) apart from the VAE's and the text encoders' (``auxiliary_calls``,
    ``auxiliary_allowed``), which attend as ``auto`` whatever the recipe names. Returns (and writes
    to ``out / "attention.json"``, for a run in another process) ``{"outcome": "ran" | "refused",
    "error", "where", "calls", "allowed": [sorted backend sets seen], "auxiliary_calls",
    "auxiliary_allowed", "rows"}``; any other error propagates."""
    import json

    import torch.nn.functional as F

    from flowrl.errors import FlowrlError

    calls, allowed = {"denoiser": 0, "auxiliary": 0}, {"denoiser": set(), "auxiliary": set()}
    original = F.scaled_dot_product_attention

    def recorded(*args, **kwargs):
        kind = _caller_kind()
        if kind is not None:
            calls[kind] += 1
            allowed[kind].add(tuple(sorted(n for n, flag in SDPA_FLAGS.items() if getattr(torch.backends.cuda, flag)())))
        return original(*args, **kwargs)

    result = {"backend": backend, "outcome": "ran", "error": "", "where": "", "rows": []}
    F.scaled_dot_product_attention = recorded
    try:
        run_dir = train_run(recipe, Path(out) / "run", f"train.attention_backend={backend!r}")
        result["rows"] = read_rows(run_dir)
    except FlowrlError as exc:
        result.update(outcome="refused", error=exc.message, where=exc.where or "")
    finally:
        F.scaled_dot_product_attention = original
    result.update(calls=calls["denoiser"], allowed=[list(a) for a in sorted(allowed["denoiser"])],
                  auxiliary_calls=calls["auxiliary"], auxiliary_allowed=[list(a) for a in sorted(allowed["auxiliary"])])
    (Path(out) / "attention.json").write_text(json.dumps(result))
    return result
