"""The final image's likelihood, estimated by the flow-matching ELBO, as a policy gradient's
log-probability (``[likelihood] use = "elbo"``; docs/objectives.md, "The likelihood estimator").

A rollout's log-probability is usually read off its SDE trajectory (``trajectory``: one Gaussian
transition per step). "Rethinking the Design Space of RL for Diffusion Models" (ICML 2026,
jaemoo-choi/rethinking-diffusion-rl) and V-GRPO (arXiv 2604.23380) estimate it from the final
image alone, by the evidence lower bound of the flow-matching model: for the clean latent ``x0``
of a sample, ``K`` noise levels ``sigma_k`` and noises ``eps_k``, ``x_k = (1 - sigma_k) x0 +
sigma_k eps_k`` and the velocity ``v_k = v_theta(x_k, sigma_k)``::

    x0_hat_k = x_k - sigma_k v_k                                      (the predicted clean latent)
    adaptive:  l_k = -mean((x0_hat_k - x0)^2) / sg(max(mean|x0_hat_k - x0|, w_min))   (the default)
    uniform:   l_k = -mean((v_k - (eps_k - x0))^2)
    sigma:     l_k = -mean((x0_hat_k - x0)^2)          (= -sigma_k^2 mean((v_k - (eps_k - x0))^2))
    exact:     l_k = -(1 - sigma_k) / (sigma_k + 1e-3) mean((v_k - (eps_k - x0))^2)

(``mean`` over the latent's elements; the adaptive weight is computed in float64 and detached).
The same ``(sigma_k, eps_k)`` score the old and the current policy, so their difference
``z_k = l_k(theta) - sg(l_k(theta_old))`` is a low-variance log-ratio. A unit is one point
(``units = "point"``: ``K`` ratios per sample, the Rethinking code's per-timestep loss) or the
whole sample (``units = "sample"``: ``z = mean_k z_k``, generation as one action, V-GRPO's form).
The ``[loss]``'s unit objective (``clipped``, ``epg``, ``pepg``, ``par``, ``vgrpo``) maps each unit's
``z`` and advantage to a loss, averaged over the sample's units and summed over samples.

Because no trajectory log-probabilities are needed, the rollout can be an ODE with few steps
(``[window] use = "ode"``); the points sit on the sampling schedule's sigmas. The old policy is
a trailing copy of the weights, ``theta_old <- d theta_old + (1 - d) theta`` after each rollout
(NFT's decay types, :mod:`flowrl.objectives.old_policy`), and the rollouts are drawn with it. Its
forward is skipped, and ``l(theta_old)`` taken from the current forward, while its values are
those of the current weights (decay 0 and no optimizer step yet in this rollout): on-policy, the
estimator costs one forward and one backward per point.

Flow-DPPO's trust region (``[loss] use = "dppo"``) is measured at the same points: a unit's
divergence from the rollout (old) policy is the velocity KL ``mean((v_theta - v_old)^2)`` of its
points (their mean for ``units = "sample"``), the surrogate NFT and the Rethinking code use for a
flow's KL (Girsanov's KL rate between the two flows, up to a weight in sigma); a unit at or past
``kl_threshold`` whose ratio moves further in its advantage's direction is dropped
(:func:`flowrl.objectives.dppo.dppo_drop_mask`). While the old weights equal the trained ones the
divergence is 0 and nothing is dropped.

Variance reductions: ``noise = "group"`` gives every sample of a prompt group the same points
(V-GRPO's group-shared timestep-noise pairs, so that the group's advantages compare likelihoods
measured alike); ``stratified = true`` draws one sigma per stratum of the schedule.
"""

from __future__ import annotations

import math

import torch

from flowrl.batch import Batch
from flowrl.interfaces import select_embeddings
from flowrl.objectives.base import MicroBatch, MicroBatchResult, UpdateContext
from flowrl.objectives.dppo import KLMaskedSurrogate
from flowrl.objectives.forward_process import forward_process_points, velocity_kl
from flowrl.objectives.old_policy import TrailingPolicy, WithTrailingPolicy, side_velocities

__all__ = ["WEIGHTINGS", "UNITS", "elbo_log_likelihood", "ElboPolicyGradient"]

