"""``[train].attention_backend`` on the lane's device (flowrl/train/accel.py): every name the recipe
accepts either trains (a 1-iteration run of the tiny FLUX pipeline, evaluated before and after,
whose attention goes through torch's scaled_dot_product_attention) with only that backend allowed
at every attention call, or is refused before training with flowrl's error naming the field.
``auto`` on CUDA must never allow cuDNN attention: with torch 2.11 on an H100 it faulted on FLUX's
attention and every later kernel failed (docs/benchmarks.md, "Attention backends"); a recipe
naming ``cudnn`` trains only if cuDNN agrees with memory-efficient attention on its model, else it
is refused by name (on an H200 it returned non-finite values). A named backend is allowed with
math, which serves the calls it has no kernel for (under ``flash`` alone T5's masked attention had
none on an H200); the probe has run the denoiser on the named backend alone.

On a GPU, ``cudnn`` runs in a process of its own: if it faults, the fault takes that process's
CUDA context down, not the lane's, and the test fails saying so. On the CPU variant the CPU's
backends (math, flash) run and the GPU's (efficient, cudnn) are refused; ``cudnn`` goes through
the same separate process there too, so that path is exercised. Measured on the 2-core CPU
(FLOWRL_GPU_LANE_DEVICE=cpu): 25 s for the file, most of it the separate process's start; not
yet timed on a GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from gpu_lane import attention_run, finite_numbers, write_flux_recipe

from flowrl.recipe import TrainConfig
from flowrl.train.accel import SDPA_BACKENDS

pytestmark = pytest.mark.gpu

#: every value the recipe accepts for [train].attention_backend
BACKENDS = typing.get_args(typing.get_type_hints(TrainConfig)["attention_backend"])
HERE = Path(__file__).resolve().parent

_IN_A_PROCESS = """
import sys
sys.path[:0] = [{here!r}, {engine!r}]
from pathlib import Path
from gpu_lane import attention_run
attention_run(Path({recipe!r}), {backend!r}, Path({out!r}))
"""


def test_the_recipe_accepts_auto_and_every_backend_flowrl_knows():
    assert "auto" in BACKENDS and set(SDPA_BACKENDS["cuda"]) | set(SDPA_BACKENDS["cpu"]) <= set(BACKENDS)


@pytest.fixture(scope="module")
def flux_recipe(lane, tiny_pipeline, tmp_path_factory):
    return write_flux_recipe(tmp_path_factory.mktemp("attention"), tiny_pipeline("flux"), lane)


def _run_apart(recipe: Path, backend: str, out: Path) -> dict:
    code = _IN_A_PROCESS.format(here=str(HERE), engine=str(HERE.parent / "train"), recipe=str(recipe),
                                backend=backend, out=str(out))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    result = out / "attention.json"
    assert proc.returncode == 0 and result.is_file(), (
        f"attention_backend = {backend!r} neither trained nor was refused with flowrl's error: the run's process "
        f"exited {proc.returncode} (cuDNN attention faulted on FLUX.1's attention on an H100: docs/benchmarks.md)\n"
        + proc.stderr[-4000:])
    return json.loads(result.read_text())


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_attention_backend_trains_or_is_refused_by_name(lane, flux_recipe, backend, tmp_path):
    if backend == "cudnn":
        result = _run_apart(flux_recipe, backend, tmp_path)
    else:
        result = attention_run(flux_recipe, backend, tmp_path)
    exists_here = backend == "auto" or backend in SDPA_BACKENDS.get(lane.device.type, ())
    if result["outcome"] == "refused":
        assert result["where"].endswith("[train].attention_backend"), result
        assert not (tmp_path / "run" / "metrics.jsonl").exists()  # before any training
        if backend == "cudnn" and lane.cuda:  # probed on the model: it disagreed with math, or had no kernel
            assert any(f"attention_backend = 'cudnn' {what}" in result["error"]
                       for what in ("disagrees with efficient attention", "cannot run this model's attention here")), result
            return
        assert not exists_here, f"{backend!r} exists on {lane.device.type} but was refused: {result['error']}"
        assert f"attention_backend = {backend!r} does not exist on device {lane.device.type!r}" in result["error"]
        assert result["calls"] == 0
        return
    assert exists_here, f"{backend!r} does not exist on {lane.device.type}, yet the run trained"
    rows = result["rows"]
    assert [r["iteration"] for r in rows] == [0, 1] and rows[-1]["final"], rows
    assert all(not finite_numbers(r) for r in rows) and rows[0]["grad_norm"] > 0
    assert "eval/brightness/mean" in rows[0] and "eval/brightness/mean" in rows[-1]
    assert result["calls"] > 0, "the tiny FLUX run never called scaled_dot_product_attention"
    loop = sorted({backend, "math"})
    if backend != "auto":  # the loop: the named backend, with math for what it has no kernel for; the probe: it alone
        assert loop in result["allowed"] and all(a in (loop, [backend]) for a in result["allowed"]), result["allowed"]
    elif lane.cuda:  # auto on CUDA: flash, efficient and math; never cuDNN (a known crash)
        assert all("cudnn" not in seen for seen in result["allowed"]), result["allowed"]
        assert result["allowed"] == [["efficient", "flash", "math"]], result["allowed"]
    # the VAE and the text encoders run under the same set, math serving what the named backend cannot
    # (T5's position bias is a mask flash does not take: "No available kernel" on an H200 under flash alone)
    assert result["auxiliary_calls"] > 0, "neither the VAE nor a text encoder called scaled_dot_product_attention"
    # outside the loop (the prompts encoded before it) the process default: auto's set on CUDA, everything on the CPU
    auxiliary = result["auxiliary_allowed"]
    assert backend == "auto" or loop in auxiliary, auxiliary
    assert all(a == loop or {"efficient", "flash", "math"} <= set(a) for a in auxiliary), auxiliary
    assert not lane.cuda or all("cudnn" not in a for a in auxiliary if a != loop), auxiliary
