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
