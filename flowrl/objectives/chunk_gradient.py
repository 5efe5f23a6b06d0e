"""The chunk-level update: exact gradients, three ways to compute them (docs/api.md §5).

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

Two more ways, same gradients:

- :func:`on_policy_chunk_backward` (the fast path): before the first optimizer step after a
  rollout every ratio is 1, so ``dL/dz`` is known without any forward (``z = 0``). Each selected
  position is forwarded once WITH grad and back-propagated, like a step-level update: a chunk of
  ``k`` costs exactly what ``k`` steps cost, with the memory of one step.
- :func:`chunk_graph_backward`: one graph per unit over its positions (one forward with grad,
  batched over the unit's steps when a batched scorer is given, and one backward), no
  re-scoring: ``k`` times the activation memory of a step, no extra forward.

Both accept ``forward_with_extra(t, idx) -> (log_prob, extra)``: one forward with grad that also
returns a per-sample extra loss term (the KL term, weighted), back-propagated with the policy
loss, so a KL term costs no second policy forward.

Lockstep (FSDP2 over several processes): every forward and backward of a sharded model is a
collective, so every process must make the same calls in the same order, while the rows each
one trains differ (its own samples, chunks and advantages). With ``lockstep`` (a
:class:`Lockstep`), each decision to skip work (no sample selected the unit, every coefficient
is 0) is agreed by all processes; a process that has nothing to do where another has makes the
same calls on one row of its micro-batch (:func:`pad_rows`) with weight 0: its gradient gets
exactly zero from them and its metrics ignore them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from flowrl.chunking import chunk_index, validate_chunks
from flowrl.objectives.losses import (
    UnitObjective,
    broadcast_advantages,
    check_unit_mask,
    objective_loss,
    reduce_units,
    unit_log_ratios,
    unit_metrics,
)

__all__ = [
    "Lockstep",
    "any_process",
    "pad_rows",
    "StepLogProbFn",
    "ForwardWithExtra",
    "lean_chunk_backward",
    "on_policy_chunk_backward",
    "chunk_graph_backward",
    "full_graph_backward",
]

# (t: position in the trainable sequence, batch_idx: LongTensor [n], grad: bool) -> [n]
StepLogProbFn = Callable[[int, torch.Tensor, bool], torch.Tensor]
# (t, batch_idx) -> (log-probs [n] with grad, extra loss [n] with grad, or None); one forward
ForwardWithExtra = Callable[[int, torch.Tensor], "tuple[torch.Tensor, torch.Tensor | None]"]
# (positions, batch_idx) -> log-probs [len(positions), n] with grad, from ONE batched forward;
# batch_idx None: every row of the micro-batch (the usual case needs no index tensor)
ManyStepLogProbFn = Callable[[list[int], "torch.Tensor | None"], torch.Tensor]


class Lockstep(Protocol):
    """``any(flag)``: True when ``flag`` is True on any process (a collective every process calls)."""

    def any(self, flag: bool) -> bool: ...


def any_process(flag: bool, lockstep: Lockstep | None) -> bool:
    """``flag`` as every process in ``lockstep`` agrees it: True when it is True on any of them (a
    collective each one calls, so that a process with nothing to do still makes the calls another
    makes); ``flag`` itself without lockstep."""
    return lockstep.any(flag) if lockstep is not None else flag


def pad_rows(rows: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(rows, False)``, or, for no rows, ``(one row: 0, True)``: the stand-in a process in
    lockstep forwards (with weight 0) where another process has work."""
    return (rows, False) if rows.numel() else (rows.new_zeros(1), True)


