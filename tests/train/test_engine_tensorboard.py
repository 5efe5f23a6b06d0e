"""The TensorBoard tracker plugin receives every iteration's scalars and the group grid."""

from __future__ import annotations

import pytest
from engine_helpers import load, quiet_console
from tiny_recipe import ENGINE, tiny_recipe, write_recipe

from flowrl.train import train

pytest.importorskip("tensorboard")


def test_tensorboard_tracker_writes_scalars_and_images(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    text = tiny_recipe(ENGINE, log={"image_every": 1}, trackers=[{"use": "tensorboard"}])
    path = write_recipe(tmp_path, text)
    run = train(load(path, f"run.output_dir={str(tmp_path / 'run')!r}", "train.iterations=2"), console=quiet_console())
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    assert "reward/area/mean" in scalars and "grad_norm" in scalars
    assert [e.step for e in acc.Scalars("reward/area/mean")] == [0, 1]
    assert acc.Tags()["images"] == ["group"]


def test_a_resumed_run_shows_each_iteration_once(tmp_path):
    """A run resumed from a checkpoint older than its last logged iteration redoes that iteration
    and logs it again: TensorBoard hides the earlier events from the resumed iteration on
    (``purge_step``), as metrics.jsonl drops its rows, so every curve has one point per step."""
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from flowrl.runlog import read_metrics

    text = tiny_recipe(ENGINE, trackers=[{"use": "tensorboard"}])
    path = write_recipe(tmp_path, text)
    sets = [f"run.output_dir={str(tmp_path / 'run')!r}", "train.iterations=3", "checkpoint.every=2"]
    run = train(load(path, *sets), console=quiet_console())
    shutil.rmtree(run / "checkpoints" / "iter_000003")  # the run ends with its iteration-2 checkpoint
    train(load(run / "recipe.toml"), resume=run, console=quiet_console())
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    logged = [(e.step, e.value) for e in acc.Scalars("reward/area/mean")]
    assert [step for step, _ in logged] == [0, 1, 2]
    rows = {r["iteration"]: r for r in read_metrics(run) if "reward/area/mean" in r}
    assert [value for _, value in logged] == pytest.approx([rows[i]["reward/area/mean"] for i in (0, 1, 2)])


def test_a_run_resumed_before_its_first_checkpoint_shows_each_iteration_once(tmp_path):
    """Stopped in an update before its first checkpoint (or killed), a run resumes at iteration 0
    and redoes everything it logged: TensorBoard hides all of it (purge_step 0), not nothing."""
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    text = tiny_recipe(ENGINE, trackers=[{"use": "tensorboard"}])
    path = write_recipe(tmp_path, text)
    run = train(load(path, f"run.output_dir={str(tmp_path / 'run')!r}", "train.iterations=2"), console=quiet_console())
    shutil.rmtree(run / "checkpoints")  # as if it never reached one
    train(load(run / "recipe.toml"), resume=run, console=quiet_console())
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward/area/mean")] == [0, 1]