#: the ELBO's weightings of the per-point error (the Rethinking code's ``adaptive``, ``uniform``, ``t``, ``exact``)
WEIGHTINGS = ("adaptive", "uniform", "sigma", "exact")
#: what one ratio covers: a point (sample, sigma) or the whole sample
UNITS = ("point", "sample")


def _col(t, x):
    t = torch.as_tensor(t, dtype=torch.float32, device=x.device)
    if t.ndim == 0:
        t = t.expand(x.shape[0])
    return t.reshape(-1, *([1] * (x.ndim - 1)))


def elbo_log_likelihood(v: torch.Tensor, x: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor, sigma, *,
                        weighting: str = "adaptive", weight_min: float = 1e-5) -> torch.Tensor:
    """The per-point ELBO term ``l [N]`` (float32; module docstring). ``v [N, ...]`` carries the
    gradient; ``x``, ``x0``, ``eps`` are used detached; ``sigma`` is a number or ``[N]``."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    vv = v.to(torch.float32)
    xx, x0d, ee = (t.detach().to(torch.float32) for t in (x, x0, eps))
    if not (vv.shape == xx.shape == x0d.shape == ee.shape) or vv.ndim < 2:
        raise ValueError(f"v, x, x0 and eps must be [N, ...] of one shape, got {tuple(vv.shape)}, {tuple(xx.shape)}, "
                         f"{tuple(x0d.shape)}, {tuple(ee.shape)}")
    s = _col(sigma, vv)
    if weighting in ("adaptive", "sigma"):
        err = ((xx - s * vv) - x0d).reshape(vv.shape[0], -1)
        mse = (err**2).mean(dim=1)
        if weighting == "sigma":
            return -mse
        w = err.detach().to(torch.float64).abs().mean(dim=1).clamp(min=weight_min)
        return -mse / w.to(torch.float32)
    mse = ((vv - (ee - x0d)) ** 2).reshape(vv.shape[0], -1).mean(dim=1)
    if weighting == "uniform":
        return -mse
    sig = s.reshape(-1)
    return -(1.0 - sig) / (sig + 1e-3) * mse


class ElboPolicyGradient(WithTrailingPolicy):
    """A ``[loss]``'s unit objective on the ELBO log-ratio (module docstring): the objective a
    ratio-based loss runs as under ``[likelihood] use = "elbo"``.

    Per micro-batch: the points of its samples (:func:`forward_process_points`, tag ``"elbo"``,
    per sample or per prompt group), the old policy's ``l`` (a forward with the old weights
    swapped in, or the current forward's own value while they are equal), one forward with grad,
    the loss's unit objective on ``z``, plus ``beta_kl`` times the velocity KL to the reference."""

    uses_units = False
    keep_means = False

    def __init__(self, loss, *, timesteps: int, weighting: str = "adaptive", units: str = "point",
                 noise: str = "sample", stratified: bool = False, decay_type: int = 1, beta_kl: float = 0.0,
                 weight_min: float = 1e-5):
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
        if units not in UNITS:
            raise ValueError(f"units must be one of {UNITS}, got {units!r}")
        if noise not in ("sample", "group"):
            raise ValueError(f"noise must be 'sample' or 'group', got {noise!r}")
        if not (isinstance(beta_kl, (int, float)) and math.isfinite(beta_kl) and beta_kl >= 0):
            raise ValueError(f"beta_kl must be a finite number >= 0, got {beta_kl!r}")
        self.unit_objective = loss.objective
        # Flow-DPPO: the unit objective reads each unit's divergence from the old policy (kl_of)
        self.trust_region = isinstance(self.unit_objective, KLMaskedSurrogate)
        self.K, self.weighting, self.units, self.noise = int(timesteps), weighting, units, noise
        self.stratified, self.beta_kl, self.weight_min = stratified, beta_kl, weight_min
        # a loss whose gradient vanishes with the advantage (epg, clipped, vgrpo) skips those samples' forwards
        self.skips_zero_advantage = bool(getattr(loss, "zero_without_advantage", False))
        self.trailing = TrailingPolicy(decay_type)
        self.reference = None

    # ------------------------------------------------------------------ the objective protocol

    def needs_reference(self) -> bool:
        return self.beta_kl > 0

    def prepare(self, ctx: UpdateContext) -> None:
        self.trailing.prepare(ctx.params, ctx.model.denoiser)
        # the engine's reference (NeedsReferencePolicy), fixed before sharding, as NFT's
        self.reference = ctx.kl.reference if self.beta_kl > 0 else None

    def start_rollout(self, ctx: UpdateContext, batch: Batch, sizes) -> None:
        self.trailing.start(ctx.optimizer_steps())

    def backward(self, ctx: UpdateContext, micro: MicroBatch) -> MicroBatchResult:
        batch, device = micro.batch, ctx.device
        adv_all = batch.advantages[micro.rows.to(device)].reshape(len(micro.rows), -1)[:, 0].to(torch.float32)
        # the samples whose gradient is not zero: all, unless the loss's gradient vanishes with the
        # advantage (and no KL term needs them); under FSDP2 every process forwards its whole
        # micro-batch (the others may have work: lockstep), the zero-advantage rows adding nothing
        live = micro.rows
        if self.skips_zero_advantage and self.beta_kl == 0:
            live = micro.rows[(adv_all != 0).cpu()]
        idx = micro.rows if ctx.lockstep is not None else live
        if idx.numel() == 0:
            return MicroBatchResult.without_units(micro, 0.0, {})
        pts = forward_process_points(ctx.seed, "elbo", batch, idx, batch.trajectory.sigmas.to(device), self.K,
                                     by_group=self.noise == "group", stratified=self.stratified)
        K, n = pts.K, int(idx.numel())
        rows_d = pts.rows.to(device)
        text = select_embeddings(batch.text, rows_d)
        adv = batch.advantages[rows_d].reshape(len(pts.rows), -1)[:, 0].to(torch.float32).reshape(n, K)
        minimum = int(live.numel()) * K * ctx.rows_per_sample
        ctx.counter.expect("update", minimum)
        model = ctx.model
        v_old, v_ref = side_velocities(ctx, self.trailing, self.reference, pts.x, pts.sigma, text, minimum)
        old_is_current = v_old is None
        l_old = None if v_old is None else elbo_log_likelihood(
            v_old, pts.x, pts.x0, pts.eps, pts.sigma, weighting=self.weighting, weight_min=self.weight_min)
        with torch.enable_grad():
            v = model.velocity(pts.x, pts.sigma, text).to(torch.float32)
            lp = elbo_log_likelihood(v, pts.x, pts.x0, pts.eps, pts.sigma, weighting=self.weighting,
                                     weight_min=self.weight_min)
            old = lp.detach() if l_old is None else l_old
            z = (lp - old).reshape(n, K)
            a = adv
            divergence = None
            if self.trust_region:
                divergence = (torch.zeros(n, K, device=z.device) if v_old is None
                              else velocity_kl(v.detach(), v_old).reshape(n, K))
            if self.units == "sample":
                z, a = z.mean(dim=1, keepdim=True), adv[:, :1]
                divergence = None if divergence is None else divergence.mean(dim=1, keepdim=True)
            if divergence is not None:
                self.unit_objective.kl_of = lambda: divergence
            per_sample = self.unit_objective(z, a).mean(dim=1)
            total = per_sample
            if v_ref is not None:
                total = total + self.beta_kl * velocity_kl(v, v_ref).reshape(n, K).mean(dim=1)
            scaled = total.sum() / micro.normaliser
            scaled.backward()
        zd = z.detach()
        metrics = {"elbo/log_likelihood": float(lp.detach().mean()), "elbo/ratio_mean": float(torch.exp(zd).mean()),
                   "elbo/log_ratio_abs_max": float(zd.abs().max()),
                   "elbo/old_forward": 0.0 if old_is_current else 1.0}
        if v_ref is not None:
            metrics["elbo/kl_ref"] = float(velocity_kl(v.detach(), v_ref).mean())
        if divergence is not None:
            metrics["dppo/kl_mean"], metrics["dppo/kl_max"] = float(divergence.mean()), float(divergence.max())
            metrics["clip_fraction"] = float(self.unit_objective.clip_mask(zd, a).float().mean())
            self.unit_objective.kl_of = None
        return MicroBatchResult.without_units(micro, float(scaled.detach()), metrics)

    def end_rollout(self, ctx: UpdateContext, batch: Batch) -> dict:
        return {"elbo/decay": self.trailing.end(ctx.optimizer_steps())}
