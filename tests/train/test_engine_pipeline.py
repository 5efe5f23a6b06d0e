"""[pipeline]: one-step-off pipelining in the engine.

- staleness 0 is the synchronous run bit for bit (metrics, weights), whatever the other keys;
- staleness 1: rollout 0 is drawn by the initial weights (trained on as it is, as in the
  synchronous run), every later rollout by the weights from before the previous update; the
  update re-scores it (its first step on-policy, checked) and weights its advantages; the
  weights' diagnostics and the staleness are logged; sync_every = 2 makes every second rollout
  two updates old;
- the worker thread and the in-order draw give the same run, bit for bit;
- interrupted and resumed, the run continues bit for bit (the behaviour weights are in the
  checkpoint, the pending rollout is redrawn with them), also when a rollout process
  (``worker = "process"``) takes over from the thread, and no rollout process outlives the run;
- on a GPU, a rollout process on the learner's GPU gives the thread's run to float32 rounding
  (skipped without CUDA; run on an H200);
- 2 processes, each drawing in a rollout process of its own, equal 1 drawing in a thread, with
  evaluation, image grids and checkpoints on (a LoRA run: the rollout processes attach it too);
- refused where replay is refused, and together with [replay].

The tiny recipe (tests/tiny_recipe.py, ``ENGINE``) over 3 iterations.
"""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import (
    InterruptAt,
    assert_records_close,
    assert_same_run,
    assert_weights_close,
    comparable,
    final_weights,
    load,
    quiet_console,
    two_processes_and_one,
)
from safetensors.torch import load_file
from tiny_recipe import ENGINE, tiny_recipe, write_recipe

from flowrl.errors import RecipeError
from flowrl.plugins import temporary_plugin
from flowrl.runlog import read_metrics
from flowrl.train import train
from flowrl.train.checkpoint import latest_checkpoint
from flowrl.train.pipeline import behaviour_iteration

SHORT = ["train.iterations=3", "checkpoint.every=1", "log.eval_every=100"]
ON = ["pipeline.staleness=1"]
PROCESS = ["pipeline.worker='process'"]


def run(recipe, out, *sets):
    return train(load(recipe, *SHORT, *sets, f"run.output_dir={str(out)!r}"), console=quiet_console())


