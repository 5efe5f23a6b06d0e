"""Rollouts whose SDE window moves: per iteration (MixGRPO) or per sample (Flow-GRPO-Fast).

A :class:`RolloutPlan` says, for one rollout, the schedule (which may change per iteration:
MixGRPO-Flash compresses the steps after the window), each sample's SDE window
``[start, stop)`` of step indices, and the deterministic solver after the window (``euler``, or
``dpm2m``: DPM-Solver++(2M), :mod:`flowrl.sampling.solvers`; steps before the window are always Euler).
:func:`rollout_plan` samples it with one model forward per step for the whole batch: each row
takes the SDE kernel inside its window and the ODE elsewhere, sharing the step's velocity.

Every sample's window has the same length ``T`` (the trained transitions; the chunk layout
needs a fixed ``T``), and every step of a window must be trainable: the kernel injects noise
there, and it is not the last step when the image is the last ``x0_hat``. The trajectory
records the positions per sample (``Trajectory.positions``), so re-scoring gathers each
row's own transitions (:func:`flowrl.sampling.rollout.rescore_position`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from flowrl.interfaces import Kernel
from flowrl.sampling.rollout import prompts_and_groups
from flowrl.sampling.schedules import validate_sigmas
from flowrl.sampling.kernels import GeneratorArg, ode_step
from flowrl.sampling.solvers import DPM2M, dpmpp_2m_step
from flowrl.sampling.trajectory import Trajectory

__all__ = ["RolloutPlan", "PlanContext", "rollout_plan", "OUTSIDE_SOLVERS"]

#: The solvers a plan may use after its window.
OUTSIDE_SOLVERS = ("euler", DPM2M)


@dataclass(frozen=True)
class RolloutPlan:
    """One rollout's schedule ``sigmas [N + 1]``, windows ``[B, 2]`` (long, ``[start, stop)``,
    every row the same length) and the solver after the window."""

    sigmas: torch.Tensor
    windows: torch.Tensor
    outside: str = "euler"

    def __post_init__(self):
        sig = validate_sigmas(self.sigmas)
        w = torch.as_tensor(self.windows)
        if w.ndim != 2 or w.shape[1] != 2 or w.dtype != torch.long:
            raise ValueError(f"windows must be a long tensor [B, 2], got {w.dtype} {tuple(w.shape)}")
        n = sig.numel() - 1
        if w.numel() and (bool((w[:, 0] < 0).any()) or bool((w[:, 1] > n).any()) or bool((w[:, 1] < w[:, 0]).any())):
            raise ValueError(f"every window must satisfy 0 <= start <= stop <= N = {n}, got {w.tolist()}")
        if w.numel() and len(set((w[:, 1] - w[:, 0]).tolist())) > 1:
            raise ValueError(f"every sample's window must have the same length, got {w.tolist()}")
        if self.outside not in OUTSIDE_SOLVERS:
            raise ValueError(f"outside must be one of {OUTSIDE_SOLVERS}, got {self.outside!r}")

    @property
    def num_trainable(self) -> int:
        return int(self.windows[0, 1] - self.windows[0, 0]) if self.windows.numel() else 0


def _subset(generators: GeneratorArg, rows: torch.Tensor):
    if generators is None or isinstance(generators, torch.Generator):
        return generators
    gens = list(generators)
    return [gens[int(r)] for r in rows]


def _solver_rows(x, v, x0, s, s_next, euler, after, prev_x0, prev_sigma):
    """The next states of the rows outside their windows (Euler, or DPM-Solver++(2M) after the
    window) and zero log-probs; the window rows are filled by the caller."""
    nxt = torch.empty_like(x)
    lp = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    if bool(euler.any()):
        rows = torch.nonzero(euler).flatten()
        nxt[rows] = ode_step(v[rows], x[rows], s.repeat(len(rows)), s_next.repeat(len(rows))).next_sample
    if bool(after.any()):
        rows = torch.nonzero(after).flatten()
        prev = None if prev_x0 is None else prev_x0[rows]
        nxt[rows] = dpmpp_2m_step(x[rows], x0[rows], float(s), float(s_next), prev,
                                  None if prev_sigma is None else float(prev_sigma))
    return nxt, lp


def _check_windows(windows: torch.Tensor, sig: torch.Tensor, kernel: Kernel, image_from: str) -> None:
    """Every step inside a window must be trainable."""
    n = sig.numel() - 1
    for i in range(n):
        if not bool(((windows[:, 0] <= i) & (i < windows[:, 1])).any()):
            continue
        if not kernel.stochastic_at(float(sig[i]), float(sig[i + 1])) or (i == n - 1 and image_from == "x0_hat"):
            raise ValueError(f"step {i} of a window is not trainable (the kernel injects no noise there, or it is the "
                             f"last step with the image decoded from its x0_hat); place the windows before it")


@torch.no_grad()
def rollout_plan(
    velocity_fn,
    initial_noise: torch.Tensor,
    plan: RolloutPlan,
    kernel: Kernel,
    *,
    generators: GeneratorArg = None,
    image_from: str = "x0_hat",
    reduction: str = "mean",
    prompts: Sequence[str] | None = None,
    group_ids: torch.Tensor | Sequence[int] | None = None,
    keep_means: bool = False,
) -> Trajectory:
    """Sample ``B`` trajectories along ``plan`` (module docstring): ``kernel`` inside each row's
    window, Euler before it and ``plan.outside`` after it. ``generators`` as in
    :func:`flowrl.sampling.rollout.rollout` (a list of ``B`` keeps each row's noise independent of the
    batch); a row draws SDE noise only inside its window. Returns a trajectory with per-sample
    ``positions`` (``[B, T]``), ``position_kernel = kernel`` and, with ``keep_means``, the
    proposal means at those positions."""
    if image_from not in ("x0_hat", "final"):
        raise ValueError(f"image_from must be 'x0_hat' or 'final', got {image_from!r}")
    x = initial_noise.to(torch.float32)
    device, b = x.device, x.shape[0]
    sig = validate_sigmas(plan.sigmas).to(device)
    n = sig.numel() - 1
    windows = plan.windows.cpu()
    if windows.shape[0] != b:
        raise ValueError(f"the plan has {windows.shape[0]} windows for {b} samples")
    T = plan.num_trainable
    starts = windows[:, 0]
    _check_windows(windows, sig, kernel, image_from)
    prompts, gids = prompts_and_groups(prompts, group_ids, b, device)
    states, log_probs = [x], []
    means = torch.zeros(b, T, *x.shape[1:], dtype=torch.float32, device=device) if keep_means else None
    prev_x0, prev_sigma, image = None, None, None
    for i in range(n):
        s, s_next = sig[i], sig[i + 1]
        v = velocity_fn(x, s.repeat(b)).to(torch.float32)
        if v.shape != x.shape:
            raise ValueError(f"velocity_fn returned shape {tuple(v.shape)}, expected {tuple(x.shape)}")
        x0 = x - s * v
        inside = ((starts <= i) & (i < windows[:, 1])).to(device)
        after = (windows[:, 1] <= i).to(device) if plan.outside == DPM2M else torch.zeros(b, dtype=torch.bool, device=device)
        nxt, lp = _solver_rows(x, v, x0, s, s_next, ~inside & ~after, after, prev_x0, prev_sigma)
        if bool(inside.any()):
            rows = torch.nonzero(inside).flatten()
            out = kernel.step(v[rows], x[rows], s.repeat(len(rows)), s_next.repeat(len(rows)),
                              generator=_subset(generators, rows.cpu()), reduction=reduction)
            nxt[rows] = out.next_sample
            lp[rows] = out.log_prob
            if means is not None:
                means[rows, i - starts.to(device)[rows]] = out.mean
        if i == n - 1 and image_from == "x0_hat":
            image = x0
        prev_x0, prev_sigma = x0, s
        x = nxt
        states.append(x)
        log_probs.append(lp)
    positions = (starts[:, None] + torch.arange(T)[None, :]).to(torch.long)
    trainable = torch.zeros(n, dtype=torch.bool)
    trainable[positions.flatten()] = True
    return Trajectory(
        latents=torch.stack(states, dim=1),
        log_probs=torch.stack(log_probs, dim=1),
        sigmas=sig,
        trainable=trainable.to(device),
        prompts=prompts,
        group_ids=gids,
        image_latents=image if image is not None else x,
        kernels=(),
        reduction=reduction,
        image_from=image_from,
        positions=positions.to(device),
        position_kernel=kernel,
        means=means,
    )


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
