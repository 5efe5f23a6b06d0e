"""The checks of ``flowrl selftest``: a tiny FLUX-architecture pipeline, built offline, trained on
this machine's device through the public entry :func:`flowrl.train.train`.

What each check proves, and how:

- **train**: 2 iterations of Chunk-GRPO with 2 optimizer steps per rollout, so that the first
  step takes the fast path (every ratio 1) and the second the chunk-graph update
  (``update_mode = "chunk_graph"``); both are counted where the update calls them, and a path
  that never ran fails the check. bf16 compute (fp32 master weights) where the GPU has it.
- **on-policy**: the run's own check (``[train].on_policy_tolerance``) raises when re-scoring
  does not reproduce the rollout's log-probs; the largest deviation seen is reported.
- **kill and resume**: the same run stopped by an exception right after iteration 1's
  checkpoint (nothing of the run handles it: no Ctrl-C save, as a kill), resumed from that
  checkpoint; every metrics row must equal the uninterrupted run's. In-process, so it costs no
  interpreter start; tests/train/test_engine_signals.py kills real process groups.
- **attention**: the tiny transformer's forward and backward under each attention backend
  flowrl can select on the device (:func:`flowrl.train.accel.attention_backend`), against the
  math backend.
- **torch.compile**: the train run again with ``[train].compile = "default"`` (GPU; on a CPU
  it costs minutes of C++ compilation, so it is skipped unless asked for).
- **fsdp2**: ``flowrl train --num-processes 2`` with ``strategy = "fsdp2"`` when 2+ GPUs are
  visible: real shards in the checkpoint.

Every check reports seconds, images per second (rollout images over training time, as the run
logs ``speed/images_per_second``) and peak memory (CUDA: ``torch.cuda.max_memory_allocated``)
against the memory plan of the same recipe (``flowrl plan``, without the CUDA context's slack,
which no allocation counts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import torch
from rich.console import Console

from ..errors import FlowrlError
from ..hookspecs import hookimpl
from ..memory_plan import CUDA_OVERHEAD, GB, estimate, peak
from ..objectives import policy_gradient as update_paths
from ..plugins import temporary_plugin
from ..recipe import load_recipe
from ..runlog import is_phase_seconds, read_metrics
from ..testing.tiny_pipelines import TINY_PROMPTS, build_tiny_flux
from ..train import train
from ..train.accel import SDPA_BACKENDS, attention_backend
from ..train.checkpoint import is_sharded_checkpoint, latest_checkpoint
from .report import Check

#: Re-scoring must reproduce the rollout's log-probs this closely. fp32: the recipes' default.
#: bf16: docs/distributed.md bounds the deviation by 3.9e-3 rms(v) when rounding errors line up
#: with the noise and by that over sqrt(D) when they do not; the tiny latent has D = 1024
#: elements (not FLUX.1's 262,144), hence a looser bound than the 1e-4 of the full-size recipes.
ON_POLICY_TOLERANCE = {"fp32": 1e-6, "bf16": 1e-3}
#: Metrics a resumed run repeats exactly (the rest are wall-clock times and memory).
NOT_REPEATED = ("time/", "speed/", "memory/")

RECIPE = """
[run]
name = "selftest"
seed = 7
device = {device}
output_dir = {output_dir}

[model]
use = "flux"
path = {pipeline}
height = 32
width = 32
max_sequence_length = 16
dtype = {dtype}
denoiser_dtype = "fp32"     # full fine-tuning keeps fp32 master weights, as the flagship does
vae_batch_size = 8

[sampler]
steps = 5                   # 4 trainable transitions

[chunker]
use = "explicit"
sizes = [1, 3]

[selector]
use = "uniform"
fraction = 1.0

[loss]
use = "clipped"
beta = 0.0

[train]
iterations = 2
prompts_per_iteration = 2
group_size = 2
micro_batch_size = 2
optimizer_steps_per_update = 2   # step 1: the fast path; step 2: the chunk-graph update
update_mode = "chunk_graph"
fast_path = true
finetune = "full"
lr = 0.002
max_grad_norm = 0.0
on_policy_tolerance = {tolerance}
compile = {compile}

[prompts]
source = {prompts}
num_eval = 2                # two images: their standard error exists

[log]
progress = false
image_every = 1
eval_every = 1

[checkpoint]
every = 1
keep_last = 2

[[rewards]]
use = "brightness"

