"""The ratio-based policy-gradient objective (:class:`PolicyGradient`), the re-scoring of a
rollout's transitions it and its KL term share (:class:`TransitionScorer`), its step statistics
(:class:`StepRecorder`), and :func:`objective_for`, which picks the objective a ``[loss]`` runs as.

The update (:class:`flowrl.train.update.PolicyUpdate`) owns the optimizer: the passes over a
rollout, the optimizer steps, gradient averaging and clipping, skipping non-finite steps, the
on-policy check. The objective owns the loss: everything between "these rows of this rollout"
and ``.backward()``. The loop and the update call the same four methods whatever the
objective (``prepare``, ``start_rollout``, ``backward``, ``end_rollout``; :class:`flowrl.interfaces.Objective`),
each with the :class:`~flowrl.objectives.base.UpdateContext`, never the update itself:

- :class:`PolicyGradient`: the ratio-based GRPO family (step GRPO, GSPO, fixed chunks,
  Chunk-GRPO, GRPO-Guard): selector -> chunk update -> KL term. A recipe's ``[loss]`` that is a
  plain :class:`~flowrl.interfaces.PolicyLoss` runs through it. Per micro-batch: the fast path
  on the first (on-policy) optimizer step after a rollout, otherwise the chunk-graph or the lean
  update (``[train].update_mode``; :mod:`flowrl.objectives.chunk_gradient`). Every re-scoring of
  a stored transition, for the policy loss as for the KL term, goes through one
  :class:`TransitionScorer`.
- :class:`flowrl.objectives.gardo.GatedKLPolicyGradient`: GARDO's anti-hacking regulariser on top: a KL to the reference
  applied only to the samples whose proxy reward is least trustworthy, and a reference that is
  reset to the current weights periodically or when the KL grows.
- :class:`flowrl.objectives.nft.ForwardProcessObjective`: DiffusionNFT, likelihood-free: trains on the rollout's clean
  samples with the flow-matching loss on implicit positive and negative policies; no trajectory
  log-probs, no units, sampling with an old copy of the weights.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from contextlib import nullcontext

import torch

from flowrl import distributed
from flowrl.batch import Batch
from flowrl.chunking import chunk_index
from flowrl.interfaces import (
    ChoosesKLForm,
    KeepsRolloutMeans,
    NormalisesStepRatio,
    Objective,
    SelectsByStepStd,
    SelectsFromRollout,
    SelectsPerGroup,
    TextEmbeddings,
    select_embeddings,
)
from flowrl.objectives.base import MicroBatch, MicroBatchResult, UpdateContext
from flowrl.objectives.chunk_gradient import (
    StepLogProbFn,
    chunk_graph_backward,
    lean_chunk_backward,
    on_policy_chunk_backward,
)
from flowrl.objectives.kl import KLTerm, ReferencePolicy
from flowrl.sampling.kernels import StepOutput
from flowrl.sampling.rollout import rescore_position, rescore_positions
from flowrl.sampling.trajectory import Trajectory
from flowrl.seeding import generator
from flowrl.selection import rollout_l1rel


def objective_for(loss):
    """The objective a recipe's ``[loss]`` component runs as: itself when it is an
    :class:`~flowrl.interfaces.Objective`, else :class:`PolicyGradient` around it."""
    return loss if isinstance(loss, Objective) else PolicyGradient(loss)


# ----------------------------------------------------------------------------- re-scoring


class TransitionScorer:
    """Re-scores a rollout's trainable transitions with the current policy or the reference.

    ``step(t, rows, grad)`` is the kernel's :class:`~flowrl.sampling.kernels.StepOutput` at trainable position
    ``t`` (``0 <= t < T``) for the samples ``rows`` (indices into the trajectory): the chunk
    update reads its ``log_prob``, the KL term its ``mean`` and ``std``. The reference's forwards
    count as the ``reference`` phase of ``counter``.
    """

    def __init__(self, model, trajectory: Trajectory, text: TextEmbeddings, reference: ReferencePolicy | None = None,
                 counter=None, step_ratio=None):
        self.model = model
        self.trajectory = trajectory
        self.text = text
        self.reference = reference
        self.counter = counter
        self.num_positions = trajectory.num_trainable
        # a loss's step transform (GRPO-Guard): the policy's re-scored "log-prob" relative to the rollout's
        self.step_ratio = step_ratio

    def step(self, t: int, rows: torch.Tensor, *, grad: bool, reference: bool = False) -> StepOutput:
        if not 0 <= t < self.num_positions:
            raise ValueError(f"trainable position must be in [0, {self.num_positions - 1}], got {t}")
        text = select_embeddings(self.text, rows)
        policy = self.reference if reference else self.model
        counted = self.counter.phase("reference") if reference and self.counter is not None else nullcontext()
        with torch.set_grad_enabled(grad), counted:
            out = rescore_position(lambda x, s: policy.velocity(x, s, text), self.trajectory, t, rows)
            if self.step_ratio is not None and not reference:
                out = dataclasses.replace(out, log_prob=self.step_ratio(out, self.trajectory.position(t, rows)))
            return out

    def log_prob_fn(self, rows: torch.Tensor) -> StepLogProbFn:
        """``fn(t, b, grad)``: log-probs of the samples ``rows[b]``, as the chunk update wants."""
        return lambda t, b, grad: self.step(t, rows[b], grad=grad).log_prob

    def many_fn(self, rows: torch.Tensor):
        """``fn(ts, b)``: log-probs ``[len(ts), len(b)]`` of positions ``ts`` for ``rows[b]`` (every
        row of ``rows`` when ``b`` is None) from one batched forward, with grad (the chunk-graph
        update)."""

        def many(ts: list[int], b: torch.Tensor | None) -> torch.Tensor:
            r = rows if b is None else rows[b]
            if self.step_ratio is not None:
                return torch.stack([self.step(t, r, grad=True).log_prob for t in ts])
            if r.numel() == 1:  # one sample (GCPO's batching): a view of its embeddings, broadcast over the steps
                i = int(r[0])
                text = {k: v[i : i + 1].expand(len(ts), *v.shape[1:]) for k, v in self.text.items()}
            else:
                text = select_embeddings(self.text, r.repeat(len(ts)))
            return rescore_positions(lambda x, s: self.model.velocity(x, s, text), self.trajectory, ts, r)

        return many


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
    update back-propagates the loss over them and the KL term to the reference is added
    (docs/architecture.md). Also records the per-step/per-unit log-ratio diagnostics."""

    uses_units = True

    def __init__(self, loss):
        self.loss = loss
        self.keep_means = bool(isinstance(loss, KeepsRolloutMeans) and loss.keep_means)
        self.kl_direction = loss.kl_direction if isinstance(loss, ChoosesKLForm) else "old_theta"
        self.scorer = self.old_lp = self.recorder = None

    # the objective protocol
    def prepare(self, ctx: UpdateContext) -> None:
        """Nothing: the KL reference is fixed by the update (``ctx.kl``)."""

    def step_transform(self):
        """The scorer's step transform (GRPO-Guard's normalised ratio) or None."""
        if isinstance(self.loss, NormalisesStepRatio):
            return self.loss.step_ratio
        return None

    def start_rollout(self, ctx: UpdateContext, batch: Batch, sizes) -> None:
        self.scorer = TransitionScorer(ctx.model, batch.trajectory, batch.text, ctx.kl.reference, ctx.counter,
                                       step_ratio=self.step_transform())
        self.old_lp = batch.trajectory.trainable_log_probs.to(ctx.device)
        self.recorder = StepRecorder(batch.trajectory.num_trainable, sizes)

    def kl_weights(self):
        """Per-sample KL weights ``[B]`` (None: every sample); GARDO's gate."""
        return None

    def backward(self, ctx: UpdateContext, micro: MicroBatch) -> MicroBatchResult:
        batch, idx = micro.batch, micro.rows
        mask = select_units(ctx.selector, ctx.seed, batch, idx, micro.sizes, micro.epoch)
        idx_d, mask_d = idx.to(ctx.device), mask.to(ctx.device)
        _expect_work(ctx, batch.advantages[idx_d], mask_d, micro.sizes, batch.iteration, micro.replayed)
        self.recorder.start(len(idx))
        loss, m, kl = self._units_backward(ctx, batch.advantages, idx_d, mask_d, micro.sizes, micro.probe,
                                           fast=micro.first and ctx.fast_path, normaliser=micro.normaliser)
        if kl is None and not micro.replayed and ctx.kl.monitors(batch.iteration):  # [log].kl_every: measured
            # through a scorer of its own, so that nothing an objective records of its re-scoring changes
            scorer = TransitionScorer(ctx.model, batch.trajectory, batch.text, ctx.kl.reference, ctx.counter)
            with ctx.counter.measuring("kl_monitor"):
                kl = KLTerm(scorer, idx_d, mask_d, micro.sizes, self.old_lp, ctx.kl.kind, 0.0, micro.normaliser,
                            direction=self.kl_direction).measure(ctx.lockstep)
        self.recorder.finish(mask)
        metrics = {} if kl is None else {f"kl/{ctx.kl.kind}": kl[0]}  # the order rows have always had
        metrics.update({k: float(v) for k, v in m.items()})
        losses = (float(loss),) if kl is None or ctx.kl.beta == 0 else (float(loss), ctx.kl.beta * kl[1])
        return MicroBatchResult(losses=losses, metrics=metrics, trained=mask)

    def end_rollout(self, ctx: UpdateContext, batch: Batch) -> dict:
        out = self.recorder.metrics(ctx.process) if self.recorder is not None else {}
        self.scorer = None
        return out

    def _units_backward(self, ctx: UpdateContext, advantages, idx, mask, sizes, probe, *, fast, normaliser):
        """Back-propagate one micro-batch's loss and KL term: the fast path on-policy, otherwise
        the chunk-graph or lean update (``[train].update_mode``). Returns (loss, unit metrics,
        (mean KL, KL term) or None). The step recorder sees every re-scored log-prob; the probe
        (the on-policy check) every one of the first optimizer step."""
        scorer, old_lp, recorder, kl_settings = self.scorer, self.old_lp, self.recorder, ctx.kl
        fn = scorer.log_prob_fn(idx)
        if probe is not None:
            fn = probe.wrap(fn, old_lp[idx])
        fn = recorder.wrap(fn, old_lp[idx])
        args = (fn, old_lp[idx], advantages[idx], sizes, mask, self.loss.objective)
        lockstep = ctx.lockstep
        kl = KLTerm(scorer, idx, mask, sizes, old_lp, kl_settings.kind, kl_settings.beta, normaliser,
                    direction=self.kl_direction, sample_weights=self.kl_weights()) if kl_settings.beta > 0 else None
        if not fast and _off_policy_mode(ctx, scorer, idx, sizes) == "lean":
            loss, m = lean_chunk_backward(*args, normaliser=normaliser, lockstep=lockstep)
            return loss, m, (kl.backward(lockstep) if kl is not None else None)
        forward = kl.forward if kl is not None else None
        if forward is not None and probe is not None:
            forward = probe.wrap_forward(forward, old_lp[idx])
        if forward is not None:
            forward = recorder.wrap_forward(forward, old_lp[idx])
        if fast:
            # [train].update_group: a unit's steps batched into one forward (one gather per group under fsdp2)
            many = None
            if ctx.update_group > 1:
                many = recorder.wrap_many(scorer.many_fn(idx), old_lp[idx])
                many = probe.wrap_many(many, old_lp[idx]) if probe is not None else many
            loss, m = on_policy_chunk_backward(*args, normaliser=normaliser, forward_with_extra=forward, many=many,
                                               group=ctx.update_group, lockstep=lockstep)
        else:
            many = recorder.wrap_many(scorer.many_fn(idx), old_lp[idx])
            loss, m = chunk_graph_backward(*args, normaliser=normaliser, forward_with_extra=forward,
                                           many=many, lockstep=lockstep)
        return loss, m, (kl.result() if kl is not None else None)