def _setup(old_lp, advantages, sizes, unit_mask):
    if old_lp.ndim != 2:
        raise ValueError(f"old_lp must be [B, T], got shape {tuple(old_lp.shape)}")
    B, T = old_lp.shape
    s = validate_chunks(sizes, T)
    old = old_lp.detach().to(torch.float32)
    m = check_unit_mask(unit_mask, B, len(s), old.device)
    adv = broadcast_advantages(advantages, torch.empty(B, len(s), device=old.device))
    return B, T, s, old, m, adv


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
    objective: UnitObjective,
    normaliser: float | None = None,
    *,
    lockstep: Lockstep | None = None,
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
            :class:`flowrl.objectives.losses.ClippedObjective`; checked at the end.
        normaliser: divides the sum over samples (default ``B``).

    Returns:
        ``(loss, metrics)``: the detached loss value and :func:`flowrl.objectives.losses.unit_metrics`
        plus ``recompute_mismatch``. Gradients are accumulated into the parameters' ``.grad``.
    """
    B, T, s, old, m, adv = _setup(old_lp, advantages, sizes, unit_mask)

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
        if any_process(bool(idx.numel()), lockstep):
            dz_used[:, u], unit_mismatch = _backward_unit(step_log_prob_fn, units_grad, new, idx, u, first, size,
                                                          lockstep)
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


def _backward_unit(step_log_prob_fn, units_grad, new, idx, u, first, size, lockstep=None) -> tuple[torch.Tensor, float]:
    """Steps 1-3 of the module docstring for unit ``u`` (positions ``first .. first + size - 1``)
    and the samples ``idx`` that selected it; fills ``new`` with their log-probs and returns
    (``dL/dz`` column ``u`` as used, the largest recompute mismatch). ``idx`` may be empty in
    lockstep: a stand-in row is then forwarded with weight 0."""
    last = first + size - 1
    rows, stand_in = pad_rows(idx)
    # 1. the unit's log-probs: the others without grad, the last with grad (kept)
    with torch.no_grad():
        for t in range(first, last):
            lp = _checked(step_log_prob_fn(t, rows, False), rows.numel(), t)
            if not stand_in:
                new[idx, t] = lp.detach().to(torch.float32)
    lp = _with_grad(step_log_prob_fn, last, rows)
    if not stand_in:
        new[idx, last] = lp.detach().to(torch.float32)
    # 2. dL/dz_u
    _, _, dz = units_grad(new)
    coef = torch.zeros(1, device=dz.device) if stand_in else dz[idx, u] / size
    live = coef != 0
    # 3. backward through the kept graph, then recompute the other positions one at a time;
    # a unit clipped (or with zero advantage) for every sample has exactly zero gradient
    if not any_process(bool(live.any()), lockstep):
        return dz[:, u], 0.0
    with torch.enable_grad():
        (coef.to(lp.dtype) * lp).sum().backward()
    del lp  # free the graph before the next forward (the memory of one step)
    sub, c, mismatch = rows[live], coef[live], 0.0
    sub, idle = pad_rows(sub)  # lockstep: another process recomputes, so this one does too
    if idle:
        c = torch.zeros(1, device=coef.device)
    for t in range(first, last):
        lp = _with_grad(step_log_prob_fn, t, sub)
        with torch.enable_grad():
            (c.to(lp.dtype) * lp).sum().backward()
        if not idle:
            mismatch = max(mismatch, float((lp.detach().to(torch.float32) - new[sub, t]).abs().max()))
        del lp
    return dz[:, u], mismatch


def _units_grad_at(z: torch.Tensor, m, adv, objective, normaliser) -> torch.Tensor:
    """``dL/dz`` of ``reduce_units(objective(z, A))`` at the given ``z`` ``[B, K]``."""
    z = torch.where(m, z, torch.zeros_like(z)).detach().requires_grad_(True)
    with torch.enable_grad():
        (dz,) = torch.autograd.grad(reduce_units(objective(z, adv), m, normaliser), z)
    return dz


def _forward(forward_with_extra, step_log_prob_fn, t, idx):
    """One forward with grad of position ``t`` for rows ``idx``: (log-probs, extra or None)."""
    if forward_with_extra is None:
        return _with_grad(step_log_prob_fn, t, idx), None
    with torch.enable_grad():
        lp, extra = forward_with_extra(t, idx)
    return _checked(lp, idx.numel(), t), extra


def _finish(new, old, s, m, adv, objective, normaliser) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss value and metrics at the new log-probs (no gradient)."""
    z = torch.where(m, unit_log_ratios(new, old, s), torch.zeros(m.shape, device=old.device))
    return _finish_units(z, m, adv, objective, normaliser)


