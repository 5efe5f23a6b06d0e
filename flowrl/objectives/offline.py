"""Offline objectives on a dataset's clean latents (:mod:`flowrl.offline`; docs/objectives.md):
no rollout, no reward model.

- **SFT**: the flow-matching (pretraining) loss on the dataset's images: per row and each of
  ``K`` sigmas, ``x = (1 - sigma) x0 + sigma eps`` and the error ``mean((v(x, sigma) - (eps - x0))^2)``
  (:func:`flowrl.objectives.preference.flow_error`), averaged.
- **DPO** (Diffusion-DPO): per pair, the chosen and the rejected latent are noised AT THE SAME
  ``K`` sigmas and noises (as the online objective, :mod:`flowrl.objectives.dpo`), and each point
  contributes :func:`flowrl.objectives.dpo.dpo_point_loss` of the policy's errors against the
  frozen reference's. Here both sides of a pair are in one forward, so the loss is the exact
  Diffusion-DPO loss (no anchors of the rollout are needed).

The points of row ``r`` of iteration ``i`` are drawn from the generator of (seed, tag, i, r): the
same after a resume, whatever the micro-batching or the number of processes.

:class:`OfflineSFT` and :class:`OfflineDPO` are the objectives the ``sft`` and ``offline_dpo``
losses run as (:class:`flowrl.interfaces.Objective` and :class:`flowrl.interfaces.TrainsOnData`):
the update hands them micro-batches of the iteration's table rows (``batch.data``,
:class:`flowrl.offline.OfflineBatch`), as it hands the online objectives rollouts.
"""

from __future__ import annotations

import contextlib

import torch

from flowrl.batch import Batch
from flowrl.interfaces import select_embeddings
from flowrl.objectives.base import MicroBatch, MicroBatchResult, UpdateContext
from flowrl.objectives.dpo import dpo_point_loss
from flowrl.objectives.forward_process import ForwardPoints
from flowrl.objectives.preference import flow_error
from flowrl.seeding import generator

__all__ = ["offline_points", "sft_loss", "offline_dpo_loss", "OfflineSFT", "OfflineDPO"]


def offline_points(seed: int, tag: str, iteration: int, rows: list[int], x0: torch.Tensor, sigmas: torch.Tensor,
                   timesteps: int, epoch: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sigma [n K], eps [n K, *L], point rows [n K])`` for the latents ``x0 [n, *L]`` of table
    rows ``rows``: ``K = min(timesteps, len(sigmas) - 1)`` sigmas drawn without replacement from
    ``sigmas[:-1]`` (the schedule without its final 0), each with its own noise. Each pass over the
    iteration's rows (``epoch``, ``[train].updates_per_rollout``) draws points of its own, as
    Diffusion-DPO draws fresh noise at every step; the first pass's are keyed as they always were."""
    grid = sigmas[:-1].to(torch.float32).cpu()
    K = min(int(timesteps), grid.numel())
    ss, es, idx = [], [], []
    for j, r in enumerate(rows):
        g = generator(seed, tag, iteration, int(r)) if not epoch else generator(seed, tag, iteration, int(r), "pass", epoch)
        pick = torch.randperm(grid.numel(), generator=g)[:K]
        for k in range(K):
            ss.append(grid[int(pick[k])])
            es.append(torch.randn(tuple(x0.shape[1:]), generator=g))
            idx.append(j)
    return torch.stack(ss), torch.stack(es), torch.tensor(idx, dtype=torch.long)


@contextlib.contextmanager
def conditional_velocity(model):
    """The model's conditional velocity for the block: true classifier-free guidance off
    (``uses_cfg``, the diffusers adapters' switch), for the policy and for the reference alike (both
    run through the same adapter). SFT is then the pretraining loss and DPO Diffusion-DPO's, which
    train the conditional prediction; the guided velocity, a policy that the online objectives
    train, would give the unconditional branch a gradient of weight ``1 - w``. Sampling (the
    evaluation) keeps the model's guidance."""
    if not getattr(model, "uses_cfg", False):
        yield
        return
    model.uses_cfg = False
    try:
        yield
    finally:
        model.uses_cfg = True


def points_of(x0: torch.Tensor, sigma: torch.Tensor, eps: torch.Tensor, idx: torch.Tensor) -> ForwardPoints:
    """The noisy points ``x = (1 - sigma) x0 + sigma eps`` on ``x0``'s device."""
    d = x0.device
    s, e, base = sigma.to(d), eps.to(d), x0[idx.to(d)].to(torch.float32)
    shape = (-1,) + (1,) * (base.ndim - 1)
    return ForwardPoints(base, e, (1 - s.reshape(shape)) * base + s.reshape(shape) * e, s, idx, 0)


