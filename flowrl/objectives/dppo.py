"""Flow-DPPO: a trust region by the exact Gaussian KL of each SDE step (arXiv 2606.11025;
Tencent-Hunyuan/UniRL ``unirl/algorithms/flowdppo.py``; docs/objectives.md).

Each SDE step of the rollout is a Gaussian with the policy's mean and a step std ``s`` that does
not depend on the weights, so the KL between the old (rollout) and the current transition is
exact and cheap::

    kl_t = mean((mu_theta - mu_old)^2) / (2 s^2)           (per element, averaged over elements)

A unit's KL is the mean of its steps' ``kl_t`` (a step: its own; a chunk: the mean over its
steps, as a chunk's log-ratio is the mean of its steps'). In place of PPO's ratio clip, the
unit's unclipped surrogate ``-A rho`` is kept unless the unit has left the trust region AND moves
further in the advantage's direction::

    drop_u = (kl_u >= delta) and ((rho_u > 1 and A > 0) or (rho_u < 1 and A < 0))
    loss_u = -A rho_u if not drop_u else 0

:func:`dppo_unit_loss` and :func:`dppo_drop_mask` are the pure float32 maths;
:class:`KLMaskedPolicyGradient` is the objective the ``dppo`` loss runs as: the ratio-based
policy gradient (selector, chunk update, KL term) whose re-scoring also records each step's KL.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from flowrl.batch import Batch
from flowrl.chunking import chunk_mean, validate_chunks
from flowrl.objectives.base import MicroBatch, MicroBatchResult, UpdateContext
from flowrl.objectives.losses import broadcast_advantages, kl_gaussian_exact
from flowrl.objectives.policy_gradient import PolicyGradient, TransitionScorer

__all__ = ["unit_kl", "dppo_drop_mask", "dppo_unit_loss", "KLMaskedSurrogate", "KLMaskedPolicyGradient"]


def _check_threshold(threshold: float) -> None:
    if not (isinstance(threshold, (int, float)) and math.isfinite(threshold) and threshold >= 0):
        raise ValueError(f"the KL threshold must be a finite number >= 0, got {threshold!r}")


def unit_kl(step_kl: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """``[B, T]`` per-step KLs -> ``[B, K]`` unit KLs (the mean over each unit's steps)."""
    if step_kl.ndim != 2:
        raise ValueError(f"step KLs must be [B, T], got shape {tuple(step_kl.shape)}")
    return chunk_mean(step_kl.to(torch.float32), validate_chunks(sizes, step_kl.shape[1]))


def dppo_drop_mask(log_ratio: torch.Tensor, advantages: torch.Tensor, kl: torch.Tensor,
                   threshold: float) -> torch.Tensor:
    """Bool ``[B, K]``: the units whose gradient is dropped, ``kl >= threshold`` and the ratio on the
    advantage's side of 1 (``rho > 1, A > 0`` or ``rho < 1, A < 0``). ``advantages`` is ``[B]`` or
    ``log_ratio``'s shape; ``kl`` is ``log_ratio``'s shape."""
    _check_threshold(threshold)
    z = log_ratio.detach().to(torch.float32)
    a = broadcast_advantages(advantages, z)
    k = torch.as_tensor(kl, dtype=torch.float32, device=z.device)
    if k.shape != z.shape:
        raise ValueError(f"kl must have the log-ratios' shape {tuple(z.shape)}, got {tuple(k.shape)}")
    outside = k.detach() >= threshold
    return outside & (((z > 0) & (a > 0)) | ((z < 0) & (a < 0)))


def dppo_unit_loss(log_ratio: torch.Tensor, advantages: torch.Tensor, kl: torch.Tensor,
                   threshold: float) -> torch.Tensor:
    """Per-unit Flow-DPPO loss ``-A rho`` where kept, exactly 0 (value and gradient) where
    :func:`dppo_drop_mask` drops it (float32, ``log_ratio``'s shape)."""
    a = broadcast_advantages(advantages, log_ratio)
    drop = dppo_drop_mask(log_ratio, a, kl, threshold)
    rho = torch.exp(log_ratio.to(torch.float32))
    return torch.where(drop, torch.zeros_like(rho), -a * rho)


class KLMaskedSurrogate:
    """The unit objective ``(z, A) -> loss [B, K]`` of the chunk update for one micro-batch: the
    unit KLs are read from ``kl_of()`` (``[B, K]``, the current re-scoring's), so the chunk update
    sees an objective elementwise in the units like the clipped one. ``clip_mask`` reports the
    dropped units (logged as ``clip_fraction``)."""

    def __init__(self, threshold: float):
        _check_threshold(threshold)
        self.threshold = threshold
        self.kl_of = None

    def __call__(self, log_ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        return dppo_unit_loss(log_ratio, advantages, self._kl(log_ratio), self.threshold)

    def clip_mask(self, log_ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        return dppo_drop_mask(log_ratio, advantages, self._kl(log_ratio), self.threshold)

    def _kl(self, log_ratio: torch.Tensor) -> torch.Tensor:
        if self.kl_of is None:  # outside an update (a unit test of the objective alone): on-policy
            return torch.zeros_like(log_ratio, dtype=torch.float32)
        return self.kl_of().to(log_ratio.device)


class _KLRecordingScorer(TransitionScorer):
    """The policy's re-scoring, which also keeps each re-scored step's exact Gaussian KL to the
    rollout's proposal (``kl [B_rollout, T]``, 0 until a step is scored in this rollout)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kl = torch.zeros(self.trajectory.batch_size, self.num_positions, dtype=torch.float32)

    def step(self, t, rows, *, grad, reference=False):
        out = super().step(t, rows, grad=grad, reference=reference)
        if not reference:
            old = self.trajectory.position(t, rows)
            if old.mean is None:
                raise ValueError("Flow-DPPO needs the rollout's proposal means (keep_means)")
            kl = kl_gaussian_exact(out.mean.detach(), old.mean.to(out.mean.device), out.std)
            self.kl[rows.cpu(), t] = kl.detach().cpu()
        return out

    def many_fn(self, rows):
        # through step(), so that every re-scored step's KL is recorded
        return lambda ts, b: torch.stack([self.step(t, rows if b is None else rows[b], grad=True).log_prob for t in ts])


class KLMaskedPolicyGradient(PolicyGradient):
    """Flow-DPPO: the ratio-based policy gradient with :class:`KLMaskedSurrogate` in place of the
    clipped surrogate; the rollout keeps its proposal means (``keep_means``) so that every re-scored
    step's KL to it is exact. Logs ``dppo/kl_mean`` and ``dppo/kl_max`` over the trained units
    and ``clip_fraction`` (the share of trained units dropped). No state beyond a rollout."""

    keep_means = True

    def __init__(self, loss):
        super().__init__(loss)
        self.beta, self.kl = loss.beta, loss.kl
        self.rows = None

    @property
    def objective(self):  # the unit objective, for code that reads [loss] directly
        return self.loss.objective

    def start_rollout(self, ctx: UpdateContext, batch: Batch, sizes) -> None:
        super().start_rollout(ctx, batch, sizes)
        self.scorer = _KLRecordingScorer(ctx.model, batch.trajectory, batch.text, ctx.kl.reference, ctx.counter)
        self.sizes = tuple(sizes)
        self.loss.objective.kl_of = lambda: unit_kl(self.scorer.kl[self.rows], self.sizes)

    def backward(self, ctx: UpdateContext, micro: MicroBatch) -> MicroBatchResult:
        self.rows = micro.rows.cpu()
        res = super().backward(ctx, micro)
        kl = unit_kl(self.scorer.kl[self.rows], self.sizes)[res.trained.cpu()]
        metrics = dict(res.metrics)
        metrics["dppo/kl_mean"] = float(kl.mean()) if kl.numel() else 0.0
        metrics["dppo/kl_max"] = float(kl.max()) if kl.numel() else 0.0
        return dataclasses.replace(res, metrics=metrics)

    def end_rollout(self, ctx: UpdateContext, batch: Batch) -> dict:
        self.loss.objective.kl_of = None
        return super().end_rollout(ctx, batch)
