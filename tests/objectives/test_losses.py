"""Ratios, clipped objective and KL (docs/api.md §5, §8)."""

import math

import pytest
import torch

from flowrl.chunking import chunk_index, validate_chunks
from flowrl.objectives.losses import (
    ClippedObjective,
    clip_mask,
    clipped_surrogate,
    kl_flow_grpo,
    kl_gaussian_exact,
    kl_old_policy_k3,
    objective_loss,
    reduce_units,
    unit_log_ratios,
)


def policy_loss(new_lp, old_lp, advantages, sizes, unit_mask, eps_low, eps_high, normaliser=None):
    """The clipped policy loss over the selected units (the engine's objective)."""
    return objective_loss(new_lp, old_lp, advantages, sizes, unit_mask, ClippedObjective(eps_low, eps_high), normaliser)


def gspo_token_log_ratios(new_lp, old_lp, sizes):
    """GSPO-token form (verl): log rho_it = sg(log rho_u(i)) + l_it - sg(l_it), [B, T]."""
    s = validate_chunks(sizes, new_lp.shape[1])
    z = unit_log_ratios(new_lp, old_lp, s).detach()
    new32 = new_lp.to(torch.float32)
    return z[:, chunk_index(s, device=new_lp.device)] + (new32 - new32.detach())


def _lps(B=3, T=16, seed=0, scale=1e-3):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(B, T, generator=g)
    new = (old + scale * torch.randn(B, T, generator=g)).requires_grad_(True)
    return new, old


def test_on_policy_ratio_one_and_gradient():
    # new == old: rho = 1 for every unit; unclipped gradient of -A rho_u wrt l_i is
    # -A / |u|, so for one unit over all T: d loss / d l = -A * grad(mean l) = -A / T
    old = torch.randn(1, 16)
    new = old.clone().requires_grad_(True)
    A = torch.tensor([0.8])
    loss, met = policy_loss(new, old, A, (16,), torch.ones(1, 1, dtype=torch.bool), 1e-4, 1e-4)
    assert met["ratio_mean"] == 1.0 and met["clip_fraction"] == 0.0 and met["num_units"] == 1
    assert loss.item() == pytest.approx(-0.8)
    loss.backward()
    assert torch.allclose(new.grad, torch.full((1, 16), -0.8 / 16))
    # chunks (2, 3, 4, 7), units 1 and 3 selected, B = 2: grad = -A_b / B / n_b / |u|
    old = torch.randn(2, 16)
    new = old.clone().requires_grad_(True)
    A = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[False, True, False, True], [True, True, True, True]])
    loss, _ = policy_loss(new, old, A, (2, 3, 4, 7), mask, 1e-4, 1e-4)
    loss.backward()
    exp = torch.zeros(2, 16)
    exp[0, 2:5] = -1.0 / 2 / 2 / 3
    exp[0, 9:16] = -1.0 / 2 / 2 / 7
    for (lo, hi) in ((0, 2), (2, 5), (5, 9), (9, 16)):
        exp[1, lo:hi] = 2.0 / 2 / 4 / (hi - lo)
    assert torch.allclose(new.grad, exp, atol=1e-7)


def _step_grpo_reference(new, old, A, step_mask, eps_low, eps_high):
    # independent step-level GRPO: rho_i = exp(l_i - old_i) per step, PPO clip per step,
    # mean over the selected steps of a sample, then mean over samples
    per_sample = []
    for b in range(new.shape[0]):
        terms = []
        for i in range(new.shape[1]):
            if step_mask[b, i]:
                rho = torch.exp(new[b, i] - old[b, i])
                terms.append(torch.maximum(-A[b] * rho, -A[b] * torch.clamp(rho, 1 - eps_low, 1 + eps_high)))
        per_sample.append(torch.stack(terms).mean())
    return torch.stack(per_sample).mean()


