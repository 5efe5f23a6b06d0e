"""DGPO, Direct Group Preference Optimization (Luo, Hu, Tang; arXiv 2510.08425;
Luo-Yihong/DGPO ``train_sd3_dgpo.py``; docs/objectives.md).

DPO between two GROUPS instead of two samples: a prompt's rollout splits into the samples with a
positive advantage ``G+`` and those with a negative one ``G-``, and the policy maximises
``log sigmoid(R(G+) - R(G-))`` with a group's reward the advantage-weighted sum of its samples'
DPO rewards ``beta (r - e)`` (``e``, ``r``: the policy's and the frozen reference's
flow-matching errors at a point shared by the group). With ``G`` the group size and, per point,

    S = sum_i A_i beta (e_i - r_i) / G            (= R(G-) - R(G+), over the whole group)

the loss ``-log sigmoid(-S)`` has the gradient ``sigmoid(S) beta / G sum_i A_i de_i``. As the
authors' code, the objective back-propagates that gradient without its constant ``beta / G``::

    loss = sg(sigmoid(S)) A_i e_i                  (per sample and point; A clipped to [-C, C])

and, PPO-style, stops the gradient of a point whose ratio ``exp(e_anchor - e)`` to the rollout
policy has left ``[1 - eps, 1 + eps]`` on the advantage's side (``A > 0`` and ratio ``> 1 +
eps``, or ``A < 0`` and ratio ``< 1 - eps``). A velocity KL ``beta_kl mean((v - v_ref)^2)`` to
the reference may be added.

The rollout is drawn by any sampler: DGPO needs no stochastic policy (a deterministic ODE solver,
``[window] use = "ode"``).

:func:`dgpo_group_sums` and :func:`dgpo_point_loss` are the pure float32 maths;
:class:`GroupPreference` is the objective the ``dgpo`` loss runs as.
"""

from __future__ import annotations

import math

import torch

from flowrl.batch import Batch
from flowrl.interfaces import select_embeddings
from flowrl.objectives.base import MicroBatch, MicroBatchResult, UpdateContext
from flowrl.objectives.forward_process import velocity_kl
from flowrl.objectives.preference import RolloutErrors, flow_error, selected_points

__all__ = ["dgpo_terms", "dgpo_group_sums", "dgpo_point_loss", "GroupPreference"]


