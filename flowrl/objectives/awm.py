"""AWM, Advantage Weighted Matching (arXiv 2509.25050; docs/objectives.md).

AWM trains on the CLEAN samples of a rollout with the pretraining loss itself: the
flow-matching (velocity-regression) loss at fresh noise, weighted by each sample's advantage.
No trajectory log-probs, no units: any sampler (an ODE solver) may draw the rollout. Per sample
and each of ``K`` trained sigmas (the forward process of
:mod:`flowrl.objectives.forward_process`, ``x = (1 - sigma) x0 + sigma eps``), the velocity
target is ``eps - x0`` and the point's "log-probability" is minus its weighted error::

    l = -w(sigma) mean((v_theta(x, sigma) - (eps - x0))^2)          (``uniform``: w = 1)
    l = -sigma ((mean(...) + 1e-10)^p - 1e-10^p) / p                (``ghuber``, power p)

With the anchor ``l_old`` (the point's ``l`` under the rollout's weights, detached) and the
advantage clipped to ``[-C, C]``, each point contributes PPO's clipped surrogate of the ratio
``rho = exp(l - l_old)``, averaged over the sample's ``K`` points::

    loss_b = mean_k max(-A rho, -A clip(rho, 1 - eps, 1 + eps))

On the first, on-policy optimizer step ``rho = 1`` and the gradient is ``A dL_FM / dtheta`` (the
advantage-weighted flow-matching gradient): descent lowers the flow-matching loss of the samples
with ``A > 0`` and raises it for ``A < 0``.

:class:`AdvantageWeightedMatching` is the objective the ``awm`` loss runs as.
"""

from __future__ import annotations

import math

import torch

from flowrl.batch import Batch
from flowrl.interfaces import select_embeddings
from flowrl.objectives.base import MicroBatch, MicroBatchResult, UpdateContext
from flowrl.objectives.forward_process import forward_process_points, velocity_kl
from flowrl.objectives.losses import clipped_surrogate

__all__ = ["WEIGHTINGS", "awm_log_prob", "awm_loss", "AdvantageWeightedMatching"]

#: the per-point weightings of the flow-matching error (the authors' ``uniform``, ``t`` and ``ghuber``)
WEIGHTINGS = ("uniform", "sigma", "ghuber")
_TINY = 1e-10


