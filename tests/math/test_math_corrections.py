"""The maths review's four corrections (docs/objectives.md), against values computed by hand or
recomputed in float32/float64 outside flowrl."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.objectives.losses import kl_old_policy_k3
from flowrl.sampling.schedules import conditioning_timestep, shifted_sigmas
from flowrl.sampling.kernels import CPSKernel, FlowKernel, StepOutput
from flowrl.selection import rollout_chunk_weights, rollout_l1rel, select_weighted
from flowrl.objectives.kl import step_kl


def _out(mean, std):
    return StepOutput(next_sample=torch.zeros_like(mean), mean=mean, std=torch.tensor([std]), log_prob=torch.zeros(1))


def test_flow_grpo_kl_with_cps_divides_by_the_step_std():
    """sigma 0.8 -> 0.6, a = 0.8: s = 0.6 sin(0.4 pi) = 0.570633910; d = [0.1, 0.3]:
    Flow-GRPO's cps KL = mean(d^2) / (2 s^2) = 0.05 / 0.651246118 = 0.0767759 (by hand)."""
    s = 0.6 * math.sin(0.8 * math.pi / 2)
    assert s == pytest.approx(0.570633910, abs=1e-9)
    mean, ref = torch.tensor([[0.1, 0.3]]), torch.zeros(1, 2)
    kl = step_kl("flow_grpo", _out(mean, s), _out(ref, s), None, 0.8, 0.6, CPSKernel(a=0.8))
    assert float(kl) == pytest.approx(0.0767759, rel=1e-5)
    exact = step_kl("gaussian_exact", _out(mean, s), _out(ref, s), None, 0.8, 0.6, CPSKernel(a=0.8))
    assert float(kl) == pytest.approx(float(exact), rel=1e-6)


def test_flow_grpo_kl_with_the_flow_kernel_is_unchanged():
    """flow kernel, a = 0.7 at sigma 0.8 -> 0.6: g = 0.7 sqrt(0.8 / 0.2) = 1.4, s = g sqrt(0.2);
    KL_FG = mean(d^2) / (2 g^2) = 0.05 / 3.92 = 0.0127551 (by hand)."""
    g = 1.4
    s = g * math.sqrt(0.2)
    mean, ref = torch.tensor([[0.1, 0.3]]), torch.zeros(1, 2)
    kl = step_kl("flow_grpo", _out(mean, s), _out(ref, s), None, 0.8, 0.6, FlowKernel(a=0.7))
    assert float(kl) == pytest.approx(0.0127551, rel=1e-5)


def test_k3_directions_closed_form():
    """z = 0.1: e^-z - 1 + z = 0.00483742 (GCPO), e^z - 1 - z = 0.00517092 (flowrl's default);
    gradients 1 - e^-z = 0.0951626 and e^z - 1 = 0.1051709."""
    for direction, value, grad in (("theta_old", 0.00483742, 0.0951626), ("old_theta", 0.00517092, 0.1051709)):
        z = torch.tensor([0.1], requires_grad=True)
        k = kl_old_policy_k3(z, direction)
        (g,) = torch.autograd.grad(k.sum(), z)
        assert float(k.detach()) == pytest.approx(value, abs=1e-7)
        assert float(g) == pytest.approx(grad, abs=1e-6)
    with pytest.raises(ValueError, match="direction"):
        kl_old_policy_k3(torch.zeros(1), "sideways")


def test_truncated_timestep_conditioning_reproduces_the_anchors_values():
    """N = 17, shift 3, computed as the anchors do in float32 (torch.linspace, the shift in float32,
    int(sigma * 1000)); the reference list was recomputed outside flowrl."""
    t = torch.linspace(1.0, 0.0, 18, dtype=torch.float32)
    sig = 3.0 * t / (1 + 2.0 * t)
    expected = [1000, 979, 957, 933, 906, 878, 846, 810, 771, 727, 677, 620, 555, 480, 391, 285, 157]
    assert [int(x * 1000) for x in sig[:17].tolist()] == expected
    got = conditioning_timestep(shifted_sigmas(17, 3.0)[:17], "truncated_1000")
    assert [round(float(x) * 1000) for x in got] == expected
    exact = shifted_sigmas(17, 3.0)
    assert conditioning_timestep(exact, "exact") is exact
    assert float((exact[:17] - got).abs().max()) < 1e-3


def test_rollout_l1rel_and_chunk_weights_by_hand():
    """x = [1, -1, 2, 0] -> x' = [1.5, -1, 1, 0]: mean|dx| = 1.5 / 4, mean|x| = 1, L1rel = 0.375.
    Chunks [1, 2] of L1rel rows [0.2, 0.4, 0.6] and [0.0, 0.0, 0.3]: weights
    [0.2, 0.5] and [0.0, 0.15] (+ 1e-8 each, as GCPO)."""
    x = torch.tensor([[1.0, -1.0, 2.0, 0.0]])
    y = torch.tensor([[1.5, -1.0, 1.0, 0.0]])
    assert float(rollout_l1rel(x, y)) == pytest.approx(0.375, rel=1e-6)
    w = rollout_chunk_weights(torch.tensor([[0.2, 0.4, 0.6], [0.0, 0.0, 0.3]]), [1, 2])
    torch.testing.assert_close(w, torch.tensor([[0.2, 0.5], [0.0, 0.15]]) + 1e-8)
    # per-sample weights are honoured: a sample whose first chunk has weight 1e-8 draws the other
    m = select_weighted(2, w, 1, [torch.Generator().manual_seed(i) for i in range(2)])
    assert bool(m[1, 1])


