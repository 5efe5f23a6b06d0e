"""FDFO (flowrl/objectives/fdfo.py): the pairs, the SPO surrogate by hand and its gradient against
its derivative in float64, and the objective's gradient on a tiny linear model against the formula
written out, on-policy (no extra forward) and off-policy (the rollout's weights)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from flowrl.objectives.fdfo import FiniteDifferenceObjective, fdfo_loss, pair_partners
from objective_helpers import Ctx, Linear, Micro, tiny_batch


def test_pair_partners():
    assert pair_partners(torch.tensor([3, 3, 8, 8])).tolist() == [1, 0, 3, 2]
    assert pair_partners(torch.tensor([5, 9, 9, 5])).tolist() == [3, 2, 1, 0]
    with pytest.raises(ValueError, match="pairs"):
        pair_partners(torch.tensor([0, 0, 0, 1]))


def _case(seed=0, n=3):
    g = torch.Generator().manual_seed(seed)
    v_ref = torch.randn(n, 2, 3, generator=g)
    dx = 0.1 * torch.randn(n, 2, 3, generator=g)
    dR = torch.tensor([0.3, -0.2, 0.05])[:n]
    return v_ref, dx, dR


def test_surrogate_by_hand_in_float64():
    v_ref, dx, dR = _case()
    v = v_ref + 0.01 * torch.randn(v_ref.shape, generator=torch.Generator().manual_seed(1))
    loss, rho = fdfo_loss(v, v_ref, dx, dR, clip_range=0.03)
    for i in range(3):
        d = dx[i].double().flatten()
        d = d / ((d**2).mean() + 1e-6)
        target = v_ref[i].double().flatten() - d
        lp = -((v[i].double().flatten() - target) ** 2).mean()
        lp_ref = -(d**2).mean()
        r = math.exp(lp - lp_ref)
        want = -float(dR[i]) * r + abs(float(dR[i])) / 0.06 * (r - 1) ** 2
        assert rho[i].item() == pytest.approx(r, rel=1e-5)
        assert loss[i].item() == pytest.approx(want, rel=1e-4, abs=1e-7)


def test_at_the_rollout_velocity_the_gradient_pushes_along_the_endpoint_difference():
    v_ref, dx, dR = _case()
    v = v_ref.clone().requires_grad_(True)
    loss, rho = fdfo_loss(v, v_ref, dx, dR, clip_range=0.03)
    torch.testing.assert_close(rho, torch.ones(3))
    torch.testing.assert_close(loss, -dR)
    loss.sum().backward()
    d = dx.double() / ((dx.double() ** 2).mean(dim=(1, 2), keepdim=True) + 1e-6)
    D = dx[0].numel()
    # dL/dv = -dR drho/dv and drho/dv = -2 (v - v*) / D = -2 d / D at v = v_ref
    want = dR.double().reshape(-1, 1, 1) * 2 * d / D
    torch.testing.assert_close(v.grad.double(), want, rtol=1e-5, atol=1e-8)


def test_the_quadratic_term_pulls_the_ratio_back():
    v_ref, dx, _ = _case()
    dR = torch.tensor([0.3, 0.3, 0.3])
    d = dx / ((dx**2).mean(dim=(1, 2), keepdim=True) + 1e-6)
    far = (v_ref - 5e-4 * d).clone().requires_grad_(True)  # moved along the push: log rho = 2e-3 mean(d^2) - ... > 0.03
    loss, rho = fdfo_loss(far, v_ref, dx, dR, clip_range=0.03)
    assert bool((rho > 1.03).all())
    loss.sum().backward()
    # past the trust region the surrogate's slope in rho is positive: descent moves back towards v_ref
    slope = -0.3 + 0.3 / 0.03 * (rho - 1.0)
    assert bool((slope > 0).all())
    assert float((far.grad * d).sum()) < 0  # descent (-grad) raises v along d, back towards v_ref


class _Trajectory:
    """States at T trainable positions, their sigmas, and the final latents."""

    def __init__(self, n=4, T=3, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.states = torch.randn(n, T, 3, 2, 2, generator=g)
        self.step_sigmas = torch.tensor([0.8, 0.5, 0.2])[:T]
        self.image_latents = torch.randn(n, 3, 2, 2, generator=g)
        self.latents = self.states
        self.num_trainable = T

    def position(self, t, rows):
        rows = torch.as_tensor(rows)
        return SimpleNamespace(sample=self.states[rows, t], sigma=self.step_sigmas[t].repeat(len(rows)))


def _by_hand(model, traj, rows, partner, dR, v_ref_model=None):
    xs, sig, dxs, r_of = [], [], [], []
    for r in rows:
        dx = 0.5 * (traj.image_latents[r] - traj.image_latents[partner[r]])
        for t in range(traj.num_trainable):
            xs.append(traj.states[r, t])
            sig.append(traj.step_sigmas[t])
            dxs.append(dx)
            r_of.append(r)
    x, s, dx = torch.stack(xs), torch.stack(sig), torch.stack(dxs)
    v = model.velocity(x, s, None)
    ref = (v_ref_model or model).velocity(x, s, None).detach()
    loss, _ = fdfo_loss(v, ref, dx, dR[torch.tensor(r_of)], clip_range=0.03)
    return loss


def test_objective_gradient_on_policy_and_off():
    traj = _Trajectory()
    batch = tiny_batch(advantages=[0.2, -0.2, 0.1, -0.1], trajectory=traj)
    model = Linear(7)
    fd = FiniteDifferenceObjective(clip_range=0.03, timesteps=0, kl_weight=0.0)
    ctx = Ctx(model)
    fd.prepare(ctx)
    fd.start_rollout(ctx, batch, (1,))
    model.calls = 0
    fd.backward(ctx, Micro(batch, torch.arange(4), 4.0))
    assert model.calls == 1 and ctx.counter.minimum == {"update": 4 * 3}
    got = [p.grad.clone() for p in ctx.params]
    for p in ctx.params:
        p.grad = None
    loss = _by_hand(model, traj, range(4), [1, 0, 3, 2], batch.advantages)
    (loss.sum() / (4.0 * 3)).backward()
    for g, p in zip(got, ctx.params):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-8)
    # after an optimizer step in the same rollout, v_ref is the rollout weights' (one more forward)
    rollout_model = Linear(7)
    with torch.no_grad():
        for p in ctx.params:
            p.add_(0.05)
    ctx.steps = 1
    for p in ctx.params:
        p.grad = None
    model.calls = 0
    fd.backward(ctx, Micro(batch, torch.arange(4), 4.0))
    assert model.calls == 2
    got = [p.grad.clone() for p in ctx.params]
    for p in ctx.params:
        p.grad = None
    loss = _by_hand(model, traj, range(4), [1, 0, 3, 2], batch.advantages, v_ref_model=rollout_model)
    (loss.sum() / (4.0 * 3)).backward()
    for g, p in zip(got, ctx.params):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-8)


def test_pairs_with_equal_rewards_skip_their_forward_and_subsets_are_seeded():
    traj = _Trajectory(T=3)
    batch = tiny_batch(advantages=[0.0, 0.0, 0.1, -0.1], trajectory=traj)
    fd = FiniteDifferenceObjective(clip_range=0.03, timesteps=2, kl_weight=0.0)
    ctx = Ctx(Linear(8))
    fd.prepare(ctx)
    fd.start_rollout(ctx, batch, (1,))
    fd.backward(ctx, Micro(batch, torch.arange(4), 4.0))
    assert ctx.counter.minimum == {"update": 2 * 2}
    assert fd._positions(ctx, batch, 2, 3) == fd._positions(ctx, batch, 2, 3)
    assert len(fd._positions(ctx, batch, 2, 3)) == 2
