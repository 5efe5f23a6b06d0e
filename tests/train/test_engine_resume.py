"""Durable state: exact resume, Ctrl-C, and a kill in the middle of a checkpoint write. (A real
signal to a subprocess run, then the resume its message suggests: tests/train/test_engine_signals.py.)"""

from __future__ import annotations

import json

import pytest
from engine_helpers import (
    InterruptAt,
    SimulatedKill,
    assert_records_close,
    assert_weights_close,
    final_weights,
    kill_after_writing,
    load,
    quiet_console,
)
from tiny_recipe import ENGINE, tiny_recipe, write_recipe

from flowrl.plugins import temporary_plugin
from flowrl.runlog import read_metrics
from flowrl.train import train
from flowrl.train.checkpoint import latest_checkpoint, load_checkpoint


def _assert_same_run(run_dir, reference_dir, reference_records):
    records = read_metrics(run_dir)
    assert [r["iteration"] for r in records] == [r["iteration"] for r in reference_records]
    for got, want in zip(records, reference_records):
        assert_records_close(got, want)
    assert_weights_close(final_weights(run_dir), final_weights(reference_dir))


@pytest.mark.slow
def test_interrupt_then_resume_equals_uninterrupted_run(tmp_path, reference_run):
    recipe_path, ref_dir, ref = reference_run
    run_dir = tmp_path / "run"
    # The same recipe plus a tracker that presses Ctrl-C after iteration 1 is logged.
    with_tracker = write_recipe(tmp_path, tiny_recipe(ENGINE, trackers=[{"use": "interrupt_at"}]))
    with temporary_plugin(InterruptAt(1), name="interrupt-at-1"):
        with pytest.raises(KeyboardInterrupt):
            train(load(with_tracker, f"run.output_dir={str(run_dir)!r}"), console=quiet_console())

    # Stopped after 2 completed iterations, with the every-2 checkpoint as latest.
    assert [r["iteration"] for r in read_metrics(run_dir)] == [0, 1]
    ckpt = latest_checkpoint(run_dir)
    assert ckpt.name == "iter_000002"
    state = load_checkpoint(ckpt)["state"]
    assert state["iteration"] == 2 and state["data_position"] == 2 * 2

    # Resume (trackers may change on resume) to the end: iterations 2-3 and the weights match.
    train(load(recipe_path, f"run.output_dir={str(run_dir)!r}"), resume=run_dir, console=quiet_console())
    _assert_same_run(run_dir, ref_dir, ref)


def test_kill_during_checkpoint_write_keeps_latest_valid(tmp_path, reference_run):
    recipe_path, ref_dir, ref = reference_run
    run_dir = tmp_path / "run"
    recipe = load(recipe_path, f"run.output_dir={str(run_dir)!r}")
    # Dies after writing the optimizer file of the final checkpoint (iteration 4).
    with pytest.raises(SimulatedKill), kill_after_writing("iter_000004/optimizer.safetensors"):
        train(recipe, console=quiet_console())

    ckpt_root = run_dir / "checkpoints"
    assert json.loads((ckpt_root / "latest.json").read_text()) == {"name": "iter_000002"}
    partial = list(ckpt_root.glob(".tmp-iter_000004-*"))
    assert partial and not (partial[0] / "state.json").exists()
    assert not (ckpt_root / "iter_000004").exists()
    state = load_checkpoint(latest_checkpoint(run_dir))  # complete and loadable
    assert state["state"]["iteration"] == 2 and state["model"]

    train(recipe, resume=run_dir, console=quiet_console())
    assert not list(ckpt_root.glob(".tmp-*")), "the partial write is cleaned up"
    _assert_same_run(run_dir, ref_dir, ref)


def test_new_run_refuses_a_directory_with_checkpoints(reference_run):
    from flowrl.errors import FlowrlError

    recipe_path, ref_dir, _ = reference_run
    with pytest.raises(FlowrlError, match="already holds a run") as exc:
        train(load(recipe_path, f"run.output_dir={str(ref_dir)!r}"), console=quiet_console())
    assert "--resume" in exc.value.hint


def test_resume_refuses_a_changed_recipe(reference_run):
    from flowrl.errors import FlowrlError

    recipe_path, ref_dir, _ = reference_run
    with pytest.raises(FlowrlError, match=r"\[train\]"):
        train(load(recipe_path, "train.lr=1e-2"), resume=ref_dir, console=quiet_console())


@pytest.mark.slow
def test_kill_right_after_a_checkpoint_is_published_loses_no_metrics_row(tmp_path, reference_run):
    """The row of an iteration is on disk before the checkpoint that says the iteration is done:
    a process killed right after publishing (latest.json written) resumes with every iteration's
    row exactly once."""
    recipe_path, ref_dir, ref = reference_run
    run_dir = tmp_path / "run"
    recipe = load(recipe_path, f"run.output_dir={str(run_dir)!r}")
    with pytest.raises(SimulatedKill), kill_after_writing("latest.json"):  # the first checkpoint, iteration 2
        train(recipe, console=quiet_console())
    assert load_checkpoint(latest_checkpoint(run_dir))["state"]["iteration"] == 2
    assert [r["iteration"] for r in read_metrics(run_dir)] == [0, 1]

    train(recipe, resume=run_dir, console=quiet_console())
    assert [r["iteration"] for r in read_metrics(run_dir)] == [0, 1, 2, 3]
    _assert_same_run(run_dir, ref_dir, ref)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_resuming_with_more_iterations_follows_the_longer_schedule_from_its_first_step(tmp_path, schedule):
    """A checkpoint keeps the LR schedule's position, not its length: resumed with 4 iterations
    instead of 2, a decaying schedule spans 4, and the first resumed step already takes its LR
    (the restored optimizer had kept the 2-iteration schedule's for one more step: a finished
    linear run took a step at LR 0 and then jumped). A note says so."""
    import io
    import math

    from rich.console import Console

    from flowrl.train.optimizer import lr_lambda

    path = write_recipe(tmp_path, tiny_recipe(ENGINE, train={"lr_schedule": schedule, "warmup_steps": 0}))
    sets = [f"run.output_dir={str(tmp_path / 'run')!r}", "checkpoint.every=1"]
    run_dir = train(load(path, *sets, "train.iterations=2"), console=quiet_console())
    out = io.StringIO()
    recipe = load(path, *sets, "train.iterations=4")
    train(recipe, resume=run_dir, console=Console(file=out, width=300))
    rows = [r for r in read_metrics(run_dir) if "lr" in r]
    steps = recipe.train.updates_per_rollout * recipe.train.optimizer_steps_per_update
    f = lr_lambda(recipe.train, 4 * steps)
    assert [r["lr"] for r in rows[2:]] == pytest.approx([recipe.train.lr * f(i * steps) for i in (2, 3)], rel=1e-9)
    assert not math.isclose(rows[2]["lr"], recipe.train.lr * lr_lambda(recipe.train, 2 * steps)(2 * steps))
    assert f"the LR schedule ('{schedule}') now spans 4 iterations" in " ".join(out.getvalue().split())