def select_units(selector, seed: int, batch: Batch, idx: torch.Tensor, sizes, epoch: int) -> torch.Tensor:
    """The selector's bool mask ``[len(idx), K]`` (CPU) for the rows ``idx`` of ``batch``, with
    what the selector declares it needs. Every draw is seeded by global quantities only (the
    sample's global index, or its prompt group for a :class:`SelectsPerGroup`), so the selection
    does not depend on how samples are split over micro-batches or processes."""
    traj = batch.trajectory
    if isinstance(selector, SelectsPerGroup):  # Flash-GRPO: one draw per group and iteration
        groups = batch.group_ids.cpu()[idx.cpu()]
        gens = [generator(seed, "select_group", batch.iteration, int(g)) for g in groups]
        return selector.select_per_group(len(idx), sizes, gens, groups).cpu()
    gens = [generator(seed, "select", batch.iteration, epoch, batch.indices[int(i)]) for i in idx]
    if isinstance(selector, SelectsByStepStd):  # E-GRPO: the entropy of each step's Gaussian
        return selector.select_from_std(len(idx), sizes, gens, traj.position_std(idx.cpu())).cpu()
    if isinstance(selector, SelectsFromRollout):  # GCPO: each sample's L1rel over its own rollout
        l1rel = torch.stack([rollout_l1rel(p.sample, p.next_sample) for p in
                             (traj.position(t, idx) for t in range(traj.num_trainable))], dim=1)
        return selector.select_from_rollout(len(idx), sizes, gens, l1rel.cpu()).cpu()
    return selector.select(len(idx), sizes, gens).cpu()


