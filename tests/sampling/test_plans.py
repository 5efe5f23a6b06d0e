"""Rollouts with moving SDE windows (flowrl.sampling.plans) against the plain rollout and against each
row rolled alone: per-sample windows change nothing but where each row's noise goes."""

from __future__ import annotations

import pytest
import torch

from flowrl.sampling.plans import RolloutPlan, rollout_plan
from flowrl.sampling.rollout import make_kernels, rescore_position, rescore_positions, rollout
from flowrl.sampling.schedules import shifted_sigmas
from flowrl.sampling.kernels import CPSKernel, FlowKernel
from flowrl.seeding import sample_generators
from flowrl.sampling.solvers import dpmpp_2m_step


def velocity(x, sigma):
    """An elementwise stand-in for a network (exact whatever the batch composition)."""
    return torch.tanh(1.3 * x) * (0.5 + sigma.reshape(-1, *([1] * (x.ndim - 1))))


def _noise(b, seed=0):
    return torch.randn(b, 4, 3, generator=torch.Generator().manual_seed(seed))


def test_a_shared_full_window_is_the_plain_rollout():
    """Every row's window [0, N - 1) with Euler after it is the plain rollout with the kernel in
    sde_window [0, N - 1) (image from x0_hat): identical latents, log-probs and means."""
    n, b = 6, 3
    sig = shifted_sigmas(n, 3.0)
    kernel = FlowKernel(a=0.7)
    noise = _noise(b)
    plain = rollout(velocity, noise, sig, make_kernels(n, kernel, (0, n - 1)), generators=sample_generators(1, "r", 0, range(b)),
                    keep_means=True)
    plan = RolloutPlan(sig, torch.tensor([[0, n - 1]] * b))
    planned = rollout_plan(velocity, noise, plan, kernel, generators=sample_generators(1, "r", 0, range(b)), keep_means=True)
    torch.testing.assert_close(planned.latents, plain.latents, rtol=0, atol=0)
    torch.testing.assert_close(planned.trainable_log_probs, plain.trainable_log_probs, rtol=0, atol=0)
    torch.testing.assert_close(planned.means, plain.means, rtol=0, atol=0)
    torch.testing.assert_close(planned.image_latents, plain.image_latents, rtol=0, atol=0)


def test_per_sample_windows_equal_rolling_each_row_alone():
    """Rows with different windows, rolled together, equal each row rolled alone with its own
    window (plain rollout with make_kernels(sde_window)): latents and trained log-probs."""
    n = 8
    sig = shifted_sigmas(n, 3.0)
    kernel = CPSKernel(a=0.8)
    sde_windows = torch.tensor([[0, 2], [3, 5], [5, 7], [3, 5]])
    noise = _noise(4, seed=2)
    gens = sample_generators(5, "r", 1, range(4))
    batch = rollout_plan(velocity, noise, RolloutPlan(sig, sde_windows), kernel, generators=gens, image_from="final")
    assert batch.positions.tolist() == [[0, 1], [3, 4], [5, 6], [3, 4]]
    for r in range(4):
        lo, hi = sde_windows[r].tolist()
        alone = rollout(velocity, noise[r : r + 1], sig, make_kernels(n, kernel, (lo, hi)),
                        generators=sample_generators(5, "r", 1, [r]), image_from="final")
        torch.testing.assert_close(batch.latents[r], alone.latents[0], rtol=0, atol=0)
        torch.testing.assert_close(batch.trainable_log_probs[r], alone.trainable_log_probs[0], rtol=0, atol=0)


def test_rescoring_per_sample_positions_is_on_policy():
    n = 8
    sig = shifted_sigmas(n, 3.0)
    kernel = FlowKernel(a=0.9)
    sde_windows = torch.tensor([[1, 3], [4, 6], [0, 2]])
    traj = rollout_plan(velocity, _noise(3, 4), RolloutPlan(sig, sde_windows), kernel,
                        generators=sample_generators(0, "r", 0, range(3)), keep_means=True)
    rows = torch.tensor([2, 0])
    for t in range(2):
        out = rescore_position(velocity, traj, t, rows)
        torch.testing.assert_close(out.log_prob, traj.trainable_log_probs[rows, t], rtol=0, atol=1e-6)
        torch.testing.assert_close(out.mean, traj.means[rows, t], rtol=0, atol=1e-6)
    both = rescore_positions(velocity, traj, [0, 1], rows)
    torch.testing.assert_close(both, traj.trainable_log_probs[rows].T, rtol=0, atol=1e-6)


def test_dpm_after_the_window():
    """After the window, DPM-Solver++(2M) with the previous step's x0_hat; before it, Euler."""
    n = 6
    sig = shifted_sigmas(n, 3.0)
    kernel = FlowKernel(a=0.7)
    noise = _noise(1, 7)
    traj = rollout_plan(velocity, noise, RolloutPlan(sig, torch.tensor([[1, 3]]), outside="dpm2m"), kernel,
                        generators=sample_generators(0, "r", 0, [0]), image_from="final")
    x = traj.latents[:, 0]
    # step 0: Euler; steps 1-2: SDE (stored); steps 3..5 DPM++(2M) from the stored states
    v0 = velocity(x, sig[0].repeat(1))
    torch.testing.assert_close(traj.latents[:, 1], x + (sig[1] - sig[0]) * v0, rtol=0, atol=1e-6)
    prev_x0, prev_s = None, None
    for i in range(n):
        xi = traj.latents[:, i]
        x0 = xi - sig[i] * velocity(xi, sig[i].repeat(1))
        if i >= 3:
            want = dpmpp_2m_step(xi, x0, float(sig[i]), float(sig[i + 1]), prev_x0, prev_s)
            torch.testing.assert_close(traj.latents[:, i + 1], want, rtol=0, atol=1e-6)
        prev_x0, prev_s = x0, float(sig[i])


def test_plans_refuse_untrainable_windows_and_unequal_lengths():
    sig = shifted_sigmas(5, 3.0)
    with pytest.raises(ValueError, match="same length"):
        RolloutPlan(sig, torch.tensor([[0, 2], [1, 2]]))
    with pytest.raises(ValueError, match="not trainable"):  # last step with the image from x0_hat
        rollout_plan(velocity, _noise(1), RolloutPlan(sig, torch.tensor([[3, 5]])), FlowKernel(a=0.7))
    with pytest.raises(ValueError, match="not trainable"):  # cps into sigma = 0 injects no noise
        rollout_plan(velocity, _noise(1), RolloutPlan(sig, torch.tensor([[3, 5]])), CPSKernel(a=0.7), image_from="final")


def test_rollouts_build_no_graph():
    """Both rollouts run under no_grad: a trainable velocity leaves no graph on the stored
    latents, log-probs or means (re-scoring would otherwise back-propagate into the rollout)."""
    w = torch.nn.Parameter(torch.ones(()))

    def trainable_velocity(x, sigma):
        return velocity(x, sigma) * w

    sig = shifted_sigmas(4, 3.0)
    plain = rollout(trainable_velocity, _noise(2), sig, FlowKernel(a=0.7), keep_means=True)
    planned = rollout_plan(trainable_velocity, _noise(2), RolloutPlan(sig, torch.tensor([[0, 2], [1, 3]])),
                           FlowKernel(a=0.7), keep_means=True)
    for t in (plain, planned):
        assert not (t.latents.requires_grad or t.log_probs.requires_grad or t.means.requires_grad)
