"""Group-relative advantages (docs/api.md §7).

``A = clip((r - mean_g) / (std + eps), -clip, clip)`` within each group ``g`` of samples that
share a prompt (``group_ids``). Options, each an anchor's choice:

- ``std="unbiased"`` (``/ (n - 1)``), ``eps=1e-8``: DanceGRPO, MixGRPO, GCPO (defaults here);
- ``std="biased"`` (``/ n``), ``eps=1e-4``, ``global_std=True`` (std of ALL rewards in the
  batch, centred on the batch mean): Flow-GRPO's default.

A group whose rewards are all equal gets exactly 0 (never NaN, also with ``eps=0``). A group
of size 1 is such a group, so it gets 0 (its unbiased std is undefined). Statistics are
computed in float64 and the result returned in float32.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from flowrl.errors import FlowrlError

__all__ = [
    "group_means",
    "group_zscore",
    "weighted_sum_rewards",
    "combine_group_advantages",
    "advantages_for",
]

_STDS = ("unbiased", "biased")


def _check_rewards(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r = torch.as_tensor(rewards)
    g = torch.as_tensor(group_ids)
    if r.ndim != 1 or r.numel() < 1:
        raise ValueError(f"rewards must be a non-empty 1-D tensor [B], got shape {tuple(r.shape)}")
    if g.shape != r.shape:
        raise ValueError(f"group_ids must be [B] = {tuple(r.shape)} like rewards, got {tuple(g.shape)}")
    if g.is_floating_point() or g.dtype == torch.bool:
        raise ValueError(f"group_ids must be integers, got dtype {g.dtype}")
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards must be finite, got NaN or inf")
    return r, g.to(device=r.device, dtype=torch.long)


def group_means(values: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Each sample's group mean ``[B]`` (float64) of ``values [B]``: the group's float64 sum over
    its size, groups given by ``group_ids [B]`` (any integers). The one group mean of the
    advantages (the z-score, GARDO's ``r - mean`` and its diversity multipliers)."""
    v = torch.as_tensor(values).reshape(-1).to(torch.float64)
    _, inv = torch.unique(torch.as_tensor(group_ids).reshape(-1).to(v.device), return_inverse=True)
    n_groups = int(inv.max()) + 1
    sums = torch.zeros(n_groups, dtype=torch.float64, device=v.device).index_add_(0, inv, v)
    return (sums / torch.bincount(inv, minlength=n_groups).to(torch.float64))[inv]


def group_zscore(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    std: str = "unbiased",
    eps: float = 1e-8,
    global_std: bool = False,
    clip: float | None = 5.0,
) -> torch.Tensor:
    """Group z-score of ``rewards [B]`` with groups ``group_ids [B]`` (any integers).

    ``A_b = (r_b - mean_{g(b)}) / (std + eps)``, ``std`` of the group (or of the whole batch when
    ``global_std``), ``"unbiased"`` or ``"biased"``; then clamped to ``[-clip, clip]``
    (``clip=None``: no clamp). All-equal groups (and groups of one) -> exactly 0.
    Returns float32 ``[B]`` on the rewards' device.
    """
    if std not in _STDS:
        raise ValueError(f"std must be one of {_STDS}, got {std!r}")
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if clip is not None and not (isinstance(clip, (int, float)) and clip > 0):
        raise ValueError(f"clip must be None or a number > 0, got {clip!r}")
    r, g = _check_rewards(rewards, group_ids)
    r = r.to(torch.float64)
    _, inv = torch.unique(g, return_inverse=True)
    n_groups = int(inv.max()) + 1
    counts = torch.bincount(inv, minlength=n_groups).to(torch.float64)
    dev = r - group_means(r, g)
    gmax = torch.full((n_groups,), -math.inf, dtype=torch.float64, device=r.device).scatter_reduce(
        0, inv, r, reduce="amax"
    )
    gmin = torch.full((n_groups,), math.inf, dtype=torch.float64, device=r.device).scatter_reduce(
        0, inv, r, reduce="amin"
    )
    constant = (gmax == gmin)[inv]
    ddof = 1 if std == "unbiased" else 0
    if global_std:
        n = r.numel()
        sd_b = (
            torch.sqrt(((r - r.mean()) ** 2).sum() / (n - ddof)).expand_as(r)
            if n - ddof > 0
            else torch.zeros_like(r)
        )
    else:
        sq = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(0, inv, dev**2)
        denom = (counts - ddof).clamp(min=1.0)  # size-1 groups are constant: masked below
        sd_b = torch.sqrt(sq / denom)[inv]
    den = sd_b + eps
    safe = torch.where(constant | (den == 0), torch.ones_like(den), den)
    adv = torch.where(constant, torch.zeros_like(dev), dev / safe)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return adv.to(torch.float32)


