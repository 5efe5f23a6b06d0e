"""Importance weights for replayed rollouts (bounded off-policy reuse, ``[replay]``).

A rollout kept from an earlier iteration was sampled by the policy of that iteration (the
behaviour policy, log-probs ``l_b``). Before it is trained on again, its trainable transitions
are re-scored with the current weights (``l_p``, no gradient); that re-scoring becomes the
"old" policy of the replayed update, so the ratio and its clip work as in an on-policy update,
and the distance from the behaviour policy is corrected by a detached weight per unit (or per
sample) that multiplies the advantage:

    log w = mean over the unit's positions of (l_p - l_b)          level "unit"
    log w = mean over the first S positions of (l_p - l_b)          level "sequence"
    w     = min(exp(log w), c)                                       truncation c

The mean (not the sum) of the per-step log-ratios is the unit ratio the objective itself uses
(the chunk ratio of docs/objectives.md, GSPO's length-normalised sequence ratio), so the weight
is at the level the objective works at. ``S`` (``[replay].weight_steps``, 0 = all) leaves the
late, low-noise steps out of the sequence weight. Since the clipped surrogate is positively
homogeneous in the advantage, multiplying A by ``w > 0`` multiplies the unit's loss by ``w``.

Every function is float32 in, float32 out, except the diagnostics' sums (float64).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flowrl.chunking import chunk_mean

__all__ = ["LEVELS", "log_weights", "truncate_weights", "effective_sample_size", "weighted_advantages"]

#: The levels an importance weight can be formed at.
LEVELS = ("unit", "sequence")


def log_weights(current: torch.Tensor, behaviour: torch.Tensor, sizes: Sequence[int], level: str,
                steps: int = 0) -> torch.Tensor:
    """Log importance weights of replayed transitions: ``[B, K]`` (level ``unit``, ``K =
    len(sizes)``) or ``[B]`` (level ``sequence``) from the current and behaviour log-probs
    ``[B, T]`` of the trainable positions. ``steps``: the first positions the sequence weight
    uses (0 = all ``T``)."""
    if current.shape != behaviour.shape or current.ndim != 2:
        raise ValueError(f"log-probs must both be [B, T], got {tuple(current.shape)} and {tuple(behaviour.shape)}")
    diff = current.float() - behaviour.float()
    if level == "unit":
        return chunk_mean(diff, sizes)
    if level == "sequence":
        T = diff.shape[1]
        if not 0 <= steps <= T:
            raise ValueError(f"steps must be in [0, {T}], got {steps}")
        return diff[:, : steps or T].mean(1)
    raise ValueError(f"level must be one of {LEVELS}, got {level!r}")


def truncate_weights(log_w: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min(exp(log_w), cap), truncated)``: the truncated weights and where the cap acted."""
    if not cap > 0:
        raise ValueError(f"the truncation cap must be > 0, got {cap}")
    w = torch.exp(log_w.float())
    truncated = w > cap
    return torch.where(truncated, torch.full_like(w, cap), w), truncated


def effective_sample_size(w: torch.Tensor) -> float:
    """Kish's effective sample size ``(sum w)^2 / sum w^2`` (float64; 0 for no weights): ``n``
    when all weights are equal, towards 1 when one weight dominates."""
    w = w.detach().double().flatten()
    sq = float((w * w).sum())
    return float(w.sum()) ** 2 / sq if sq > 0 else 0.0


def weighted_advantages(advantages: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The advantages a replayed update trains on: ``A w`` with ``A`` ``[B]`` or ``[B, K]`` and
    ``w`` ``[B]`` (sequence) or ``[B, K]`` (unit); per-unit weights make per-unit advantages."""
    if w.ndim == 1:
        return advantages * (w if advantages.ndim == 1 else w[:, None])
    return (advantages[:, None] if advantages.ndim == 1 else advantages) * w
