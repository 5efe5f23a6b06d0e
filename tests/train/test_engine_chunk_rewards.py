"""Rewards weighted differently per chunk (e.g. by noise level): ``[[rewards]] chunk_weights``."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import comparable, load, quiet_console
from tiny_recipe import ENGINE, tiny_recipe, write_recipe

from flowrl.objectives.advantages import advantages_for
from flowrl.errors import RecipeError
from flowrl.recipe import ComponentChoice
from flowrl.runlog import read_metrics
from flowrl.train import train
from flowrl_plugins.advantages import GroupZScore, GroupZScoreConfig


def _recipe(tmp_path, area=None, bright=None, *overrides):
    """The tiny recipe scored by area (weight 1) and brightness (weight 0.5), each with the
    ``chunk_weights`` given (none by default)."""
    rewards = [{"use": "area", "weight": 1.0}, {"use": "brightness", "weight": 0.5}]
    for reward, weights in zip(rewards, (area, bright)):
        if weights is not None:
            reward["chunk_weights"] = weights
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = write_recipe(tmp_path, tiny_recipe(ENGINE, rewards=rewards))
    return load(path, f"run.output_dir={str(tmp_path / 'run')!r}", "train.iterations=2", *overrides)


def test_per_chunk_advantage_is_the_estimator_under_each_chunks_weights():
    torch.manual_seed(0)
    rewards = {"a": torch.rand(8), "b": torch.rand(8)}
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    est = GroupZScore(GroupZScoreConfig())
    choices = [ComponentChoice("x", None, weight=1.0, label="a", chunk_weights=[1.0, 0.0, 0.25]),
               ComponentChoice("y", None, weight=0.5, label="b")]
    adv = advantages_for(est, rewards, choices, groups, 3)
    assert adv.shape == (8, 3)
    # chunk 1 ignores reward a entirely: its advantage is reward b's z-score, times b's weight
    torch.testing.assert_close(adv[:, 1], 0.5 * est({"b": rewards["b"]}, {"b": 1.0}, groups))
    for k, wa in enumerate([1.0, 0.0, 0.25]):
        torch.testing.assert_close(adv[:, k], est(rewards, {"a": wa, "b": 0.5}, groups))
    # without chunk weights: one advantage per sample
    plain = [ComponentChoice("x", None, weight=1.0, label="a"), ComponentChoice("y", None, weight=0.5, label="b")]
    assert advantages_for(est, rewards, plain, groups, 3).shape == (8,)


def test_constant_chunk_weights_reproduce_the_plain_run(tmp_path):
    plain = read_metrics(train(_recipe(tmp_path / "p"), console=quiet_console()))
    same = read_metrics(train(_recipe(tmp_path / "c", [1.0, 1.0], [0.5, 0.5]),
                              console=quiet_console()))
    for a, b in zip(plain, same):
        a, b = comparable(a), comparable(b)
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], float):
                # abs: losses are sums of +-A terms that cancel to ~1e-8; summation order may differ
                assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-7), k
            else:
                assert a[k] == b[k], k


def test_noise_dependent_weights_change_training(tmp_path):
    plain = read_metrics(train(_recipe(tmp_path / "p"), console=quiet_console()))
    split = read_metrics(train(_recipe(tmp_path / "s", [1.0, 0.0], [0.0, 0.5]),
                               console=quiet_console()))
    assert plain[0]["grad_norm"] != pytest.approx(split[0]["grad_norm"], rel=1e-3)
    assert "reward/area/mean" in split[0] and "reward/brightness/mean" in split[0]


def test_wrong_number_of_chunk_weights_is_a_recipe_error(tmp_path):
    with pytest.raises(RecipeError, match="chunk_weights has 3 entries but the chunker makes 2 chunks"):
        _recipe(tmp_path, [1.0, 1.0, 1.0])
