"""``[train].compile = "default"`` (torch.compile of the denoiser, flowrl/train/accel.py) on the lane's
device, in its precision: one iteration of the tiny recipe of the engine tests. The rollout (no
grad) and the update (grad) run different compiled graphs; the first optimizer step's re-scored
log-probs must still match the rollout's within the run's on-policy tolerance (the run stops
otherwise), the weights keep their uncompiled names in the checkpoint, and dynamo did compile.

A run once trained uncompiled, silently: its FLOP count made the compiled denoiser's first call
under ``FlopCounterMode``, after which dynamo never compiled it. The count now runs with
``torch.compiler.set_stance("force_eager")``, and this test fails if no graph is compiled.

The lane's most expensive test: inductor compiles the forward and backward
graphs (on the 2-core CPU: 327 s of C++ compilation; the GPU's Triton compilation not yet timed).
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import write_recipe
from gpu_lane import finite_numbers, read_rows, train_run, weights

pytestmark = pytest.mark.gpu


def test_compiled_denoiser_trains_and_keeps_the_on_policy_check(lane, tmp_path):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    try:
        run_dir = train_run(write_recipe(tmp_path), tmp_path / "run", *lane.placed(), "train.iterations=1",
                            "train.updates_per_rollout=1", "train.optimizer_steps_per_update=1",
                            "train.compile='default'")
        graphs = counters["stats"]["unique_graphs"] - before
    finally:
        torch._dynamo.reset()  # later tests in this process start uncompiled
    (row,) = read_rows(run_dir)
    assert not finite_numbers(row) and row["grad_norm"] > 0
    assert row["on_policy/max_abs_log_ratio"] <= (1e-3 if lane.bf16 else 1e-6), row["on_policy/max_abs_log_ratio"]
    saved = weights(run_dir)
    assert saved and not any("_orig_mod" in k for k in saved)
    assert graphs >= 1, "train.compile='default' compiled no graph: the run trained uncompiled"