def awm_log_prob(v: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor, sigma, *, weighting: str = "uniform",
                 power: float = 1.0) -> torch.Tensor:
    """Minus the weighted flow-matching error per point ``[N]`` (float32; module docstring).
    ``v`` carries the gradient; ``x0``, ``eps`` are detached; ``sigma`` is a number or ``[N]``."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    if not (isinstance(power, (int, float)) and math.isfinite(power) and power > 0):
        raise ValueError(f"power must be a finite number > 0, got {power!r}")
    vv = v.to(torch.float32)
    target = eps.detach().to(torch.float32) - x0.detach().to(torch.float32)
    if vv.shape != target.shape or vv.ndim < 2:
        raise ValueError(f"v, x0 and eps must be [N, ...] of one shape, got {tuple(vv.shape)} and {tuple(target.shape)}")
    mse = ((vv - target) ** 2).reshape(vv.shape[0], -1).mean(dim=1)
    s = torch.as_tensor(sigma, dtype=torch.float32, device=vv.device)
    s = s.expand(vv.shape[0]) if s.ndim == 0 else s.reshape(-1)
    if weighting == "uniform":
        return -mse
    if weighting == "sigma":
        return -mse * s
    return -((mse + _TINY) ** power - _TINY**power) * s / power


def awm_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, K: int, *,
             clip_range: float, adv_clip: float) -> torch.Tensor:
    """Per-sample AWM loss ``[N / K]``: PPO's clipped surrogate of ``rho = exp(l - l_old)`` per
    point with the advantage clipped to ``[-adv_clip, adv_clip]``, averaged over each sample's
    ``K`` consecutive points. ``log_prob``, ``old_log_prob``, ``advantages`` are ``[N]`` (one
    advantage per point: its sample's)."""
    if not (isinstance(adv_clip, (int, float)) and adv_clip > 0):
        raise ValueError(f"adv_clip must be a number > 0, got {adv_clip!r}")
    if log_prob.ndim != 1 or log_prob.shape != old_log_prob.shape or log_prob.numel() % K:
        raise ValueError(f"log-probs must be [N] with N a multiple of K = {K}, got {tuple(log_prob.shape)} "
                         f"and {tuple(old_log_prob.shape)}")
    a = torch.as_tensor(advantages, dtype=torch.float32, device=log_prob.device).reshape(-1).clamp(-adv_clip, adv_clip)
    z = log_prob.to(torch.float32) - old_log_prob.detach().to(torch.float32)
    per_point = clipped_surrogate(z, a, clip_range, clip_range)
    return per_point.reshape(-1, K).mean(dim=1)


class AdvantageWeightedMatching:
    """AWM (scxue/advantage_weighted_matching, ``train_sd3_awm.py``), likelihood-free.

    Per micro-batch: the forward-process points of its samples (:func:`forward_process_points`,
    seeded by (seed, "awm", iteration, sample)), one velocity forward with grad, :func:`awm_log_prob`
    and :func:`awm_loss` against each point's anchor, plus ``beta_kl`` times the velocity KL to the
    reference. The anchor of a point is its ``l`` the first time the rollout trains it: on the
    first (on-policy) optimizer step that is the rollout policy's, exactly, at no extra forward.
    Anchors live for one rollout: the objective keeps no state across iterations."""

    uses_units = False
    keep_means = False

    def __init__(self, *, timesteps: int, weighting: str, power: float, clip_range: float, adv_clip: float,
                 beta_kl: float):
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
        self.K, self.weighting, self.power = timesteps, weighting, power
        self.clip_range, self.adv_clip, self.beta_kl = clip_range, adv_clip, beta_kl
        self.reference = None
        self.anchors: dict[int, torch.Tensor] = {}

    def needs_reference(self) -> bool:
        return self.beta_kl > 0

    def prepare(self, ctx: UpdateContext) -> None:
        # the engine's reference (NeedsReferencePolicy), fixed before sharding, as NFT's
        self.reference = ctx.kl.reference if self.beta_kl > 0 else None

    def start_rollout(self, ctx: UpdateContext, batch: Batch, sizes) -> None:
        self.anchors = {}

    def backward(self, ctx: UpdateContext, micro: MicroBatch) -> MicroBatchResult:
        batch, device, idx = micro.batch, ctx.device, micro.rows
        pts = forward_process_points(ctx.seed, "awm", batch, idx, batch.trajectory.sigmas.to(device), self.K)
        rows_d = pts.rows.to(device)
        text = select_embeddings(batch.text, rows_d)
        adv = batch.advantages[rows_d].reshape(len(pts.rows), -1)[:, 0].to(torch.float32)
        live = int((adv != 0).sum()) if self.beta_kl == 0 else len(pts.rows)
        ctx.counter.expect("update", live * ctx.rows_per_sample)
        v_ref = None
        if self.reference is not None:
            ctx.counter.expect("reference", len(pts.rows) * ctx.rows_per_sample)
            with ctx.counter.phase("reference"):
                v_ref = self.reference.velocity(pts.x, pts.sigma, text).to(torch.float32)
        with torch.enable_grad():
            v = ctx.model.velocity(pts.x, pts.sigma, text).to(torch.float32)
            lp = awm_log_prob(v, pts.x0, pts.eps, pts.sigma, weighting=self.weighting, power=self.power)
            old = self._anchor(idx, lp.detach(), pts.K)
            loss = awm_loss(lp, old, adv, pts.K, clip_range=self.clip_range, adv_clip=self.adv_clip)
            total = loss
            if v_ref is not None:
                total = total + self.beta_kl * velocity_kl(v, v_ref).reshape(-1, pts.K).mean(dim=1)
            scaled = total.sum() / micro.normaliser
            scaled.backward()
        z = (lp.detach() - old).reshape(-1)
        metrics = {"awm/fm_loss": float(-lp.detach().mean()), "awm/ratio_mean": float(torch.exp(z).mean()),
                   "awm/log_ratio_abs_max": float(z.abs().max())}
        if v_ref is not None:
            metrics["awm/kl_ref"] = float(velocity_kl(v.detach(), v_ref).mean())
        return MicroBatchResult.without_units(micro, float(scaled.detach()), metrics)

    def _anchor(self, idx: torch.Tensor, lp: torch.Tensor, K: int) -> torch.Tensor:
        """The anchors ``[n K]`` of the rows ``idx``: a row's ``l`` at its first training visit."""
        out = []
        for j, r in enumerate(idx.tolist()):
            if r not in self.anchors:
                self.anchors[r] = lp[j * K : (j + 1) * K].clone()
            out.append(self.anchors[r].to(lp.device))
        return torch.cat(out)

    def end_rollout(self, ctx: UpdateContext, batch: Batch) -> dict:
        self.anchors = {}
        return {}