def _check_weights(rewards: Mapping[str, torch.Tensor], weights: Mapping[str, float]) -> None:
    if not rewards:
        raise ValueError("rewards must hold at least one named reward")
    if set(rewards) != set(weights):
        raise ValueError(
            f"weights must name exactly the rewards: rewards {sorted(rewards)}, weights {sorted(weights)}"
        )
    for k, w in weights.items():
        if not (isinstance(w, (int, float)) and math.isfinite(w)):
            raise ValueError(f"weight of reward {k!r} must be a finite number, got {w!r}")


def weighted_sum_rewards(
    rewards: Mapping[str, torch.Tensor], weights: Mapping[str, float]
) -> torch.Tensor:
    """Flow-GRPO-style multi-reward: ``r = sum_k w_k r_k`` on raw rewards; float32 ``[B]``."""
    _check_weights(rewards, weights)
    shapes = {tuple(torch.as_tensor(v).shape) for v in rewards.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(f"every reward must be a tensor [B] of the same B, got shapes {sorted(shapes)}")
    keys = sorted(rewards)
    total = sum(float(weights[k]) * torch.as_tensor(rewards[k]).to(torch.float64) for k in keys)
    return total.to(torch.float32)


def combine_group_advantages(
    rewards: Mapping[str, torch.Tensor],
    group_ids: torch.Tensor,
    weights: Mapping[str, float],
    **zscore_kwargs,
) -> torch.Tensor:
    """MixGRPO-style multi-reward: ``A = sum_k w_k * group_zscore(r_k, group_ids, ...)``.

    Each reward is normalised (and clipped) within its group, then weighted. MixGRPO's weights
    sum to 1; they are used as given (not renormalised). Float32 ``[B]``.
    """
    _check_weights(rewards, weights)
    total = None
    for k in sorted(rewards):
        a = group_zscore(rewards[k], group_ids, **zscore_kwargs).to(torch.float64) * float(weights[k])
        total = a if total is None else total + a
    return total.to(torch.float32)


def advantages_for(estimator, rewards: Mapping[str, torch.Tensor], choices, group_ids: torch.Tensor,
                   num_chunks: int, features: torch.Tensor | None = None) -> torch.Tensor:
    """A run's advantages: ``[S]``, or ``[S, K]`` when a reward weights chunks differently.

    ``estimator`` is the recipe's advantage component, ``choices`` its ``[[rewards]]`` entries
    (label, weight, chunk_weights). With per-chunk weights (``[[rewards]] chunk_weights``, e.g.
    more weight on a preference reward in high-noise chunks and on a structure reward in
    low-noise ones), chunk k's advantage is the estimator's output under chunk k's weights, so
    both multi-reward modes keep their meaning. The loss then pairs each trained chunk with its
    own advantage. ``features`` (``[S, F]``, for an estimator that uses image features, a
    diversity bonus) is passed on as ``features=``.
    """
    extra = {} if features is None else {"features": features}
    if not any(c.chunk_weights for c in choices):
        return estimator(rewards, {c.label: c.weight for c in choices}, group_ids, **extra).float()
    for c in choices:
        if c.chunk_weights and len(c.chunk_weights) != num_chunks:
            raise FlowrlError(
                f"reward '{c.label}' has {len(c.chunk_weights)} chunk_weights but there are {num_chunks} chunks",
                where="[[rewards]].chunk_weights",
                hint="keep the number of chunks fixed (dynamics: num_chunks) or match the weights to it",
            )
    per_chunk = [
        estimator(rewards, {c.label: (c.chunk_weights[k] if c.chunk_weights else c.weight) for c in choices}, group_ids,
                  **extra)
        for k in range(num_chunks)
    ]
    return torch.stack(per_chunk, dim=1).float()
