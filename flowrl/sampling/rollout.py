"""Rollouts: sample trajectories with one kernel per step, and re-score their transitions.

docs/api.md §1 (conventions), 2 (kernels), 3 (log-probs) and 4 (trainable set).

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

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from flowrl.checks import positive_int
from flowrl.interfaces import Kernel
from flowrl.sampling.kernels import GeneratorArg, ODEKernel, StepOutput, ode_step
from flowrl.sampling.schedules import validate_sigmas
from flowrl.sampling.trajectory import Trajectory

__all__ = [
    "ode_sample",
    "StepVelocity",
    "Sampler",
    "VelocityFn",
    "make_kernels",
    "trainable_mask",
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
    window: tuple[int, int] | None = None,
    outside: str | Kernel = "ode",
) -> tuple[Kernel, ...]:
    """One kernel per step: ``sde_kernel`` inside ``window``, ``outside`` elsewhere.

    ``window = (start, stop)`` is a half-open range of step indices ``start <= i < stop``
    (MixGRPO's sliding window, Flow-GRPO-Fast's SDE-only-early steps); ``None`` means every step.
    ``outside`` is ``"ode"`` (deterministic Euler, the default) or any :class:`Kernel`.
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
    if window is None:
        start, stop = 0, num_steps
    else:
        try:
            start, stop = (int(w) for w in window)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"window must be a pair (start, stop) of step indices, got {window!r}") from exc
        if not (0 <= start < stop <= num_steps):
            raise ValueError(
                f"window (start, stop) must satisfy 0 <= start < stop <= num_steps = {num_steps}, "
                f"got {window!r}"
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


@torch.no_grad()
def rollout(
    velocity_fn: VelocityFn,
    initial_noise: torch.Tensor,
    sigmas,
    kernels: Sequence[Kernel] | Kernel,
    *,
    generators: GeneratorArg = None,
    image_from: str = "x0_hat",
    reduction: str = "mean",
    prompts: Sequence[str] | None = None,
    group_ids: torch.Tensor | Sequence[int] | None = None,
    keep_means: bool = False,
) -> Trajectory:
    """Sample ``B`` trajectories from ``initial_noise [B, ...]`` along ``sigmas [N + 1]``.

    Step ``i``: ``v = velocity_fn(x_i, sigma_i [B])``, then ``kernels[i].step`` samples
    ``x_{i+1}`` and its log-prob (float32, ``reduction`` of section 3). ``generators`` is one
    generator or a list of ``B`` per-sample generators (noise independent of the batch
    composition). ``image_latents`` is the last step's ``x0_hat = x_{N-1} - sigma_{N-1} v``
    (``image_from="x0_hat"``, DanceGRPO / MixGRPO / GCPO) or ``x_N`` (``"final"``, Flow-GRPO).
    ``trainable`` follows :func:`trainable_mask`. ``prompts`` defaults to ``[""] * B``;
    ``group_ids`` defaults to one group per distinct prompt (order of first appearance).
    ``keep_means`` stores the kernels' proposal means at the trainable transitions
    (``Trajectory.means``, for GRPO-Guard). Runs under ``torch.no_grad``.
    """
    if image_from not in _IMAGE_FROM:
        raise ValueError(f"image_from must be one of {_IMAGE_FROM}, got {image_from!r}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if initial_noise.ndim < 2:
        raise ValueError(f"initial_noise must be [B, ...] with >= 2 dims, got {tuple(initial_noise.shape)}")
    device = initial_noise.device
    sig = validate_sigmas(sigmas).to(device)
    n = sig.numel() - 1
    if isinstance(kernels, Kernel):
        kernels = (kernels,) * n
    kernels = tuple(kernels)
    trainable = trainable_mask(kernels, sig.cpu(), image_from)
    b = initial_noise.shape[0]
    prompts, gids = prompts_and_groups(prompts, group_ids, b, device)

    x = initial_noise.to(torch.float32)
    states = [x]
    log_probs = []
    means = []
    x0_hat = None
    for i in range(n):
        s_i = sig[i].repeat(b)
        s_n = sig[i + 1].repeat(b)
        v = velocity_fn(x, s_i)
        if v.shape != x.shape:
            raise ValueError(f"velocity_fn returned shape {tuple(v.shape)}, expected {tuple(x.shape)}")
        if i == n - 1 and image_from == "x0_hat":
            x0_hat = x - s_i.reshape(b, *([1] * (x.ndim - 1))) * v.to(torch.float32)
        out = kernels[i].step(v, x, s_i, s_n, generator=generators, reduction=reduction)
        if keep_means and bool(trainable[i]):
            means.append(out.mean)
        x = out.next_sample
        states.append(x)
        log_probs.append(out.log_prob)
    latents = torch.stack(states, dim=1)
    image = x0_hat if image_from == "x0_hat" else x
    return Trajectory(
        latents=latents,
        log_probs=torch.stack(log_probs, dim=1),
        sigmas=sig,
        trainable=trainable.to(device),
        prompts=prompts,
        group_ids=gids,
        image_latents=image,
        kernels=kernels,
        reduction=reduction,
        image_from=image_from,
        means=torch.stack(means, dim=1) if keep_means else None,
    )


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
