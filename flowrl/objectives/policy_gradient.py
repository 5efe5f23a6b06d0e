"""The ratio-based policy-gradient objective (:class:`PolicyGradient`), its step statistics
(:class:`StepRecorder`), and :func:`objective_for`, which picks the objective a ``[loss]`` runs as.

The update (:class:`flowrl.train.update.PolicyUpdate`) owns the optimizer: the passes over a
rollout, the optimizer steps, gradient averaging and clipping, skipping non-finite steps, the
on-policy check. The objective owns the loss: everything between "these rows of this rollout"
and ``.backward()``. The loop and the update call the same four methods whatever the
objective (``prepare``, ``start_rollout``, ``backward``, ``end_rollout``):

- :class:`PolicyGradient`: the ratio-based GRPO family (step GRPO, GSPO, fixed chunks,
  Chunk-GRPO, GRPO-Guard): selector -> chunk update -> KL pass. A recipe's ``[loss]`` that is a
  plain :class:`~flowrl.interfaces.PolicyLoss` runs through it.
- :class:`flowrl.objectives.gardo.GatedKLPolicyGradient`: GARDO's anti-hacking regulariser on top: a KL to the reference
  applied only to the samples whose proxy reward is least trustworthy, and a reference that is
  reset to the current weights periodically or when the KL grows.
- :class:`flowrl.objectives.nft.ForwardProcessObjective`: DiffusionNFT, likelihood-free: trains on the rollout's clean
  samples with the flow-matching loss on implicit positive and negative policies; no trajectory
  log-probs, no units, sampling with an old copy of the weights.
"""

from __future__ import annotations

import math

import torch

from flowrl import distributed
from flowrl.chunking import chunk_index
from flowrl.interfaces import KeepsRolloutMeans, NormalisesStepRatio, Objective, SelectsFromRollout
from flowrl.objectives.base import MicroBatch, MicroBatchResult
from flowrl.seeding import generator
from flowrl.selection import rollout_l1rel


def objective_for(loss):
    """The objective a recipe's ``[loss]`` component runs as: itself when it is an
    :class:`~flowrl.interfaces.Objective`, else :class:`PolicyGradient` around it."""
    return loss if isinstance(loss, Objective) else PolicyGradient(loss)


# ----------------------------------------------------------------------------- diagnostics


class StepRecorder:
    """Per-step and per-unit statistics of the log-ratio ``l_theta - l_old`` seen while
    re-scoring (for GRPO-Guard: the normalised ratio). Within one micro-batch each (row,
    position) keeps its last value; the values of the transitions each row trained are then
    accumulated per position ``t`` and per unit ``k`` (the unit log-ratio is the mean over the
    unit's positions). ``metrics`` all-reduces the sums over processes."""

    def __init__(self, T: int, sizes):
        self.T, self.sizes = T, tuple(sizes)
        self.step = torch.zeros(3, T, dtype=torch.float64)  # n, sum, sum of squares
        self.unit = torch.zeros(3, len(self.sizes), dtype=torch.float64)
        self.cur = None

    def start(self, n_rows: int) -> None:
        self.cur = torch.full((n_rows, self.T), float("nan"), dtype=torch.float64)

    def observe(self, t: int, b: torch.Tensor, lp: torch.Tensor, old: torch.Tensor) -> None:
        self.cur[b.cpu(), t] = (lp.detach().double() - old.detach().double()).cpu()

    def wrap(self, fn, old_lp: torch.Tensor):
        def recorded(t, b, grad):
            lp = fn(t, b, grad)
            self.observe(t, b, lp, old_lp[b, t])
            return lp
        return recorded

    def wrap_forward(self, forward, old_lp: torch.Tensor):
        def recorded(t, b):
            lp, extra = forward(t, b)
            self.observe(t, b, lp, old_lp[b, t])
            return lp, extra
        return recorded

    def wrap_many(self, many, old_lp: torch.Tensor):
        def recorded(ts, b):
            lp = many(ts, b)
            if b is None:  # every row
                b = torch.arange(old_lp.shape[0])
            for j, t in enumerate(ts):
                self.observe(t, b, lp[j], old_lp[b, t])
            return lp
        return recorded

    def finish(self, mask: torch.Tensor) -> None:
        """Accumulate the micro-batch (``mask [n, K]``: the units each row trained)."""
        cur, self.cur = self.cur, None
        if cur is None:
            return
        if not self.sizes:
            return
        idx = chunk_index(self.sizes)
        m = mask.cpu().bool()
        # only the transitions of the units each row trained: what is re-scored besides them
        # depends on the update path and the micro-batching, what is trained does not
        seen = ~torch.isnan(cur) & m[:, idx]
        vals = torch.where(seen, cur, torch.zeros_like(cur))
        self.step += torch.stack([seen.sum(0).double(), vals.sum(0), (vals**2).sum(0)])
        for k in range(len(self.sizes)):
            cols = (idx == k).nonzero().flatten()
            ok = m[:, k] & seen[:, cols].all(1)
            z = vals[:, cols].mean(1)[ok]
            self.unit[:, k] += torch.stack([torch.tensor(float(z.numel()), dtype=torch.float64), z.sum(), (z**2).sum()])

    def metrics(self, ctx) -> dict:
        # counts, sums and sums of squares of every step and unit: one all-reduce, not one per number
        both = distributed.all_reduce_sum(torch.cat([self.step.flatten(), self.unit.flatten()]), ctx)
        step, unit = both[: self.step.numel()].reshape(self.step.shape), both[self.step.numel():].reshape(self.unit.shape)

        def stats(a):
            n = a[0].clamp(min=1)
            mean = a[1] / n
            std = (a[2] / n - mean**2).clamp(min=0).sqrt()
            none = a[0] == 0
            return ([None if e else float(v) for v, e in zip(mean, none)], [None if e else float(v) for v, e in zip(std, none)])

        out = {}
        total = step.sum(1)
        if float(total[0]) > 0:
            mean = float(total[1] / total[0])
            out["diag/log_ratio_mean"] = mean
            out["diag/log_ratio_std"] = math.sqrt(max(float(total[2] / total[0]) - mean**2, 0.0))
        out["diag/step_log_ratio_mean"], out["diag/step_log_ratio_std"] = stats(step)
        if unit.numel():
            out["diag/unit_log_ratio_mean"], out["diag/unit_log_ratio_std"] = stats(unit)
        return out