def test_guard_at_chunk_level_against_a_float64_hand_gradient():
    """One sample, one chunk of two steps, off-policy (d != 0). With zh_t = mean(eps_t d_t) and
    w_t = 1 / h_t, the chunk ratio is exp((zh_1 + zh_2) / 2) and, unclipped, the loss
    -A exp(z_u) has gradient dL/dmu_t = -A exp(z_u) w_t eps_t / (2 D) (each step keeps its own
    weight inside the chunk). Computed here in float64 by hand; flowrl's route: the guard step
    transform (flowrl.objectives.guard.guard_step_ratio) through objective_loss."""
    from flowrl.objectives.losses import ClippedObjective, objective_loss
    from flowrl.objectives.guard import guard_step_ratio
    from flowrl.sampling.trajectory import Position

    g = torch.Generator().manual_seed(5)
    D, A = 6, 1.5
    steps = [(0.8, 0.6, 0.4), (0.6, 0.45, 0.3)]  # sigma, sigma_next, step std
    eps = [torch.randn(1, D, generator=g, dtype=torch.float64) for _ in steps]
    mu_old = [torch.randn(1, D, generator=g, dtype=torch.float64) for _ in steps]
    d = [0.05 * torch.randn(1, D, generator=g, dtype=torch.float64) for _ in steps]
    # hand, float64
    zh = [float((e * dd).mean()) for e, dd in zip(eps, d)]
    zu = sum(zh) / 2
    w = [1 / (s - sn) for s, sn, _ in steps]
    want = [-A * math.exp(zu) * w_t * e / (2 * D) for w_t, e in zip(w, eps)]
    # flowrl, float32
    mus, lps = [], []
    for (s, sn, std), e, mo, dd in zip(steps, eps, mu_old, d):
        mu = (mo + dd).float().requires_grad_(True)
        old = Position(sample=torch.zeros(1, D), next_sample=(mo + std * e).float(), sigma=torch.tensor([s]),
                       sigma_next=torch.tensor([sn]), log_prob=torch.tensor([0.3]), mean=mo.float(), kernel=None)
        out = StepOutput(next_sample=old.next_sample, mean=mu, std=torch.tensor([std]), log_prob=torch.zeros(1))
        lps.append(guard_step_ratio(out, old))
        mus.append(mu)
    new_lp = torch.stack(lps, dim=1)  # [1, 2]
    loss, _ = objective_loss(new_lp, torch.full((1, 2), 0.3), torch.tensor([A]), [2], torch.ones(1, 1, dtype=torch.bool),
                             ClippedObjective(0.9, 10.0))
    grads = torch.autograd.grad(loss, mus)
    for got, exp in zip(grads, want):
        torch.testing.assert_close(got.double(), exp, rtol=1e-5, atol=1e-7)
    assert float(new_lp[0, 0] - 0.3) == pytest.approx(zh[0], abs=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_guard_normalised_ratio_reduces_as_the_rollout_log_probs(reduction):
    """The guard's "log-prob" is the rollout's ``l_old`` plus ``zh``, so ``zh`` must reduce a
    sample's elements as ``l_old`` did (``[sampler] logprob_reduction``): with ``"sum"`` it is
    ``sum(eps d)`` (by hand, float64), read from the trajectory's position, not a fixed mean."""
    from flowrl.objectives.guard import guard_step_ratio
    from flowrl.sampling.kernels import StepOutput
    from flowrl.sampling.trajectory import Trajectory

    g = torch.Generator().manual_seed(11)
    D, std = 8, 0.3
    mu_old, eps, d = (torch.randn(1, 1, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    latents = torch.zeros(1, 3, 1, 2, 4)
    latents[:, 1] = (mu_old + std * eps).float()
    traj = Trajectory(latents=latents, log_probs=torch.full((1, 2), 0.3), sigmas=torch.tensor([1.0, 0.5, 0.0]),
                      trainable=torch.tensor([True, False]), prompts=["a"], group_ids=torch.tensor([0]),
                      image_latents=torch.zeros(1, 1, 2, 4), reduction=reduction,
                      means=mu_old.float().unsqueeze(1))
    old = traj.position(0, torch.tensor([0]))
    assert old.reduction == reduction
    out = StepOutput(next_sample=old.next_sample, mean=(mu_old + 0.1 * d).float(), std=torch.tensor([std]),
                     log_prob=torch.zeros(1))
    zh = (eps * 0.1 * d).sum() / (D if reduction == "mean" else 1)
    assert float(guard_step_ratio(out, old, reweight=False) - 0.3) == pytest.approx(float(zh), rel=1e-5, abs=1e-7)
