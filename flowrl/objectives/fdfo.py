"""FDFO, finite-difference flow optimisation (McAllister et al., arXiv 2603.12893;
NVlabs/finite-difference-flow-optimization, ``fdfo/train_loop.py``). docs/objectives.md, "FDFO".

The whole sampling run is one action, and its gradient is estimated from a pair of runs: two
samples of one prompt from the same starting noise whose stochastic steps differ slightly (the
rollout's SDE kernel at a small noise level; ``[train] same_noise_in_group = true`` with
``group_size = 2``). With ``R`` and ``R'`` their rewards and ``x0``, ``x0'`` their final
latents, each sample gets

    dR = (R - R') / 2          dx = (x0 - x0') / 2          (its half of the finite difference)

(``dR`` is the ``group_centred`` advantage of the pair). At every trained state ``x_t`` of the
sample's own trajectory (noise level ``sigma_t``) with the rollout policy's velocity ``v_ref``
there, the velocity is pushed along the endpoint difference::

    d = dx / (mean(dx^2) + 1e-6)                        (mean over the latent's elements)
    v* = v_ref - d                                      (v = eps - x0: lower v moves x0 along +d)
    l = -mean((v - v*)^2)        l_ref = -mean(d^2)     (l at v = v_ref)
    rho = exp(l - l_ref)
    L = -dR rho + |dR| / (2 c) (rho - 1)^2              (the SPO surrogate, c = clip_range)

(``l - l_ref`` is computed as ``-mean(delta^2 + 2 delta d)`` with ``delta = v - v_ref``, the same
value without the float32 cancellation of two terms of size ``mean(d^2)``.)

At ``v = v_ref`` (``rho = 1``) the gradient is ``dL/dv = -dR drho/dv = 2 dR d / D`` (``D``
elements): descent lowers ``v`` along ``d`` (moves the sample's endpoint ``x0 = x - sigma v``
further to its own side of the pair) when its reward is the higher one, and the quadratic term pulls ``rho`` back to 1 as it moves (a trust
region without clipping), plus ``kl_weight mean((v - v_base)^2)`` to the reference.

FDFO stores the rollout's velocities; flowrl's trajectory keeps the states, and ``v_ref`` is the
current forward's own value while the weights are the rollout's (the first optimizer step of each
rollout), else one forward of the rollout's weights, kept as a trailing copy (decay 0,
:mod:`flowrl.objectives.old_policy`). Cost per iteration: the paired rollout (2 samples per
prompt) and, per sample, one forward and one backward at each of its ``K`` trained states.
"""

from __future__ import annotations

import math

import torch

from flowrl.batch import Batch
from flowrl.interfaces import select_embeddings
from flowrl.objectives.base import MicroBatch, MicroBatchResult, UpdateContext
from flowrl.objectives.forward_process import velocity_kl
from flowrl.objectives.old_policy import TrailingPolicy, WithTrailingPolicy, side_velocities
from flowrl.seeding import generator

__all__ = ["pair_partners", "fdfo_loss", "FiniteDifferenceObjective"]


def pair_partners(group_ids: torch.Tensor) -> torch.Tensor:
    """For each row, the other row of its group ``[B]`` (long); every group must have exactly 2 rows."""
    g = torch.as_tensor(group_ids).reshape(-1).cpu()
    partner = torch.empty_like(g, dtype=torch.long)
    for gid in torch.unique(g).tolist():
        rows = torch.nonzero(g == gid).flatten()
        if rows.numel() != 2:
            raise ValueError(f"FDFO needs pairs: prompt group {gid} has {rows.numel()} samples on this process "
                             "(group_size = 2, and groups whole on one process)")
        partner[rows[0]], partner[rows[1]] = rows[1], rows[0]
    return partner