def _check_positive(name: str, x) -> None:
    if not (isinstance(x, (int, float)) and math.isfinite(x) and x > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {x!r}")


def dgpo_terms(delta: torch.Tensor, advantages: torch.Tensor, group_size: torch.Tensor, beta: float) -> torch.Tensor:
    """Each sample's share of its group's sum, ``A beta delta / G`` ``[N, K]`` (float32), with
    ``delta = e - r`` ``[N, K]``, ``advantages`` and ``group_size`` ``[N]``."""
    _check_positive("beta", beta)
    d = delta.detach().to(torch.float32)
    a = torch.as_tensor(advantages, dtype=torch.float32, device=d.device).reshape(-1, 1)
    n = torch.as_tensor(group_size, dtype=torch.float32, device=d.device).reshape(-1, 1)
    if d.ndim != 2 or a.shape[0] != d.shape[0] or n.shape[0] != d.shape[0]:
        raise ValueError(f"delta must be [N, K] and advantages, group sizes [N], got {tuple(d.shape)}, "
                         f"{tuple(a.shape)}, {tuple(n.shape)}")
    return a * beta * d / n


def dgpo_group_sums(terms: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """``S`` per sample ``[N, K]``: the sum of :func:`dgpo_terms` over its group, per point."""
    g = torch.as_tensor(groups).reshape(-1)
    _, inverse = torch.unique(g, return_inverse=True)
    sums = torch.zeros(int(inverse.max()) + 1, terms.shape[1], dtype=terms.dtype, device=terms.device)
    sums.index_add_(0, inverse.to(terms.device), terms)
    return sums[inverse.to(terms.device)]


def dgpo_point_loss(err: torch.Tensor, anchor: torch.Tensor, group_sum: torch.Tensor, advantages: torch.Tensor, *,
                    clip_range: float, adv_clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss [n, K], clipped [n, K] bool)``: ``sg(sigmoid(S)) A e`` per point with ``A`` clipped to
    ``[-adv_clip, adv_clip]``, the gradient of ``e`` stopped where the ratio ``exp(anchor - e)``
    has left ``[1 - clip_range, 1 + clip_range]`` on the advantage's side (module docstring).
    ``err`` carries the gradient; ``anchor`` and ``group_sum`` are used detached."""
    _check_positive("adv_clip", adv_clip)
    if not (isinstance(clip_range, (int, float)) and math.isfinite(clip_range) and clip_range >= 0):
        raise ValueError(f"clip_range must be a finite number >= 0, got {clip_range!r}")
    e = err.to(torch.float32)
    old = torch.as_tensor(anchor, dtype=torch.float32, device=e.device).detach()
    s = torch.as_tensor(group_sum, dtype=torch.float32, device=e.device).detach()
    if e.ndim != 2 or old.shape != e.shape or s.shape != e.shape:
        raise ValueError(f"errors, anchors and group sums must be [n, K] alike, got {tuple(e.shape)}, "
                         f"{tuple(old.shape)}, {tuple(s.shape)}")
    a = torch.as_tensor(advantages, dtype=torch.float32, device=e.device).reshape(-1, 1).clamp(-adv_clip, adv_clip)
    ratio = torch.exp(old - e.detach())
    clipped = torch.where(a > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
    e_used = torch.where(clipped, e.detach(), e)
    return torch.sigmoid(s) * a * e_used, clipped


class GroupPreference:
    """DGPO on the rollout's clean samples, likelihood-free.

    Per sample ``K`` points shared by its group (seeded by (seed, "dgpo", iteration, group)). Once
    per rollout every trained point's error under the rollout policy (the anchor) and the frozen
    reference is taken and gathered (:class:`flowrl.objectives.preference.RolloutErrors`); in a
    micro-batch a sample's group sum ``S`` uses its own current error and its mates' anchors
    (exact on the on-policy first step), and its ratio is to its own anchor. Trained: the
    samples with a non-zero advantage (all of them with a KL term). No state across iterations."""

    uses_units = False
    keep_means = False

    def __init__(self, *, beta: float, timesteps: int, leading_steps: int, clip_range: float, adv_clip: float,
                 beta_kl: float):
        self.beta, self.K, self.leading = beta, timesteps, leading_steps
        self.clip_range, self.adv_clip, self.beta_kl = clip_range, adv_clip, beta_kl
        self.reference = None
        self.errors: RolloutErrors | None = None
        self.sums = self.terms = self.sizes = None

    def needs_reference(self) -> bool:
        return True

    def prepare(self, ctx: UpdateContext) -> None:
        self.reference = ctx.kl.reference

    def _trained(self, adv: torch.Tensor) -> torch.Tensor:
        return adv != 0 if self.beta_kl == 0 else torch.ones_like(adv, dtype=torch.bool)

    def start_rollout(self, ctx: UpdateContext, batch: Batch, sizes) -> None:
        adv, groups = RolloutErrors.gathered(ctx, batch)
        offset = ctx.process.rank * ctx.samples_per_process
        trained = self._trained(adv[offset : offset + len(batch.indices)])
        errs = RolloutErrors.measure(ctx, batch, "dgpo", self.K, self.leading, trained, self.reference)
        a = errs.advantages.clamp(-self.adv_clip, self.adv_clip)
        self.sizes = errs.group_size()
        # an untrained sample has A = 0 (or its errors are 0): it adds nothing to its group's sum
        self.terms = dgpo_terms(errs.policy - errs.reference, a * errs.trained, self.sizes, self.beta)
        self.sums = dgpo_group_sums(self.terms, errs.groups)
        self.errors = errs

    def backward(self, ctx: UpdateContext, micro: MicroBatch) -> MicroBatchResult:
        batch, device, errs = micro.batch, ctx.device, self.errors
        selected = selected_points(ctx, micro, "dgpo", micro.rows[errs.trained[micro.rows + errs.offset]], self.K,
                                   self.leading)
        if selected is None:
            return MicroBatchResult.without_units(micro)
        rows, stand_in, pts = selected
        n, K = len(rows), pts.K
        if not stand_in:
            ctx.counter.expect("update", n * K * ctx.rows_per_sample)
        text = select_embeddings(batch.text, pts.rows.to(device))
        v_ref = None
        if self.beta_kl > 0:
            if not stand_in:
                ctx.counter.expect("reference", n * K * ctx.rows_per_sample)
            with ctx.counter.phase("reference"):
                v_ref = self.reference.velocity(pts.x, pts.sigma, text).to(torch.float32)
        g = rows + errs.offset
        a = errs.advantages[g].clamp(-self.adv_clip, self.adv_clip)
        with torch.enable_grad():
            v = ctx.model.velocity(pts.x, pts.sigma, text).to(torch.float32)
            e = flow_error(v, pts.x0, pts.eps).reshape(n, K)
            own = dgpo_terms(e.detach().cpu() - errs.reference[g], a, self.sizes[g], self.beta)
            s = self.sums[g] - self.terms[g] + own  # the mates' anchors, the sample's current error
            pl, clipped = dgpo_point_loss(e, errs.policy[g].to(device), s.to(device), a.to(device),
                                          clip_range=self.clip_range, adv_clip=self.adv_clip)
            total = pl.mean(dim=1)
            if v_ref is not None:
                total = total + self.beta_kl * velocity_kl(v, v_ref).reshape(n, K).mean(dim=1)
            scaled = total.sum() / micro.normaliser * (0.0 if stand_in else 1.0)
            scaled.backward()
        if stand_in:
            return MicroBatchResult.without_units(micro)
        z = errs.policy[g] - e.detach().cpu()
        metrics = {"dgpo/fm_loss": float(e.detach().mean()), "dgpo/weight_mean": float(torch.sigmoid(s).mean()),
                   "dgpo/clip_fraction": float(clipped.float().mean()), "dgpo/log_ratio_abs_max": float(z.abs().max())}
        if v_ref is not None:
            metrics["dgpo/kl_ref"] = float(velocity_kl(v.detach(), v_ref).mean())
        return MicroBatchResult.without_units(micro, float(scaled.detach()), metrics)

    def end_rollout(self, ctx: UpdateContext, batch: Batch) -> dict:
        self.errors = self.sums = self.terms = self.sizes = None
        return {}
