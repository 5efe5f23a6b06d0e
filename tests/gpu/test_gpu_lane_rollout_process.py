"""The rollout process (``[pipeline] staleness = 1``, ``worker = "process"``) on the lane's device: a
process spawned after the learner has started CUDA, on the learner's GPU, sent the trained
weights at every sync, its batches moved to the learner. It must draw the run the worker thread
draws, with evaluation, image grids and checkpoints on: to float32 rounding on a GPU (measured on
an H200: the 7th significant digit, tests/train/test_engine_pipeline.py), bit for bit on the CPU.

fp32 (the comparison is about the process boundary, not bf16's rounding); the tiny recipe of the
engine tests for 3 iterations. Two runs, 32 s on the 2-core CPU (the rollout process's
interpreter start is much of it); not yet timed on a GPU.
"""

from __future__ import annotations

import multiprocessing

import pytest
from engine_helpers import write_recipe
from gpu_lane import read_rows, row_differences, train_run, weight_differences, weights

from flowrl.train.checkpoint import latest_checkpoint

pytestmark = pytest.mark.gpu

SETS = ["train.iterations=3", "checkpoint.every=1", "pipeline.staleness=1", "log.eval_every=1", "prompts.num_eval=2",
        "log.image_every=1"]
PROCESS = "pipeline.worker='process'"


@pytest.fixture(scope="module")
def thread_and_process(lane, tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout_process")
    recipe = write_recipe(root)
    fp32 = f"run.device={str(lane.device)!r}"
    thread = train_run(recipe, root / "thread", fp32, *SETS)
    process = train_run(recipe, root / "process", fp32, *SETS, PROCESS)
    return thread, process


def test_the_rollout_process_drew_and_ended_with_the_run(thread_and_process):
    _, process = thread_and_process
    assert multiprocessing.active_children() == []  # no rollout process outlives its run
    trained = [r for r in read_rows(process) if "lr" in r]
    assert [r["pipeline/staleness"] for r in trained] == [0, 1, 1]
    assert trained[-1]["time/pipeline/rollout"] > 0 and trained[-1]["compute/pipeline/forward"] > 0
    for row in trained[1:]:  # re-scored by the learner: its first step is on-policy
        assert row["on_policy/max_abs_log_ratio"] <= 1e-4 and 0 < row["pipeline/ess_fraction"] <= 1
    assert (latest_checkpoint(process) / "pipeline.safetensors").is_file()
    assert list(process.rglob("*.png"))


def test_the_rollout_process_draws_the_worker_threads_run(lane, thread_and_process):
    thread, process = thread_and_process
    rtol, atol = (1e-5, 1e-6) if lane.cuda else (0.0, 0.0)
    wrong = row_differences(read_rows(process), read_rows(thread), rtol, atol)
    wrong += weight_differences(weights(process), weights(thread), atol)
    how = "rtol 1e-5, atol 1e-6" if lane.cuda else "bit for bit on the CPU"
    assert not wrong, f"fp32 on {lane.device}: the rollout process's run != the worker thread's ({how}): " + \
        "; ".join(wrong[:6])