[[trackers]]
use = "selftest_probe"
"""


class SelftestKill(BaseException):
    """Stops a run as a kill would: a BaseException, so nothing in the loop catches it and saves."""


class Probe:
    """The tracker plugin of the self-test's runs (``selftest_probe``): it keeps each iteration's
    images per second, and stops the run after iteration ``kill_after`` when that is set."""

    def __init__(self):
        self.images_per_second: list[float] = []
        self.kill_after: int | None = None

    @hookimpl
    def register_trackers(self, register):
        probe = self

        class Tracker:
            def log_metrics(self, step, metrics):
                if "speed/images_per_second" in metrics:
                    probe.images_per_second.append(metrics["speed/images_per_second"])
                if probe.kill_after is not None and step == probe.kill_after:
                    raise SelftestKill(f"stopped after iteration {step}")

            def log_image(self, step, name, image):
                pass

            def close(self):
                pass

        register("selftest_probe", Tracker, help="flowrl selftest: images per second, and a simulated kill")


@dataclasses.dataclass
class Setup:
    """Where and how the self-test runs: its directory, device and compute dtype."""

    workdir: Path
    device: torch.device
    dtype: str  # "bf16" or "fp32"
    probe: Probe = dataclasses.field(default_factory=Probe)
    registry: object = None  # the plugin registry with the probe's tracker, inside :meth:`plugged`

    @property
    def pipeline(self) -> Path:
        return self.workdir / "tiny_flux"

    def recipe(self, name: str, *, compile_mode: str = "off", probed: bool = True):
        """Write and load the self-test recipe for run ``name`` (its directory under ``workdir``);
        ``probed=False`` leaves the probe's tracker out (for a run in other processes, which lack it)."""
        prompts = self.workdir / "prompts.txt"
        if not prompts.is_file():
            prompts.write_text("\n".join(TINY_PROMPTS) + "\n", encoding="utf-8")
        text = RECIPE.format(device=json.dumps(str(self.device)), output_dir=json.dumps(str(self.workdir / name)),
                             pipeline=json.dumps(str(self.pipeline)), dtype=json.dumps(self.dtype),
                             tolerance=ON_POLICY_TOLERANCE[self.dtype], compile=json.dumps(compile_mode),
                             prompts=json.dumps(str(prompts)))
        if not probed:
            text = text.split("[[trackers]]", 1)[0]
        path = self.workdir / f"{name}.toml"
        path.write_text(text, encoding="utf-8")
        return load_recipe(path, [], registry=self.registry)

    @contextlib.contextmanager
    def plugged(self) -> Iterator[None]:
        """The probe's tracker is registered for the block."""
        with temporary_plugin(self.probe, name="flowrl-selftest") as registry:
            self.registry = registry
            try:
                yield
            finally:
                self.registry = None


def choose_dtype(device: torch.device, requested: str) -> str:
    """``bf16`` on a GPU that computes it natively, else ``fp32`` (a CPU's bf16 is emulated on most
    machines and would only make CI slower); ``requested`` other than ``auto`` wins."""
    if requested != "auto":
        return requested
    if device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False):
        return "bf16"
    return "fp32"


