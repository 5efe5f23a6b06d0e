"""Rollouts whose SDE window moves: per iteration (MixGRPO) or per sample (Flow-GRPO-Fast).

A :class:`RolloutPlan` says, for one rollout, the schedule (which may change per iteration:
MixGRPO-Flash compresses the steps after the window), each sample's SDE window
``[start, stop)`` of step indices (``sde_windows``), and the deterministic solver after the window
(``euler``, or ``dpm2m``: DPM-Solver++(2M), :mod:`flowrl.sampling.solvers`; steps before the window
are always Euler). :func:`rollout_plan` turns it into the per-step plan of the one rollout loop
(:func:`flowrl.sampling.rollout.rollout_steps`), with one model forward per step for the whole
batch: each row takes the SDE kernel inside its window and the ODE elsewhere, sharing the step's
velocity.

Every sample's window has the same length ``T`` (the trained transitions; the chunk layout
needs a fixed ``T``), and every step of a window must be trainable: the kernel injects noise
there, and it is not the last step when the image is the last ``x0_hat``. The trajectory
records the positions per sample (``Trajectory.positions``), so re-scoring gathers each
row's own transitions (:func:`flowrl.sampling.rollout.rescore_position`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from flowrl.interfaces import Kernel
from flowrl.sampling.rollout import PlannedStep, VelocityFn, rollout_steps, trainable_mask
from flowrl.sampling.schedules import validate_sigmas
from flowrl.sampling.solvers import OUTSIDE_SOLVERS
from flowrl.sampling.trajectory import Trajectory

__all__ = ["RolloutPlan", "PlanContext", "rollout_plan", "OUTSIDE_SOLVERS"]


@dataclass(frozen=True)
class RolloutPlan:
    """One rollout's schedule ``sigmas [N + 1]``, SDE windows ``sde_windows [B, 2]`` (long,
    ``[start, stop)``, every row the same length) and the solver after the window."""

    sigmas: torch.Tensor
    sde_windows: torch.Tensor
    outside: str = "euler"

    def __post_init__(self):
        sig = validate_sigmas(self.sigmas)
        w = torch.as_tensor(self.sde_windows)
        if w.ndim != 2 or w.shape[1] != 2 or w.dtype != torch.long:
            raise ValueError(f"sde_windows must be a long tensor [B, 2], got {w.dtype} {tuple(w.shape)}")
        n = sig.numel() - 1
        if w.numel() and (bool((w[:, 0] < 0).any()) or bool((w[:, 1] > n).any()) or bool((w[:, 1] < w[:, 0]).any())):
            raise ValueError(f"every SDE window must satisfy 0 <= start <= stop <= N = {n}, got {w.tolist()}")
        if w.numel() and len(set((w[:, 1] - w[:, 0]).tolist())) > 1:
            raise ValueError(f"every sample's SDE window must have the same length, got {w.tolist()}")
        if self.outside not in OUTSIDE_SOLVERS:
            raise ValueError(f"outside must be one of {OUTSIDE_SOLVERS}, got {self.outside!r}")

    @property
    def num_trainable(self) -> int:
        return int(self.sde_windows[0, 1] - self.sde_windows[0, 0]) if self.sde_windows.numel() else 0

    def for_samples(self, rows: slice) -> RolloutPlan:
        """The plan of the samples ``rows`` (a sub-batch of the rollout): their SDE windows."""
        return replace(self, sde_windows=self.sde_windows[rows])

    def steps(self, kernel: Kernel) -> tuple[PlannedStep, ...]:
        """The per-step plan (:class:`flowrl.sampling.rollout.PlannedStep`): at step ``i``, the
        samples with ``start <= i < stop`` take ``kernel``, those past their window ``outside``."""
        windows = self.sde_windows.cpu()
        starts, stops = windows[:, 0], windows[:, 1]
        return tuple(PlannedStep(kernel, in_sde_window=(starts <= i) & (i < stops), after_sde_window=stops <= i,
                                 solver_after=self.outside) for i in range(self.sigmas.numel() - 1))


def _check_sde_windows(plan: RolloutPlan, kernel: Kernel, image_from: str) -> None:
    """Every step inside an SDE window must be trainable (:func:`flowrl.sampling.rollout.trainable_mask`)."""
    sig = validate_sigmas(plan.sigmas).cpu()
    trainable = trainable_mask((kernel,) * (sig.numel() - 1), sig, image_from)
    for i, step in enumerate(plan.steps(kernel)):
        if bool(step.in_sde_window.any()) and not bool(trainable[i]):
            raise ValueError(f"step {i} of an SDE window is not trainable (the kernel injects no noise there, or it is "
                             f"the last step with the image decoded from its x0_hat); place the windows before it")


def rollout_plan(velocity_fn: VelocityFn, initial_noise: torch.Tensor, plan: RolloutPlan, kernel: Kernel,
                 **options) -> Trajectory:
    """Sample ``B`` trajectories along ``plan`` (module docstring): ``kernel`` inside each row's
    SDE window, Euler before it and ``plan.outside`` after it, one ``velocity_fn(x, sigma [B])``
    call per step for the whole batch: :func:`flowrl.sampling.rollout.rollout_steps` on
    :meth:`RolloutPlan.steps`. ``options`` are its keywords; a list of ``B`` ``generators`` keeps
    each row's noise independent of the batch, and a row draws SDE noise only inside its window.
    Returns a trajectory with per-sample ``positions`` (``[B, T]``), ``position_kernel = kernel``
    and, with ``keep_means``, the proposal means at those positions."""
    if plan.sde_windows.shape[0] != initial_noise.shape[0]:
        raise ValueError(f"the plan has {plan.sde_windows.shape[0]} SDE windows for {initial_noise.shape[0]} samples")
    _check_sde_windows(plan, kernel, options.get("image_from", "x0_hat"))
    return rollout_steps(lambda rows: velocity_fn, initial_noise, plan.sigmas, plan.steps(kernel), **options)


@dataclass(frozen=True)
class PlanContext:
    """What a :class:`flowrl.interfaces.WindowPlanner` plans with: the number of steps ``N``, the
    run's ``sigmas [N + 1]``, ``trainable [N]`` (bool: the steps the kernel could train: it
    injects noise there and, with the image from ``x0_hat``, not the last), the schedule's
    ``warp`` (uniform time -> sigma; None when the schedule has none), the run's seed, the group
    size, and ``sde_window`` (``[sampler].sde_window``, empty = every step)."""

    num_steps: int
    sigmas: torch.Tensor
    trainable: torch.Tensor
    warp: Callable[[torch.Tensor], torch.Tensor] | None
    seed: int
    group_size: int
    sde_window: tuple[int, ...] = ()

    @property
    def trainable_prefix(self) -> int:
        """M: the steps ``0 .. M - 1`` are all trainable (where windows may sit)."""
        m = 0
        for flag in self.trainable.tolist():
            if not flag:
                break
            m += 1
        return m
