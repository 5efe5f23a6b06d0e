"""Compute accounting: every built-in algorithm runs at the algorithmic minimum of
model work on the fast path (compute/ratio = 1.00), and the counter sees recomputation when it
happens (the exact lean path re-scores chunks)."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import quiet_console

from flowrl.recipe import load_recipe
from flowrl.runlog import read_metrics
from flowrl.train import train

REPO = Path(__file__).resolve().parents[2]
SMALL = ["train.iterations=1", "train.prompts_per_iteration=2", "train.group_size=4", "train.micro_batch_size=4",
         "prompts.num_eval=0", "log.progress=false", "log.image_every=0", "model.random_init=true"]


def _run(tmp_path, recipe: str, *extra: str) -> dict:
    recipe = load_recipe(REPO / "recipes" / recipe, [*SMALL, f"run.output_dir={str(tmp_path / 'run')!r}", *extra])
    return read_metrics(train(recipe, console=quiet_console()))[0]


@pytest.mark.parametrize("recipe", ["quickstart_hacking.toml", "quickstart_step.toml", "quickstart_gspo.toml",
                                    "quickstart_fixed.toml", "quickstart_dynamics.toml"])
def test_builtin_algorithms_run_at_the_minimum_on_the_fast_path(tmp_path, recipe, monkeypatch):
    monkeypatch.chdir(REPO)  # the dynamics recipe names its profile relative to the repository
    row = _run(tmp_path, recipe)
    steps = 17
    assert row["compute/rollout/forward"] == steps * 8  # every sample, every step, once
    assert row["compute/update/forward"] == row["compute/update/backward"] > 0
    assert row["compute/ratio"] == 1.0, row


@pytest.mark.parametrize("kind", ["gaussian_exact", "old_policy_k3"])
def test_a_kl_term_costs_no_second_policy_forward(tmp_path, kind):
    row = _run(tmp_path, "quickstart_hacking.toml", "loss.beta=0.1", f"loss.kl={kind!r}")
    assert row["compute/ratio"] == 1.0, row
    if kind == "gaussian_exact":  # one reference forward per trained transition
        assert row["compute/reference/forward"] == row["compute/update/forward"]
    else:
        assert "compute/reference/forward" not in row


@pytest.mark.slow
def test_the_counter_sees_the_lean_paths_recomputation(tmp_path):
    row = _run(tmp_path, "quickstart_hacking.toml", "train.fast_path=false", "train.update_mode='lean'")
    # a chunk of k re-scores k - 1 steps without grad before its backward: more forwards than the minimum
    assert row["compute/update/forward"] > row["compute/update/backward"]
    assert row["compute/ratio"] > 1.05, row


def test_the_chunk_graph_update_computes_nothing_twice_off_policy(tmp_path):
    row = _run(tmp_path, "quickstart_hacking.toml", "train.fast_path=false", "train.update_mode='chunk_graph'")
    assert row["compute/update/forward"] == row["compute/update/backward"]


def test_grouped_fast_path_forwards_train_the_same_weights_at_the_minimum(tmp_path):
    """``[train].update_group = 4``: the chunks' steps go through the model four at a time (fewer,
    larger forwards), every trained transition still once, and the weights after the update are
    the one-step-at-a-time run's to float32 rounding."""
    from flowrl.train.checkpoint import read_model_weights

    rows, weights = {}, {}
    for group in (1, 4):
        out = tmp_path / f"group{group}"
        out.mkdir()
        rows[group] = _run(out, "quickstart_hacking.toml", f"train.update_group={group}", "checkpoint.every=1")
        weights[group] = read_model_weights(out / "run" / "checkpoints" / "iter_000001")
    assert rows[4]["compute/ratio"] == rows[1]["compute/ratio"] == 1.0
    assert rows[4]["compute/update/forward"] == rows[1]["compute/update/forward"]
    assert rows[4]["loss"] == pytest.approx(rows[1]["loss"], rel=1e-5, abs=1e-9)
    moved = max(float((weights[4][k] - weights[1][k]).abs().max()) for k in weights[1])
    assert moved <= 1e-6, moved


@pytest.mark.slow
def test_flash_and_egrpo_train_fewer_transitions_at_the_minimum(tmp_path):
    """Flash-GRPO trains one of the 16 transitions per sample, E-GRPO the 8 highest-entropy ones,
    step GRPO (uniform 0.5) 8: the update's forwards follow, each at the minimum, the rollout unchanged."""
    # the step recipe's geometry and one pass (the selector recipes run the study's regime: 33 steps,
    # SDE in the first 16, two passes)
    like_step = ["sampler.steps=17", "sampler.sde_window=[0, 16]", "train.updates_per_rollout=1"]
    rows = {name: _run(tmp_path / name, f"quickstart_{name}.toml", *(like_step if name != "step" else []))
            for name in ("step", "flash", "egrpo")}
    for row in rows.values():
        assert row["compute/rollout/forward"] == 17 * 8 and row["compute/ratio"] == 1.0, row
    assert all(len(u) == 1 for u in rows["flash"]["trained_units"])
    assert all(len(u) == 8 for name in ("step", "egrpo") for u in rows[name]["trained_units"])
    # a sample with a zero advantage carries no gradient and costs no forward; each trained
    # transition of every other sample costs one. Flash-GRPO and E-GRPO differ only in the selector
    # (same rollout, same rewards, so the same samples carry a gradient): 1 forward each against 8.
    # The step recipe optimises another reward (the area), so only its unit count is compared.
    flash = rows["flash"]["compute/update/forward"]
    assert 0 < flash <= 8 and rows["egrpo"]["compute/update/forward"] == 8 * flash
    assert rows["step"]["compute/update/forward"] > 0 and rows["step"]["compute/update/forward"] % 8 == 0
