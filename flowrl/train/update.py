"""The update phase: advantages over whole groups, then the policy update.

One rollout is used for ``updates_per_rollout`` passes; each pass takes
``optimizer_steps_per_update`` AdamW steps, each over ``grad_accumulation`` micro-batches.
:class:`PolicyUpdate` owns the optimizer, its LR schedule, the distributed strategy, the passes,
gradient clipping, skipping non-finite steps and the on-policy check; per micro-batch the
objective (:mod:`flowrl.objectives`) owns the forward and backward. The update hands it the
micro-batch (:class:`flowrl.objectives.base.MicroBatch`) and a typed
:class:`flowrl.objectives.base.UpdateContext`, never itself.

The first optimizer step of a rollout is exactly on-policy: an
:class:`~flowrl.objectives.base.OnPolicyProbe`, fed by the objective, checks that re-scoring
reproduces the rollout's log-probs (``[train].on_policy_tolerance``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from .. import distributed
from ..errors import FlowrlError
from ..interfaces import CheckpointsState, SamplesTrees, trains_on_units
from ..memory_plan import choose_gradient_sync
from ..objectives.base import MicroBatch, OnPolicyProbe, UpdateContext, UpdateMode
from ..objectives.kl import KLSettings
from ..objectives.policy_gradient import objective_for
from ..seeding import generator
from ..stop_points import stop_point
from .compute import ComputeCounter, network_rows_per_sample
from .context_parallel import sequence_tokens
from .finetune import prepare_trainable
from .checkpoint import OBJECTIVE
from .optimizer import make_optimizer, make_scheduler
from .parallel import Strategy, Topology, declared_blocks, resolve_strategy
from .replay import replay_optimizer_steps
from .run import Run


#: Seconds inside the update (``time/update/<part>``, a breakdown of ``time/update``, so not a phase
#: of its own), each summed over the iteration's optimizer steps (a replayed rollout's included),
#: on this process as its ``time/*`` are: ``micro_batches`` (the objective's forwards and backwards,
#: re-scoring included, the KL monitor's ``time/kl_monitor`` not), ``gradient_sync`` (the gradients'
#: reduction over processes once the step's micro-batches are done: DDP's all-reduce, FSDP2's
#: reduce-scatter; FSDP2 with ``gradient_sync = "micro_batch"`` reduces inside the backwards),
#: ``optimizer`` (clipping with its norm's all-reduce, the skip decision, AdamW and the LR schedule).
UPDATE_TIME = "time/update/"


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
    AdamW and its LR schedule, and the :class:`~flowrl.objectives.base.UpdateContext` its
    objective works in."""

    def __init__(self, run: Run):
        session, geometry, ctx = run.session, run.geometry, run.ctx
        train, loss, model = session.recipe.train, session.components.loss, session.model
        self.session, self.geometry, self.ctx = session, geometry, ctx
        params = prepare_trainable(model, train, session.recipe.run.seed)
        # what the update optimises: the [loss] component itself when it owns the backward
        # (flowrl.interfaces.Objective), else the ratio-based family around it
        self.objective = objective_for(loss)
        # KL regularisation: the reference is fixed now, before any update (and before a resume
        # loads trained weights), and before sharding (a frozen copy is a plain module). The
        # old-policy kind needs no reference model.
        kl = KLSettings.of(loss, model, session.recipe.log.kl_every)  # [log].kl_every: a reference to measure against
        # [distributed]: the denoiser placed, replicated or sharded, and the optimizer rebound to
        # the parameters as the strategy holds them (docs/distributed.md)
        self.strategy = Strategy.from_recipe(session.recipe.distributed, session.device, ctx,
                                             gradient_sync=gradient_sync(session, ctx))
        self.optimizer = make_optimizer(params, train, self.strategy.kind, session.device, session.recipe.source)
        model.denoiser = self.strategy.prepare(model.denoiser, self.optimizer, declared_blocks(model),
                                               tokens=sequence_tokens(model), attention=train.attention_backend)
        if kl.reference is not None and kl.reference.frozen is not None:  # laid out like the denoiser,
            # the engine's copy or the adapter's own (else a whole copy on every GPU that the plan never counted)
            kl.reference.frozen = self.strategy.prepare_frozen(kl.reference.frozen, on_cpu=train.reference_on_cpu)
        self.params = self.strategy.params
        self.scheduler = make_scheduler(self.optimizer, train, geometry,
                                        replay_optimizer_steps(session.recipe.replay, train.iterations, geometry))
        self.counter = ComputeCounter(session.model.denoiser)
        self.seconds: dict[str, float] = defaultdict(float)  # the update's parts (take_seconds)
        if kl.reference is not None and kl.reference.frozen is not None:
            self.counter.watch(kl.reference.frozen)
        self.context = UpdateContext(
            model=model, device=session.device, seed=session.recipe.run.seed, process=ctx, counter=self.counter,
            selector=session.components.selector,
            lockstep=distributed.AnyRank(ctx) if self.strategy.lockstep else None,
            params=self.params, kl=kl, fast_path=train.fast_path, update_mode=UpdateMode(train.update_mode),
            update_group=train.update_group,
            samples_per_process=geometry.samples_per_process, rows_per_sample=network_rows_per_sample(model),
            optimizer_steps=lambda: self.scheduler.last_epoch)
        self.objective.prepare(self.context)
        # FP8 rollouts whose own log-probs stay the ratio's denominator ([sampler].rollout_correction =
        # "importance"): the first step's ratios are importance weights, not 1 (flowrl.sampling.precision)
        sampler = session.recipe.sampler
        self.behaviour_differs = (sampler.rollout_precision == "fp8" and sampler.rollout_correction == "importance"
                                  and trains_on_units(self.objective))

    @property
    def auto_mode(self) -> str | None:
        """``update_mode = "auto"``: the mode decided on the first off-policy step (None before);
        checkpointed, so that a resumed run keeps it."""
        return self.context.update_mode.decided

    @auto_mode.setter
    def auto_mode(self, mode: str | None) -> None:
        self.context.update_mode.decided = mode

    def run(self, batch, sizes: tuple[int, ...], first_epoch: int = 0) -> UpdateOutcome:
        """Every pass and optimizer step of this rollout (none when the rewards were not finite:
        then there is nothing to train, and the update counts as skipped). ``first_epoch``: the
        number of the first pass; a replayed rollout (:mod:`flowrl.train.replay`) starts past the
        passes it was already trained with, so that its chunk selections and orders are new
        draws. Its log-probs were re-scored with the current weights just before, so its first
        optimizer step is on-policy too (checked)."""
        g, seed = self.geometry, self.session.recipe.run.seed
        out = UpdateOutcome(lr=self.scheduler.get_last_lr()[0],  # the LR this iteration's first step uses
                            trained=torch.zeros(len(batch.indices), len(sizes), dtype=torch.bool),
                            skipped=not batch.trainable)
        if first_epoch == 0 and batch.trajectory is not None:  # a replayed rollout was counted when collected;
            # offline rows were never sampled
            full = batch.trajectory.num_steps * len(batch.indices)
            window = self.session.components.window  # a tree computes each shared prefix once
            run = full if not isinstance(window, SamplesTrees) else len(batch.indices) // g.group_size * (
                window.tree().forward_rows(batch.trajectory.num_steps, g.group_size))
            self.counter.expect("rollout", run * self.context.rows_per_sample)
            self.counter.saved("rollout", (full - run) * self.context.rows_per_sample)
        if not out.skipped:
            self.objective.start_rollout(self.context, batch, sizes)
        metrics: dict[str, list[float]] = defaultdict(list)
        per_step = g.micro_batch_size * g.grad_accumulation  # samples per optimizer step, per process
        for epoch in range(first_epoch, first_epoch + (0 if out.skipped else g.updates_per_rollout)):
            order = torch.randperm(len(batch.indices), generator=generator(seed, "order", batch.iteration, epoch, self.ctx.rank))
            for opt_step in range(g.optimizer_steps_per_update):
                rows = order[opt_step * per_step : (opt_step + 1) * per_step]
                # exactly on-policy: checked (not after FP8 rollouts kept as the importance denominator)
                first = epoch == first_epoch and opt_step == 0 and not self.behaviour_differs
                if not self._optimizer_step(batch, rows, sizes, epoch, out, metrics, first, epoch == first_epoch):
                    out.skipped = True
        local = {k: {"min": min, "max": max, "sum": sum}.get(update_aggregate(k), lambda xs: sum(xs) / len(xs))(v)
                 for k, v in metrics.items()}
        out.metrics = distributed.reduce_metrics(local, {k: update_aggregate(k) for k in local}, self.ctx)
        if batch.trainable:
            out.metrics.update(self.objective.end_rollout(self.context, batch))
        return out

    def _optimizer_step(self, batch, rows, sizes, epoch, out, metrics, check_on_policy, first_pass) -> bool:
        """One AdamW step over ``rows`` (this process's samples of the step, in micro-batches;
        every process has as many, so the run may stop before each: :mod:`flowrl.stop_points`).
        Returns False when it was skipped for a non-finite loss or gradient."""
        g = self.geometry
        per_step = g.micro_batch_size * g.grad_accumulation
        self.strategy.zero_grad()
        probe = OnPolicyProbe() if check_on_policy else None
        step_loss = 0.0
        began, measured = self._now(), self._measured()
        with self.strategy.accumulate():  # gradients are reduced once, on leaving the block
            for start in range(0, len(rows), g.micro_batch_size):
                stop_point()
                idx = rows[start : start + g.micro_batch_size]
                # the objective owns the micro-batch's forward and backward (flowrl.objectives)
                res = self.objective.backward(self.context, MicroBatch(batch, idx, tuple(sizes), epoch, per_step,
                                                                       check_on_policy, probe,
                                                                       replayed=epoch >= g.updates_per_rollout))
                if first_pass:
                    out.trained[idx] = res.trained.cpu()
                for term in res.losses:  # in order, as the terms were always summed
                    step_loss += term
                for k, v in res.metrics.items():
                    metrics[k].append(float(v))
            computed = self._now()
        reduced = self._now()
        self.seconds["micro_batches"] += computed - began - (self._measured() - measured)
        self.seconds["gradient_sync"] += reduced - computed
        try:
            return self._step(step_loss, probe, out, metrics)
        finally:
            self.seconds["optimizer"] += self._now() - reduced

    def take_seconds(self) -> dict[str, float]:
        """``time/update/<part>`` since the last call (:data:`UPDATE_TIME`): the iteration's update,
        its replayed rollouts' included; then forgotten."""
        taken, self.seconds = {UPDATE_TIME + k: v for k, v in self.seconds.items()}, defaultdict(float)
        return taken

    def _step(self, step_loss, probe, out, metrics) -> bool:
        """Clip, decide together whether the step is finite, then step AdamW and the LR schedule."""
        train = self.session.recipe.train
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

    def _now(self) -> float:
        """A time stamp after the device's queued work (on CUDA: synchronised, so the parts are real)."""
        if self.session.device.type == "cuda":
            torch.cuda.synchronize(self.session.device)
        return time.perf_counter()

    def _measured(self) -> float:
        """Seconds the objective's measurements took so far (the KL monitor: ``time/kl_monitor``)."""
        return sum(self.counter.measured_seconds.values())

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

    def follow_schedule(self) -> tuple[float, float] | None:
        """After a resume: the LR the schedule gives this step now. A checkpoint keeps the schedule's
        position, not its length, so a resume with more (or fewer) iterations plans a decaying
        schedule (cosine, linear) over the new length, and the optimizer's LR, restored as the old
        schedule left it, would jump to the new one only after the first step. It is set to the new
        schedule's at once; returns ``(restored, now)`` when they differ, None when not."""
        s = self.scheduler
        now = [base * f(s.last_epoch) for base, f in zip(s.base_lrs, s.lr_lambdas)]
        restored = [group["lr"] for group in self.optimizer.param_groups]
        if all(math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0) for a, b in zip(restored, now)):
            return None
        for group, lr in zip(self.optimizer.param_groups, now):
            group["lr"] = lr
        s._last_lr = list(now)  # what get_last_lr() reports (the first resumed row's lr)
        return restored[0], now[0]

    def load_state_dict(self, state: dict[str, Any], tensors: dict[str, dict[str, torch.Tensor]]) -> None:
        """Continue from a checkpoint's ``state.json`` and named tensors (as written above)."""
        self.scheduler.load_state_dict(state["lr_scheduler"])
        self.auto_mode = state.get("update_mode")
        if isinstance(self.objective, CheckpointsState) and OBJECTIVE in state:
            self.objective.load_state(state[OBJECTIVE], tensors.get(OBJECTIVE) or {})


def gradient_sync(session, ctx) -> str:
    """``[distributed].gradient_sync`` for this run: ``"auto"`` plans against the GPU's memory
    (:func:`flowrl.memory_plan.choose_gradient_sync`; a CPU has no such limit: ``"step"``)."""
    recipe, config = session.recipe, session.recipe.distributed
    if config.gradient_sync != "auto":
        return config.gradient_sync
    if resolve_strategy(config, ctx.process_count) != "fsdp2":
        return "step"
    if config.strategy != "fsdp2":  # "auto" that the launcher made fsdp2: plan it as such
        recipe = dataclasses.replace(recipe, distributed=dataclasses.replace(config, strategy="fsdp2"))
    device = session.device
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    return choose_gradient_sync(recipe, session.registry, ctx.process_count, Topology.from_context(ctx).num_nodes,
                                memory)[0]

