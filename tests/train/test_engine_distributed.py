"""Data parallelism: 2 gloo processes under torchrun equal 1 process on the same global batch."""

from __future__ import annotations

import json
import shutil

import pytest
from engine_helpers import assert_records_close, assert_weights_close, final_weights, load, quiet_console, run_cli

from flowrl.train.checkpoint import latest_checkpoint, read_model_weights

from flowrl.runlog import read_metrics
from flowrl.train import train

# 3 prompts x 4 samples over 2 processes: 6 samples each, so prompt 1's group is split across
# the processes on purpose and its advantages need the gathered rewards. The evaluation's 10
# images make 2 batches of 8 (micro-batch x 4): the main process evaluates the first, process 1
# the second, and the gathered numbers are the one process's.
ONE_STEP = [
    "train.iterations=1", "train.prompts_per_iteration=3", "train.group_size=4", "train.micro_batch_size=2",
    "train.updates_per_rollout=1", "train.optimizer_steps_per_update=1", "prompts.num_eval=5", "prompts.eval_seeds=2",
]


# The 2-process run of one iteration that both tests need: the first compares it with 1 process,
# the second resumes a copy of it for the second iteration (checkpoint.every=1 only matters to
# that resume; a 1-iteration run checkpoints at its end either way).
ONE_STEP_CHECKPOINTED = [*ONE_STEP, "checkpoint.every=1"]


@pytest.fixture(scope="module")
def two_process_iteration(tmp_path_factory, reference_run):
    recipe_path, _, _ = reference_run
    two = tmp_path_factory.mktemp("ddp") / "two"
    sets = [a for s in ONE_STEP_CHECKPOINTED for a in ("--set", s)]
    # through flowrl's own launcher (torchrun), as users launch: the other 2-process runs of the
    # engine tests fork their workers from the test process (engine_helpers.run_forked_workers)
    proc = run_cli(["train", str(recipe_path), *sets, "-o", str(two), "--num-processes", "2"], timeout=300,
                   launcher=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return two, proc


def test_two_processes_equal_one(tmp_path, reference_run, two_process_iteration):
    recipe_path, _, _ = reference_run
    (two, proc), one = two_process_iteration, tmp_path / "one"
    out = " ".join(proc.stdout.split())
    assert "world size 2" in out and "6 per process" in out and "split groups across processes" in out

    train(load(recipe_path, *ONE_STEP, f"run.output_dir={str(one)!r}"), console=quiet_console())

    (rec2, final2), (rec1, final1) = read_metrics(two), read_metrics(one)
    assert final2["final"] and "eval/area/mean" in rec2  # evaluated before the iteration and at the end
    final2.pop("world_size", None), final1.pop("world_size", None)
    assert_records_close(final2, final1, rtol=1e-4, atol=1e-6)
    # the world size inside the run, not just what was asked for
    assert rec2["world_size"] == 2 and rec1["world_size"] == 1
    ckpt = two / "checkpoints" / "iter_000001"
    state = json.loads((ckpt / "state.json").read_text())
    assert state["world_size"] == 2
    # ddp replicates the weights: the main process writes the single-process layout, no shards
    # (docs/distributed.md, "Checkpoints"); only fsdp2 writes sharded/ (test_engine_fsdp2.py)
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "optimizer.safetensors").is_file()
    assert not (ckpt / "sharded").exists() and "format" not in state
    rec2.pop("world_size"), rec1.pop("world_size")
    # the update's time, broken down: the 2 processes' all-reduce of the gradients is their own part
    assert rec2["time/update/gradient_sync"] > max(rec1["time/update/gradient_sync"], 0.0)
    assert len(rec2["trained_units"]) == 12  # gathered from both processes, in global order
    assert_records_close(rec2, rec1, rtol=1e-4, atol=1e-6)
    assert_weights_close(final_weights(two), final_weights(one), atol=1e-6)
    # ... and the step really moved them (lr 3e-3): equal because both processes did their share
    from flowrl_plugins.embedded.plugin import EmbeddedConfig, EmbeddedModel

    initial = dict(EmbeddedModel(EmbeddedConfig(random_init=True)).denoiser.named_parameters())
    moved = max((w - initial[k].detach()).abs().max().item() for k, w in final_weights(one).items())
    assert moved > 1e-4


def test_a_ddp_run_resumes_exactly(tmp_path, reference_run, two_process_iteration):
    """Stopped after iteration 1 and resumed with 2 processes from the main process's
    single-process checkpoint (every process reads model.safetensors and the main process's RNG
    states): the same metrics and, bit for bit, the same weights as the uninterrupted run."""
    recipe_path, _, _ = reference_run
    two_iterations = [*ONE_STEP[1:], "train.iterations=2", "checkpoint.every=1"]
    sets = [a for s in two_iterations for a in ("--set", s)]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    proc = run_cli(["train", str(recipe_path), *sets, "-o", str(whole), "--num-processes", "2"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    # the first iteration, stopped there: the shared run with the same recipe and 1 iteration
    shutil.copytree(two_process_iteration[0], parts)
    proc = run_cli(["train", str(parts / "recipe.toml"), *sets, "--resume", str(parts), "--num-processes", "2"],
                   timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert not (latest_checkpoint(parts) / "sharded").exists()
    a, b = read_metrics(whole), read_metrics(parts)
    assert [r["iteration"] for r in b] == [0, 1, 2]  # 2 iterations and the final evaluation
    for x, y in zip(a, b):
        assert_records_close(x, y, rtol=0, atol=0)
    wa, wb = read_model_weights(latest_checkpoint(whole)), read_model_weights(latest_checkpoint(parts))
    assert sorted(wa) == sorted(wb) and all(bool((wa[k] == wb[k]).all()) for k in wa)
