"""Exact chunk-level update with the memory of one step (docs/api.md §5).

The loss depends on the new log-probs only through the unit log-ratios
``z_u = (1/|u|) sum_{i in u} (l_i - l_i^old)``, so by the chain rule

    dL/dtheta = sum_u dL/dz_u * (1/|u|) * sum_{i in u} dl_i/dtheta.

:func:`lean_chunk_backward` uses this unit by unit (chunk by chunk), for the samples that
selected the unit:

1. compute the new log-probs of the unit's positions: all but the last without grad, the last
   WITH grad (its graph is the only one alive), hence ``z_u``;
2. make ``z`` a leaf, evaluate the objective, and get ``dL/dz_u`` by autograd (any objective that
   is elementwise in the units works, not only the clipped surrogate);
3. backpropagate ``sum_b coef[b] * l_t[b]`` with ``coef = dL/dz_u / |u|``: first through the
   graph kept from step 1, then, for each other position, recompute its log-prob WITH grad and
   backpropagate. Samples whose ``coef`` is exactly 0 (clipped, or zero advantage) contribute
   exactly 0 and are not recomputed. Only one step's graph is alive at a time.

The gradients accumulate into ``.grad`` exactly as ``loss.backward()`` of the full graph would
(:func:`full_graph_backward`, same signature, is the reference). Cost: one extra forward without
grad per selected transition that is not the last of its unit, so a unit of size 1 (step-level
GRPO) costs exactly a step-level update and a chunk of ``k`` costs ``k - 1`` extra no-grad
forwards. ``step_log_prob_fn`` must be deterministic: steps 1 and 3 must agree (the
``recompute_mismatch`` metric reports the largest difference over recomputed positions).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from flowrl.chunking import chunk_index, validate_chunks
from flowrl.losses import (
    Objective,
    broadcast_advantages,
    check_unit_mask,
    objective_loss,
    reduce_units,
    unit_log_ratios,
    unit_metrics,
)

__all__ = ["StepLogProbFn", "lean_chunk_backward", "full_graph_backward"]

# (t: position in the trainable sequence, batch_idx: LongTensor [n], grad: bool) -> [n]
StepLogProbFn = Callable[[int, torch.Tensor, bool], torch.Tensor]


def _setup(old_lp, advantages, sizes, unit_mask):
    if old_lp.ndim != 2:
        raise ValueError(f"old_lp must be [B, T], got shape {tuple(old_lp.shape)}")
    B, T = old_lp.shape
    s = validate_chunks(sizes, T)
    old = old_lp.detach().to(torch.float32)
    m = check_unit_mask(unit_mask, B, len(s), old.device)
    uid = chunk_index(s, device=old.device)
    trans = m[:, uid]  # [B, T] selected transitions
    adv = broadcast_advantages(advantages, torch.empty(B, len(s), device=old.device))
    return B, T, s, old, m, uid, trans, adv


def _checked(lp: torch.Tensor, n: int, t: int) -> torch.Tensor:
    if lp.shape != (n,):
        raise ValueError(f"step_log_prob_fn(t={t}) must return [{n}] log-probs, got shape {tuple(lp.shape)}")
    return lp


def lean_chunk_backward(
    step_log_prob_fn: StepLogProbFn,
    old_lp: torch.Tensor,
    advantages: torch.Tensor,
    sizes: Sequence[int],
    unit_mask: torch.Tensor,
    objective: Objective,
    normaliser: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Backpropagate ``reduce_units(objective(z, A), unit_mask, normaliser)`` one step at a time.

    Args:
        step_log_prob_fn: ``(t, batch_idx, grad) -> [len(batch_idx)]`` log-prob of trainable
            position ``t`` (0 <= t < T) for those samples, with gradient iff ``grad``.
        old_lp: ``[B, T]`` rollout log-probs of the trainable transitions.
        advantages: ``[B]`` (or ``[B, K]``).
        sizes: chunk layout summing to ``T``.
        unit_mask: bool ``[B, K]``, at least one unit per sample.
        objective: ``(z [B, K], A [B, K]) -> per-unit loss [B, K]``, elementwise in the units
            (unit ``u``'s loss depends on ``z_u`` and ``A_u`` only), e.g.
            :class:`flowrl.losses.ClippedObjective`; checked at the end.
        normaliser: divides the sum over samples (default ``B``).

    Returns:
        ``(loss, metrics)``: the detached loss value and :func:`flowrl.losses.unit_metrics`
        plus ``recompute_mismatch``. Gradients are accumulated into the parameters' ``.grad``.
    """
    B, T, s, old, m, uid, trans, adv = _setup(old_lp, advantages, sizes, unit_mask)

    def units_grad(new_lp):
        # dL/dz on the whole [B, K] matrix; column u is final once unit u has been scored
        z = unit_log_ratios(new_lp, old, s)
        z = torch.where(m, z, torch.zeros_like(z)).detach().requires_grad_(True)
        with torch.enable_grad():
            loss = reduce_units(objective(z, adv), m, normaliser)
            (dz,) = torch.autograd.grad(loss, z)
        return z, loss, dz

    new = old.clone()
    dz_used = torch.zeros(B, len(s), dtype=torch.float32, device=old.device)
    mismatch, first = 0.0, 0
    for u, size in enumerate(s):
        idx = torch.nonzero(m[:, u], as_tuple=False).flatten()
        if idx.numel():
            dz_used[:, u], unit_mismatch = _backward_unit(step_log_prob_fn, units_grad, new, idx, u, first, size)
            mismatch = max(mismatch, unit_mismatch)
        first += size

    z, loss, dz = units_grad(new)
    # equal_nan: a diverged model gives NaN log-probs; the caller's finiteness check handles that
    if not torch.allclose(dz, dz_used, rtol=1e-5, atol=0.0, equal_nan=True):
        raise ValueError(
            "the objective is not elementwise in the units: a unit's dL/dz changed once later units "
            "were scored, so the gradient accumulated unit by unit is wrong; use full_graph_backward"
        )
    metrics = unit_metrics(z.detach(), adv, m, objective)
    metrics["recompute_mismatch"] = mismatch
    return loss.detach(), metrics