def _finish_units(z, m, adv, objective, normaliser) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss value and metrics at the unit log-ratios ``z`` ``[B, K]`` (0 where unselected)."""
    with torch.no_grad():
        loss = reduce_units(objective(z, adv), m, normaliser)
    metrics = unit_metrics(z, adv, m, objective)
    metrics["recompute_mismatch"] = 0.0
    return loss.detach(), metrics


def on_policy_chunk_backward(
    step_log_prob_fn: StepLogProbFn,
    old_lp: torch.Tensor,
    advantages: torch.Tensor,
    sizes: Sequence[int],
    unit_mask: torch.Tensor,
    objective: UnitObjective,
    normaliser: float | None = None,
    *,
    forward_with_extra: ForwardWithExtra | None = None,
    many: ManyStepLogProbFn | None = None,
    group: int = 1,
    lockstep: Lockstep | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The fast path of :func:`lean_chunk_backward` for the on-policy point (the current weights
    ARE the rollout's: every ratio is 1, ``z = 0``). Same arguments and return value.

    With ``many`` and ``group > 1`` (and no ``forward_with_extra``) up to ``group`` positions of a
    unit go through one batched forward and one backward: the same gradient up to float32
    rounding, ``group`` times the activation memory, and under FSDP2 one weight gather per group
    instead of one per position (``[train].update_group``).

    ``dL/dz`` is taken at ``z = 0`` without any forward; each unit's positions are then forwarded
    once with grad for the samples whose coefficient ``dL/dz_u / |u|`` is not 0 (a zero advantage
    contributes nothing, and nothing is clipped at ratio 1) and back-propagated, in the lean
    update's order: each selected transition with a gradient costs exactly one forward and one
    backward. With ``forward_with_extra`` every selected row is forwarded (the extra term needs
    them all) and ``sum(coef * log_prob + extra)`` is back-propagated. The returned loss and
    metrics are evaluated at the log-probs those forwards produced (rows not forwarded keep
    ``z = 0``).
    """
    B, T, s, old, m, adv = _setup(old_lp, advantages, sizes, unit_mask)
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    width = group if many is not None and forward_with_extra is None else 1  # steps per forward
    dz = _units_grad_at(torch.zeros(B, len(s), device=old.device), m, adv, objective, normaliser)
    new, first = old.clone(), 0
    for u, size in enumerate(s):
        idx = torch.nonzero(m[:, u], as_tuple=False).flatten()
        coef = dz[idx, u] / size
        live = coef != 0
        if any_process(bool(idx.numel()) and (bool(live.any()) or forward_with_extra is not None), lockstep):
            last = first + size - 1
            t_rows, t_coef = (idx, coef) if forward_with_extra is not None else (idx[live], coef[live])
            t_rows, stand_in = pad_rows(t_rows)
            weight = 0.0 if stand_in else 1.0  # a stand-in row (lockstep) contributes nothing
            order = [last, *range(first, last)]  # the lean update's order
            for ts in (order[k : k + width] for k in range(0, size, width)):
                if width > 1:
                    with torch.enable_grad():
                        lps, extras = list(many(ts, t_rows).unbind(0)), [None] * len(ts)
                else:
                    lps, extras = zip(*[_forward(forward_with_extra, step_log_prob_fn, ts[0], t_rows)])
                with torch.enable_grad():
                    total = sum((t_coef.to(lp.dtype) * lp).sum() if not stand_in else 0.0 * lp.sum() for lp in lps)
                    total = total + sum(weight * e.sum() for e in extras if e is not None)
                    total.backward()
                if not stand_in:
                    for t, lp in zip(ts, lps):
                        new[t_rows, t] = lp.detach().to(torch.float32)
                del lps, extras, total  # one group's graph at a time
        first += size
    return _finish(new, old, s, m, adv, objective, normaliser)


