"""[replay]: bounded off-policy reuse in the engine.

- off (size 0) or with staleness 0, a run is the on-policy run bit for bit (metrics, weights);
- on, each iteration after the first trains on the previous rollout again: its first step is
  on-policy to the re-scoring (checked), the weights and their diagnostics are logged, and the
  weights differ from the on-policy run's;
- interrupted with rollouts in the buffer and resumed, the run continues bit for bit (the
  buffer's contents are in the checkpoint);
- 2 processes equal 1 (the buffer keeps each process's samples; its checkpoint gathers them).

The tiny recipe (tests/tiny_recipe.py, ``ENGINE``) over 3 iterations; the 2-process test scores brightness, a
smooth reward, so that a weight difference at rounding level does not flip a thresholded pixel
of the second rollout (the reason the other 2-process tests stop after one iteration).
"""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import (
    InterruptAt,
    assert_same_run,
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

SHORT = ["train.iterations=3", "checkpoint.every=1", "log.eval_every=100"]
ON = ["replay.size=2", "replay.max_staleness=2"]


def run(recipe, out, *sets):
    return train(load(recipe, *SHORT, *sets, f"run.output_dir={str(out)!r}"), console=quiet_console())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay")
    recipe = write_recipe(root)
    return recipe, run(recipe, root / "on_policy"), run(recipe, root / "replay", *ON)


@pytest.mark.slow
@pytest.mark.parametrize("off", [["replay.size=2", "replay.max_staleness=0"], ["replay.size=0", "replay.max_staleness=3"]])
def test_replay_off_is_the_on_policy_run_bit_for_bit(tmp_path, runs, off):
    recipe, on_policy, _ = runs
    got = run(recipe, tmp_path / "off", *off)
    assert [comparable(r) for r in read_metrics(got)] == [comparable(r) for r in read_metrics(on_policy)]
    a, b = final_weights(got), final_weights(on_policy)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert not (latest_checkpoint(got) / "replay.safetensors").exists()


@pytest.mark.slow
def test_replay_trains_on_kept_rollouts_and_logs_its_weights(runs):
    recipe, on_policy, replayed = runs
    rows = [r for r in read_metrics(replayed) if "lr" in r]
    assert [r["replay/rollouts"] for r in rows] == [0, 1, 1]
    assert "replay/ess" not in rows[0]
    for r in rows[1:]:
        assert r["replay/staleness_max"] == 1 and r["replay/staleness_mean"] == 1
        # the re-scoring reproduced itself in the replayed update's first step
        assert r["replay/on_policy/max_abs_log_ratio"] <= 1e-4
        # the policy moved since the rollout: weights not all 1, ESS below the count
        assert r["replay/weight_min"] < 1 < r["replay/weight_max"] or r["replay/weight_std"] > 0
        assert 0 < r["replay/ess"] <= r["replay/weights"] and 0 < r["replay/ess_fraction"] <= 1
        assert r["replay/weight_min"] <= r["replay/weight_mean"] <= r["replay/weight_max"] <= 2.0
        assert "replay/loss" in r and "replay/grad_norm" in r
        assert r["compute/replay/forward"] > 0  # the re-scoring's forwards are counted
    a, b = final_weights(replayed), final_weights(on_policy)
    assert any(not torch.equal(a[k], b[k]) for k in a)
    ckpt = latest_checkpoint(replayed)
    state = json.loads((ckpt / "state.json").read_text())
    # after iteration 2: rollouts 1 and 2 kept (size 2), both within staleness 2 of iteration 3
    assert state["replay"]["iterations"] == [1, 2]
    tensors = load_file(str(ckpt / "replay.safetensors"))
    assert tensors["0.latents"].shape[0] == 8 and tensors["0.advantages"].shape == (8,)


@pytest.mark.slow
def test_replay_resumes_bit_for_bit_with_the_buffer(tmp_path, runs):
    recipe, _, whole = runs
    parts = tmp_path / "parts"
    tracked = tmp_path / "tracked.toml"
    tracked.write_text(recipe.read_text() + '\n[[trackers]]\nuse = "interrupt_at"\n')
    with temporary_plugin(InterruptAt(1), name="interrupt-at-1"):
        with pytest.raises(KeyboardInterrupt):
            run(tracked, parts, *ON)
    ckpt = latest_checkpoint(parts)
    assert ckpt.name == "iter_000002"
    assert json.loads((ckpt / "state.json").read_text())["replay"]["iterations"] == [0, 1]
    train(load(recipe, *SHORT, *ON, f"run.output_dir={str(parts)!r}"), resume=parts, console=quiet_console())
    assert [comparable(r) for r in read_metrics(parts)] == [comparable(r) for r in read_metrics(whole)]
    a, b = final_weights(parts), final_weights(whole)
    assert all(torch.equal(a[k], b[k]) for k in b)
    got, want = (load_file(str(latest_checkpoint(d) / "replay.safetensors")) for d in (parts, whole))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path):
    recipe = write_recipe(tmp_path, tiny_recipe(ENGINE, rewards=[{"use": "brightness"}]))
    # one optimizer step per pass: with more, which samples share a step depends on the layout (loop.py)
    sets = [*SHORT, *ON, "train.iterations=2", "train.optimizer_steps_per_update=1"]
    two, one = two_processes_and_one(recipe, sets, tmp_path)
    assert [r["replay/rollouts"] for r in read_metrics(one) if "lr" in r] == [0, 1]
    assert_same_run(two, one)
    # the buffer's checkpoint is the same global batch, whoever wrote it
    got, want = (load_file(str(latest_checkpoint(d) / "replay.safetensors")) for d in (two, one))
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.allclose(got[k], want[k], atol=1e-5), k


def test_replay_is_refused_where_it_cannot_reweight(tmp_path):
    recipe = write_recipe(tmp_path)
    with pytest.raises(RecipeError, match="proposal means"):
        load(recipe, *ON, "loss.use='guard'")
    with pytest.raises(RecipeError, match="fsdp2"):
        load(recipe, *ON, "distributed.strategy='fsdp2'")
    with pytest.raises(RecipeError, match="weight_steps"):
        load(recipe, *ON, "replay.weight_level='sequence'", "replay.weight_steps=9")
    with pytest.raises(RecipeError, match="weight_steps"):
        load(recipe, *ON, "replay.weight_steps=2")  # the unit level uses each unit's own positions
