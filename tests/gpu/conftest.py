"""The GPU lane (``pytest -m gpu``): the engine, resume, FSDP2, the rollout process,
every adapter's conformance suite, the attention backends, torch.compile and the memory plan,
on CUDA in the precision a GPU run uses (bf16 compute, fp32 master weights).

Where it runs (tests/gpu/gpu_lane.py, ``resolve_lane``):

- torch sees a GPU: on it (``cuda``; ``FLOWRL_GPU_LANE_DEVICE=cuda:N`` picks one);
- no GPU: every test skips, "needs a CUDA device" (so the default run spends nothing here);
- ``FLOWRL_GPU_LANE_DEVICE=cpu``: on the CPU, in fp32, so that the lane's own logic is checked on
  a machine without a GPU. Checks that mean nothing there skip with their reason even then (the
  memory plan against CUDA's allocator peak); the others check the CPU's analogue (FSDP2 over
  gloo instead of nccl; the attention backends the CPU has, and the refusal of the others).

Every test file marks its tests ``gpu`` (``pytestmark``). The default run (``-m 'not slow'``)
collects them and skips them in a moment where there is no GPU.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The engine tests' helpers (the tiny recipe of the embedded model), shared rather than copied.
_TRAIN_TESTS = str(Path(__file__).resolve().parents[1] / "train")
if _TRAIN_TESTS not in sys.path:
    sys.path.append(_TRAIN_TESTS)

import pytest
from gpu_lane import resolve_lane  # imports torch and flowrl: no cuBLAS, no hub yet

LANE, WHY_NOT = resolve_lane()
if LANE is not None:  # where the lane skips, the rest of the run's environment stays as it was
    # Before diffusers / huggingface_hub are imported: the tiny pipelines load from disk, offline
    # (a GPU machine may reach no network at all).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if LANE.cuda:
        # Before anything starts cuBLAS: deterministic matrix products need a fixed workspace (torch
        # reads the variable at the first cuBLAS call; tests/gpu/test_gpu_lane_resume.py).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before any fixture of a lane test is built: skip (no GPU) or fail (a GPU was asked for)."""
    if LANE is None:
        kind, _, why = WHY_NOT.partition(": ")
        if kind == "skip":
            pytest.skip(why)
        pytest.fail(why, pytrace=False)


@pytest.fixture(scope="session")
def lane():
    """The lane's device and precision (:class:`gpu_lane.Lane`)."""
    return LANE


@pytest.fixture(scope="session")
def lane_tiny_dir(tmp_path_factory):
    """A directory for the tiny offline diffusers pipelines (flowrl.testing.tiny_pipelines), built
    on first use; diffusers' and transformers' progress bars and warnings off."""
    from diffusers.utils import logging as dlog
    from transformers.utils import logging as tlog

    dlog.disable_progress_bar()
    tlog.disable_progress_bar()
    tlog.set_verbosity_error()
    dlog.set_verbosity_error()
    return tmp_path_factory.mktemp("lane_tiny_pipelines")


@pytest.fixture(scope="session")
def tiny_pipeline(lane_tiny_dir):
    """``tiny_pipeline(name) -> path``: a tiny offline pipeline (``flux``, ``flux_schnell``, ``sd3``,
    ``flux_kontext``, ``qwen_image``, ``qwen_image_edit``, ``flux2_klein``, ``flux2_klein_distilled``,
    ``zimage``, ``wan``, ``wan22``, ``wan22_a14b``, ``wan22_a14b_i2v``, ``ltx``), each written once per session."""
    from flowrl.testing import tiny_pipelines as tp

    builders = {
        "flux": lambda p: tp.build_tiny_flux(p),
        "flux_schnell": lambda p: tp.build_tiny_flux(p, guidance_embeds=False, seed=1),
        "sd3": lambda p: tp.build_tiny_sd3(p),
        "flux_kontext": lambda p: tp.build_tiny_flux_kontext(p),
        "qwen_image": lambda p: tp.build_tiny_qwen_image(p),
        "qwen_image_edit": lambda p: tp.build_tiny_qwen_image_edit(p),
        "flux2_klein": lambda p: tp.build_tiny_flux2_klein(p),
        "flux2_klein_distilled": lambda p: tp.build_tiny_flux2_klein(p, distilled=True, seed=1),
        "zimage": lambda p: tp.build_tiny_zimage(p),
        "wan": lambda p: tp.build_tiny_wan(p),
        "wan22": lambda p: tp.build_tiny_wan22(p),
        "wan22_a14b": lambda p: tp.build_tiny_wan22_a14b(p),
        "wan22_a14b_i2v": lambda p: tp.build_tiny_wan22_a14b(p, image_to_video=True),
        "ltx": lambda p: tp.build_tiny_ltx(p),
    }
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = Path(builders[name](lane_tiny_dir / name))
        return built[name]

    return get
