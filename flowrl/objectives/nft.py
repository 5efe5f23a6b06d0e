"""DiffusionNFT's likelihood-free objective on the forward process (docs/objectives.md).

DiffusionNFT (NVlabs) trains on the CLEAN samples of a rollout and their rewards only: no
trajectory, no log-probs, so any sampler (an ODE solver) may produce them. With the advantage
mapped to an "optimality probability" ``r`` in [0, 1]::

    r = clip(clip(A, -C, C) / (2 C) + 1/2, 0, 1)

and, per sample and trained noise level ``sigma`` (fresh noise ``eps``,
``x = (1 - sigma) x0 + sigma eps``), the current velocity ``v = v_theta(x, sigma)`` and the
old policy's ``v_old`` (no gradient), two implicit policies::

    v+ = beta v + (1 - beta) v_old          (positive)
    v- = (1 + beta) v_old - beta v          (negative)
    x0+- = x - sigma v+-
    L+- = mean((x0+- - x0)^2) / sg(max(mean|x0+- - x0|, w_min))      (adaptive weight)
    loss = C (r L+ + (1 - r) L-) / beta

At ``theta = theta_old`` the gradient is ``C (2r - 1) dL/dv`` whatever ``beta``: descent moves
``v`` towards the data's velocity when ``A > 0`` and away when ``A < 0``. The old parameters
follow the trained ones softly after every iteration, ``theta_old <- d theta_old + (1 - d) theta``
with ``d`` from :func:`old_policy_decay`.

:class:`ForwardProcessObjective` is the objective the ``nft`` loss runs as: it owns its backward
(no trajectory log-probs, no units) and samples with the old weights.
"""

from __future__ import annotations

import math

import torch

from flowrl.batch import Batch
from flowrl.interfaces import select_embeddings
from flowrl.objectives.base import MicroBatch, MicroBatchResult, UpdateContext
from flowrl.objectives.forward_process import forward_process_points, velocity_kl
from flowrl.objectives.old_policy import (
    DECAY_PRESETS,
    TrailingPolicy,
    WithTrailingPolicy,
    old_policy_decay,
    side_velocities,
)

__all__ = ["optimality_probability", "nft_loss", "velocity_kl", "old_policy_decay", "DECAY_PRESETS",
           "ForwardProcessObjective"]

def optimality_probability(advantages: torch.Tensor, clip: float = 5.0) -> torch.Tensor:
    """``r = clip(clip(A, -C, C) / (2 C) + 1/2, 0, 1)`` (float32, ``A``'s shape)."""
    if not (isinstance(clip, (int, float)) and math.isfinite(clip) and clip > 0):
        raise ValueError(f"clip C must be a number > 0, got {clip!r}")
    a = torch.as_tensor(advantages, dtype=torch.float32).clamp(-clip, clip)
    return (a / (2.0 * clip) + 0.5).clamp(0.0, 1.0)


def _col(t, x):
    t = torch.as_tensor(t, dtype=torch.float32, device=x.device)
    if t.ndim == 0:
        t = t.expand(x.shape[0])
    return t.reshape(-1, *([1] * (x.ndim - 1)))


