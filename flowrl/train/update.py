"""The update phase: advantages over whole groups, then the policy update.

One rollout is used for ``updates_per_rollout`` passes; each pass takes
``optimizer_steps_per_update`` AdamW steps, each over ``grad_accumulation`` micro-batches. Per
micro-batch the selector picks the chunks each sample trains, the memory-lean chunk update
(:mod:`flowrl.objectives.chunk_gradient`) back-propagates the loss over them one step at a time, and a
KL pass adds the loss's KL term. Every re-scoring of a stored transition, for the policy loss as
for the KL, goes through one :class:`TransitionScorer`.

The first optimizer step of a rollout is exactly on-policy: :class:`OnPolicyProbe` checks that
re-scoring reproduces the rollout's log-probs (``[train].on_policy_tolerance``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from .. import distributed
from ..errors import FlowrlError
from ..interfaces import CheckpointsState, KLRegularised, TextEmbeddings, select_embeddings
from ..sampling.rollout import rescore_position, rescore_positions
from ..sampling.kernels import StepOutput
from ..seeding import generator
from ..sampling.trajectory import Trajectory
from ..objectives.chunk_gradient import StepLogProbFn, chunk_graph_backward, lean_chunk_backward, on_policy_chunk_backward
from .checkpoint import OBJECTIVE
from .compute import ComputeCounter, network_rows_per_sample
from .finetune import prepare_trainable
from ..objectives.base import MicroBatch
from ..objectives.policy_gradient import objective_for
from .optimizer import make_optimizer, make_scheduler
from .parallel import Strategy, declared_blocks
from .run import Run
from ..objectives.kl import KLTerm, ReferencePolicy, kl_backward


class TransitionScorer:
    """Re-scores a rollout's trainable transitions with the current policy or the reference.

    ``step(t, rows, grad)`` is the kernel's :class:`~flowrl.sampling.kernels.StepOutput` at trainable position
    ``t`` (``0 <= t < T``) for the samples ``rows`` (indices into the trajectory): the chunk
    update reads its ``log_prob``, the KL pass its ``mean`` and ``std``.
    """

    def __init__(self, model, trajectory: Trajectory, text: TextEmbeddings, reference: ReferencePolicy | None = None,
                 counter: ComputeCounter | None = None, step_ratio=None):
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


class OnPolicyProbe:
    """Largest per-step ``|log pi_new - log pi_old|`` seen while re-scoring, before any update.

    Wraps the step log-prob function handed to :func:`flowrl.objectives.chunk_gradient.lean_chunk_backward`
    and reads every recomputation of a selected transition, with or without grad (the lean
    update scores the last position of each chunk only with grad), so the check costs no extra
    forward. Before the first optimizer step every call is on-policy. It is stricter than
    looking at unit ratios: a per-step error cannot cancel inside a chunk mean.
    """

    def __init__(self):
        self.max_abs = 0.0
        self.fed = False  # an objective without log-probs never feeds it

    def wrap(self, fn: StepLogProbFn, old_lp: torch.Tensor) -> StepLogProbFn:
        """``fn(t, b, grad)`` with ``old_lp [len(micro-batch), T]`` the rollout log-probs."""

        def probed(t: int, b: torch.Tensor, grad: bool) -> torch.Tensor:
            lp = fn(t, b, grad)
            self.observe(lp, old_lp[b, t])
            return lp

        return probed

    def wrap_forward(self, forward, old_lp: torch.Tensor):
        """The same check for ``forward(t, b) -> (log_prob, extra)`` (the fast path with a KL term)."""

        def probed(t: int, b: torch.Tensor):
            lp, extra = forward(t, b)
            self.observe(lp, old_lp[b, t])
            return lp, extra

        return probed

    def observe(self, lp: torch.Tensor, old: torch.Tensor) -> None:
        self.fed = True
        d = float((lp.detach().float() - old.float()).abs().max())
        if not d <= self.max_abs:  # also catches NaN
            self.max_abs = d


def update_aggregate(key: str) -> str:
    """How a per-micro-batch update metric combines over micro-batches and processes."""
    if key.endswith("min"):
        return "min"
    if key.endswith("max") or key == "recompute_mismatch":
        return "max"
    if key == "num_units":  # units trained in the iteration, whatever the micro-batching
        return "sum"
    return "mean"


@dataclasses.dataclass
class UpdateOutcome:
    """What one iteration's update did: the LR of its first step, the on-policy deviation
    (None when nothing was trained), the chunks each local sample trained in the first pass
    (``[S_local, K]``), whether a step was skipped for non-finite values, and its metrics
    (aggregated over micro-batches and processes)."""

    lr: float
    trained: torch.Tensor
    skipped: bool
    on_policy: float | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


class PolicyUpdate:
    """What the update keeps across iterations: the trainable parameters, the KL reference,
    AdamW and its LR schedule."""

    def __init__(self, run: Run):
        session, geometry, ctx = run.session, run.geometry, run.ctx
        train, loss, model = session.recipe.train, session.components.loss, session.model
        self.session, self.geometry, self.ctx = session, geometry, ctx  # what the objectives read
        params = prepare_trainable(model, train)
        # what the update optimises: the [loss] component itself when it owns the backward
        # (flowrl.interfaces.Objective), else the ratio-based family around it
        self.objective = objective_for(loss)
        # KL regularisation: the reference is fixed now, before any update (and before a resume
        # loads trained weights), and before sharding (a frozen copy is a plain module). The
        # old-policy kind needs no reference model.
        kl = isinstance(loss, KLRegularised)
        self.beta = float(loss.beta or 0.0) if kl else 0.0
        self.kl_kind = loss.kl if kl else "gaussian_exact"
        self.reference = ReferencePolicy(model) if self.beta > 0 and self.kl_kind != "old_policy_k3" else None
        # [distributed]: the denoiser placed, replicated or sharded, and the optimizer rebound to
        # the parameters as the strategy holds them (docs/distributed.md)
        self.strategy = Strategy.from_recipe(session.recipe.distributed, session.device, ctx)
        self.optimizer = make_optimizer(params, train, self.strategy.kind, session.device, session.recipe.source)
        model.denoiser = self.strategy.prepare(model.denoiser, self.optimizer, declared_blocks(model))
        if self.reference is not None and self.reference.frozen is not None:  # laid out like the denoiser,
            # the engine's copy or the adapter's own (else a whole copy on every GPU that the plan never counted)
            self.reference.frozen = self.strategy.prepare_frozen(self.reference.frozen, on_cpu=train.reference_on_cpu)
        self.params = self.strategy.params
        self.lockstep = distributed.AnyRank(ctx) if self.strategy.lockstep else None
        self.scheduler = make_scheduler(self.optimizer, train, geometry)
        self.fast_path = train.fast_path
        self.auto_mode: str | None = None  # update_mode "auto", decided on the first off-policy step
        self.counter = ComputeCounter(session.model.denoiser)
        if self.reference is not None and self.reference.frozen is not None:
            self.counter.watch(self.reference.frozen)
        self.rows_per_sample = network_rows_per_sample(session.model)
        self.objective.prepare(self)

    def make_scorer(self, batch, step_ratio=None) -> TransitionScorer:
        """The re-scorer of this rollout's trainable transitions (policy and reference)."""
        return TransitionScorer(self.session.model, batch.trajectory, batch.text, self.reference, self.counter,
                                step_ratio=step_ratio)

    def run(self, batch, sizes: tuple[int, ...]) -> UpdateOutcome:
        """Every pass and optimizer step of this rollout (none when the rewards were not finite:
        then there is nothing to train, and the update counts as skipped)."""
        g, seed = self.geometry, self.session.recipe.run.seed
        out = UpdateOutcome(lr=self.scheduler.get_last_lr()[0],  # the LR this iteration's first step uses
                            trained=torch.zeros(len(batch.indices), len(sizes), dtype=torch.bool),
                            skipped=batch.advantages is None)
        self.counter.expect("rollout", batch.trajectory.num_steps * len(batch.indices) * self.rows_per_sample)
        if not out.skipped:
            self.objective.start_rollout(self, batch, sizes)
        metrics: dict[str, list[float]] = defaultdict(list)
        per_step = g.micro_batch_size * g.grad_accumulation  # samples per optimizer step, per process
        for epoch in range(0 if out.skipped else g.updates_per_rollout):
            order = torch.randperm(len(batch.indices), generator=generator(seed, "order", batch.iteration, epoch, self.ctx.rank))
            for opt_step in range(g.optimizer_steps_per_update):
                rows = order[opt_step * per_step : (opt_step + 1) * per_step]
                first = epoch == 0 and opt_step == 0  # exactly on-policy: checked
                if not self._optimizer_step(batch, rows, sizes, epoch, out, metrics, first):
                    out.skipped = True
        local = {k: {"min": min, "max": max, "sum": sum}.get(update_aggregate(k), lambda xs: sum(xs) / len(xs))(v)
                 for k, v in metrics.items()}
        out.metrics = distributed.reduce_metrics(local, {k: update_aggregate(k) for k in local}, self.ctx)
        if not (batch.advantages is None):
            out.metrics.update(self.objective.end_rollout(self, batch))
        return out

    def _optimizer_step(self, batch, rows, sizes, epoch, out, metrics, check_on_policy) -> bool:
        """One AdamW step over ``rows`` (this process's samples of the step, in micro-batches).
        Returns False when it was skipped for a non-finite loss or gradient."""
        g, train = self.geometry, self.session.recipe.train
        per_step = g.micro_batch_size * g.grad_accumulation
        self.strategy.zero_grad()
        probe = OnPolicyProbe() if check_on_policy else None
        step_loss = 0.0
        with self.strategy.accumulate():  # gradients are reduced once, on leaving the block
            for start in range(0, len(rows), g.micro_batch_size):
                idx = rows[start : start + g.micro_batch_size]
                # the objective owns the micro-batch's forward and backward (flowrl.train.objective)
                res = self.objective.backward(self, MicroBatch(batch, idx, tuple(sizes), epoch, per_step,
                                                               check_on_policy, probe))
                if epoch == 0:
                    out.trained[idx] = res.trained.cpu()
                for term in res.losses:  # in order, as the terms were always summed
                    step_loss += term
                for k, v in res.metrics.items():
                    metrics[k].append(float(v))
        if probe is not None:  # on every process: one whose rows all have zero advantage fed nothing
            out.on_policy = self._check_on_policy(probe)
        grad_norm = self.strategy.clip_grad_norm_(train.max_grad_norm if train.max_grad_norm > 0 else float("inf"))
        # grad_norm is global after the reduction; the loss is summed so that every process
        # takes the same skip decision.
        step_loss = distributed.all_reduce_scalar(step_loss, self.ctx) / self.ctx.world_size
        if not (math.isfinite(step_loss) and math.isfinite(float(grad_norm))):
            self.strategy.zero_grad()
            return False
        self.strategy.step()
        self.scheduler.step()
        metrics["loss"].append(step_loss)
        metrics["grad_norm"].append(float(grad_norm))
        return True

    def micro_batch_backward(self, scorer, old_lp, advantages, idx, mask, sizes, probe, *, fast, normaliser,
                             recorder=None, kl_direction="old_theta", kl_weights=None):
        """Back-propagate one micro-batch's loss and KL term: the fast path on-policy, otherwise
        the chunk-graph or lean update (``[train].update_mode``). Returns (loss, unit metrics,
        (mean KL, KL term) or None). ``recorder`` (:class:`flowrl.objectives.policy_gradient.StepRecorder`)
        sees every re-scored log-prob; ``kl_direction`` and ``kl_weights`` (per-sample ``[B]``)
        go to the KL pass."""
        objective = self.session.components.loss.objective
        fn = scorer.log_prob_fn(idx)
        if probe is not None:
            fn = probe.wrap(fn, old_lp[idx])
        if recorder is not None:
            fn = recorder.wrap(fn, old_lp[idx])
        args = (fn, old_lp[idx], advantages[idx], sizes, mask, objective)
        lockstep = self.lockstep
        if not fast and self._mode(scorer, idx, sizes) == "lean":
            loss, m = lean_chunk_backward(*args, normaliser=normaliser, lockstep=lockstep)
            if self.beta <= 0:
                return loss, m, None
            return loss, m, kl_backward(scorer, idx, mask, sizes, old_lp=old_lp, kind=self.kl_kind, beta=self.beta,
                                        normaliser=normaliser, lockstep=lockstep, direction=kl_direction,
                                        sample_weights=kl_weights)
        kl = KLTerm(scorer, idx, mask, sizes, old_lp, self.kl_kind, self.beta, normaliser, direction=kl_direction,
                    sample_weights=kl_weights) if self.beta > 0 else None
        forward = kl.forward if kl is not None else None
        if forward is not None and probe is not None:
            forward = probe.wrap_forward(forward, old_lp[idx])
        if forward is not None and recorder is not None:
            forward = recorder.wrap_forward(forward, old_lp[idx])
        if fast:
            loss, m = on_policy_chunk_backward(*args, normaliser=normaliser, forward_with_extra=forward, lockstep=lockstep)
        else:
            many = scorer.many_fn(idx)
            if recorder is not None:
                many = recorder.wrap_many(many, old_lp[idx])
            loss, m = chunk_graph_backward(*args, normaliser=normaliser, forward_with_extra=forward,
                                           many=many, lockstep=lockstep)
        return loss, m, (kl.result() if kl is not None else None)

    def expect_update(self, advantages: torch.Tensor, mask: torch.Tensor, sizes) -> None:
        """The minimum work of a micro-batch: each trained transition whose gradient is not zero
        (non-zero advantage, or any with a KL term) once forward and backward; one reference
        forward per trained transition for the reference KL kinds."""
        size = torch.tensor(sizes, device=mask.device)
        adv = advantages if advantages.ndim == 2 else advantages[:, None].expand(mask.shape)
        trained = int((mask * size).sum())
        live = trained if self.beta > 0 else int((mask & (adv != 0)).mul(size).sum())
        self.counter.expect("update", live * self.rows_per_sample)
        if self.beta > 0 and self.reference is not None:
            self.counter.expect("reference", trained * self.rows_per_sample)

    def _mode(self, scorer, idx, sizes) -> str:
        """``lean`` or ``chunk_graph`` for an off-policy micro-batch (``auto``: measured once)."""
        mode = self.session.recipe.train.update_mode
        if mode != "auto":
            return mode
        if self.auto_mode is None:  # decided once per run (and checkpointed, so a resume keeps it)
            with self.counter.paused():
                per_step = activation_bytes(lambda: scorer.step(0, idx, grad=True).log_prob)
            budget = free_memory_bytes(self.session.device) / 2
            fits = max(sizes) * per_step <= budget
            # every process takes the same mode (under FSDP2 they must make the same calls)
            self.auto_mode = "lean" if distributed.any_rank(not fits, self.ctx) else "chunk_graph"
        return self.auto_mode

    def _check_on_policy(self, probe: OnPolicyProbe) -> float | None:
        """The largest deviation any process saw (None when no process re-scored anything). A
        collective: every process calls it, whether or not its own probe was fed."""
        seen = distributed.reduce_metrics({"deviation": probe.max_abs, "fed": float(probe.fed)},
                                          {"deviation": "max", "fed": "max"}, self.ctx)
        if not seen["fed"]:
            return None
        deviation = seen["deviation"]
        tolerance = self.session.recipe.train.on_policy_tolerance
        if not deviation <= tolerance:
            raise FlowrlError(
                f"on-policy check failed: max |log pi_new - log pi_old| = {deviation:.3g} > "
                f"{tolerance:g} before any update; rollout and training log-probs disagree",
                where=f"{self.session.recipe.source}: [train].on_policy_tolerance",
                hint="the model adapter must be deterministic for a given batch (dropout? dtype casts?)",
            )
        return deviation

    # ---------------------------------------------------------------------- checkpointed state

    def state_dict(self) -> dict[str, Any]:
        """The update's entries of a checkpoint's ``state.json``: the LR schedule's position, the
        mode ``update_mode = "auto"`` chose (null until it chose), and the objective's own state
        when it keeps one (an old policy, a reset reference, an adaptive gate). The weights and
        AdamW are the strategy's (:func:`flowrl.train.checkpoint.write_checkpoint`)."""
        out: dict[str, Any] = {"lr_scheduler": self.scheduler.state_dict(), "update_mode": self.auto_mode}
        if isinstance(self.objective, CheckpointsState):
            out[OBJECTIVE] = self.objective.state_dict()
        return out

    def checkpoint_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """The objective's tensors, under the name a checkpoint keeps them by (none when it has none)."""
        tensors = self.objective.tensors() if isinstance(self.objective, CheckpointsState) else {}
        return {OBJECTIVE: tensors} if tensors else {}

    def load_state_dict(self, state: dict[str, Any], tensors: dict[str, dict[str, torch.Tensor]]) -> None:
        """Continue from a checkpoint's ``state.json`` and named tensors (as written above)."""
        self.scheduler.load_state_dict(state["lr_scheduler"])
        self.auto_mode = state.get("update_mode")
        if isinstance(self.objective, CheckpointsState) and OBJECTIVE in state:
            self.objective.load_state(state[OBJECTIVE], tensors.get(OBJECTIVE) or {})


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