def chunk_graph_backward(
    step_log_prob_fn: StepLogProbFn,
    old_lp: torch.Tensor,
    advantages: torch.Tensor,
    sizes: Sequence[int],
    unit_mask: torch.Tensor,
    objective: UnitObjective,
    normaliser: float | None = None,
    *,
    forward_with_extra: ForwardWithExtra | None = None,
    many: ManyStepLogProbFn | None = None,
    lockstep: Lockstep | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Exact at any policy: one graph per unit (its positions forwarded with grad, batched into
    one forward by ``many`` when given), the unit's ``dL/dz`` from those log-probs, one backward.
    No re-scoring; ``|u|`` times the activation memory of one step. Same arguments and return
    value as :func:`lean_chunk_backward` (``many`` is not used with ``forward_with_extra``)."""
    B, T, s, old, m, adv = _setup(old_lp, advantages, sizes, unit_mask)
    # the unit log-ratios [B, K]: 0 (ratio 1) until a unit is scored, as the lean update's
    # z of not-yet-scored units (only z is kept, not a [B, T] copy of the new log-probs)
    z, first = torch.zeros(m.shape, device=old.device), 0
    batched = many is not None and forward_with_extra is None
    for u, size in enumerate(s):
        # every row selects the unit (always so at GCPO's batching, one sample): a slice, and the
        # batched scorer gets None, so no index tensor lives through the unit's forward
        every_row = batched and B > 0 and bool(m[:, u].all())
        idx = slice(None) if every_row else torch.nonzero(m[:, u], as_tuple=False).flatten()
        if any_process(every_row or bool(idx.numel()), lockstep):
            positions = list(range(first, first + size))
            rows, stand_in = (None, False) if every_row else pad_rows(idx)  # lockstep: a stand-in row, weight 0
            if batched:
                with torch.enable_grad():
                    lps, extras = list(many(positions, rows).unbind(0)), [None] * size
            else:
                lps, extras = zip(*(_forward(forward_with_extra, step_log_prob_fn, t, rows) for t in positions))
            if stand_in:
                coef, weight = torch.zeros(1, device=old.device), 0.0
            else:
                new_u = torch.stack([lp.detach() for lp in lps], 1).to(torch.float32)
                z[idx, u] = (new_u - old[idx, first : first + size]).mean(dim=-1)
                coef, weight = _units_grad_at(z, m, adv, objective, normaliser)[idx, u] / size, 1.0
                del new_u
            with torch.enable_grad():
                total = sum((coef.to(lp.dtype) * lp).sum() for lp in lps)
                total = total + sum(weight * e.sum() for e in extras if e is not None)
                total.backward()
            del lps, extras, total, coef  # nothing of this unit lives through the next unit's forward
        first += size
    return _finish_units(z, m, adv, objective, normaliser)


def full_graph_backward(
    step_log_prob_fn: StepLogProbFn,
    old_lp: torch.Tensor,
    advantages: torch.Tensor,
    sizes: Sequence[int],
    unit_mask: torch.Tensor,
    objective: UnitObjective,
    normaliser: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Reference for :func:`lean_chunk_backward`: every selected transition's graph kept alive,
    :func:`flowrl.objectives.losses.objective_loss` on them, one ``loss.backward()``. Same arguments and
    return value (``recompute_mismatch`` is 0)."""
    _, T, s, old, m, _ = _setup(old_lp, advantages, sizes, unit_mask)
    trans = m[:, chunk_index(s, device=old.device)]  # [B, T] selected transitions
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
