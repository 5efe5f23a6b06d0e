"""One-step-off pipelining (``[pipeline]``): the rollout of iteration i + 1 overlaps update i.

With ``staleness = 1`` the rollouts are drawn by a second copy of the policy (the behaviour
policy), never by the weights being trained:

- the copy starts as the initial weights; the trained weights are copied into it every
  ``sync_every`` updates (k), just before the update of an iteration i with i % k == 0;
- as soon as update i starts, the rollout of iteration i + 1 is drawn by the copy, in a worker
  thread (``overlap = true``: torch releases the GIL inside its kernels, so the rollout and the
  update use two cores) or first, in order (``overlap = false``: the same draws, no overlap);
- update i then trains on rollout i, drawn by the copy one to k updates earlier: it is
  re-scored with the current weights (its "old" policy, so the first optimizer step is exactly
  on-policy, and checked) and its advantages multiplied by truncated importance weights against
  the log-probs recorded when it was drawn (:func:`flowrl.train.replay.importance_corrected`,
  the same correction a replayed rollout gets). Rollout 0 is drawn by the initial weights, the
  weights update 0 starts from: it is trained on as it is.

Which weights drew which rollout is fixed by the iteration alone: rollout j (j >= 1) is drawn by
the weights before update ``k * floor((j - 1) / k)`` (staleness ``j - k * floor((j - 1) / k)``,
1 to k), so the worker thread and the in-order form, any number of processes, and a resumed run
all draw the same rollouts. The worker only draws and scores (no collective): advantages, the
correction and the update stay in the main thread; the worker is waited for before anything
else reads the model (evaluation, checkpoint). A run asked to stop (:mod:`flowrl.stop_points`)
stops the worker thread at its next model call, and the main thread's wait for it; a rollout
process still drawing when the run ends is killed (its rollout is not checkpointed: see below).

Resume: the pending rollout is not checkpointed; the behaviour weights are (``pipeline.safetensors``,
the copy's trainable parameters, and ``state.json``'s ``pipeline`` entry: the iteration whose
starting weights they are). A resumed run redraws the pending rollout with them, which draws it
bit for bit as the uninterrupted run did (every draw is seeded by the iteration and sample).
With ``staleness = 0`` nothing here is built and the loop is the synchronous one.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..stop_points import carried, wait_for
from .collect import Batch, collect
from .compute import ComputeCounter
from .parallel import unwrap_module
from .progress import PhaseTimer
from .replay import WeightStats, importance_corrected
from .rollout_worker import RolloutProcess, rollout_device
from .run import Run

#: The name the behaviour weights are checkpointed under (``pipeline.safetensors``, ``state.json``).
PIPELINE = "pipeline"


def behaviour_iteration(j: int, sync_every: int) -> int:
    """The iteration whose starting weights draw rollout ``j`` (the weights before that
    iteration's update): 0 for the first two rollouts, then the last sync before update j."""
    return 0 if j == 0 else sync_every * ((j - 1) // sync_every)


@dataclasses.dataclass
class Pending:
    """A rollout drawn (or being drawn) by the copy: its iteration, the iteration whose weights
    drew it, and the draw (a future in the worker thread, or the finished result)."""

    iteration: int
    version: int
    result: Future


class Pipeline:
    """The ``[pipeline]`` phase of the loop: the behaviour copy, the pending rollout, the correction."""

    def __init__(self, run: Run, prompts, counter: ComputeCounter | None = None):
        self.run, self.prompts, self.config = run, prompts, run.session.recipe.pipeline
        self.iterations = run.session.recipe.train.iterations
        self.counter = ComputeCounter()  # the copy's forwards, added to the iteration's own when taken
        self.live = unwrap_module(run.session.model.denoiser)
        self.trainable = [name for name, p in self.live.named_parameters() if p.requires_grad]
        self.version = 0  # the iteration whose starting weights the copy holds
        self.pending: Pending | None = None
        self.taken: tuple[int, int, dict[str, float]] = (-1, 0, {})  # (iteration, staleness, draw seconds)
        self.copy = self.worker = None
        if self.config.worker == "process":  # the copy lives in a rollout process (rollout_worker.py)
            session = run.session
            device = rollout_device(self.config.device, session.device, run.ctx.local_rank)
            self.worker = RolloutProcess(session.recipe, run.geometry, run.ctx, prompts, device, session.device)
            self._send_weights(self._trained_weights())
        else:
            # the engine's counter hook (if the live module has it) is copied onto the new counter
            memo = {id(counter): self.counter} if counter is not None else {}
            denoiser = copy.deepcopy(self.live, memo).requires_grad_(False)
            if not any(getattr(h, "__self__", None) is self.counter for h in denoiser._forward_hooks.values()):
                self.counter.watch(denoiser)
            model = copy.copy(run.session.model)  # the adapter, sharing everything but the denoiser
            model.denoiser = denoiser
            session = dataclasses.replace(run.session, components=dataclasses.replace(run.session.components, model=model))
            self.behaviour = dataclasses.replace(run, session=session)
            self.copy = denoiser
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flowrl-rollout") if self.config.overlap else None

    @classmethod
    def attach(cls, run: Run, prompts, counter: ComputeCounter | None = None) -> "Pipeline | None":
        """The pipeline, or None with ``staleness = 0`` (the synchronous loop)."""
        return cls(run, prompts, counter) if run.session.recipe.pipeline.enabled else None

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        try:
            drawing = self.pending is not None and not self.pending.result.done()
            if drawing and self.worker is not None:  # a rollout no one will take (the run ends): not waited for
                self.worker.abandon()
            if self.pool is not None:  # a rollout being drawn is finished, or stopped at its next stop point
                self.pool.shutdown(wait=True, cancel_futures=True)
        finally:
            if self.worker is not None:
                self.worker.close()

    # ---------------------------------------------------------------------- the loop's calls

    def take(self, iteration: int, timer) -> Batch:
        """The rollout of ``iteration``: the one drawn during the previous update, or (the first
        iteration, after a resume) drawn now by the copy. Its draw's seconds go into the row as
        ``time/pipeline/<phase>``; the main thread's wait as ``rollout_wait``."""
        if self.pending is None or self.pending.iteration != iteration:
            self.pending = Pending(iteration, self.version, self._draw_now(iteration))
        with timer("rollout_wait"):
            batch, seconds = wait_for(self.pending.result)
        self.taken = (iteration, iteration - self.pending.version, seconds)
        self.pending = None
        self._merge_counts(timer)
        return batch

    def start_next(self, batch: Batch) -> None:
        """Before update ``batch.iteration``: copy the trained weights into the behaviour policy
        when a sync is due, then start drawing the next iteration's rollout with it."""
        i = batch.iteration
        if i % self.config.sync_every == 0 and self.version != i:
            self._sync(i)
        if i + 1 < self.iterations:
            draw = self.pool.submit(carried(self._draw), i + 1) if self.pool is not None else self._draw_now(i + 1)
            self.pending = Pending(i + 1, self.version, draw)

    def corrected(self, batch: Batch, sizes, timer) -> tuple[Batch, dict[str, Any]]:
        """The rollout (the one just taken) as update ``batch.iteration`` trains on it: re-scored
        and importance-weighted when an older policy drew it (as it is when the current weights
        did); ``pipeline/*`` metrics. A collective when weighted (every process has the same
        staleness)."""
        iteration, staleness, seconds = self.taken
        if iteration != batch.iteration:
            raise ValueError(f"the rollout of iteration {batch.iteration} was not taken from the pipeline")
        record: dict[str, Any] = {"pipeline/staleness": staleness}
        record.update({f"time/pipeline/{k}": v for k, v in seconds.items()})
        if staleness == 0 or batch.advantages is None:
            return batch, record
        c, session = self.config, self.run.session
        with timer("pipeline"):
            batch, w, truncated = importance_corrected(batch, sizes, session.model,
                                                       session.recipe.train.micro_batch_size, c.weight_level, 0,
                                                       c.truncate)
        stats = WeightStats(PIPELINE)
        stats.add(w, truncated, staleness)
        record.update(stats.metrics(self.run.ctx))
        return batch, record

    def settle(self, timer) -> None:
        """Wait for the next rollout (its failure is raised here), so that nothing else reads the
        model while it is drawn."""
        if self.pending is not None:
            with timer("rollout_wait"):
                wait_for(self.pending.result)

    # ---------------------------------------------------------------------- drawing

    def _draw(self, iteration: int) -> tuple[Batch, dict[str, float]]:
        """Collect the iteration's rollout with the behaviour copy; its own phase timer."""
        if self.worker is not None:
            batch, seconds, counts = self.worker.draw(iteration)
            self.counter.add(counts)
            return batch, seconds
        timer = PhaseTimer(self.run.session.device, counter=self.counter)
        start = time.perf_counter()
        with torch.no_grad():
            batch = collect(self.behaviour, self.prompts, iteration, timer)
        return batch, {**timer.seconds, "total": time.perf_counter() - start}

    def _draw_now(self, iteration: int) -> Future:
        future: Future = Future()
        try:
            future.set_result(self._draw(iteration))
        except BaseException as exc:  # raised when taken, as a worker's failure would be
            future.set_exception(exc)
        return future

    def _trained_weights(self) -> dict[str, torch.Tensor]:
        """CPU copies of the trained parameters, by name."""
        live = dict(self.live.named_parameters())
        return {name: live[name].detach().cpu().clone() for name in self.trainable}

    def _send_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """The rollout process's behaviour weights: sent, and kept here for the checkpoint."""
        self.sent = weights
        self.worker.load(weights)

    def _sync(self, iteration: int) -> None:
        if self.worker is not None:
            self._send_weights(self._trained_weights())
            self.version = iteration
            return
        live = dict(self.live.named_parameters())
        mine = dict(self.copy.named_parameters())
        with torch.no_grad():
            for name in self.trainable:
                mine[name].copy_(live[name])
        self.version = iteration

    def _merge_counts(self, timer) -> None:
        """Add the copy's counted work (the rollout's forwards, the decoded samples) to the
        engine's counter, so that the iteration's ``compute/*`` cover its rollout."""
        main = getattr(timer, "counter", None)
        if main is not None:
            main.add(self.counter.counts())
        self.counter.take()

    # ---------------------------------------------------------------------- checkpointed state

    def state_dict(self) -> dict[str, Any]:
        """``state.json``'s ``pipeline`` entry: the iteration whose starting weights the copy holds."""
        return {PIPELINE: {"behaviour_iteration": self.version}}

    def checkpoint_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """The copy's trainable parameters (the others are the base model's), as on every process."""
        if self.worker is not None:
            return {PIPELINE: {name: t.clone() for name, t in self.sent.items()}}
        params = dict(self.copy.named_parameters())
        return {PIPELINE: {name: params[name].detach().cpu().clone() for name in self.trainable}}

    def load_state_dict(self, state: dict[str, Any], tensors: dict[str, dict[str, torch.Tensor]]) -> None:
        saved, weights = state.get(PIPELINE), tensors.get(PIPELINE) or {}
        missing = [name for name in self.trainable if name not in weights]
        if saved is None or missing:
            raise ValueError(f"the checkpoint holds no behaviour weights for [pipeline] staleness = 1 "
                             f"({len(missing)} of {len(self.trainable)} missing)")
        self.version = int(saved["behaviour_iteration"])
        if self.worker is not None:
            self._send_weights({name: weights[name].detach().cpu().clone() for name in self.trainable})
            return
        params = dict(self.copy.named_parameters())
        with torch.no_grad():
            for name in self.trainable:
                params[name].copy_(weights[name].to(params[name].device))


__all__ = ["PIPELINE", "Pipeline", "behaviour_iteration"]
