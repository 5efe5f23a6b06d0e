"""A diffusers command prints none of the library messages that ask nothing of a user.

Run as a user's environment runs it: torchvision absent (the base install does not bring it),
so transformers would announce its PIL fallback for every image processor the pipeline has.
"""

from __future__ import annotations

import pytest

import os
import subprocess
import sys

from conftest import REPO, TINY_MODEL

from flowrl.compat import ensure_torchvision_importable

ensure_torchvision_importable()  # this process builds the tiny pipeline (flowrl.compat)

SCRIPT = """
import sys
sys.modules["torchvision"] = None  # not installed, as after `pip install -e .`
from flowrl import cli
cli.main(sys.argv[1:])
"""


@pytest.mark.slow
def test_sample_of_a_diffusers_model_prints_no_library_warning(tiny_flux, tmp_path):
    sets = []
    for s in [f"model.path={tiny_flux}", *TINY_MODEL]:
        sets += ["--set", s]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1", COLUMNS="250")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, "sample", str(REPO / "recipes" / "chunk_grpo_flux.toml"), *sets,
         "-p", "a cat", "--steps", "2", "--device", "cpu", "-o", str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    noise = [line for line in proc.stderr.splitlines() if "torchvision" in line or "warn" in line.lower()
             or "should be kept in float32" in line]
    assert not noise, proc.stderr
