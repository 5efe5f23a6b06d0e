"""AWM's maths (flowrl/objectives/awm.py) against values derived by hand and a float64 second
route, and the forward-process points it shares with DiffusionNFT."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from flowrl.objectives.awm import awm_log_prob, awm_loss
from flowrl.objectives.forward_process import forward_process_points


def test_log_prob_by_hand():
    # one point, D = 2: v = (1, 2), eps - x0 = (0, 0) -> mse = (1 + 4) / 2 = 2.5
    v, x0, eps = torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, -1.0]]), torch.tensor([[1.0, -1.0]])
    assert awm_log_prob(v, x0, eps, 0.4).tolist() == [-2.5]
    assert awm_log_prob(v, x0, eps, 0.4, weighting="sigma").item() == pytest.approx(-1.0)
    # ghuber, p = 0.5: -sigma ((2.5 + 1e-10)^0.5 - 1e-5) / 0.5
    want = -0.4 * (math.sqrt(2.5 + 1e-10) - 1e-5) / 0.5
    assert awm_log_prob(v, x0, eps, 0.4, weighting="ghuber", power=0.5).item() == pytest.approx(want, rel=1e-6)
    # ghuber with p = 1 is the sigma weighting
    assert awm_log_prob(v, x0, eps, 0.4, weighting="ghuber").item() == pytest.approx(-1.0, rel=1e-6)
    with pytest.raises(ValueError, match="weighting"):
        awm_log_prob(v, x0, eps, 0.4, weighting="t**3")
    with pytest.raises(ValueError, match="shape"):
        awm_log_prob(v, x0[:, :1], eps[:, :1], 0.4)


def test_on_policy_gradient_is_the_advantage_weighted_flow_matching_gradient():
    """At the anchor (ratio 1) the loss is -mean_k A and its gradient w.r.t. v is
    A w 2 (v - (eps - x0)) / (D K): checked against that formula in float64."""
    g = torch.Generator().manual_seed(0)
    N, K, D = 6, 3, 5
    v = torch.randn(N, D, generator=g, requires_grad=True)
    x0, eps = torch.randn(N, D, generator=g), torch.randn(N, D, generator=g)
    sigma = torch.rand(N, generator=g)
    A = torch.tensor([1.5, -0.5]).repeat_interleave(K)  # two samples of K points
    for weighting, w in (("uniform", torch.ones(N)), ("sigma", sigma)):
        lp = awm_log_prob(v, x0, eps, sigma, weighting=weighting)
        loss = awm_loss(lp, lp.detach(), A, K, clip_range=0.2, adv_clip=5.0)
        assert loss.tolist() == pytest.approx([-1.5, 0.5])
        (grad,) = torch.autograd.grad(loss.sum(), v)
        want = (A.double() * w.double())[:, None] * 2 * (v.double() - (eps.double() - x0.double())) / (D * K)
        assert torch.allclose(grad.double(), want, rtol=1e-5, atol=1e-7)


def test_off_policy_ratio_clip_and_advantage_clip_by_hand():
    K = 1
    lp = torch.tensor([math.log(1.7), math.log(1.7), math.log(0.2), 0.0], requires_grad=True)
    old = torch.zeros(4)
    A = torch.tensor([1.0, -1.0, -1.0, 12.0])
    loss = awm_loss(lp, old, A, K, clip_range=0.5, adv_clip=5.0)
    # A > 0, rho 1.7 > 1.5: clipped at -1.5 (no gradient); A < 0, rho 1.7: max(1.7, 1.5) = 1.7;
    # A < 0, rho 0.2 < 0.5: max(0.2, 0.5) = 0.5 (clipped, no gradient); A = 12 -> 5: -5 rho = -5
    assert loss.tolist() == pytest.approx([-1.5, 1.7, 0.5, -5.0], rel=1e-6)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    assert grad.tolist() == pytest.approx([0.0, 1.7, 0.0, -5.0], rel=1e-6)  # d(-A rho)/dl = -A rho


def test_loss_rejects_bad_input():
    lp = torch.zeros(4)
    with pytest.raises(ValueError, match="multiple of K"):
        awm_loss(lp, lp, torch.zeros(4), 3, clip_range=0.2, adv_clip=5.0)
    with pytest.raises(ValueError, match="adv_clip"):
        awm_loss(lp, lp, torch.zeros(4), 2, clip_range=0.2, adv_clip=0.0)
    with pytest.raises(ValueError, match="eps_low"):
        awm_loss(lp, lp, torch.zeros(4), 2, clip_range=1.0, adv_clip=5.0)


def _batch(n=3, shape=(2, 4, 4), iteration=5):
    lat = torch.randn(n, *shape, generator=torch.Generator().manual_seed(7))
    traj = SimpleNamespace(image_latents=lat)
    return SimpleNamespace(trajectory=traj, iteration=iteration, indices=[10 + i for i in range(n)])


def test_forward_process_points():
    batch = _batch()
    sigmas = torch.tensor([1.0, 0.8, 0.5, 0.3, 0.1, 0.0])
    idx = torch.tensor([2, 0])
    p = forward_process_points(3, "awm", batch, idx, sigmas, 3)
    assert p.K == 3 and p.rows.tolist() == [2, 2, 2, 0, 0, 0]
    assert p.x.shape == p.eps.shape == p.x0.shape == (6, 2, 4, 4)
    s = p.sigma.reshape(-1, 1, 1, 1)
    assert torch.allclose(p.x, (1 - s) * p.x0 + s * p.eps)
    assert torch.equal(p.x0[0], batch.trajectory.image_latents[2])
    assert set(p.sigma.tolist()) <= set(sigmas[:-1].tolist()) and 0.0 not in p.sigma.tolist()
    assert len(set(p.sigma[:3].tolist())) == 3  # without replacement
    # the points depend on the sample, not on the micro-batch it sits in
    q = forward_process_points(3, "awm", batch, torch.tensor([0]), sigmas, 3)
    assert torch.equal(q.x, p.x[3:]) and torch.equal(q.sigma, p.sigma[3:])
    # more sigmas asked than the schedule has: all of them
    assert forward_process_points(3, "awm", batch, idx, sigmas, 99).K == 5
    # another tag draws other points
    assert not torch.equal(forward_process_points(3, "nft", batch, idx, sigmas, 3).eps, p.eps)


def test_awm_config_checks():
    from flowrl.config import from_dict
    from flowrl.errors import RecipeError
    from plugins.losses import AwmConfig

    with pytest.raises(ValueError, match="weighting"):
        AwmConfig(weighting="t**2")
    assert AwmConfig().timesteps == 6 and AwmConfig().weighting == "uniform"
    for key, bad in (("clip_range", 1.0), ("clip_range", -0.1), ("adv_clip", 0.0), ("timesteps", 0),
                     ("power", 0.0), ("beta_kl", -1.0)):
        with pytest.raises(RecipeError, match=key):
            from_dict(AwmConfig, {key: bad}, where="[loss]")
