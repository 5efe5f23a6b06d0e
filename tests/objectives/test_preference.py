"""Online DPO's and DGPO's maths (flowrl/objectives/dpo.py, dgpo.py) against values derived by
hand and a float64 second route, the group-shared forward-process points, and their params."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from flowrl.objectives.dgpo import dgpo_group_sums, dgpo_point_loss, dgpo_terms
from flowrl.objectives.dpo import best_worst_pairs, dpo_point_loss
from flowrl.objectives.preference import flow_error, group_points


def test_flow_error_by_hand():
    # v = (1, 2), eps - x0 = (0, 1): ((1 - 0)^2 + (2 - 1)^2) / 2 = 1
    v, x0, eps = torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 1.0]])
    assert flow_error(v, x0, eps).tolist() == [1.0]
    with pytest.raises(ValueError, match="shape"):
        flow_error(v, x0[:, :1], eps[:, :1])


def test_best_worst_pairs():
    adv = torch.tensor([0.5, -1.0, 2.0, 2.0, 0.0, 0.0, 1.0, -3.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
    partner, winner = best_worst_pairs(adv, groups)
    # group 0: the first of the highest (2) is paired with the lowest (1); group 1 all equal: no pair
    assert partner.tolist() == [-1, 2, 1, -1, -1, -1, 7, 6]
    assert winner.tolist() == [False, False, True, False, False, False, True, False]


def test_dpo_loss_by_hand():
    # winner: e 1.0, r 1.1 (own -0.1); loser: e 2.0, r 1.9 (other +0.1): m = -0.2, beta 10: softplus(-1)
    e = torch.tensor([[1.0], [2.0]])
    r = torch.tensor([[1.1], [1.9]])
    pe, pr = e.flip(0), r.flip(0)
    loss = dpo_point_loss(e, r, pe, pr, torch.tensor([True, False]), 10.0)
    want = math.log1p(math.exp(-1.0))
    assert loss.flatten().tolist() == pytest.approx([want, want], rel=1e-6)
    with pytest.raises(ValueError, match="beta"):
        dpo_point_loss(e, r, pe, pr, torch.tensor([True, False]), 0.0)
    with pytest.raises(ValueError, match=r"\[n, K\]"):
        dpo_point_loss(e, r[:1], pe, pr, torch.tensor([True, False]), 1.0)


def test_dpo_rows_sum_to_the_pair_gradient_on_policy():
    """Each row uses its own error with the gradient and its partner's as a number: with the
    partner's number equal to its current error (on-policy), the two rows' gradients are the
    pair loss's gradient, checked in float64 on the pair loss written out."""
    g = torch.Generator().manual_seed(0)
    K, beta = 3, 40.0
    e = (1 + 0.1 * torch.randn(2, K, generator=g)).requires_grad_(True)
    r = 1 + 0.1 * torch.randn(2, K, generator=g)
    rows = dpo_point_loss(e, r, e.detach().flip(0), r.flip(0), torch.tensor([True, False]), beta)
    (grad,) = torch.autograd.grad(rows.sum(), e)
    e64 = e.detach().double().requires_grad_(True)
    pair = F.softplus(beta / 2 * ((e64[0] - r[0].double()) - (e64[1] - r[1].double())))
    (want,) = torch.autograd.grad(pair.sum(), e64)
    assert torch.allclose(grad.double(), want, rtol=1e-5)
    assert torch.allclose(rows[0].double(), pair.detach(), rtol=1e-6) and torch.equal(rows[0], rows[1])


def test_dgpo_group_sums_by_hand():
    # group 0 of size 2: A = (1, -1), delta = (0.2, 0.4), beta 10: S = (1*10*0.2 - 1*10*0.4) / 2 = -1
    delta = torch.tensor([[0.2], [0.4], [0.3]])
    adv = torch.tensor([1.0, -1.0, 2.0])
    groups = torch.tensor([5, 5, 9])
    sizes = torch.tensor([2, 2, 4])  # the third sample's group has 3 more members, untrained
    terms = dgpo_terms(delta, adv, sizes, 10.0)
    assert terms.flatten().tolist() == pytest.approx([1.0, -2.0, 1.5])
    assert dgpo_group_sums(terms, groups).flatten().tolist() == pytest.approx([-1.0, -1.0, 1.5])
    with pytest.raises(ValueError, match="beta"):
        dgpo_terms(delta, adv, sizes, -1.0)


