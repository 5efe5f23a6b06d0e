"""The training engine on the lane's device, in its precision (bf16 compute, fp32 master weights on
a GPU), with everything a real run does on: the quickstart recipe (DiffusionNFT on the embedded
model with its shipped weights and three rewards) for 2 iterations, evaluated before each update
and at the end, image grids every iteration, a checkpoint every iteration.

One run (module fixture, 9-11 s on the 2-core CPU; not yet timed on a GPU); the tests read it.
"""

from __future__ import annotations

import json

import pytest
import torch
from gpu_lane import finite_numbers, read_rows, train_run, weights

from flowrl.train.checkpoint import latest_checkpoint, load_checkpoint

pytestmark = pytest.mark.gpu

ITERATIONS = 2
SETS = [f"train.iterations={ITERATIONS}", "train.prompts_per_iteration=2", "train.group_size=4",
        "train.micro_batch_size=4", "prompts.num_eval=2", "prompts.eval_seeds=1", "log.eval_every=1",
        "log.image_every=1", "checkpoint.every=1", "checkpoint.keep_last=3"]


@pytest.fixture(scope="module")
def quickstart(lane, tmp_path_factory):
    from engine_helpers import REPO

    if lane.cuda:
        torch.cuda.reset_peak_memory_stats(lane.device)
    run_dir = train_run(REPO / "recipes" / "quickstart.toml", tmp_path_factory.mktemp("engine") / "run",
                        *lane.placed(), *SETS)
    return run_dir, read_rows(run_dir)


def test_every_iteration_logs_a_finite_row_and_the_final_evaluation(quickstart):
    _, rows = quickstart
    assert [r["iteration"] for r in rows] == [0, 1, ITERATIONS] and rows[-1].get("final") is True
    for row in rows:
        assert not finite_numbers(row), f"non-finite values in iteration {row['iteration']}: {finite_numbers(row)}"
    for row in rows[:-1]:
        assert row["nonfinite_steps"] == 0 and row["grad_norm"] > 0 and row["loss"] == row["loss"]
        assert 0.0 <= row["reward/verifier/mean"] <= 1.0 and row["compute/rollout/forward"] > 0
    # the first update starts from the rollout's own weights (the ELBO's old policy is the policy: no old forward)
    assert rows[0]["elbo/ratio_mean"] == 1.0 and rows[0]["elbo/old_forward"] == 0.0


def test_evaluation_ran_before_each_update_and_after_the_last(quickstart):
    _, rows = quickstart
    for row in rows:
        for reward in ("verifier", "embedded_clip", "area"):
            assert 0.0 <= row[f"eval/{reward}/mean"] <= 1.0, (row["iteration"], reward)
        assert row["eval/hf_share/mean"] >= 0.0
    # the policy moved between the first and the final evaluation (same prompts, same noise)
    assert rows[0]["eval/verifier/mean"] != rows[-1]["eval/verifier/mean"] or \
        rows[0]["eval/embedded_clip/mean"] != rows[-1]["eval/embedded_clip/mean"]


def test_image_grids_are_written_and_readable(quickstart):
    from PIL import Image

    run_dir, _ = quickstart
    grids = [run_dir / "images" / f"iter_{i:06d}.png" for i in range(ITERATIONS)]
    evals = [run_dir / "images" / "eval" / f"iter_{i:06d}.png" for i in range(ITERATIONS + 1)]
    for path in grids + evals:
        assert path.is_file(), path
        with Image.open(path) as image:
            image.load()
            low, high = image.convert("L").getextrema()
            assert min(image.size) >= 16 and low < high, path  # not blank


def test_checkpoints_hold_finite_master_weights_and_the_state_to_resume(lane, quickstart):
    run_dir, _ = quickstart
    latest = latest_checkpoint(run_dir)
    assert latest is not None and latest.name == f"iter_{ITERATIONS:06d}"
    assert (run_dir / "checkpoints" / "iter_000001").is_dir()
    for name in ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json", "recipe.toml"):
        assert (latest / name).is_file(), name
    saved = weights(run_dir)
    assert saved and all(t.dtype == torch.float32 for t in saved.values())  # master weights stay fp32 under bf16
    assert all(bool(torch.isfinite(t).all()) for t in saved.values())
    state = load_checkpoint(latest)["state"]
    assert state["iteration"] == ITERATIONS
    assert f"mixed_precision = \"{'bf16' if lane.bf16 else 'no'}\"" in (latest / "recipe.toml").read_text()


def test_the_run_used_the_lane_device(lane, quickstart):
    run_dir, _ = quickstart
    info = json.loads((run_dir / "run_info.json").read_text())
    assert info["device"] == str(lane.device), info
    if lane.cuda:  # it allocated on the GPU (the CPU allocator keeps no count)
        assert torch.cuda.max_memory_allocated(lane.device) > 0


def test_the_rows_carry_the_runs_peak_device_memory(lane, quickstart):
    """A CUDA run logs the allocator's high-water marks (flowrl.train.device_memory): positive,
    never falling from row to row, reserved at least allocated, below the device's memory; a CPU
    run logs none."""
    _, rows = quickstart
    logged = [r for r in rows if not r.get("final")]
    if not lane.cuda:
        assert not any(k.startswith("memory/") for r in logged for k in r)
        return
    allocated = [r["memory/peak_allocated_gib"] for r in logged]
    reserved = [r["memory/peak_reserved_gib"] for r in logged]
    total = torch.cuda.get_device_properties(lane.device).total_memory / 2**30
    assert 0 < allocated[0] and allocated == sorted(allocated) and all(a <= r < total for a, r in zip(allocated, reserved))