def fdfo_loss(v: torch.Tensor, v_ref: torch.Tensor, dx: torch.Tensor, dR: torch.Tensor, *, clip_range: float,
              eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Per state ``[N]``: the SPO surrogate of the module docstring, and ``rho`` (detached). ``v``
    carries the gradient; ``v_ref``, ``dx`` ``[N, ...]`` and ``dR [N]`` are used detached."""
    if not (isinstance(clip_range, (int, float)) and math.isfinite(clip_range) and clip_range > 0):
        raise ValueError(f"clip_range must be a finite number > 0, got {clip_range!r}")
    vv = v.to(torch.float32)
    ref, d = v_ref.detach().to(torch.float32), dx.detach().to(torch.float32)
    if not (vv.shape == ref.shape == d.shape) or vv.ndim < 2:
        raise ValueError(f"v, v_ref and dx must be [N, ...] of one shape, got {tuple(vv.shape)}, {tuple(ref.shape)}, "
                         f"{tuple(d.shape)}")
    dims = tuple(range(1, vv.ndim))
    ms = (d**2).mean(dim=dims, keepdim=True)
    d = d / (ms + eps)
    # l - l_ref = -mean((v - v_ref + d)^2 - d^2) = -mean(delta^2 + 2 delta d), delta = v - v_ref: written
    # so, not as the difference of two terms of size mean(d^2) (~1 / mean(dx^2)), which cancels in float32
    delta = vv - ref
    rho = torch.exp(-(delta**2 + 2.0 * delta * d).mean(dim=dims))
    r = torch.as_tensor(dR, dtype=torch.float32, device=vv.device).reshape(-1)
    loss = -r * rho + r.abs() / (2.0 * clip_range) * (rho - 1.0) ** 2
    return loss, rho.detach()


class FiniteDifferenceObjective(WithTrailingPolicy):
    """FDFO as an objective (module docstring): paired rollouts, trained at ``K`` of each sample's
    trajectory states (all of them with ``timesteps = 0``)."""

    uses_units = False
    keep_means = False
    #: validation: pairs from one starting noise, and a stochastic rollout whose states are trained
    paired_rollouts = True
    trains_trajectory_states = True

    def __init__(self, *, clip_range: float, timesteps: int, kl_weight: float):
        self.clip_range, self.K, self.kl_weight = clip_range, int(timesteps), kl_weight
        self.trailing = TrailingPolicy(0)
        self.reference = None

    def needs_reference(self) -> bool:
        return self.kl_weight > 0

    def prepare(self, ctx: UpdateContext) -> None:
        self.trailing.prepare(ctx.params, ctx.model.denoiser)
        self.reference = ctx.kl.reference if self.kl_weight > 0 else None

    def start_rollout(self, ctx: UpdateContext, batch: Batch, sizes) -> None:
        self.trailing.start(ctx.optimizer_steps())
        self.partner = pair_partners(batch.group_ids)

    def _positions(self, ctx: UpdateContext, batch: Batch, row: int, T: int) -> list[int]:
        if self.K <= 0 or self.K >= T:
            return list(range(T))
        g = generator(ctx.seed, "fdfo", batch.iteration, batch.indices[row])
        return sorted(torch.randperm(T, generator=g)[: self.K].tolist())

    def backward(self, ctx: UpdateContext, micro: MicroBatch) -> MicroBatchResult:
        batch, device, traj = micro.batch, ctx.device, micro.batch.trajectory
        T = traj.num_trainable
        if T < 1:
            raise ValueError("FDFO trains the rollout's stochastic states: the sampler has none")
        dR_all = batch.advantages.reshape(len(batch.group_ids), -1)[:, 0].to(torch.float32)
        live = micro.rows
        if self.kl_weight == 0:  # a pair of equal rewards has no gradient
            live = micro.rows[(dR_all[micro.rows.to(dR_all.device)] != 0).cpu()]
        idx = micro.rows if ctx.lockstep is not None else live
        if idx.numel() == 0:
            return MicroBatchResult.without_units(micro, 0.0, {})
        # each sample's trained states (row-major), read one trainable position at a time
        picks = {r: self._positions(ctx, batch, r, T) for r in idx.tolist()}
        states = {}
        for t in sorted({t for ts in picks.values() for t in ts}):
            at = [r for r, ts in picks.items() if t in ts]
            pos = traj.position(t, torch.tensor(at, device=traj.latents.device))
            for j, r in enumerate(at):
                states[r, t] = (pos.sample[j], pos.sigma.reshape(-1)[j])
        rows = [r for r, ts in picks.items() for _ in ts]
        x = torch.stack([states[r, t][0] for r, ts in picks.items() for t in ts]).to(device, torch.float32)
        sigma = torch.stack([states[r, t][1] for r, ts in picks.items() for t in ts]).to(device, torch.float32)
        rows_t = torch.tensor(rows, dtype=torch.long)
        x0 = traj.image_latents
        dx = (0.5 * (x0[rows_t].to(torch.float32) - x0[self.partner[rows_t]].to(torch.float32))).to(device)
        dR = dR_all.to(device)[rows_t.to(device)]
        text = select_embeddings(batch.text, rows_t.to(device))
        per_live = (len(rows) // int(idx.numel())) * int(live.numel()) * ctx.rows_per_sample
        ctx.counter.expect("update", per_live)
        model = ctx.model
        # v_ref: the rollout weights' velocity (the trained forward's own while they are the same)
        v_ref, v_base = side_velocities(ctx, self.trailing, self.reference, x, sigma, text, per_live)
        with torch.enable_grad():
            v = model.velocity(x, sigma, text).to(torch.float32)
            if v_ref is None:
                v_ref = v.detach()
            loss, rho = fdfo_loss(v, v_ref, dx, dR, clip_range=self.clip_range)
            total = loss
            if v_base is not None:
                total = total + self.kl_weight * velocity_kl(v, v_base)
            per_state = len(rows) // int(idx.numel())
            scaled = total.sum() / (micro.normaliser * per_state)
            scaled.backward()
        metrics = {"fdfo/ratio_mean": float(rho.mean()),
                   "fdfo/clip_fraction": float(((rho - 1.0).abs() > self.clip_range).float().mean()),
                   "fdfo/dR_abs": float(dR.abs().mean())}
        if v_base is not None:
            metrics["fdfo/kl_ref"] = float(velocity_kl(v.detach(), v_base).mean())
        return MicroBatchResult.without_units(micro, float(scaled.detach()), metrics)

    def end_rollout(self, ctx: UpdateContext, batch: Batch) -> dict:
        self.trailing.end(ctx.optimizer_steps())
        return {}
