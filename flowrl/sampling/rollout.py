"""Rollouts: sample trajectories, and re-score their transitions.

docs/api.md §1 (conventions), 2 (kernels), 3 (log-probs) and 4 (trainable set).

:func:`rollout_steps` is the one rollout loop, driven by a per-step plan (a :class:`PlannedStep`
per step: the kernel, which samples are in their SDE window, the solver outside it, the branch
factor). Every rollout is this loop on its plan, so the seeding, stepping and collecting exist
once: :func:`rollout` (one kernel per step for every sample),
:func:`flowrl.sampling.plans.rollout_plan` (per-sample SDE windows) and
:func:`flowrl.sampling.branching.branch_rollout` (trees) only build their plans.

``velocity_fn(x [B, ...], sigma [B]) -> v [B, ...]`` is a closure over the model and the text
embeddings of exactly the samples it is given (for re-scoring a sub-batch, build the closure
for that sub-batch; see :func:`make_step_log_prob_fn`). ``sigma`` is passed as a float32 tensor
``[B]`` taken from the stored schedule, identical at rollout and at training.

:func:`ode_sample` is the one deterministic sampler (Euler along the schedule, the policy's mean
path): what training evaluates with, what ``flowrl sample`` and ``flowrl eval`` draw images with
(including hybrid inference: a different velocity for the late steps), and what the embedded
model's own evaluation uses.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from flowrl.checks import positive_int
from flowrl.interfaces import Kernel
from flowrl.sampling.kernels import GeneratorArg, ODEKernel, StepOutput, ode_step
from flowrl.sampling.schedules import validate_sigmas
from flowrl.sampling.solvers import DPM2M, OUTSIDE_SOLVERS, dpmpp_2m_step
from flowrl.sampling.trajectory import Trajectory

__all__ = [
    "ode_sample",
    "StepVelocity",
    "Sampler",
    "VelocityFn",
    "make_kernels",
    "trainable_mask",
    "PlannedStep",
    "rollout_steps",
    "rollout",
    "prompts_and_groups",
    "rescore_transition",
    "rescore_transitions",
    "rescore_position",
    "rescore_positions",
    "transition_log_prob",
    "make_step_log_prob_fn",
]

VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_IMAGE_FROM = ("x0_hat", "final")


@dataclass(frozen=True)
class Sampler:
    """What a run samples with: ``sigmas [N + 1]`` (float32), one kernel per step, T (the
    number of trainable transitions), where the image is decoded from (``"x0_hat"`` or
    ``"final"``) and the log-prob reduction (``"mean"`` or ``"sum"``)."""

    sigmas: torch.Tensor
    kernels: tuple[Kernel, ...]
    num_trainable: int
    image_from: str
    reduction: str


def make_kernels(
    num_steps: int,
    sde_kernel: Kernel,
    sde_window: tuple[int, int] | None = None,
    outside: str | Kernel = "ode",
) -> tuple[Kernel, ...]:
    """One kernel per step: ``sde_kernel`` inside ``sde_window``, ``outside`` elsewhere.

    ``sde_window = (start, stop)`` is a half-open range of step indices ``start <= i < stop``
    (``[sampler].sde_window``; MixGRPO's sliding window, Flow-GRPO-Fast's SDE-only-early steps);
    ``None`` means every step. ``outside`` is ``"ode"`` (deterministic Euler, the default) or any
    :class:`Kernel`.
    """
    positive_int(num_steps, "num_steps")
    if not isinstance(sde_kernel, Kernel):
        raise ValueError(f"sde_kernel must be a Kernel instance, got {type(sde_kernel).__name__}")
    if isinstance(outside, str):
        if outside != "ode":
            raise ValueError(f"outside must be 'ode' or a Kernel instance, got {outside!r}")
        outside_k: Kernel = ODEKernel()
    elif isinstance(outside, Kernel):
        outside_k = outside
    else:
        raise ValueError(f"outside must be 'ode' or a Kernel instance, got {outside!r}")
    if sde_window is None:
        start, stop = 0, num_steps
    else:
        try:
            start, stop = (int(w) for w in sde_window)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"sde_window must be a pair (start, stop) of step indices, got {sde_window!r}") from exc
        if not (0 <= start < stop <= num_steps):
            raise ValueError(
                f"sde_window (start, stop) must satisfy 0 <= start < stop <= num_steps = {num_steps}, "
                f"got {sde_window!r}"
            )
    return tuple(sde_kernel if start <= i < stop else outside_k for i in range(num_steps))


def trainable_mask(
    kernels: Sequence[Kernel], sigmas: torch.Tensor, image_from: str = "x0_hat"
) -> torch.Tensor:
    """Bool ``[N]``: steps whose kernel injects noise there, minus the last transition when
    the image is decoded from the last step's ``x0_hat`` (its noise never reaches the reward;
    docs/api.md §4: N = 17 flow steps give 16 trainable transitions)."""
    if image_from not in _IMAGE_FROM:
        raise ValueError(f"image_from must be one of {_IMAGE_FROM}, got {image_from!r}")
    sig = validate_sigmas(sigmas)
    n = sig.numel() - 1
    if len(kernels) != n:
        raise ValueError(f"need one kernel per step: {n} steps, got {len(kernels)} kernels")
    mask = torch.tensor(
        [kernels[i].stochastic_at(float(sig[i]), float(sig[i + 1])) for i in range(n)],
        dtype=torch.bool,
    )
    if image_from == "x0_hat":
        mask[-1] = False
    return mask


def _group_ids_from_prompts(prompts: Sequence[str]) -> torch.Tensor:
    first: dict[str, int] = {}
    return torch.tensor([first.setdefault(p, len(first)) for p in prompts], dtype=torch.long)


def prompts_and_groups(prompts, group_ids, b: int, device) -> tuple[list[str], torch.Tensor]:
    """A rollout's ``prompts`` (default ``[""] * B``) and ``group_ids`` (default: one group per
    distinct prompt, in order of first appearance), checked to have ``B`` entries."""
    prompts = [""] * b if prompts is None else list(prompts)
    if len(prompts) != b:
        raise ValueError(f"prompts must have B = {b} entries, got {len(prompts)}")
    if group_ids is None:
        gids = _group_ids_from_prompts(prompts)
    else:
        gids = torch.as_tensor(group_ids, dtype=torch.long).flatten()
        if gids.numel() != b:
            raise ValueError(f"group_ids must have B = {b} entries, got {gids.numel()}")
    return prompts, gids.to(device)


@dataclass(frozen=True)
class PlannedStep:
    """What one sampling step does, the unit of :func:`rollout_steps`' per-step plan.

    ``kernel`` steps the samples in their SDE window: every sample when ``in_sde_window`` is None
    (one kernel per step, :func:`make_kernels`: the kernel may then be the ODE), else the samples
    it marks (bool ``[B]``, per-sample windows: :mod:`flowrl.sampling.plans`). The others take a
    deterministic solver: Euler before their window, ``solver_after`` (``"euler"`` or ``"dpm2m"``,
    DPM-Solver++(2M)) once ``after_sde_window`` (bool ``[B]``) says it is behind them.
    ``branch_factor`` copies every live row that many times before the step draws its noise (a
    branch rollout's split, :mod:`flowrl.sampling.branching`; 1: no split)."""

    kernel: Kernel
    in_sde_window: torch.Tensor | None = None
    after_sde_window: torch.Tensor | None = None
    solver_after: str = "euler"
    branch_factor: int = 1

    def __post_init__(self):
        if self.solver_after not in OUTSIDE_SOLVERS:
            raise ValueError(f"solver_after must be one of {OUTSIDE_SOLVERS}, got {self.solver_after!r}")
        if not (isinstance(self.branch_factor, int) and self.branch_factor >= 1):
            raise ValueError(f"branch_factor must be an integer >= 1, got {self.branch_factor!r}")


def _roots(steps: tuple[PlannedStep, ...], b: int) -> int:
    """The number of roots (distinct starting rows) of a per-step plan for ``b`` samples; raises
    ``ValueError`` for a plan that does not fit them."""
    block = math.prod(step.branch_factor for step in steps)
    if b % block:
        raise ValueError(f"the branch factors' product ({block}) must divide the batch ({b})")
    masks = [mask for step in steps for mask in (step.in_sde_window, step.after_sde_window) if mask is not None]
    if any(tuple(mask.shape) != (b,) for mask in masks):
        raise ValueError(f"a step's SDE window masks must be bool [B] with B = {b}")
    per_sample = any(step.in_sde_window is not None for step in steps)
    if per_sample and block > 1:
        raise ValueError("per-sample SDE windows and branching do not combine: a shared row has one window")
    if per_sample and any(step.kernel != steps[0].kernel for step in steps):
        raise ValueError("a plan with per-sample SDE windows has one kernel for every step")
    return b // block


def _generators_of(generators: GeneratorArg, rows: torch.Tensor) -> GeneratorArg:
    """The generators of ``rows`` (sample indices): one per row from a list, else the one given."""
    if generators is None or isinstance(generators, torch.Generator):
        return generators
    gens = list(generators)
    return [gens[int(r)] for r in rows]


class _LiveRows:
    """The distinct rows a rollout steps: each stands for ``block`` consecutive samples (a branch
    rollout's shared prefix) and is known by the first of them, whose generator it draws from, so
    the tree does not depend on the batch it is sampled in. Block 1: every sample is its own row."""

    def __init__(self, b: int, roots: int, device):
        self.b, self.block, self.device = b, b // roots, device
        self.samples = torch.arange(0, b, self.block, device=device)

    def split(self, factor: int) -> None:
        self.block //= factor
        self.samples = torch.arange(0, self.b, self.block, device=self.device)

    def owners(self) -> torch.Tensor | None:
        """Each sample's row (None when every sample is its own row: nothing to expand)."""
        return None if self.block == 1 else torch.arange(self.b, device=self.device) // self.block


def _expand(t: torch.Tensor, owners: torch.Tensor | None) -> torch.Tensor:
    return t if owners is None else t[owners]


def _solve_outside(step: PlannedStep, v, x, x0, sigma, sigma_next, previous) -> torch.Tensor:
    """The next states of the rows outside their SDE window (the caller fills the others): Euler,
    or DPM-Solver++(2M) past the window with the previous step's ``(x0_hat, sigma)``."""
    nxt, inside = torch.empty_like(x), step.in_sde_window.to(x.device)
    after = step.after_sde_window
    dpm = (after.to(x.device) & ~inside) if after is not None and step.solver_after == DPM2M else torch.zeros_like(inside)
    euler = ~inside & ~dpm
    if bool(euler.any()):
        rows = torch.nonzero(euler).flatten()
        nxt[rows] = ode_step(v[rows], x[rows], sigma.repeat(len(rows)), sigma_next.repeat(len(rows))).next_sample
    if bool(dpm.any()):
        rows = torch.nonzero(dpm).flatten()
        prev_x0, prev_sigma = previous if previous is not None else (None, None)
        nxt[rows] = dpmpp_2m_step(x[rows], x0[rows], float(sigma), float(sigma_next),
                                  None if prev_x0 is None else prev_x0[rows],
                                  None if prev_sigma is None else float(prev_sigma))
    return nxt


def _take_step(step: PlannedStep, v, x, x0, sigma, sigma_next, previous, generators, reduction):
    """One step of the live rows ``x``: ``(x_next, log_probs, kernel rows, the kernel's means)``
    with ``kernel rows`` None when the kernel stepped every row; log-prob 0 outside the window."""
    if step.in_sde_window is None:
        out = step.kernel.step(v, x, sigma.repeat(len(x)), sigma_next.repeat(len(x)), generator=generators,
                               reduction=reduction)
        return out.next_sample, out.log_prob, None, out.mean
    nxt = _solve_outside(step, v, x, x0, sigma, sigma_next, previous)
    lp = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    rows = torch.nonzero(step.in_sde_window.to(x.device)).flatten()
    if not rows.numel():
        return nxt, lp, rows, None
    out = step.kernel.step(v[rows], x[rows], sigma.repeat(len(rows)), sigma_next.repeat(len(rows)),
                           generator=_generators_of(generators, rows.cpu()), reduction=reduction)
    nxt[rows] = out.next_sample
    lp[rows] = out.log_prob
    return nxt, lp, rows, out.mean


class _Record:
    """What a rollout keeps: every state and log-prob of its live rows with the samples they stand
    for, and the proposal means at each sample's trainable transitions (``trainable [N, B]``)."""

    def __init__(self, x: torch.Tensor, owners, trainable: torch.Tensor, keep_means: bool):
        b, device = trainable.shape[1], x.device
        self.states, self.log_probs, self.trainable = [(x, owners)], [], trainable
        t = _transitions_per_sample(trainable)
        self.means = torch.zeros(b, t, *x.shape[1:], dtype=torch.float32, device=device) if keep_means else None
        self.slot = torch.zeros(b, dtype=torch.long, device=device)

    def add(self, i: int, x_next, log_prob, owners, kernel_rows, mean) -> None:
        self.states.append((x_next, owners))
        self.log_probs.append((log_prob, owners))
        if self.means is None or mean is None or not bool(self.trainable[i].any()):
            return
        if kernel_rows is None:  # every sample, at a transition the whole batch trains
            kernel_rows, mean = torch.arange(self.slot.numel(), device=self.slot.device), _expand(mean, owners)
        keep = self.trainable[i].to(kernel_rows.device)[kernel_rows]
        if not bool(keep.all()):  # a sample in its window at a step the kernel does not train there
            kernel_rows, mean = kernel_rows[keep], mean[keep]
        self.means[kernel_rows, self.slot[kernel_rows]] = mean
        self.slot[kernel_rows] += 1

    def latents(self) -> torch.Tensor:
        return torch.stack([_expand(s, o) for s, o in self.states], dim=1)

    def stacked_log_probs(self) -> torch.Tensor:
        return torch.stack([_expand(lp, o) for lp, o in self.log_probs], dim=1)


def _transitions_per_sample(trainable: torch.Tensor) -> int:
    """T: the trainable transitions of each sample (``trainable [N, B]``), the same for all."""
    counts = trainable.sum(dim=0)
    if counts.numel() and bool((counts != counts[0]).any()):
        raise ValueError(f"every sample needs the same number of trainable transitions, got {counts.tolist()}")
    return int(counts[0]) if counts.numel() else 0


def _trajectory(record: _Record, steps, stochastic, sig, image, common: dict) -> Trajectory:
    """The :class:`Trajectory` of a finished rollout: one kernel per step when every sample took
    the step's kernel (``stochastic``: :func:`trainable_mask`), else per-sample trainable positions
    with the plan's one kernel."""
    device = sig.device
    if all(step.in_sde_window is None for step in steps):
        form = {"trainable": stochastic.to(device), "kernels": tuple(step.kernel for step in steps)}
    else:
        b, t = record.trainable.shape[1], _transitions_per_sample(record.trainable)
        positions = torch.nonzero(record.trainable.T)[:, 1].reshape(b, t)
        form = {"trainable": record.trainable.any(dim=1).to(device), "kernels": (), "positions": positions.to(device),
                "position_kernel": steps[0].kernel}
    return Trajectory(latents=record.latents(), log_probs=record.stacked_log_probs(), sigmas=sig, image_latents=image,
                      means=record.means, **form, **common)


@torch.no_grad()
def rollout_steps(
    velocity_for: Callable[[torch.Tensor], VelocityFn],
    initial_noise: torch.Tensor,
    sigmas,
    steps: Sequence[PlannedStep],
    *,
    generators: GeneratorArg = None,
    image_from: str = "x0_hat",
    reduction: str = "mean",
    prompts: Sequence[str] | None = None,
    group_ids: torch.Tensor | Sequence[int] | None = None,
    keep_means: bool = False,
) -> Trajectory:
    """THE rollout loop: sample ``B`` trajectories from ``initial_noise [B, ...]`` along ``sigmas
    [N + 1]``, step ``i`` as ``steps[i]`` (:class:`PlannedStep`) says. :func:`rollout`,
    :func:`flowrl.sampling.plans.rollout_plan` and :func:`flowrl.sampling.branching.branch_rollout`
    build their plans and call it.

    Step ``i``: ``v = velocity(x_i, sigma_i [rows])`` once per live row (a branch rollout's shared
    prefix is one row), then the split, then the kernel samples ``x_{i+1}`` and its log-prob
    (float32, ``reduction`` of section 3) for the samples in their SDE window, a solver for the
    others. ``velocity_for(rows)`` builds the closure for the live rows ``rows`` (their first
    samples' indices, ascending), called at the start and after each split. ``generators`` is one
    generator or a list of ``B`` per-sample generators (noise independent of the batch
    composition; a live row draws from its first sample's). ``image_latents`` is the last step's
    ``x0_hat = x_{N-1} - sigma_{N-1} v`` (``image_from="x0_hat"``, DanceGRPO / MixGRPO / GCPO) or
    ``x_N`` (``"final"``, Flow-GRPO). A sample's trainable transitions are the steps where it is in
    its SDE window and the kernel injects noise, minus the last with the image from ``x0_hat``
    (:func:`trainable_mask`). ``prompts`` defaults to ``[""] * B``; ``group_ids`` to one group per
    distinct prompt (order of first appearance). ``keep_means`` stores the kernels' proposal means
    at the trainable transitions (``Trajectory.means``, for GRPO-Guard). Runs under
    ``torch.no_grad``."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if initial_noise.ndim < 2:
        raise ValueError(f"initial_noise must be [B, ...] with >= 2 dims, got {tuple(initial_noise.shape)}")
    device, b = initial_noise.device, initial_noise.shape[0]
    sig, steps = validate_sigmas(sigmas).to(device), tuple(steps)
    n = sig.numel() - 1
    stochastic = trainable_mask(tuple(step.kernel for step in steps), sig.cpu(), image_from)  # one step per sigma
    live = _LiveRows(b, _roots(steps, b), device)
    trainable = torch.stack([stochastic[i] & (torch.ones(b, dtype=torch.bool) if step.in_sde_window is None
                                              else step.in_sde_window.cpu()) for i, step in enumerate(steps)])
    prompts, gids = prompts_and_groups(prompts, group_ids, b, device)
    x = _expand(initial_noise.to(torch.float32), None if live.block == 1 else live.samples)
    record = _Record(x, live.owners(), trainable, keep_means)
    velocity_fn, previous, x0 = velocity_for(live.samples), None, None
    multistep = any(step.solver_after == DPM2M for step in steps)  # keeps each step's x0_hat for the next
    for i, step in enumerate(steps):
        v = velocity_fn(x, sig[i].repeat(len(x)))
        if v.shape != x.shape:
            raise ValueError(f"velocity_fn returned shape {tuple(v.shape)}, expected {tuple(x.shape)}")
        if step.branch_factor > 1:  # the split: copies of the state AND of its velocity (no forward is repeated)
            live.split(step.branch_factor)
            x, v = x.repeat_interleave(step.branch_factor, dim=0), v.repeat_interleave(step.branch_factor, dim=0)
            velocity_fn = velocity_for(live.samples)
        if multistep or (i == n - 1 and image_from == "x0_hat"):
            x0 = x - sig[i] * v.to(torch.float32)
        gens = generators if live.block == 1 else _generators_of(generators, live.samples)
        x_next, lp, kernel_rows, mean = _take_step(step, v, x, x0, sig[i], sig[i + 1], previous, gens, reduction)
        record.add(i, x_next, lp, live.owners(), kernel_rows, mean)
        previous, x = ((x0, sig[i]) if multistep else None), x_next
    image = _expand(x0 if image_from == "x0_hat" else x, live.owners())
    return _trajectory(record, steps, stochastic, sig, image,
                       {"prompts": prompts, "group_ids": gids, "reduction": reduction, "image_from": image_from})


def rollout(
    velocity_fn: VelocityFn,
    initial_noise: torch.Tensor,
    sigmas,
    kernels: Sequence[Kernel] | Kernel,
    **options,
) -> Trajectory:
    """Sample ``B`` trajectories with one kernel per step (``kernels[i]`` steps every sample at
    step ``i``; one :class:`Kernel` for all): :func:`rollout_steps` on that plan, with
    ``velocity_fn(x, sigma [B])`` for the whole batch. ``options`` are :func:`rollout_steps`'
    keywords (``generators``, ``image_from``, ``reduction``, ``prompts``, ``group_ids``,
    ``keep_means``); ``trainable`` follows :func:`trainable_mask`."""
    if isinstance(kernels, Kernel):
        kernels = (kernels,) * (validate_sigmas(sigmas).numel() - 1)
    return rollout_steps(lambda rows: velocity_fn, initial_noise, sigmas, [PlannedStep(k) for k in kernels],
                         **options)


def rescore_transition(
    velocity_fn: VelocityFn,
    trajectory: Trajectory,
    i: int,
    batch_idx: torch.Tensor | None = None,
) -> StepOutput:
    """Re-score transition ``i`` of the samples ``batch_idx`` (default all) with ``velocity_fn``
    (built for exactly those samples): the kernel's :class:`~flowrl.sampling.kernels.StepOutput` for the stored
    ``x_i -> x_{i+1}``, whose ``log_prob [len(batch_idx)]`` (float32) and ``mean`` carry the
    gradient of ``velocity_fn`` when grad mode is on. Uses the trajectory's stored kernel, sigmas,
    float32 latents and reduction, so on-policy the ratio is 1 (section 3)."""
    if not trajectory.kernels:
        raise ValueError("the trajectory has no kernels; re-scoring needs the kernel of each step")
    tr = trajectory.transition(i)
    if batch_idx is None:
        x, nxt = tr.sample, tr.next_sample
    else:
        idx = torch.as_tensor(batch_idx, dtype=torch.long).to(trajectory.latents.device)
        x, nxt = tr.sample[idx], tr.next_sample[idx]
    b = x.shape[0]
    s_i = tr.sigma.repeat(b)
    s_n = tr.sigma_next.repeat(b)
    v = velocity_fn(x, s_i)
    return tr.kernel.step(v, x, s_i, s_n, next_sample=nxt, reduction=trajectory.reduction)


def rescore_transitions(
    velocity_fn: VelocityFn,
    trajectory: Trajectory,
    steps: Sequence[int],
    batch_idx: torch.Tensor,
) -> torch.Tensor:
    """The log-probs ``[len(steps), n]`` of transitions ``steps`` for the samples ``batch_idx``
    from ONE velocity call on the ``len(steps) * n`` states (rows ordered step by step), so a
    chunk's steps are scored in one batched forward. ``velocity_fn`` must be built for
    ``batch_idx`` repeated ``len(steps)`` times. Same values as :func:`transition_log_prob` per
    step up to the rounding of a different batch composition."""
    idx = torch.as_tensor(batch_idx, dtype=torch.long).to(trajectory.latents.device)
    trs = [trajectory.transition(i) for i in steps]
    n = idx.numel()
    steps = list(steps)
    if n == 1 and steps == list(range(steps[0], steps[0] + len(steps))):
        # one sample, consecutive steps: its states are views of the trajectory (no copy that the
        # first layer would keep for backward; GCPO's chunk batching costs no more memory)
        row, first, last = trajectory.latents[int(idx[0])], steps[0], steps[-1]
        x, x_next = row[first : last + 1], row[first + 1 : last + 2]
        sigma, sigma_next = trajectory.sigmas[first : last + 1], trajectory.sigmas[first + 1 : last + 2]
    else:
        x = torch.cat([tr.sample[idx] for tr in trs])
        x_next = sigma_next = None
        sigma = torch.cat([tr.sigma.repeat(n) for tr in trs])
    v = velocity_fn(x, sigma)
    if all(tr.kernel is trs[0].kernel for tr in trs):  # one kernel (the usual case): one step over all rows
        if sigma_next is None:
            sigma_next = torch.cat([tr.sigma_next.repeat(n) for tr in trs])
        if x_next is None:
            x_next = torch.cat([tr.next_sample[idx] for tr in trs])
        out = trs[0].kernel.step(v, x, sigma, sigma_next, next_sample=x_next, reduction=trajectory.reduction)
        return out.log_prob.reshape(len(trs), n)
    return torch.stack([
        tr.kernel.step(v_s, tr.sample[idx], tr.sigma.repeat(n), tr.sigma_next.repeat(n),
                       next_sample=tr.next_sample[idx], reduction=trajectory.reduction).log_prob
        for tr, v_s in zip(trs, v.split(n))
    ])


def rescore_position(
    velocity_fn: VelocityFn,
    trajectory: Trajectory,
    t: int,
    batch_idx: torch.Tensor,
) -> StepOutput:
    """Re-score trainable position ``t`` (``0 <= t < T``) of the samples ``batch_idx``: the stored
    transition :meth:`~flowrl.sampling.trajectory.Trajectory.position_index` of each row, with that row's
    sigmas and the trajectory's kernel. A trajectory whose trainable transitions are shared is
    re-scored exactly as :func:`rescore_transition` does; one with per-sample positions gathers
    each row's states and passes per-row sigmas ``[n]`` (``velocity_fn`` gets them too)."""
    if trajectory.positions is None:
        return rescore_transition(velocity_fn, trajectory, int(trajectory.trainable_indices[t]), batch_idx)
    p = trajectory.position(t, batch_idx)
    v = velocity_fn(p.sample, p.sigma)
    return p.kernel.step(v, p.sample, p.sigma, p.sigma_next, next_sample=p.next_sample, reduction=trajectory.reduction)


def rescore_positions(
    velocity_fn: VelocityFn,
    trajectory: Trajectory,
    ts: Sequence[int],
    batch_idx: torch.Tensor,
) -> torch.Tensor:
    """The log-probs ``[len(ts), n]`` of trainable positions ``ts`` for ``batch_idx`` from ONE
    velocity call (rows ordered position by position); :func:`rescore_transitions` for a
    trajectory with shared trainable transitions."""
    if trajectory.positions is None:
        steps = trajectory.trainable_indices.tolist()  # a list: no index tensor lives through the forward
        return rescore_transitions(velocity_fn, trajectory, [steps[t] for t in ts], batch_idx)
    ps = [trajectory.position(t, batch_idx) for t in ts]
    v = velocity_fn(torch.cat([p.sample for p in ps]), torch.cat([p.sigma for p in ps])).split(len(batch_idx))
    return torch.stack([
        p.kernel.step(v_p, p.sample, p.sigma, p.sigma_next, next_sample=p.next_sample,
                      reduction=trajectory.reduction).log_prob
        for p, v_p in zip(ps, v)
    ])


def transition_log_prob(
    velocity_fn: VelocityFn,
    trajectory: Trajectory,
    i: int,
    batch_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``log_prob`` of :func:`rescore_transition`: float32 ``[len(batch_idx)]``."""
    return rescore_transition(velocity_fn, trajectory, i, batch_idx).log_prob


def make_step_log_prob_fn(
    velocity_fn_for: Callable[[torch.Tensor], VelocityFn], trajectory: Trajectory
) -> Callable[[int, torch.Tensor, bool], torch.Tensor]:
    """Adapter for :mod:`flowrl.objectives.chunk_gradient`: returns ``fn(t, batch_idx, grad) -> [len]``
    where ``t`` is a position in the trainable sequence (``0 <= t < T``) and
    ``velocity_fn_for(batch_idx)`` builds the velocity closure for those samples.

    Section 3 pitfall: on a GPU a sub-batch can round differently from the rollout's batch, so
    the on-policy ratio may drift from 1 by more than 1e-6. If that matters, write a
    ``step_log_prob_fn`` that evaluates the rollout's batch composition and indexes it."""
    positions = trajectory.trainable_indices.tolist()

    def step_log_prob(t: int, batch_idx: torch.Tensor, grad: bool) -> torch.Tensor:
        if not 0 <= t < len(positions):
            raise ValueError(f"trainable position must be in [0, {len(positions) - 1}], got {t}")
        with torch.set_grad_enabled(grad):
            return transition_log_prob(velocity_fn_for(batch_idx), trajectory, positions[t], batch_idx)

    return step_log_prob


#: ``velocity_at(step, x [B, *L], sigma [B]) -> v [B, *L]``
StepVelocity = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


@torch.no_grad()
def ode_sample(velocity_at: StepVelocity, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """Euler ODE sampling from ``noise [B, *L]`` along ``sigmas [N + 1]``; returns ``x_N``
    (float32). ``velocity_at(i, x, sigma)`` gives step ``i``'s velocity, so a caller can switch
    models part-way (hybrid inference)."""
    x = noise.to(torch.float32)
    b = x.shape[0]
    for i in range(len(sigmas) - 1):
        s, s_next = sigmas[i].repeat(b), sigmas[i + 1].repeat(b)
        x = ode_step(velocity_at(i, x, s), x, s, s_next).next_sample
    return x
