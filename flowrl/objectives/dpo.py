"""Online DPO for flow models: Diffusion-DPO (Wallace et al., arXiv 2311.12908) on the
flow-matching error, with the pairs formed inside each prompt group of a rollout (as Flow-Factory
and VeRL-Omni run it online; docs/objectives.md).

Per prompt group the sample with the highest advantage is the winner ``w`` and the one with the
lowest the loser ``l`` (no pair when they are equal). Both are noised alike (the same sigma and
noise, :func:`flowrl.objectives.preference.group_points`) and, with ``e`` the policy's
flow-matching error and ``r`` the frozen reference's at a point::

    m    = (e_w - r_w) - (e_l - r_l)
    loss = -log sigmoid(-beta / 2 * m) = softplus(beta / 2 * m)       (per point, mean over K)

Descent lowers the winner's error relative to the reference and raises the loser's, and stops
pushing once the margin is large (``sigmoid`` saturates): the reference keeps the policy near.

:func:`dpo_point_loss` is the pure float32 maths; :class:`OnlineDPO` is the objective the ``dpo``
loss runs as: each member of a pair is forwarded where its row falls, with its partner's error
under the rollout policy (:class:`flowrl.objectives.preference.RolloutErrors`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from flowrl.batch import Batch
from flowrl.interfaces import select_embeddings
from flowrl.objectives.base import MicroBatch, MicroBatchResult, UpdateContext
from flowrl.objectives.preference import RolloutErrors, flow_error, selected_points

__all__ = ["best_worst_pairs", "dpo_point_loss", "OnlineDPO"]


def best_worst_pairs(advantages: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partner [N] long, winner [N] bool)``: per group, the first sample of highest advantage
    is paired with the first of lowest (partner ``-1``: not in a pair; no pair in a group whose
    advantages are all equal)."""
    a = torch.as_tensor(advantages, dtype=torch.float32).reshape(-1)
    g = torch.as_tensor(groups).reshape(-1)
    if a.shape != g.shape:
        raise ValueError(f"advantages and groups must be [N] alike, got {tuple(a.shape)} and {tuple(g.shape)}")
    partner = torch.full_like(g, -1, dtype=torch.long)
    winner = torch.zeros(a.shape, dtype=torch.bool)
    for gid in torch.unique(g).tolist():
        members = torch.nonzero(g == gid, as_tuple=False).flatten()
        vals = a[members]
        hi, lo = members[int(torch.argmax(vals))], members[int(torch.argmin(vals))]
        if not a[hi] > a[lo]:
            continue
        partner[hi], partner[lo], winner[hi] = lo, hi, True
    return partner, winner


def dpo_point_loss(err: torch.Tensor, ref_err: torch.Tensor, partner_err: torch.Tensor, partner_ref_err: torch.Tensor,
                   winner: torch.Tensor, beta: float) -> torch.Tensor:
    """``softplus(beta / 2 * m)`` per point (module docstring), float32, ``err``'s shape ``[n, K]``.
    ``err`` carries the gradient; the other errors are used detached; ``winner`` (bool ``[n]``)
    says which side of the pair each row is."""
    if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta > 0):
        raise ValueError(f"beta must be a finite number > 0, got {beta!r}")
    e = err.to(torch.float32)
    parts = [torch.as_tensor(t, dtype=torch.float32, device=e.device).detach() for t in (ref_err, partner_err, partner_ref_err)]
    if any(p.shape != e.shape for p in parts) or e.ndim != 2:
        raise ValueError(f"errors must be [n, K] alike, got {[tuple(t.shape) for t in (e, *parts)]}")
    r, pe, pr = parts
    w = torch.as_tensor(winner, device=e.device).reshape(-1, 1).to(torch.bool)
    own, other = e - r, pe - pr
    m = torch.where(w, own - other, other - own)
    return F.softplus(0.5 * beta * m)


class OnlineDPO:
    """Online Diffusion-DPO on the rollout's clean samples, likelihood-free (any sampler draws the
    rollout). Pairs: the best and the worst sample of each group (:func:`best_worst_pairs`);
    ``K`` points per pair shared by its two samples (seeded by (seed, "dpo", iteration, group));
    the frozen reference is the engine's (the model before RL; the base with LoRA adapters
    disabled). Only the samples in a pair are forwarded. A pair's loss is
    :func:`dpo_point_loss`, each of its samples contributing the term of its own error with the
    other's at the rollout policy (exact on the on-policy first step; module
    :mod:`flowrl.objectives.preference`). The per-micro-batch loss is the sum over its paired
    samples divided by the step's samples. No state across iterations."""

    uses_units = False
    keep_means = False

    def __init__(self, *, beta: float, timesteps: int, leading_steps: int = 0):
        self.beta, self.K, self.leading = beta, timesteps, leading_steps
        self.reference = None
        self.errors: RolloutErrors | None = None
        self.partner = self.winner = None

    def needs_reference(self) -> bool:
        return True

    def prepare(self, ctx: UpdateContext) -> None:
        self.reference = ctx.kl.reference

    def start_rollout(self, ctx: UpdateContext, batch: Batch, sizes) -> None:
        adv, groups = RolloutErrors.gathered(ctx, batch)
        self.partner, self.winner = best_worst_pairs(adv, groups)
        offset = ctx.process.rank * ctx.samples_per_process
        trained = self.partner[offset : offset + len(batch.indices)] >= 0
        self.errors = RolloutErrors.measure(ctx, batch, "dpo", self.K, self.leading, trained, self.reference)

    def backward(self, ctx: UpdateContext, micro: MicroBatch) -> MicroBatchResult:
        batch, device, errs = micro.batch, ctx.device, self.errors
        selected = selected_points(ctx, micro, "dpo", micro.rows[self.partner[micro.rows + errs.offset] >= 0], self.K,
                                   self.leading)
        if selected is None:
            return MicroBatchResult.without_units(micro)
        rows, stand_in, pts = selected
        if not stand_in:
            ctx.counter.expect("update", len(pts.rows) * ctx.rows_per_sample)
        text = select_embeddings(batch.text, pts.rows.to(device))
        g = rows + errs.offset
        mate = self.partner[g].clamp(min=0)
        with torch.enable_grad():
            v = ctx.model.velocity(pts.x, pts.sigma, text)
            e = flow_error(v, pts.x0, pts.eps).reshape(len(rows), pts.K)
            pl = dpo_point_loss(e, errs.reference[g].to(device), errs.policy[mate].to(device),
                                errs.reference[mate].to(device), self.winner[g], self.beta)
            scaled = pl.mean(dim=1).sum() / micro.normaliser * (0.0 if stand_in else 1.0)
            scaled.backward()
        if stand_in:
            return MicroBatchResult.without_units(micro)
        ed, w = e.detach().cpu(), self.winner[g]
        own = ed - errs.reference[g]
        m = torch.where(w.reshape(-1, 1), own - (errs.policy[mate] - errs.reference[mate]),
                        (errs.policy[mate] - errs.reference[mate]) - own)
        metrics = {"dpo/loss": float(pl.detach().mean()), "dpo/margin": float(m.mean()),
                   "dpo/accuracy": float((m < 0).float().mean()), "dpo/fm_loss": float(ed.mean())}
        return MicroBatchResult.without_units(micro, float(scaled.detach()), metrics)

    def end_rollout(self, ctx: UpdateContext, batch: Batch) -> dict:
        pairs = int(self.winner.sum()) if self.winner is not None else 0
        self.errors, self.partner, self.winner = None, None, None
        return {"dpo/pairs": float(pairs)}
