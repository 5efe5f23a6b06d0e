"""Dynamics chunks in the engine: profiling at start, weighted sampling from the chunker's
L1rel, adaptive re-profiling every N iterations, and resume keeping the moved boundaries."""

from __future__ import annotations

import json

import pytest
from engine_helpers import InterruptAt, comparable, load, quiet_console
from tiny_recipe import ENGINE, tiny_recipe, write_recipe

from flowrl.dynamics.profile_file import read_l1rel
from flowrl.plugins import temporary_plugin
from flowrl.runlog import read_metrics
from flowrl.train import train

#: The tiny recipe with dynamics chunks profiled at start and re-profiled every iteration, and
#: chunks sampled by their L1rel.
DYNAMICS = {"chunker": {"use": "dynamics", "size": None, "profile": "", "num_chunks": 2, "min_size": 1,
                        "reprofile_every": 1, "num_prompts": 2, "seeds": 1},
            "selector": {"use": "weighted"}}


@pytest.mark.slow
def test_profiles_at_start_reprofiles_and_resumes(tmp_path):
    path = write_recipe(tmp_path, tiny_recipe(ENGINE, DYNAMICS))
    run = tmp_path / "run"
    records = read_metrics(train(load(path, f"run.output_dir={str(run)!r}"), console=quiet_console()))
    # the start profile is written beside the run and is a valid profile of T = 4 transitions
    assert read_l1rel(str(run / "profile.json"), num_transitions=4).shape == (4,)
    sizes = [r["chunk_sizes"] for r in records if "chunk_sizes" in r]
    assert all(sum(s) == 4 and len(s) == 2 for s in sizes)
    assert all("time/profile" in r for r in records[1:4])  # re-profiled every iteration after the first
    for r in records:
        if "chunk_sizes_changed" in r:
            assert r["chunk_sizes_changed"]["to"] == r["chunk_sizes"]
    # the checkpoint carries the layout and the selector's weights
    state = json.loads((run / "checkpoints" / "iter_000004" / "state.json").read_text())
    assert state["chunk_sizes"] == sizes[-1] and len(state["selector_l1rel"]) == 4

    # Ctrl-C after iteration 2 (the layout has been re-profiled twice), then resume:
    # identical to the uninterrupted run
    run2 = tmp_path / "run2"
    (tmp_path / "t").mkdir()
    with_tracker = write_recipe(tmp_path / "t", tiny_recipe(ENGINE, DYNAMICS, trackers=[{"use": "interrupt_at"}]))
    with temporary_plugin(InterruptAt(2), name="interrupt-at-2"):
        with pytest.raises(KeyboardInterrupt):
            train(load(with_tracker, f"run.output_dir={str(run2)!r}"), console=quiet_console())
    resumed = read_metrics(train(load(path, f"run.output_dir={str(run2)!r}"), resume=run2, console=quiet_console()))
    assert [comparable(r)["chunk_sizes"] for r in resumed if "chunk_sizes" in r] == sizes
    for a, b in zip(records, resumed):
        assert comparable(a).get("reward/area/mean") == comparable(b).get("reward/area/mean")
        assert comparable(a).get("trained_units") == comparable(b).get("trained_units")
        # the resumed run read its start profile back rather than measuring it again: its first
        # row counts no more forwards outside the training phases than the uninterrupted run's
        assert a.get("compute/other/forward", 0) == b.get("compute/other/forward", 0), a["iteration"]