def _expect_work(ctx: UpdateContext, advantages: torch.Tensor, mask: torch.Tensor, sizes, iteration: int,
                 replayed: bool = False) -> None:
    """The minimum work of a micro-batch: each trained transition whose gradient is not zero
    (non-zero advantage, or any with a KL term) once forward and backward; one reference
    forward per trained transition for the reference KL kinds, also when the KL is only measured
    (``[log].kl_every``; the policy's forwards of that measurement count as ``kl_monitor``, as
    evaluation's count as ``eval``: outside the ratio)."""
    size = torch.tensor(sizes, device=mask.device)
    adv = advantages if advantages.ndim == 2 else advantages[:, None].expand(mask.shape)
    trained = int((mask * size).sum())
    live = trained if ctx.kl.beta > 0 else int((mask & (adv != 0)).mul(size).sum())
    ctx.counter.expect("update", live * ctx.rows_per_sample)
    if ctx.kl.reference is not None and (ctx.kl.beta > 0 or (not replayed and ctx.kl.monitors(iteration))):
        ctx.counter.expect("reference", trained * ctx.rows_per_sample)


def _off_policy_mode(ctx: UpdateContext, scorer: TransitionScorer, idx, sizes) -> str:
    """``lean`` or ``chunk_graph`` for an off-policy micro-batch (``auto``: measured once, on the
    first off-policy step: the chunk-graph update when the largest chunk's activations fit in
    half the free memory on every process)."""
    mode = ctx.update_mode
    if mode.setting != "auto":
        return mode.setting
    if mode.decided is None:  # decided once per run (and checkpointed, so a resume keeps it)
        with ctx.counter.paused():
            per_step = activation_bytes(lambda: scorer.step(0, idx, grad=True).log_prob)
        budget = free_memory_bytes(ctx.device) / 2
        fits = max(sizes) * per_step <= budget
        # every process takes the same mode (under FSDP2 they must make the same calls)
        mode.decided = "lean" if distributed.any_rank(not fits, ctx.process) else "chunk_graph"
    return mode.decided


def activation_bytes(forward: Callable[[], torch.Tensor]) -> int:
    """Bytes of the tensors autograd saves for backward in ``forward()`` (its graph is freed)."""
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    return total


def free_memory_bytes(device: torch.device) -> float:
    """Free memory of the device: CUDA's free memory, or the host's available memory."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return float("inf")
