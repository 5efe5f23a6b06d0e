"""The one rollout loop (flowrl.sampling.rollout.rollout_steps) and its per-step plan: the plain
rollout, the planned rollout and the branch rollout are that loop on their plans, bit for bit."""

from __future__ import annotations

import pytest
import torch

from flowrl.sampling.branching import branch_rollout
from flowrl.sampling.kernels import CPSKernel, FlowKernel
from flowrl.sampling.plans import RolloutPlan, rollout_plan
from flowrl.sampling.rollout import PlannedStep, make_kernels, rollout, rollout_steps
from flowrl.sampling.schedules import shifted_sigmas
from flowrl.seeding import sample_generators

FIELDS = ("latents", "log_probs", "trainable", "image_latents", "means", "positions")


def velocity(x, sigma):
    """Depends on the whole batch (its mean), so a different batch composition would show."""
    return torch.tanh(1.3 * x) * (0.5 + sigma.reshape(-1, *([1] * (x.ndim - 1)))) + 0.1 * x.mean(0, keepdim=True)


def _noise(b, seed=0):
    return torch.randn(b, 4, 3, generator=torch.Generator().manual_seed(seed))


def _same(a, b):
    for field in FIELDS:
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None and y is None) or torch.equal(x, y), field
    assert a.kernels == b.kernels and a.position_kernel == b.position_kernel


def test_the_plain_rollout_is_the_loop_with_one_kernel_per_step():
    sig, kernels = shifted_sigmas(7, 3.0), make_kernels(7, FlowKernel(0.7), (1, 5))
    plain = rollout(velocity, _noise(3), sig, kernels, generators=sample_generators(0, "r", 0, range(3)),
                    keep_means=True)
    loop = rollout_steps(lambda rows: velocity, _noise(3), sig, [PlannedStep(k) for k in kernels],
                         generators=sample_generators(0, "r", 0, range(3)), keep_means=True)
    _same(plain, loop)
    assert plain.positions is None and plain.trainable_indices.tolist() == [1, 2, 3, 4]


def test_the_planned_rollout_is_the_loop_on_the_plans_steps():
    sig, kernel = shifted_sigmas(8, 3.0), CPSKernel(a=0.6)
    plan = RolloutPlan(sig, torch.tensor([[0, 2], [3, 5], [1, 3]]), outside="dpm2m")
    planned = rollout_plan(velocity, _noise(3, 1), plan, kernel, generators=sample_generators(1, "r", 0, range(3)),
                           keep_means=True, image_from="final")
    steps = plan.steps(kernel)
    assert [s.in_sde_window.tolist() for s in steps[:4]] == [[True, False, False], [True, False, True],
                                                              [False, False, True], [False, True, False]]
    assert steps[3].after_sde_window.tolist() == [True, False, True] and steps[3].solver_after == "dpm2m"
    loop = rollout_steps(lambda rows: velocity, _noise(3, 1), sig, steps,
                         generators=sample_generators(1, "r", 0, range(3)), keep_means=True, image_from="final")
    _same(planned, loop)
    assert planned.positions.tolist() == [[0, 1], [3, 4], [1, 2]]


def test_the_branch_rollout_is_the_loop_with_branch_factors():
    sig, kernels = shifted_sigmas(6, 3.0), make_kernels(6, FlowKernel(0.7))
    gens = lambda: sample_generators(2, "r", 0, range(8))  # noqa: E731

    def velocity_for(rows):
        return lambda x, s: velocity(x, s) + 0.01 * rows.reshape(-1, 1, 1).to(torch.float32)

    tree = branch_rollout(velocity_for, _noise(8, 2), sig, kernels, group_size=4, branch_steps=[1, 3],
                          branch_factors=[2, 2], generators=gens(), keep_means=True)
    steps = [PlannedStep(k, branch_factor={1: 2, 3: 2}.get(i, 1)) for i, k in enumerate(kernels)]
    loop = rollout_steps(velocity_for, _noise(8, 2), sig, steps, generators=gens(), keep_means=True)
    _same(tree, loop)
    assert torch.equal(tree.latents[0, :2], tree.latents[3, :2])  # one root per group of 4


def test_nothing_trainable_keeps_empty_means():
    """An all-ODE rollout with keep_means: no trainable transition, so means [B, 0, ...]."""
    sig = shifted_sigmas(5, 3.0)
    traj = rollout(velocity, _noise(2), sig, FlowKernel(a=0.0), keep_means=True)
    assert traj.num_trainable == 0 and tuple(traj.means.shape) == (2, 0, 4, 3)


def test_plans_that_do_not_fit_are_refused():
    sig, kernel = shifted_sigmas(4, 3.0), FlowKernel(0.7)
    with pytest.raises(ValueError, match="solver_after"):
        PlannedStep(kernel, solver_after="rk4")
    with pytest.raises(ValueError, match="branch_factor"):
        PlannedStep(kernel, branch_factor=0)
    with pytest.raises(ValueError, match="one kernel per step"):
        rollout_steps(lambda rows: velocity, _noise(2), sig, [PlannedStep(kernel)] * 3)
    with pytest.raises(ValueError, match="must divide the batch"):
        rollout_steps(lambda rows: velocity, _noise(3), sig,
                      [PlannedStep(kernel, branch_factor=2)] + [PlannedStep(kernel)] * 3)
    window = torch.tensor([True, False])
    with pytest.raises(ValueError, match="do not combine"):
        rollout_steps(lambda rows: velocity, _noise(2), sig, [PlannedStep(kernel, in_sde_window=window, branch_factor=2)]
                      + [PlannedStep(kernel, in_sde_window=window)] * 3)
    with pytest.raises(ValueError, match="one kernel for every step"):
        rollout_steps(lambda rows: velocity, _noise(2), sig,
                      [PlannedStep(FlowKernel(0.7 - 0.1 * i), in_sde_window=window) for i in range(4)])