def test_chunk_size_one_is_step_level_grpo():
    new, old = _lps(B=4, T=16, seed=1, scale=2e-4)
    A = torch.tensor([1.0, -0.5, 2.0, -1.5])
    mask = torch.rand(4, 16, generator=torch.Generator().manual_seed(3)) < 0.5
    mask[:, 0] = True
    eps = 1e-4
    loss, met = policy_loss(new, old, A, (1,) * 16, mask, eps, eps)
    assert 0 < met["clip_fraction"] < 1  # some units clipped, some not
    (g1,) = torch.autograd.grad(loss, new)
    new2 = new.detach().clone().requires_grad_(True)
    ref = _step_grpo_reference(new2, old, A, mask, eps, eps)
    (g2,) = torch.autograd.grad(ref, new2)
    assert torch.allclose(loss, ref, atol=1e-7)
    assert torch.allclose(g1, g2, atol=1e-8, rtol=1e-6)


def test_one_chunk_is_gspo_sequence_ratio():
    new, old = _lps(B=2, T=16, seed=2)
    A = torch.tensor([0.7, -1.1])
    z = unit_log_ratios(new, old, (16,))
    assert torch.allclose(z[:, 0], (new - old).mean(1))
    loss, _ = policy_loss(new, old, A, (16,), torch.ones(2, 1, dtype=torch.bool), 0.2, 0.2)
    (g1,) = torch.autograd.grad(loss, new)
    new2 = new.detach().clone().requires_grad_(True)
    rho = torch.exp((new2 - old).mean(1))  # GSPO sequence ratio, by hand
    ref = torch.maximum(-A * rho, -A * rho.clamp(0.8, 1.2)).mean()
    (g2,) = torch.autograd.grad(ref, new2)
    assert torch.allclose(loss, ref) and torch.allclose(g1, g2, atol=1e-8)


def test_clipping_by_hand():
    # rho  = [1.5, 0.5, 0.5, 1.5, 1.0], A = [1, -1, 1, -1, 2], eps 0.2:
    # max(-1.5, -1.2) = -1.2 (clipped) ; max(0.5, 0.8) = 0.8 (clipped) ; max(-0.5, -0.8) = -0.5 ;
    # max(1.5, 1.2) = 1.5 ; max(-2, -2) = -2. Gradient wrt log rho: -A rho unless clipped -> 0
    z = torch.log(torch.tensor([1.5, 0.5, 0.5, 1.5, 1.0])).requires_grad_(True)
    A = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0])
    loss = clipped_surrogate(z, A, 0.2, 0.2)
    assert torch.allclose(loss, torch.tensor([-1.2, 0.8, -0.5, 1.5, -2.0]), atol=1e-6)
    (g,) = torch.autograd.grad(loss.sum(), z)
    assert torch.allclose(g, torch.tensor([0.0, 0.0, -0.5, 1.5, -2.0]), atol=1e-6)
    assert clip_mask(z, A, 0.2, 0.2).tolist() == [True, True, False, False, False]
    # asymmetric: eps_low 0.1, eps_high 0.3 -> max(-1.5, -1.3) = -1.3 ; max(0.5, 0.9) = 0.9
    asym = clipped_surrogate(z[:2], A[:2], 0.1, 0.3)
    assert torch.allclose(asym, torch.tensor([-1.3, 0.9]), atol=1e-6)
    # unit-level: metrics count the clipped units
    _, met = policy_loss(z.detach()[:, None], torch.zeros(5, 1), A, (1,), torch.ones(5, 1, dtype=torch.bool), 0.2, 0.2)
    assert met["clip_fraction"] == pytest.approx(0.4) and met["ratio_max"] == pytest.approx(1.5)
    assert met["ratio_min"] == pytest.approx(0.5)


def test_reduce_units_normaliser_and_errors():
    per_unit = torch.tensor([[1.0, 2.0, 4.0], [3.0, 5.0, 7.0]])
    mask = torch.tensor([[True, False, True], [False, True, False]])
    # sample means 2.5 and 5 ; sum 7.5 ; / B = 3.75 ; / 10 = 0.75
    assert reduce_units(per_unit, mask).item() == 3.75
    assert reduce_units(per_unit, mask, normaliser=10).item() == pytest.approx(0.75)
    with pytest.raises(ValueError, match="at least one selected unit"):
        reduce_units(per_unit, torch.tensor([[True, False, False], [False, False, False]]))
    with pytest.raises(ValueError, match="unit_mask"):
        reduce_units(per_unit, torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="sum to"):
        policy_loss(*_lps(), torch.ones(3), (2, 3), torch.ones(3, 2, dtype=torch.bool), 0.1, 0.1)


