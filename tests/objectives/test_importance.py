"""The replay's importance weights, their truncation and the effective sample size, against
values worked out by hand or in float64 by a second route (products of per-step ratios)."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.objectives.importance import effective_sample_size, log_weights, truncate_weights, weighted_advantages


def test_unit_weights_are_the_geometric_mean_ratio_of_each_unit():
    current = torch.tensor([[0.1, 0.3, -0.2, 0.0, 0.5]])
    behaviour = torch.tensor([[0.0, 0.1, 0.1, 0.2, 0.1]])
    got = torch.exp(log_weights(current, behaviour, (2, 3), "unit"))
    # second route, float64: the k-th root of the product of the per-step ratios in each unit
    c, b = current.double()[0], behaviour.double()[0]
    ratios = [math.exp(x - y) for x, y in zip(c.tolist(), b.tolist())]
    want = [(ratios[0] * ratios[1]) ** (1 / 2), (ratios[2] * ratios[3] * ratios[4]) ** (1 / 3)]
    assert got.shape == (1, 2)
    assert torch.allclose(got[0].double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=0)


def test_sequence_weight_uses_only_the_first_steps():
    current = torch.tensor([[0.4, 0.2, 9.0, -9.0], [0.0, 0.0, 0.0, 0.0]])
    behaviour = torch.zeros(2, 4)
    # by hand: steps 0 and 1 only: log w = (0.4 + 0.2) / 2 = 0.3; the late steps (+-9) are left out
    got = log_weights(current, behaviour, (4,), "sequence", steps=2)
    assert torch.allclose(got, torch.tensor([0.3, 0.0]), atol=1e-7)
    # all steps: (0.4 + 0.2 + 9 - 9) / 4 = 0.15
    assert torch.allclose(log_weights(current, behaviour, (4,), "sequence"), torch.tensor([0.15, 0.0]), atol=1e-6)


def test_on_policy_weights_are_exactly_one():
    lp = torch.randn(3, 6, generator=torch.Generator().manual_seed(0))
    for level, sizes in (("unit", (1,) * 6), ("unit", (2, 4)), ("sequence", (6,))):
        w, truncated = truncate_weights(log_weights(lp, lp, sizes, level), 2.0)
        assert torch.equal(w, torch.ones_like(w)) and not truncated.any()


def test_truncation_caps_weights_and_reports_where():
    w, truncated = truncate_weights(torch.tensor([math.log(0.5), math.log(1.5), math.log(3.0), 1000.0]), 2.0)
    assert torch.allclose(w, torch.tensor([0.5, 1.5, 2.0, 2.0]), atol=1e-6)
    assert truncated.tolist() == [False, False, True, True]  # exp(1000) overflows to inf: capped, not NaN
    with pytest.raises(ValueError):
        truncate_weights(torch.zeros(2), 0.0)


def test_effective_sample_size_by_hand():
    assert effective_sample_size(torch.ones(8)) == pytest.approx(8.0)
    # (1 + 1 + 2)^2 / (1 + 1 + 4) = 16 / 6
    assert effective_sample_size(torch.tensor([1.0, 1.0, 2.0])) == pytest.approx(16 / 6)
    # one weight dominates: towards 1
    assert effective_sample_size(torch.tensor([1e-6, 1e-6, 1.0])) == pytest.approx(1.0, rel=1e-5)
    assert effective_sample_size(torch.zeros(3)) == 0.0


def test_weighted_advantages_broadcast_per_sample_and_per_unit():
    A = torch.tensor([1.0, -2.0])
    assert torch.equal(weighted_advantages(A, torch.tensor([0.5, 2.0])), torch.tensor([0.5, -4.0]))
    per_unit = weighted_advantages(A, torch.tensor([[1.0, 0.5], [2.0, 1.0]]))
    assert torch.equal(per_unit, torch.tensor([[1.0, 0.5], [-4.0, -2.0]]))
    A2 = torch.tensor([[1.0, 3.0], [-1.0, 0.0]])
    assert torch.equal(weighted_advantages(A2, torch.tensor([2.0, 0.5])), torch.tensor([[2.0, 6.0], [-0.5, 0.0]]))


def test_weighting_the_advantage_weighs_the_clipped_loss():
    """The clipped surrogate is positively homogeneous in A: the weight scales the unit's loss
    (and its gradient) exactly, clipped or not."""
    from flowrl.objectives.losses import ClippedObjective

    objective = ClippedObjective(0.2, 0.2)
    z = torch.tensor([[-0.5, 0.0, 0.1, 0.5]])
    A = torch.tensor([[1.0, -1.0, 2.0, -0.5]])
    w = torch.tensor([[0.3, 1.7, 2.0, 0.9]])
    assert torch.allclose(objective(z, A * w), objective(z, A) * w, atol=1e-7)


def test_bad_shapes_and_levels_are_refused():
    with pytest.raises(ValueError):
        log_weights(torch.zeros(2, 3), torch.zeros(2, 4), (3,), "unit")
    with pytest.raises(ValueError):
        log_weights(torch.zeros(2, 3), torch.zeros(2, 3), (3,), "trajectory")
    with pytest.raises(ValueError):
        log_weights(torch.zeros(2, 3), torch.zeros(2, 3), (3,), "sequence", steps=4)