@contextlib.contextmanager
def measured(device: torch.device) -> Iterator[dict]:
    """Seconds and peak device memory of the block, into the yielded figures."""
    figures: dict = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    try:
        yield figures
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            figures["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / GB
        else:
            figures["peak_memory_gb"] = None  # the CPU allocator keeps no peak
        figures["seconds"] = time.perf_counter() - start


def planned_gb(setup: Setup, recipe) -> float | None:
    """The memory plan's peak per process for ``recipe`` (``flowrl plan``), less the CUDA context."""
    try:
        _, _, lines = estimate(recipe, setup.registry, 1)
    except FlowrlError:
        return None
    return (peak(lines)[0] - CUDA_OVERHEAD) / GB


def guarded(section: str, name: str, check: Callable[[], list[Check]]) -> list[Check]:
    """Run one check; an error in it is that check's failure, and the report goes on."""
    start = time.perf_counter()
    try:
        return check()
    except FlowrlError as exc:
        detail = exc.format().replace("\n  ", " ")
    except Exception as exc:  # a crash in one check must not hide the others' results
        detail = f"{type(exc).__name__}: {exc}"
    return [Check(section, name, "fail", detail, {"seconds": time.perf_counter() - start})]


def check_build(setup: Setup) -> list[Check]:
    with measured(torch.device("cpu")) as figures:
        build_tiny_flux(setup.pipeline)
    weights = sum(f.stat().st_size for f in (setup.pipeline / "transformer").glob("*.safetensors"))
    figures.pop("peak_memory_gb")
    return [Check("model", "tiny FLUX pipeline", "pass",
                  f"FluxPipeline (FLUX.1 architecture, {weights / 1024:.0f} KiB transformer) written offline "
                  f"to {setup.pipeline}", figures)]


@contextlib.contextmanager
def counting_update_paths() -> Iterator[dict[str, int]]:
    """Count the update's micro-batch backwards by path: the fast path (on-policy, ratio 1) and
    the chunk-graph update, where :mod:`flowrl.objectives.policy_gradient` calls them."""
    calls = {"fast path": 0, "chunk-graph update": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    with mock.patch.object(update_paths, "on_policy_chunk_backward",
                           counted("fast path", update_paths.on_policy_chunk_backward)), \
         mock.patch.object(update_paths, "chunk_graph_backward",
                           counted("chunk-graph update", update_paths.chunk_graph_backward)):
        yield calls


def _images_per_second(setup: Setup) -> float | None:
    speeds = setup.probe.images_per_second
    return sum(speeds) / len(speeds) if speeds else None


def check_training(setup: Setup, reference: dict) -> list[Check]:
    """The uninterrupted 2-iteration run; its metrics go into ``reference`` for the resume check."""
    recipe = setup.recipe("train")
    setup.probe.images_per_second.clear()
    with counting_update_paths() as calls, measured(setup.device) as figures:
        run_dir = train(recipe, console=Console(quiet=True), registry=setup.registry)
    figures.update(images_per_second=_images_per_second(setup), plan_gb=planned_gb(setup, recipe))
    records = read_metrics(run_dir)
    reference["records"] = records
    rows = [r for r in records if not r.get("final")]
    reward = rows[-1].get("reward/brightness/mean", math.nan)
    figures["seconds_per_phase"] = phases = seconds_per_phase(rows)
    checks = [Check("train", "2 iterations", "pass",
                    f"{setup.dtype} on {setup.device}, {len(rows)} metrics rows, last reward {reward:.3f}; seconds per "
                    f"iteration: {', '.join(f'{name} {t:.3f}' for name, t in phases.items())}", figures)]
    for path, n in calls.items():
        checks.append(Check("train", path, "pass" if n else "fail",
                            f"{n} micro-batch backward(s)" if n else "never ran: the update did not take this path"))
    deviations = [r["on_policy/max_abs_log_ratio"] for r in rows if "on_policy/max_abs_log_ratio" in r]
    tolerance = recipe.train.on_policy_tolerance
    held = len(deviations) == len(rows) and all(d <= tolerance for d in deviations)
    checks.append(Check("train", "on-policy check", "pass" if held else "fail",
                        f"max |log pi_new - log pi_old| = {max(deviations, default=math.nan):.2e} "
                        f"<= {tolerance:g} in {len(deviations)} of {len(rows)} rollouts"
                        if held else f"checked in {len(deviations)} of {len(rows)} rollouts: {deviations}"))
    return checks


def seconds_per_phase(rows: list[dict]) -> dict[str, float]:
    """Each phase's mean seconds per iteration (the rows' ``time/<phase>``), slowest first."""
    totals: dict[str, float] = {}
    for row in rows:
        for key, value in row.items():
            if is_phase_seconds(key):
                totals[key[5:]] = totals.get(key[5:], 0.0) + value
    return dict(sorted(((k, v / len(rows)) for k, v in totals.items()), key=lambda kv: -kv[1]))


def differences(got: list[dict], want: list[dict], rtol: float, atol: float) -> list[str]:
    """Where two runs' metrics rows differ (times and memory aside): ``iteration N: key a != b``."""
    out = []
    if [r.get("iteration") for r in got] != [r.get("iteration") for r in want]:
        return [f"iterations {[r.get('iteration') for r in got]} != {[r.get('iteration') for r in want]}"]
    for a, b in zip(got, want):
        keys = {k for k in a.keys() | b.keys() if not k.startswith(NOT_REPEATED)}
        for key in sorted(keys):
            x, y = a.get(key), b.get(key)
            numbers = isinstance(x, (int, float)) and isinstance(y, (int, float))
            close = x == y or (numbers and (math.isclose(x, y, rel_tol=rtol, abs_tol=atol)
                                            or (math.isnan(x) and math.isnan(y))))
            if not close:
                out.append(f"iteration {a.get('iteration')}: {key} {x!r} != {y!r}")
    return out


def check_resume(setup: Setup, reference: dict) -> list[Check]:
    """Stop the same run after iteration 1's checkpoint, resume it, compare every metrics row."""
    if "records" not in reference:
        return [Check("resume", "kill and resume", "skip", "the uninterrupted run failed: nothing to compare with")]
    recipe = setup.recipe("resume")
    with measured(setup.device) as figures:
        # the trackers see iteration 1's row after iteration 0's checkpoint (the loop writes the
        # row, then the checkpoint): a kill there leaves iter_000001 as the latest checkpoint
        setup.probe.kill_after = 1
        try:
            train(recipe, console=Console(quiet=True), registry=setup.registry)
            return [Check("resume", "kill and resume", "fail", "the run was not stopped after iteration 1")]
        except SelftestKill:
            pass
        finally:
            setup.probe.kill_after = None
        stopped = latest_checkpoint(recipe.output_dir)
        train(recipe, resume=recipe.output_dir, console=Console(quiet=True), registry=setup.registry)
    # the same device, kernels and batch shapes: fp32 repeats to rounding, bf16 to its own rounding
    rtol, atol = (1e-5, 1e-6) if setup.dtype == "fp32" else (1e-3, 1e-4)
    wrong = differences(read_metrics(recipe.output_dir), reference["records"], rtol, atol)
    if stopped is None or stopped.name != "iter_000001":
        wrong.insert(0, f"the stopped run's latest checkpoint is {stopped.name if stopped else None}, not iter_000001")
    detail = (f"stopped after iteration 1 (latest checkpoint {stopped.name if stopped else None}), resumed: "
              + ("every metrics row equals the uninterrupted run's" if not wrong else
                 f"{len(wrong)} value(s) differ from the uninterrupted run: {'; '.join(wrong[:4])}")
              + f" (rtol {rtol:g})")
    return [Check("resume", "kill and resume", "fail" if wrong else "pass", detail, figures)]


def _tiny_transformer_inputs(transformer, device, dtype, batch: int = 2) -> dict:
    """Random inputs of the tiny FLUX transformer (a 16 x 16 latent packed to 64 tokens, 16 text tokens)."""
    g = torch.Generator().manual_seed(0)
    c = transformer.config

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    def full(shape, value):
        return torch.full(shape, value, device=device, dtype=dtype)

    return dict(hidden_states=rand(batch, 64, c.in_channels),
                encoder_hidden_states=rand(batch, 16, c.joint_attention_dim),
                pooled_projections=rand(batch, c.pooled_projection_dim), timestep=full((batch,), 0.5),
                img_ids=full((64, 3), 0.0), txt_ids=full((16, 3), 0.0),
                guidance=full((batch,), 3.5) if c.guidance_embeds else None, return_dict=False)


def check_attention(setup: Setup) -> list[Check]:
    """Forward and backward of the tiny transformer under every backend flowrl can select here."""
    from diffusers import FluxTransformer2DModel

    dtype = torch.bfloat16 if setup.dtype == "bf16" else torch.float32
    transformer = FluxTransformer2DModel.from_pretrained(setup.pipeline / "transformer").to(setup.device, dtype)
    inputs = _tiny_transformer_inputs(transformer, setup.device, dtype)

    def forward_backward(name):
        transformer.zero_grad(set_to_none=True)
        with attention_backend(name, setup.device):
            out = transformer(**inputs)[0]
            out.float().square().mean().backward()
        grad = torch.cat([p.grad.flatten().float() for p in transformer.parameters() if p.grad is not None])
        return out.detach().float(), grad

    reference = forward_backward("math")
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    checks = []
    for name in SDPA_BACKENDS.get(setup.device.type, ("math",)):
        try:
            with measured(setup.device) as figures:
                out, grad = forward_backward(name)
        except RuntimeError as exc:  # e.g. no flash kernel for this GPU: the backend is unavailable here
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            checks.append(Check("attention", name, "skip", f"not available on this device in {setup.dtype}: {reason}"))
            continue
        error = max(_relative(out, reference[0]), _relative(grad, reference[1]))
        ok = error <= tolerance
        detail = (f"forward and backward in {setup.dtype}, relative deviation from math {error:.1e}"
                  + ("" if ok else f" > {tolerance:g}"))
        if name == "cudnn" and not ok:  # what a run naming it meets too: refused by its probe, never used
            checks.append(Check("attention", name, "skip", f"{detail}: flowrl refuses attention_backend = 'cudnn' "
                                "here (flowrl.train.accel.probe_attention_backend); 'auto' never uses it", figures))
            continue
        checks.append(Check("attention", name, "pass" if ok else "fail", detail, figures))
    return checks


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def check_compile(setup: Setup, mode: str) -> list[Check]:
    """The train run again with the denoiser compiled: it trains and the on-policy check holds."""
    if mode == "off" or (mode == "auto" and setup.device.type == "cpu"):
        why = ("asked off" if mode == "off" else
               "on a CPU, inductor compiles C++ for minutes and does not pay for small models "
               "(docs/benchmarks.md); --compile on runs it")
        return [Check("compile", "torch.compile", "skip", why)]
    from torch._dynamo.utils import counters  # how many graphs dynamo compiled: a run can train uncompiled

    recipe = setup.recipe("compiled", compile_mode="default")
    setup.probe.images_per_second.clear()
    before = counters["stats"]["unique_graphs"]
    with measured(setup.device) as figures:
        run_dir = train(recipe, console=Console(quiet=True), registry=setup.registry)
    graphs = counters["stats"]["unique_graphs"] - before
    rows = [r for r in read_metrics(run_dir) if not r.get("final")]
    deviation = max((r.get("on_policy/max_abs_log_ratio", 0.0) for r in rows), default=math.nan)
    figures.update(images_per_second=_images_per_second(setup), plan_gb=planned_gb(setup, recipe), graphs=graphs)
    if graphs == 0:
        return [Check("compile", "torch.compile", "fail", "compile = 'default' compiled no graph: the run trained "
                      "uncompiled", figures)]
    return [Check("compile", "torch.compile", "pass",
                  f"compile = 'default': {len(rows)} iterations, {graphs} graphs compiled, on-policy deviation "
                  f"{deviation:.2e} (the seconds include compilation)", figures)]


def check_fsdp2(setup: Setup, timeout: float = 600) -> list[Check]:
    """Two processes under FSDP2 through ``flowrl train --num-processes 2`` (needs 2 GPUs)."""
    gpus = torch.cuda.device_count() if setup.device.type == "cuda" else 0
    if gpus < 2:
        return [Check("fsdp2", "2-process FSDP2", "skip",
                      f"needs 2 or more GPUs; {gpus} visible" if setup.device.type == "cuda" else
                      "needs 2 or more GPUs; running on the CPU (tests/distributed covers FSDP2 on gloo)")]
    recipe = setup.recipe("fsdp2", probed=False)
    # 2 samples per process: two optimizer steps of one (the fast path, then the chunk-graph update)
    command = [sys.executable, "-m", "flowrl", "train", str(recipe.source), "--num-processes", "2",
               "--set", 'distributed.strategy="fsdp2"', "--set", "train.micro_batch_size=1",
               "--set", 'run.device="cuda"']  # each process on its own GPU, cuda:LOCAL_RANK
    with measured(setup.device) as figures:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    figures.pop("peak_memory_gb")  # the workers' memory, not this process's
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        errors = list(dict.fromkeys(line for line in lines if line.startswith("error:")))  # flowrl's own message
        tail = " | ".join(errors or lines[-4:])
        return [Check("fsdp2", "2-process FSDP2", "fail", f"exit {proc.returncode}: {tail}", figures)]
    rows = [r for r in read_metrics(recipe.output_dir) if not r.get("final")]
    sharded = is_sharded_checkpoint(latest_checkpoint(recipe.output_dir))
    ok = len(rows) == recipe.train.iterations and sharded
    return [Check("fsdp2", "2-process FSDP2", "pass" if ok else "fail",
                  f"{len(rows)} iterations on 2 GPUs, checkpoint " + ("sharded" if sharded else "NOT sharded"),
                  figures)]


def run_selftest(workdir: Path, device: torch.device, *, dtype: str = "auto", compile_mode: str = "auto",
                 say: Callable[[str], None] = lambda _: None) -> list[Check]:
    """Every check, in order, on ``device``; files under ``workdir`` (left for the caller to remove)."""
    setup = Setup(Path(workdir), device, choose_dtype(device, dtype))
    checks: list[Check] = []
    reference: dict = {}
    with setup.plugged():
        steps = [("model", "tiny FLUX pipeline", lambda: check_build(setup)),
                 ("train", "2 iterations", lambda: check_training(setup, reference)),
                 ("resume", "kill and resume", lambda: check_resume(setup, reference)),
                 ("attention", "attention backends", lambda: check_attention(setup)),
                 ("compile", "torch.compile", lambda: check_compile(setup, compile_mode)),
                 ("fsdp2", "2-process FSDP2", lambda: check_fsdp2(setup))]
        for section, name, step in steps:
            say(f"{section}: {name}")
            checks += guarded(section, name, step)
            if section == "model" and checks[-1].status == "fail":
                break  # nothing else can run without the pipeline
    return checks


def remove(workdir: Path) -> None:
    shutil.rmtree(workdir, ignore_errors=True)