def test_gspo_token_form():
    new, old = _lps(B=2, T=6, seed=4)
    sizes = (2, 4)
    tok = gspo_token_log_ratios(new, old, sizes)
    z = unit_log_ratios(new, old, sizes)
    assert torch.allclose(tok, z[:, [0, 0, 1, 1, 1, 1]])  # same value as the unit ratio
    A = torch.tensor([0.5, -1.0])
    # constant advantage, unclipped (wide eps): token-mean loss within each unit has the same
    # gradient as the unit loss averaged over units
    tok_loss = torch.stack([clipped_surrogate(tok[:, :2], A, 0.99, 1.0).mean(1),
                            clipped_surrogate(tok[:, 2:], A, 0.99, 1.0).mean(1)], 1).mean()
    (g1,) = torch.autograd.grad(tok_loss, new)
    unit_loss, _ = policy_loss(new, old, A, sizes, torch.ones(2, 2, dtype=torch.bool), 0.99, 1.0)
    (g2,) = torch.autograd.grad(unit_loss, new)
    assert torch.allclose(g1, g2, atol=1e-7)


def test_kl_terms_values_and_gradients():
    g = torch.Generator().manual_seed(0)
    mu = torch.randn(3, 2, 4, generator=g).requires_grad_(True)
    ref = torch.randn(3, 2, 4, generator=g)
    s = torch.tensor([0.5, 0.2, 1.0])
    kl = kl_gaussian_exact(mu, ref, s)
    # independent: torch's closed-form KL between Normals, averaged over the 8 elements
    p = torch.distributions.Normal(mu.detach().double(), s.double().view(3, 1, 1))
    q = torch.distributions.Normal(ref.double(), s.double().view(3, 1, 1))
    assert torch.allclose(kl.double(), torch.distributions.kl_divergence(p, q).mean((1, 2)), atol=1e-6)
    (gmu,) = torch.autograd.grad(kl.sum(), mu)  # d/dmu = (mu - ref) / (s^2 D)
    assert torch.allclose(gmu, (mu.detach() - ref) / (s.view(3, 1, 1) ** 2 * 8), atol=1e-6)
    # Flow-GRPO's form uses g, not s = g sqrt(h): kl_flow_grpo(g) = h * kl_exact(g sqrt(h))
    gcoef, h = torch.tensor([2.0, 3.0, 0.5]), 0.04
    kf = kl_flow_grpo(mu, ref, gcoef)
    assert kf.requires_grad
    assert torch.allclose(kf, h * kl_gaussian_exact(mu, ref, gcoef * math.sqrt(h)), rtol=1e-5)
    # k3 against the old policy: e^z - 1 - z ; at z = 0.1 -> 0.00517092 ; gradient e^z - 1
    z = torch.tensor([0.1, 0.0, -0.2], requires_grad=True)
    k3 = kl_old_policy_k3(z)
    assert torch.allclose(k3, torch.tensor([0.0051709181, 0.0, 0.0187307531]), atol=1e-8)
    (gz,) = torch.autograd.grad(k3.sum(), z)
    assert torch.allclose(gz, torch.expm1(z.detach()))


def test_clipped_objective_and_eps_errors():
    obj = ClippedObjective(1e-4, 2e-4)
    z = torch.tensor([[3e-4, -3e-4]])
    assert obj.clip_mask(z, torch.tensor([[1.0, 1.0]])).tolist() == [[True, False]]
    with pytest.raises(ValueError, match="eps_low"):
        ClippedObjective(1.5, 0.1)
    with pytest.raises(ValueError, match="eps_high"):
        clipped_surrogate(z, torch.ones(1), 0.1, -1.0)