def test_dgpo_gradient_is_the_group_dpo_gradient():
    """sg(sigmoid(S)) A e has the gradient of -log sigmoid(R(G+) - R(G-)) divided by beta / G, with
    R(G) = sum over G of |A| beta (r - e) / G: checked in float64 on that loss written out."""
    g = torch.Generator().manual_seed(1)
    G, K, beta = 4, 2, 30.0
    e = (1 + 0.05 * torch.randn(G, K, generator=g)).requires_grad_(True)
    r = 1 + 0.05 * torch.randn(G, K, generator=g)
    adv = torch.tensor([1.2, -0.3, 0.6, -1.5])
    S = dgpo_group_sums(dgpo_terms(e.detach() - r, adv, torch.full((G,), G), beta), torch.zeros(G, dtype=torch.long))
    loss, clipped = dgpo_point_loss(e, e.detach(), S, adv, clip_range=0.01, adv_clip=5.0)
    assert not clipped.any()
    (grad,) = torch.autograd.grad(loss.sum(), e)
    e64 = e.detach().double().requires_grad_(True)
    a = adv.double()[:, None]
    pos, neg = (a > 0).double(), (a < 0).double()
    reward = a.abs() * beta * (r.double() - e64) / G
    margin = (reward * pos).sum(0) - (reward * neg).sum(0)  # per point
    (want,) = torch.autograd.grad(-F.logsigmoid(margin).sum(), e64)
    assert torch.allclose(grad.double() * beta / G, want, rtol=1e-5)


def test_dgpo_clip_and_advantage_clip_by_hand():
    # anchors 0; e = log-ratio's negative: ratio = exp(0 - e)
    e = torch.tensor([[-0.2], [-0.2], [0.2], [0.0]], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, -1.0, 12.0])
    S = torch.zeros(4, 1)
    loss, clipped = dgpo_point_loss(e, torch.zeros(4, 1), S, adv, clip_range=0.1, adv_clip=5.0)
    # A > 0, ratio e^0.2 > 1.1: clipped; A < 0, ratio e^0.2 > 1: kept; A < 0, ratio e^-0.2 < 0.9:
    # clipped; A = 12 -> 5, ratio 1: kept. sigmoid(0) = 0.5: loss = 0.5 A e
    assert clipped.flatten().tolist() == [True, False, True, False]
    assert loss.flatten().tolist() == pytest.approx([-0.1, 0.1, -0.1, 0.0])
    (grad,) = torch.autograd.grad(loss.sum(), e)
    assert grad.flatten().tolist() == pytest.approx([0.0, -0.5, 0.0, 2.5])
    with pytest.raises(ValueError, match="clip_range"):
        dgpo_point_loss(e, torch.zeros(4, 1), S, adv, clip_range=-1.0, adv_clip=5.0)
    with pytest.raises(ValueError, match="adv_clip"):
        dgpo_point_loss(e, torch.zeros(4, 1), S, adv, clip_range=0.1, adv_clip=0.0)


def test_group_points_are_shared_by_a_group():
    lat = torch.randn(4, 2, 4, 4, generator=torch.Generator().manual_seed(7))
    batch = SimpleNamespace(trajectory=SimpleNamespace(image_latents=lat), iteration=3, indices=range(4),
                            group_ids=torch.tensor([0, 0, 1, 1]))
    sigmas = torch.tensor([1.0, 0.8, 0.5, 0.3, 0.1, 0.0])
    p = group_points(5, "dpo", batch, torch.tensor([0, 1, 2]), sigmas, 2)
    assert p.K == 2 and p.rows.tolist() == [0, 0, 1, 1, 2, 2]
    assert torch.equal(p.eps[0:2], p.eps[2:4]) and torch.equal(p.sigma[0:2], p.sigma[2:4])  # one group
    assert not torch.equal(p.eps[0:2], p.eps[4:6])  # another group
    assert torch.equal(p.x0[2], lat[1])
    s = p.sigma.reshape(-1, 1, 1, 1)
    assert torch.allclose(p.x, (1 - s) * p.x0 + s * p.eps)
    # leading steps: the sigmas come from the first n of the schedule only
    q = group_points(5, "dpo", batch, torch.tensor([0]), sigmas, 9, leading=2)
    assert q.K == 2 and sorted(q.sigma.tolist()) == pytest.approx([0.8, 1.0])
    # the same points whichever micro-batch the sample is in
    assert torch.equal(group_points(5, "dpo", batch, torch.tensor([1]), sigmas, 2).x, p.x[2:4])


def test_dpo_and_dgpo_config_checks():
    from flowrl.config import from_dict
    from flowrl.errors import RecipeError
    from plugins.losses import DgpoConfig, DpoConfig

    assert DpoConfig().beta == 5000.0 and DpoConfig().timesteps == 1
    assert DgpoConfig().beta == 100.0 and DgpoConfig().timesteps == 4 and DgpoConfig().clip_range == 1e-2
    for key, bad in (("beta", 0.0), ("timesteps", 0), ("leading_steps", -1)):
        with pytest.raises(RecipeError, match=key):
            from_dict(DpoConfig, {key: bad}, where="[loss]")
    for key, bad in (("beta", 0.0), ("timesteps", 0), ("clip_range", 1.0), ("adv_clip", 0.0), ("beta_kl", -1.0),
                     ("leading_steps", -2)):
        with pytest.raises(RecipeError, match=key):
            from_dict(DgpoConfig, {key: bad}, where="[loss]")
