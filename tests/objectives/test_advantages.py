"""Group advantages (docs/api.md §7)."""

import pytest
import torch

from flowrl.objectives.advantages import (
    combine_group_advantages,
    group_zscore,
    weighted_sum_rewards,
)

R = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 10.0, 4.0, 8.0])
G = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])


def test_unbiased_by_hand():
    # group 0: mean 2, unbiased std sqrt((1 + 0 + 1) / 2) = 1 -> [-1, 0, 1]
    # group 1: all equal -> 0 ; group 2: mean 6, std sqrt((4 + 4) / 1) = 2.828427 -> -+0.707107
    a = group_zscore(R, G)
    exp = torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0, -0.7071068, 0.7071068])
    assert a.dtype == torch.float32 and torch.allclose(a, exp, atol=1e-6)
    assert torch.all(a[3:6] == 0)


def test_biased_and_global_by_hand():
    # biased: group 0 std sqrt(2/3) = 0.8164966 -> -+1.2247449 ; group 2 std 2 -> -+1
    a = group_zscore(R, G, std="biased", eps=0.0)
    exp = torch.tensor([-1.2247449, 0.0, 1.2247449, 0, 0, 0, -1.0, 1.0])
    assert torch.allclose(a, exp, atol=1e-6)
    # global biased std: batch mean 48/8 = 6, squares 25+16+9+16+16+16+4+4 = 106,
    # std sqrt(106 / 8) = 3.6400549 ; group-centred: group 0 -> -+1/3.64, group 2 -> -+2/3.64
    a = group_zscore(R, G, std="biased", eps=0.0, global_std=True)
    s = 3.6400549
    exp = torch.tensor([-1 / s, 0.0, 1 / s, 0, 0, 0, -2 / s, 2 / s])
    assert torch.allclose(a, exp, atol=1e-6)
    # Flow-GRPO's eps 1e-4 only perturbs the 5th digit
    assert torch.allclose(group_zscore(R, G, std="biased", eps=1e-4, global_std=True), exp, atol=1e-4)


def test_clip_by_hand():
    # 49 zeros and one 1: mean 0.02, unbiased var (49 * 0.0004 + 0.9604) / 49 = 0.02,
    # std 0.1414214 -> the 1 gets 0.98 / 0.1414214 = 6.93 -> clipped to 5 ; zeros -0.1414214
    r = torch.zeros(50)
    r[7] = 1.0
    a = group_zscore(r, torch.zeros(50, dtype=torch.long))
    assert a[7].item() == 5.0
    assert torch.allclose(a[:7], torch.full((7,), -0.1414214), atol=1e-6)
    assert group_zscore(r, torch.zeros(50, dtype=torch.long), clip=None)[7].item() == pytest.approx(6.9296465, abs=1e-5)


def test_equal_groups_and_singletons_are_zero_never_nan():
    r = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.3])
    g = torch.tensor([5, 5, 5, 9, 2])  # arbitrary, non-contiguous ids; 9 and 2 are singletons
    for std in ("unbiased", "biased"):
        for glob in (False, True):
            a = group_zscore(r, g, std=std, eps=0.0, global_std=glob)
            assert not torch.isnan(a).any()
            assert torch.all(a == 0)
    a = group_zscore(torch.full((4,), 3.3), torch.zeros(4, dtype=torch.long), eps=0.0)
    assert torch.all(a == 0)


def test_multi_reward_by_hand():
    rewards = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0, 5.0])}
    # 0.5 * [1, 2] + 2 * [3, 5] = [6.5, 11]
    assert weighted_sum_rewards(rewards, {"a": 0.5, "b": 2.0}).tolist() == [6.5, 11.0]
    # one group of 2: each reward z-scores to [-0.7071068, 0.7071068] (unbiased); weights 0.3 + 0.7
    rewards = {"a": torch.tensor([1.0, 3.0]), "b": torch.tensor([10.0, 0.0])}
    a = combine_group_advantages(rewards, torch.tensor([0, 0]), {"a": 0.3, "b": 0.7})
    k = 0.7071068
    assert torch.allclose(a, torch.tensor([-0.3 * k + 0.7 * k, 0.3 * k - 0.7 * k]), atol=1e-6)
    with pytest.raises(ValueError, match="weights must name exactly the rewards"):
        weighted_sum_rewards(rewards, {"a": 1.0})


def test_input_errors():
    with pytest.raises(ValueError, match="group_ids"):
        group_zscore(R, G[:3])
    with pytest.raises(ValueError, match="std"):
        group_zscore(R, G, std="population")
    with pytest.raises(ValueError, match="finite"):
        group_zscore(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))


def test_group_centred_is_the_scaled_deviation_from_the_group_mean():
    """``group_centred``: scale (r - group mean), in the reward's units; in a pair, half the
    reward difference (FDFO's dR)."""
    from flowrl.plugins import get_registry

    comp = get_registry().get("advantage", "group_centred")
    rewards = {"r": torch.tensor([0.9, 0.3, 0.5, 0.5, 1.0, 0.0])}
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    adv = comp.build(comp.params(scale=1.0))(rewards, {"r": 1.0}, groups)
    torch.testing.assert_close(adv, torch.tensor([0.3, -0.3, 0.0, 0.0, 0.5, -0.5]))
    scaled = comp.build(comp.params(scale=0.1, clip=0.04))(rewards, {"r": 1.0}, groups)
    torch.testing.assert_close(scaled, torch.tensor([0.03, -0.03, 0.0, 0.0, 0.04, -0.04]))


@pytest.mark.parametrize("name", ["group_zscore", "tree", "diversity", "group_centred"])
def test_clip_zero_disables_the_clamp_in_every_estimator(name):
    """``clip = 0`` is documented as "disables" for every estimator: the 6.93 of
    ``test_clip_by_hand`` stays 6.93 (it was a ValueError after the first rollout for
    ``group_zscore`` and ``tree``)."""
    from flowrl.plugins import get_registry

    comp = get_registry().get("advantage", name)
    r = torch.zeros(50)
    r[7] = 1.0
    rewards, groups = {"r": r}, torch.zeros(50, dtype=torch.long)
    estimator = comp.build(comp.params(clip=0.0))
    if name == "diversity":  # equal features: every nearest distance 1, every multiplier 1
        adv = estimator(rewards, {"r": 1.0}, groups, features=torch.zeros(50, 3))
    else:
        adv = estimator(rewards, {"r": 1.0}, groups)
    expected = 0.98 / 0.1414214 if name != "group_centred" else 0.98
    assert adv[7].item() == pytest.approx(expected, rel=1e-5)