def nft_loss(v: torch.Tensor, v_old: torch.Tensor, x: torch.Tensor, x0: torch.Tensor, sigma, r: torch.Tensor, *,
             beta: float, clip: float = 5.0, weight_min: float = 1e-5) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-sample NFT loss ``[B]`` (module docstring) and its parts ``{"positive", "negative"}``
    (``L+``, ``L-``, detached). ``v`` carries the gradient; ``v_old``, ``x``, ``x0`` are used
    detached; ``sigma`` is a number or ``[B]``; ``r [B]`` the optimality probabilities. The
    adaptive weights are computed in float64 and detached."""
    if not (isinstance(beta, (int, float)) and beta > 0):
        raise ValueError(f"beta must be a number > 0, got {beta!r}")
    vv = v.to(torch.float32)
    vo = v_old.detach().to(torch.float32)
    xx, x0d = x.detach().to(torch.float32), x0.detach().to(torch.float32)
    if not (vv.shape == vo.shape == xx.shape == x0d.shape) or vv.ndim < 2:
        raise ValueError(f"v, v_old, x and x0 must be [B, ...] of one shape, got {tuple(vv.shape)}, "
                         f"{tuple(vo.shape)}, {tuple(xx.shape)}, {tuple(x0d.shape)}")
    s = _col(sigma, xx)
    rr = torch.as_tensor(r, dtype=torch.float32, device=xx.device).reshape(-1)
    parts = {}
    losses = []
    for name, vel in (("positive", beta * vv + (1.0 - beta) * vo), ("negative", (1.0 + beta) * vo - beta * vv)):
        err = (xx - s * vel) - x0d
        flat = err.reshape(err.shape[0], -1)
        w = flat.detach().to(torch.float64).abs().mean(dim=1).clamp(min=weight_min)
        loss = (flat**2).mean(dim=1) / w.to(torch.float32)
        parts[name] = loss.detach()
        losses.append(loss)
    total = clip * (rr * losses[0] + (1.0 - rr) * losses[1]) / beta
    return total, parts


# ----------------------------------------------------------------------------- DiffusionNFT


class ForwardProcessObjective(WithTrailingPolicy):
    """DiffusionNFT (NVlabs/DiffusionNFT ``train_nft_sd3.py``), likelihood-free.

    Per sample of the rollout (its clean latent ``x0 = image_latents``) and each of ``K`` trained
    sigmas (a per-sample random subset of the sampling schedule's, without 0), fresh noise
    ``eps`` (seeded by (seed, "nft", iteration, sample)), ``x = (1 - sigma) x0 + sigma eps``;
    the loss :func:`nft_loss` of the current velocity against the old policy's (whose forward is
    skipped while its weights equal the trained ones: the current forward's values), with
    ``r`` the optimality probability of the sample's advantage, plus ``beta_kl`` times the
    velocity KL to the reference. Rollouts are drawn with the old weights
    (:meth:`rollout_weights`); after each rollout the old weights move towards the trained ones
    with NFT's decay schedule on the optimizer-step counter."""

    uses_units = False
    keep_means = False

    def __init__(self, *, beta: float, clip: float, timesteps: int, decay_type: int, beta_kl: float,
                 weight_min: float = 1e-5):
        self.beta, self.clip, self.K, self.beta_kl = beta, clip, timesteps, beta_kl
        self.decay = DECAY_PRESETS[decay_type]
        self.weight_min = weight_min
        self.trailing = TrailingPolicy(decay_type)
        self.reference = None

    def prepare(self, ctx: UpdateContext) -> None:
        self.trailing.prepare(ctx.params, ctx.model.denoiser)
        # the engine's reference (NeedsReferencePolicy), fixed before sharding and laid out like the
        # denoiser: a copy taken here would copy the sharded module, outside what the plan counts
        self.reference = ctx.kl.reference if self.beta_kl > 0 else None

    def needs_reference(self) -> bool:
        return self.beta_kl > 0

    def start_rollout(self, ctx: UpdateContext, batch: Batch, sizes) -> None:
        self.trailing.start(ctx.optimizer_steps())

    def backward(self, ctx: UpdateContext, micro: MicroBatch) -> MicroBatchResult:
        batch, device = micro.batch, ctx.device
        idx = micro.rows
        sigmas = batch.trajectory.sigmas.to(device)
        pts = forward_process_points(ctx.seed, "nft", batch, idx, sigmas, self.K)
        x0, x, s, rows, K = pts.x0, pts.x, pts.sigma, pts.rows, pts.K
        text = select_embeddings(batch.text, rows.to(device))
        r = optimality_probability(batch.advantages[rows.to(device)].reshape(len(rows), -1)[:, 0], self.clip)
        model = ctx.model
        rows_fwd = len(rows) * ctx.rows_per_sample
        ctx.counter.expect("update", rows_fwd)
        # the old policy's velocities: its own forward, or the current one's while the values are equal
        v_old, v_ref = side_velocities(ctx, self.trailing, self.reference, x, s, text, rows_fwd)
        with torch.enable_grad():
            v = model.velocity(x, s, text).to(torch.float32)
            if v_old is None:
                v_old = v.detach()
            loss, parts = nft_loss(v, v_old, x, x0, s, r, beta=self.beta, clip=self.clip, weight_min=self.weight_min)
            total = loss
            if v_ref is not None:
                total = total + self.beta_kl * velocity_kl(v, v_ref)
            scaled = total.sum() / (micro.normaliser * K)
            scaled.backward()
        dev = float(((v.detach() - v_old) ** 2).mean())
        metrics = {"nft/positive": float(parts["positive"].mean()), "nft/negative": float(parts["negative"].mean()),
                   "nft/old_deviation": dev, "nft/r_mean": float(r.mean())}
        if v_ref is not None:
            metrics["nft/kl_ref"] = float(velocity_kl(v.detach(), v_ref).mean())
        return MicroBatchResult.without_units(micro, float(scaled.detach()), metrics)

    def end_rollout(self, ctx: UpdateContext, batch: Batch) -> dict:
        return {"nft/decay": self.trailing.end(ctx.optimizer_steps())}