def trained_rows(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "lr" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    recipe = write_recipe(root)
    return recipe, run(recipe, root / "synchronous"), run(recipe, root / "pipelined", *ON)


def test_behaviour_iteration_is_the_last_sync_before_the_previous_update():
    assert [behaviour_iteration(j, 1) for j in range(5)] == [0, 0, 1, 2, 3]
    assert [behaviour_iteration(j, 2) for j in range(6)] == [0, 0, 0, 2, 2, 4]
    assert [j - behaviour_iteration(j, 3) for j in range(1, 8)] == [1, 2, 3, 1, 2, 3, 1]


@pytest.mark.slow
def test_staleness_0_is_the_synchronous_run_bit_for_bit(tmp_path, runs):
    recipe, synchronous, _ = runs
    got = run(recipe, tmp_path / "off", "pipeline.staleness=0", "pipeline.sync_every=3", "pipeline.overlap=false")
    assert [comparable(r) for r in read_metrics(got)] == [comparable(r) for r in read_metrics(synchronous)]
    a, b = final_weights(got), final_weights(synchronous)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert not (latest_checkpoint(got) / "pipeline.safetensors").exists()


@pytest.mark.slow
def test_staleness_1_trains_on_the_previous_weights_rollouts_importance_weighted(runs):
    _, synchronous, pipelined = runs
    rows, sync_rows = trained_rows(pipelined), trained_rows(synchronous)
    assert [r["pipeline/staleness"] for r in rows] == [0, 1, 1]
    # rollout 0 is drawn by the initial weights in both runs, and trained on as it is
    assert rows[0]["reward/area/mean"] == sync_rows[0]["reward/area/mean"]
    assert rows[0]["loss"] == sync_rows[0]["loss"] and "pipeline/ess" not in rows[0]
    # rollout 1 is drawn by the initial weights too (the synchronous run's by the updated ones)
    assert rows[1]["reward/area/mean"] != sync_rows[1]["reward/area/mean"]
    for r in rows[1:]:
        assert r["on_policy/max_abs_log_ratio"] <= 1e-4  # re-scored: the first step is on-policy
        assert r["pipeline/staleness_max"] == 1 and r["pipeline/weights"] == 16  # 8 samples x 2 chunks
        assert r["pipeline/weight_min"] < r["pipeline/weight_max"] <= 2.0
        assert 0 < r["pipeline/ess"] <= r["pipeline/weights"] and 0 < r["pipeline/ess_fraction"] <= 1
        assert r["compute/pipeline/forward"] > 0 and r["compute/rollout/forward"] > 0
        assert r["time/pipeline/rollout"] > 0
    a, b = final_weights(pipelined), final_weights(synchronous)
    assert any(not torch.equal(a[k], b[k]) for k in a)
    ckpt = latest_checkpoint(pipelined)
    assert json.loads((ckpt / "state.json").read_text())["pipeline"] == {"behaviour_iteration": 2}
    assert sorted(load_file(str(ckpt / "pipeline.safetensors"))) == sorted(a)  # the trainable parameters


@pytest.mark.slow
def test_the_worker_thread_and_the_in_order_draw_are_the_same_run(tmp_path, runs):
    recipe, _, pipelined = runs
    got = run(recipe, tmp_path / "in_order", *ON, "pipeline.overlap=false")
    assert [comparable(r) for r in read_metrics(got)] == [comparable(r) for r in read_metrics(pipelined)]
    a, b = final_weights(got), final_weights(pipelined)
    assert all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.slow
def test_sync_every_2_draws_every_second_rollout_two_updates_old(tmp_path, runs):
    recipe, _, pipelined = runs
    got = run(recipe, tmp_path / "k2", *ON, "pipeline.sync_every=2")
    rows = trained_rows(got)
    assert [r["pipeline/staleness"] for r in rows] == [0, 1, 2]
    # rollouts 0 and 1 are drawn by the initial weights whatever k
    assert [comparable(r) for r in rows[:2]] == [comparable(r) for r in trained_rows(pipelined)[:2]]
    # synced before update 2: the weights that would draw rollout 3 (if the run were extended)
    assert json.loads((latest_checkpoint(got) / "state.json").read_text())["pipeline"] == {"behaviour_iteration": 2}


@pytest.mark.slow
def test_resumes_bit_for_bit_with_the_behaviour_weights_in_a_rollout_process(tmp_path, runs):
    """Interrupted with the worker thread, resumed with a rollout process (the placement may
    change on resume): the process takes the checkpoint's behaviour weights, redraws the pending
    rollout and draws the rest exactly as the thread did, and ends with the run."""
    import multiprocessing

    recipe, _, whole = runs
    parts = tmp_path / "parts"
    tracked = tmp_path / "tracked.toml"
    tracked.write_text(recipe.read_text() + '\n[[trackers]]\nuse = "interrupt_at"\n')
    with temporary_plugin(InterruptAt(1), name="interrupt-at-1"):
        with pytest.raises(KeyboardInterrupt):
            run(tracked, parts, *ON)
    ckpt = latest_checkpoint(parts)
    assert ckpt.name == "iter_000002"
    # rollout 2 was pending, drawn by the weights from before update 1: those are kept
    assert json.loads((ckpt / "state.json").read_text())["pipeline"] == {"behaviour_iteration": 1}
    train(load(recipe, *SHORT, *ON, *PROCESS, "pipeline.device='cpu'", f"run.output_dir={str(parts)!r}"),
          resume=parts, console=quiet_console())
    assert multiprocessing.active_children() == []  # the rollout process ended with the run
    assert [comparable(r) for r in read_metrics(parts)] == [comparable(r) for r in read_metrics(whole)]
    assert trained_rows(parts)[-1]["time/pipeline/rollout"] > 0  # drawn (redrawn) in the rollout process
    a, b = final_weights(parts), final_weights(whole)
    assert all(torch.equal(a[k], b[k]) for k in b)
    got, want = (load_file(str(latest_checkpoint(d) / "pipeline.safetensors")) for d in (parts, whole))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
def test_under_bf16_autocast_the_rollout_process_draws_as_the_thread_does(tmp_path):
    """mixed_precision = 'bf16': the learner's policy computes under accelerate's autocast, and so
    must the rollout process's copy, which no Accelerator prepares; it drew in float32 before
    (rollout 0's rewards and ratios differed from the thread's). Now the same run, row for row."""
    recipe = write_recipe(tmp_path)
    sets = [*ON, "distributed.mixed_precision='bf16'", "train.on_policy_tolerance=1e-2"]
    thread = run(recipe, tmp_path / "thread", *sets)
    process = run(recipe, tmp_path / "process", *sets, *PROCESS, "pipeline.device='cpu'")
    assert [comparable(r) for r in read_metrics(process)] == [comparable(r) for r in read_metrics(thread)]
    a, b = final_weights(process), final_weights(thread)
    assert all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path):
    recipe = write_recipe(tmp_path, tiny_recipe(ENGINE, rewards=[{"use": "brightness"}]))
    # one optimizer step per pass (loop.py); evaluation, grids and checkpoints on, as in the other 2-process tests;
    # a LoRA, which each rollout process attaches to its own copy before it takes the trained weights
    sets = [*SHORT, *ON, "train.iterations=2", "train.optimizer_steps_per_update=1", "log.eval_every=1",
            "prompts.num_eval=2", "log.image_every=1", "train.finetune='lora'"]
    # each of the 2 training processes draws in a rollout process of its own; the 1 process in a thread
    two, one = two_processes_and_one(recipe, sets, tmp_path, two_only=PROCESS)
    rec1 = read_metrics(one)
    assert [r["pipeline/staleness"] for r in rec1 if "lr" in r] == [0, 1]
    assert sum("eval/brightness/mean" in r for r in rec1) == 3  # 0, 1 and the final
    assert_same_run(two, one)
    got, want = (load_file(str(latest_checkpoint(d) / "pipeline.safetensors")) for d in (two, one))
    assert sorted(got) == sorted(want) and all(torch.allclose(got[k], want[k], atol=1e-6) for k in want)
    assert list(two.rglob("*.png"))  # the grids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_rollout_process_draws_the_worker_threads_run(tmp_path):
    """On CUDA, learner and rollout process on the same GPU (the process spawned after CUDA has
    started in the learner, sent the weights at every sync, its batch moved to the learner): the
    run equals the worker thread's to float32 rounding, with evaluation, grids and checkpoints on.
    Not bit for bit, as on the CPU: on an H200 (torch 2.11) the rewards and log-ratios differed in
    the 7th significant digit (advantage mean 1.5e-8 against 0.0)."""
    import multiprocessing

    recipe = write_recipe(tmp_path, tiny_recipe(ENGINE, run={"device": "cuda"}))
    sets = [*ON, "log.eval_every=1", "prompts.num_eval=2", "log.image_every=1"]
    thread, process = run(recipe, tmp_path / "thread", *sets), run(recipe, tmp_path / "process", *sets, *PROCESS)
    assert multiprocessing.active_children() == []
    rows_t, rows_p = read_metrics(thread), read_metrics(process)
    assert trained_rows(process)[-1]["time/pipeline/rollout"] > 0 and list(process.rglob("*.png"))
    for a, b in zip(rows_p, rows_t, strict=True):
        assert_records_close(a, b)
    assert_weights_close(final_weights(process), final_weights(thread), atol=1e-6)


def test_refused_where_an_older_policy_cannot_be_corrected(tmp_path):
    recipe = write_recipe(tmp_path)
    with pytest.raises(RecipeError, match=r"\[pipeline\] staleness = 1 cannot re-weight loss 'guard'"):
        load(recipe, *ON, "loss.use='guard'")
    with pytest.raises(RecipeError, match=r"\[pipeline\] staleness = 1 is not supported with strategy = 'fsdp2'"):
        load(recipe, *ON, "distributed.strategy='fsdp2'")
    with pytest.raises(RecipeError, match=r"\[pipeline\] staleness = 1 and \[replay\] cannot be combined"):
        load(recipe, *ON, "replay.size=1")
    with pytest.raises(RecipeError, match="staleness"):
        load(recipe, "pipeline.staleness=2")
    with pytest.raises(RecipeError, match="sync_every"):
        load(recipe, "pipeline.sync_every=0")
    with pytest.raises(RecipeError, match="set worker = 'process' too"):
        load(recipe, *ON, "pipeline.device='cuda:1'")
    with pytest.raises(RecipeError, match=r"device must be '', 'cpu', 'cuda' or 'cuda:N', got 'gpu1'"):
        load(recipe, *ON, *PROCESS, "pipeline.device='gpu1'")
