"""FP8 rollouts (``[sampler].rollout_precision = "fp8"``) on the lane's GPU: the step-level GRPO
quickstart trains an iteration with each correction at ``compute/ratio`` 1.00, the ``rescore``
run passing the on-policy check. FP8 needs compute capability 8.9 or higher and torchao: on an
older GPU, without torchao and on the CPU lane the test skips, saying which."""

from __future__ import annotations

import pytest
from gpu_lane import finite_numbers, read_rows, train_run

pytestmark = pytest.mark.gpu

SETS = ["train.iterations=1", "train.prompts_per_iteration=2", "train.group_size=4", "train.micro_batch_size=4",
        "prompts.num_eval=0", "log.image_every=0", "checkpoint.every=1"]


@pytest.mark.parametrize("correction, finetune", [("rescore", "full"), ("importance", "full"), ("rescore", "lora")])
def test_fp8_rollouts_train_an_iteration_with_each_correction(lane, tmp_path, correction, finetune):
    """Full fine-tuning's float32 master weights are cast to bfloat16 in the FP8 copy; a LoRA's own
    float32 matrices stay out of it (torchao's per-row FP8 takes bfloat16 weights only)."""
    from engine_helpers import REPO

    from flowrl.sampling.precision import fp8_support

    lane.skip_on_cpu("FP8 matmuls need a CUDA GPU")
    why = fp8_support(lane.device)
    if why is not None:
        pytest.skip(why)
    pytest.importorskip("torchao", reason="flowrl-diffusion[fp8] installs torchao")
    run = train_run(REPO / "recipes" / "quickstart_step.toml", tmp_path / "run", *lane.placed(), *SETS,
                    "sampler.rollout_precision='fp8'", f"sampler.rollout_correction={correction!r}",
                    f"train.finetune={finetune!r}")
    row = read_rows(run)[0]
    assert not finite_numbers(row), finite_numbers(row)
    assert row["compute/ratio"] == 1.0 and row["grad_norm"] > 0
    if correction == "rescore":  # every trained transition re-scored once, then exactly on-policy
        assert row["compute/rescore/forward"] > 0 and "on_policy/max_abs_log_ratio" in row
    else:  # the FP8 log-probs are the ratio's denominator: no extra forward, no on-policy check
        assert "compute/rescore/forward" not in row and "on_policy/max_abs_log_ratio" not in row