# ----------------------------------------------------------------------------- the GRPO family


class PolicyGradient:
    """The ratio-based family: per micro-batch the selector picks each row's units, the chunk
    update back-propagates the loss over them and the KL pass adds the loss's KL term
    (docs/architecture.md). Also records the per-step/per-unit log-ratio diagnostics."""

    uses_units = True

    def __init__(self, loss):
        self.loss = loss
        self.keep_means = bool(isinstance(loss, KeepsRolloutMeans) and loss.keep_means)
        self.kl_direction = getattr(loss, "kl_direction", "old_theta")
        self.scorer = self.old_lp = self.recorder = None

    # the objective protocol
    def prepare(self, update) -> None:
        """The KL reference is fixed by the update (:class:`flowrl.objectives.kl.ReferencePolicy`)."""

    def step_transform(self):
        """The scorer's step transform (GRPO-Guard's normalised ratio) or None."""
        if isinstance(self.loss, NormalisesStepRatio):
            return self.loss.step_ratio
        return None

    def start_rollout(self, update, batch, sizes) -> None:
        self.scorer = update.make_scorer(batch, step_ratio=self.step_transform())
        self.old_lp = batch.trajectory.trainable_log_probs.to(update.session.device)
        self.recorder = StepRecorder(batch.trajectory.num_trainable, sizes)

    def kl_weights(self):
        """Per-sample KL weights ``[B]`` (None: every sample); GARDO's gate."""
        return None

    def backward(self, update, micro: MicroBatch) -> MicroBatchResult:
        seed, batch = update.session.recipe.run.seed, micro.batch
        idx = micro.rows
        gens = [generator(seed, "select", batch.iteration, micro.epoch, batch.indices[int(i)]) for i in idx]
        selector = update.session.components.selector
        if isinstance(selector, SelectsFromRollout):  # GCPO: each sample's L1rel over its own rollout
            traj = batch.trajectory
            l1rel = torch.stack([rollout_l1rel(p.sample, p.next_sample) for p in
                                 (traj.position(t, idx) for t in range(traj.num_trainable))], dim=1)
            mask = selector.select_from_rollout(len(idx), micro.sizes, gens, l1rel.cpu()).cpu()
        else:
            mask = selector.select(len(idx), micro.sizes, gens).cpu()
        device = update.session.device
        idx_d, mask_d = idx.to(device), mask.to(device)
        update.expect_update(batch.advantages[idx_d], mask_d, micro.sizes)
        self.recorder.start(len(idx))
        loss, m, kl = update.micro_batch_backward(
            self.scorer, self.old_lp, batch.advantages, idx_d, mask_d, micro.sizes, micro.probe,
            fast=micro.first and update.fast_path, normaliser=micro.normaliser, recorder=self.recorder,
            kl_direction=self.kl_direction, kl_weights=self.kl_weights())
        self.recorder.finish(mask)
        metrics = {} if kl is None else {f"kl/{update.kl_kind}": kl[0]}  # the order rows have always had
        metrics.update({k: float(v) for k, v in m.items()})
        losses = (float(loss),) if kl is None else (float(loss), update.beta * kl[1])
        return MicroBatchResult(losses=losses, metrics=metrics, trained=mask)

    def end_rollout(self, update, batch) -> dict:
        out = self.recorder.metrics(update.ctx) if self.recorder is not None else {}
        self.scorer = None
        return out