def sft_loss(model, x0: torch.Tensor, text, sigma: torch.Tensor, eps: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The mean flow-matching error over all points (scalar; the gradient flows through
    ``model.velocity``). ``text`` holds one embedding row per point."""
    pts = points_of(x0, sigma, eps, idx)
    return flow_error(model.velocity(pts.x, pts.sigma, text), pts.x0, pts.eps).mean()


def offline_dpo_loss(model, reference, chosen: torch.Tensor, rejected: torch.Tensor, text, sigma: torch.Tensor,
                     eps: torch.Tensor, idx: torch.Tensor, beta: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Diffusion-DPO on ``n`` pairs, ``K`` shared points each (module docstring): the mean over
    pairs and points of ``softplus(beta / 2 ((e_w - e_w_ref) - (e_l - e_l_ref)))``, and its metrics
    (``loss``, ``margin``, ``accuracy``: the fraction of points where the policy already prefers
    the chosen image more than the reference does). ``reference(x, sigma, text)`` is the frozen
    model's velocity; ``text`` holds one embedding row per point."""
    n = chosen.shape[0]
    w, lo = points_of(chosen, sigma, eps, idx), points_of(rejected, sigma, eps, idx)
    x = torch.cat([w.x, lo.x])
    s = torch.cat([w.sigma, lo.sigma])
    t = {k: torch.cat([v, v]) for k, v in text.items()}
    x0, e = torch.cat([w.x0, lo.x0]), torch.cat([w.eps, lo.eps])
    with torch.no_grad():
        e_ref = flow_error(reference(x, s, t), x0, e).reshape(2, n, -1)
    err = flow_error(model.velocity(x, s, t), x0, e).reshape(2, n, -1)
    # dpo_point_loss differentiates its own side only (the partner's error is detached): written
    # once from each side, the two terms have the same value and their gradients add up to the
    # exact gradient of the pair's loss; subtracting one value (detached) keeps the value right
    wins = dpo_point_loss(err[0], e_ref[0], err[1], e_ref[1], torch.ones(n, dtype=torch.bool), beta).mean()
    loses = dpo_point_loss(err[1], e_ref[1], err[0], e_ref[0], torch.zeros(n, dtype=torch.bool), beta).mean()
    loss = wins + loses - wins.detach()
    m = ((err[0] - e_ref[0]) - (err[1] - e_ref[1])).detach()
    return loss, {"loss": float(wins.detach()), "margin": float(m.mean()), "accuracy": float((m < 0).float().mean())}


class OfflineObjective:
    """What the two offline objectives share: the micro-batch's table rows, their points (keyed
    by table row, :func:`offline_points`) and text embeddings, and the loss normalised as the
    online objectives' (the micro-batch's rows times their mean loss, over the step's rows). No
    trajectory log-probs, no chunks, no state across iterations (the reference is fixed)."""

    uses_units = False
    keep_means = False
    data_kind = ""
    tag = ""

    def __init__(self, *, timesteps: int):
        self.K = timesteps

    def needs_reference(self) -> bool:
        return False

    def prepare(self, ctx: UpdateContext) -> None:
        pass

    def start_rollout(self, ctx: UpdateContext, batch: Batch, sizes) -> None:
        if batch.data is None:
            raise ValueError(f"loss {self.tag!r} trains on an offline table ([data]), not on rollouts")

    def end_rollout(self, ctx: UpdateContext, batch: Batch) -> dict:
        return {}

    def backward(self, ctx: UpdateContext, micro: MicroBatch) -> MicroBatchResult:
        data, device = micro.batch.data, ctx.device
        rows = micro.rows
        table_rows = [data.rows[int(r)] for r in rows]
        latents = {k: v[rows.to(v.device)] for k, v in data.latents.items()}
        first = next(iter(latents.values()))
        sigma, eps, idx = offline_points(ctx.seed, self.tag, micro.batch.iteration, table_rows, first, data.sigmas,
                                         self.K, micro.epoch)
        text = select_embeddings(micro.batch.text, rows[idx].to(device))
        ctx.counter.expect("update", len(idx) * self.sides)  # one network row a point: no CFG (below)
        with torch.enable_grad(), conditional_velocity(ctx.model):
            loss, metrics = self.loss(ctx, latents, text, sigma, eps, idx)
            scaled = loss * (len(rows) / micro.normaliser)  # the mean over the step's rows, summed over micro-batches
            scaled.backward()
        return MicroBatchResult.without_units(micro, float(scaled.detach()), metrics)


class OfflineSFT(OfflineObjective):
    """Offline supervised fine-tuning: the flow-matching loss on a table of images (:func:`sft_loss`)."""

    data_kind, tag, sides = "images", "offline_sft", 1

    def loss(self, ctx, latents, text, sigma, eps, idx):
        loss = sft_loss(ctx.model, latents["image"], text, sigma, eps, idx)
        return loss, {"sft/fm_loss": float(loss.detach())}


class OfflineDPO(OfflineObjective):
    """Offline Diffusion-DPO on a table of preference pairs (:func:`offline_dpo_loss`), against
    the engine's frozen reference (the model before training; the base with LoRA disabled)."""

    data_kind, tag, sides = "pairs", "offline_dpo", 2

    def __init__(self, *, beta: float, timesteps: int):
        super().__init__(timesteps=timesteps)
        self.beta = beta
        self.reference = None

    def needs_reference(self) -> bool:
        return True

    def prepare(self, ctx: UpdateContext) -> None:
        self.reference = ctx.kl.reference

    def loss(self, ctx, latents, text, sigma, eps, idx):
        ctx.counter.expect("reference", len(idx) * 2)

        def reference(x, s, t):
            with ctx.counter.phase("reference"):
                return self.reference.velocity(x, s, t)

        loss, parts = offline_dpo_loss(ctx.model, reference, latents["chosen"], latents["rejected"], text, sigma,
                                       eps, idx, self.beta)
        return loss, {f"dpo/{k}": v for k, v in parts.items()}
