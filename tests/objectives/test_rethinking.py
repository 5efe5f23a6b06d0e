"""EPG, PEPG, PAR (flowrl/objectives/rethinking.py) and V-GRPO (flowrl/objectives/vgrpo.py): values
by hand, gradients against their derivatives written out in float64, the ratio-free variants, and
the soft clip."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.objectives.rethinking import epg_loss, par_loss, pepg_loss
from flowrl.objectives.vgrpo import soft_clip, vgrpo_loss

Z = [0.0, 0.03, -0.02, 0.5, -0.4]
A = [1.0, -0.7, 0.4, 0.2, -1.5]


def _grad(fn, z, a, **kw):
    zz = torch.tensor(z, dtype=torch.float32, requires_grad=True)
    out = fn(zz, torch.tensor(a), **kw)
    out.sum().backward()
    return out.detach().double(), zz.grad.double()


def test_values_by_hand():
    for z, a in zip(Z, A):
        rho = math.exp(z)
        v, _ = _grad(epg_loss, [z], [a])
        assert v.item() == pytest.approx(-rho * a * z, abs=1e-7)
        v, _ = _grad(pepg_loss, [z], [a])
        assert v.item() == pytest.approx(-rho * (a - z) * z, abs=1e-7)
        v, _ = _grad(par_loss, [z], [a])
        assert v.item() == pytest.approx(0.5 * rho * (a - z) ** 2, rel=1e-6)
        v, _ = _grad(par_loss, [z], [a], ratio=False)
        assert v.item() == pytest.approx(0.5 * (a - z) ** 2, rel=1e-6)


def test_gradients_are_the_derivatives_with_the_ratio_held_fixed():
    z64, a64 = torch.tensor(Z, dtype=torch.float64), torch.tensor(A, dtype=torch.float64)
    rho = torch.exp(z64)
    _, g = _grad(epg_loss, Z, A)
    torch.testing.assert_close(g, -rho * a64, rtol=1e-6, atol=1e-7)
    _, g_pepg = _grad(pepg_loss, Z, A)
    _, g_par = _grad(par_loss, Z, A)
    torch.testing.assert_close(g_pepg, -rho * (a64 - z64), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g_par, g_pepg, rtol=1e-6, atol=1e-7)  # one gradient, two values
    _, g = _grad(epg_loss, Z, A, ratio=False)
    torch.testing.assert_close(g, -a64, rtol=1e-6, atol=1e-7)  # REINFORCE on the log-likelihood
    _, g = _grad(pepg_loss, Z, A, ratio=False)
    torch.testing.assert_close(g, -(a64 - z64), rtol=1e-6, atol=1e-7)


def test_on_policy_values_and_gradients():
    zero = [0.0] * len(A)
    for fn in (epg_loss, pepg_loss):
        v, g = _grad(fn, zero, A)
        assert v.abs().max() == 0
        torch.testing.assert_close(g, -torch.tensor(A, dtype=torch.float64))
    v, g = _grad(par_loss, zero, A)
    torch.testing.assert_close(v, 0.5 * torch.tensor(A, dtype=torch.float64) ** 2, rtol=1e-6, atol=0)
    torch.testing.assert_close(g, -torch.tensor(A, dtype=torch.float64))


def test_advantages_broadcast_per_sample():
    z = torch.zeros(2, 3, requires_grad=True)
    epg_loss(z, torch.tensor([1.0, -2.0])).sum().backward()
    assert z.grad.tolist() == [[-1.0] * 3, [2.0] * 3]


def test_soft_clip():
    a = torch.tensor([-10.0, -1.0, 0.0, 0.1, 10.0])
    out = soft_clip(a, 3.0)
    torch.testing.assert_close(out, 3.0 * torch.tanh(a / 3.0))
    assert out.abs().max() < 3.0 and out[3].item() == pytest.approx(0.1, rel=1e-3)
    assert torch.equal(soft_clip(a, 0.0), a)
    with pytest.raises(ValueError):
        soft_clip(a, -1.0)


def test_vgrpo_is_the_clipped_surrogate_of_the_soft_clipped_advantage():
    eps, c = 1e-3, 2.0
    for z, a in zip([0.0, 0.0005, 0.002, -0.002, 0.002], [1.0, -1.0, 1.0, -1.0, -3.0]):
        rho, at = math.exp(z), c * math.tanh(a / c)
        want = max(-at * rho, -at * min(max(rho, 1 - eps), 1 + eps))
        v, g = _grad(vgrpo_loss, [z], [a], eps=eps, adv_soft_clip=c)
        assert v.item() == pytest.approx(want, rel=1e-6)
        clipped = (at > 0 and rho > 1 + eps) or (at < 0 and rho < 1 - eps)
        assert g.item() == pytest.approx(0.0 if clipped else -at * rho, rel=1e-6, abs=1e-9)