def _with_grad(step_log_prob_fn: StepLogProbFn, t: int, idx: torch.Tensor) -> torch.Tensor:
    with torch.enable_grad():
        lp = _checked(step_log_prob_fn(t, idx, True), idx.numel(), t)
    if not lp.requires_grad:
        raise ValueError(f"step_log_prob_fn(t={t}, grad=True) returned a tensor without gradient; nothing to train")
    return lp


def _backward_unit(step_log_prob_fn, units_grad, new, idx, u, first, size) -> tuple[torch.Tensor, float]:
    """Steps 1-3 of the module docstring for unit ``u`` (positions ``first .. first + size - 1``)
    and the samples ``idx`` that selected it; fills ``new`` with their log-probs and returns
    (``dL/dz`` column ``u`` as used, the largest recompute mismatch)."""
    last = first + size - 1
    # 1. the unit's log-probs: the others without grad, the last with grad (kept)
    with torch.no_grad():
        for t in range(first, last):
            new[idx, t] = _checked(step_log_prob_fn(t, idx, False), idx.numel(), t).detach().to(torch.float32)
    lp = _with_grad(step_log_prob_fn, last, idx)
    new[idx, last] = lp.detach().to(torch.float32)
    # 2. dL/dz_u
    _, _, dz = units_grad(new)
    coef = dz[idx, u] / size
    live = coef != 0
    # 3. backward through the kept graph, then recompute the other positions one at a time;
    # a unit clipped (or with zero advantage) for every sample has exactly zero gradient
    if not bool(live.any()):
        return dz[:, u], 0.0
    with torch.enable_grad():
        (coef.to(lp.dtype) * lp).sum().backward()
    del lp  # free the graph before the next forward (the memory of one step)
    sub, c, mismatch = idx[live], coef[live], 0.0
    for t in range(first, last):
        lp = _with_grad(step_log_prob_fn, t, sub)
        with torch.enable_grad():
            (c.to(lp.dtype) * lp).sum().backward()
        mismatch = max(mismatch, float((lp.detach().to(torch.float32) - new[sub, t]).abs().max()))
        del lp
    return dz[:, u], mismatch


def full_graph_backward(
    step_log_prob_fn: StepLogProbFn,
    old_lp: torch.Tensor,
    advantages: torch.Tensor,
    sizes: Sequence[int],
    unit_mask: torch.Tensor,
    objective: Objective,
    normaliser: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Reference for :func:`lean_chunk_backward`: every selected transition's graph kept alive,
    :func:`flowrl.losses.objective_loss` on them, one ``loss.backward()``. Same arguments and
    return value (``recompute_mismatch`` is 0)."""
    _, T, s, old, m, _, trans, _ = _setup(old_lp, advantages, sizes, unit_mask)
    with torch.enable_grad():
        cols = []
        for t in range(T):
            idx = torch.nonzero(trans[:, t], as_tuple=False).flatten()
            col = old[:, t]
            if idx.numel():
                lp = _checked(step_log_prob_fn(t, idx, True), idx.numel(), t).to(torch.float32)
                col = col.index_put((idx,), lp)
            cols.append(col)
        loss, metrics = objective_loss(torch.stack(cols, dim=1), old, advantages, s, m, objective, normaliser)
        loss.backward()
    metrics["recompute_mismatch"] = 0.0
    return loss.detach(), metrics
