"""What a training checkpoint holds, and how a run resumes from one.

A checkpoint (layout in :mod:`flowrl.train.checkpoint`) holds the trainable weights, AdamW's
state, the RNG states and ``state.json``::

    iteration         completed iterations: the next one to run        TrainState
    nonfinite_steps   updates skipped so far for non-finite values     TrainState
    data_position     prompts consumed (iteration x prompts per iteration)
    world_size        processes that wrote it
    lr_scheduler      the LR schedule's position                       PolicyUpdate
    update_mode       what ``[train] update_mode = "auto"`` chose      PolicyUpdate
                      (null until an off-policy step)
    objective         the objective's own state (one that keeps any)   PolicyUpdate
    chunk_sizes       the chunk layout in use (moved by adaptive       ChunkLayout
                      re-profiling)
    selector_l1rel    the weighted selector's L1rel curve in use, or   ChunkLayout
                      null
    ema               EMA updates and optimizer steps counted (only    WeightEMA
                      with [ema] enabled)
    replay            the iterations of the kept rollouts (only with   Replay
                      [replay] on; their tensors: replay.safetensors)

Each part (right) writes and reads its own entries, ``state_dict()`` and ``load_state_dict()``;
the EMA weights (``ema.safetensors``) and the objective's tensors are that part's named tensors
(``checkpoint_tensors()``); the weights, AdamW and the RNG are the strategy's
(:func:`flowrl.train.checkpoint.write_checkpoint`). Resuming restores every one of them, so a
resumed run repeats exactly what the uninterrupted run would have done. Only iterations, ``[log]``,
``[checkpoint]`` and ``[[trackers]]`` may differ from the recipe that started the run.

:class:`Checkpointer` decides when to write one: every ``[checkpoint].every`` iterations, every
``[checkpoint].every_minutes`` minutes, at the end, and when the run is stopped.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from .. import distributed
from ..errors import FlowrlError, counted
from ..recipe import dump_toml
from .checkpoint import checkpoint_iteration, latest_checkpoint, read_checkpoint, write_checkpoint
from .ema import EMA_KEY
from .run import Run


@dataclasses.dataclass
class TrainState:
    """Where a run is, besides its weights and optimizer."""

    iteration: int = 0  # completed iterations: the next one to run
    nonfinite_steps: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"iteration": self.iteration, "nonfinite_steps": self.nonfinite_steps}

    def load_state_dict(self, state: dict) -> None:
        self.iteration, self.nonfinite_steps = state["iteration"], state["nonfinite_steps"]


def save_training_checkpoint(run_dir: Path, run: Run, state: TrainState, update, layout, ema=None,
                             replay=None, pipeline=None) -> Path | None:
    """Write a checkpoint of the whole training state, atomically (see the module docstring):
    every stateful part's ``state_dict()`` composed into ``state.json``, its named tensors beside
    it, the weights and AdamW through the strategy (:func:`~flowrl.train.checkpoint.write_checkpoint`:
    the main process writes safetensors, or under FSDP2 every process writes its shards). Returns
    its path on the main process, None on the others."""
    recipe, parts = run.session.recipe, stateful_parts(update, layout, ema, replay, pipeline)
    info = {
        **state.state_dict(),
        "data_position": state.iteration * run.geometry.prompts_per_iteration,
        "world_size": run.ctx.world_size,
        **{k: v for part in parts for k, v in part.state_dict().items()},
    }
    return write_checkpoint(run_dir / "checkpoints", f"iter_{state.iteration:06d}", update.strategy, state=info,
                            recipe_toml=dump_toml(recipe.to_toml_dict()), keep_last=recipe.checkpoint.keep_last,
                            extra=named_tensors(parts))


def stateful_parts(update, layout, ema=None, replay=None, pipeline=None) -> list:
    """What a checkpoint keeps besides the counters (:class:`TrainState`) and the weights and
    AdamW (the strategy's): each has ``state_dict()`` (its entries of ``state.json``) and
    ``load_state_dict(state)``, or ``load_state_dict(state, tensors)`` with
    ``checkpoint_tensors()`` (``{name: tensors}``; a name is also the part's ``state.json`` key)."""
    return [update, layout] + [part for part in (ema, replay, pipeline) if part is not None]


def named_tensors(parts: list) -> dict:
    """``{name: tensors}`` of every part that keeps tensors (``checkpoint_tensors()``)."""
    return {k: v for part in parts if hasattr(part, "checkpoint_tensors") for k, v in part.checkpoint_tensors().items()}


def restore_training_state(run_dir: Path, run: Run, update, layout, console: Console, ema=None,
                           replay=None, pipeline=None) -> TrainState:
    """Load the latest checkpoint into the model, AdamW and the RNG (the strategy's), and into
    every stateful part (the LR schedule, the update mode, the objective, the chunk layout, the
    EMA); a run directory without a checkpoint starts at iteration 0. A sharded checkpoint loads
    under any strategy and process count (DCP reshards it)."""
    ctx = run.ctx
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        if ctx.is_main:
            console.print(f"[yellow]note:[/yellow] {run_dir} has no checkpoint yet; starting at iteration 0")
        return TrainState()
    parts = stateful_parts(update, layout, ema, replay, pipeline)
    state, tensors = read_checkpoint(ckpt, update.strategy, named_tensors(parts))  # sharded: read into these
    if ema is not None and (EMA_KEY not in tensors or EMA_KEY not in state):
        raise FlowrlError(
            f"{ckpt} holds no EMA weights, but the recipe has [ema] enabled = true",
            where="[ema].enabled", hint="resume with the recipe that started the run (the EMA cannot start late)",
        )
    for part in parts:
        if hasattr(part, "checkpoint_tensors"):
            part.load_state_dict(state, tensors)
        else:
            part.load_state_dict(state)
    moved = update.follow_schedule()  # a resume with another number of iterations: its schedule, at once
    if moved is not None and ctx.is_main:
        console.print(f"[yellow]note:[/yellow] the LR schedule ('{run.session.recipe.train.lr_schedule}') now spans "
                      f"{run.session.recipe.train.iterations} iterations: its LR at this step is {moved[1]:.4g} "
                      f"(the run's schedule had {moved[0]:.4g})")
    saved_world = state.get("world_size", ctx.world_size)
    if saved_world != ctx.world_size and run.session.recipe.train.optimizer_steps_per_update > 1 and ctx.is_main:
        console.print(
            f"[yellow]note:[/yellow] the run was saved with {counted(saved_world, 'process', 'processes')} and "
            f"resumes with {ctx.world_size}; with optimizer_steps_per_update > 1 the grouping of samples into "
            "optimizer steps changes, so the continuation is valid but not bit-identical"
        )
    if ctx.is_main:
        console.print(f"resumed from {ckpt} at iteration {state['iteration']}")
    restored = TrainState()
    restored.load_state_dict(state)
    return restored


@dataclasses.dataclass
class Checkpointer:
    """Writes the training checkpoint when one is due: every ``[checkpoint].every`` iterations,
    when ``[checkpoint].every_minutes`` have passed since the last one (all processes take the
    same decision), at the end, and when the run stops early."""

    run_dir: Path
    run: Run
    state: TrainState
    update: Any  # PolicyUpdate
    layout: Any  # ChunkLayout
    ema: Any = None  # WeightEMA, with [ema] enabled
    replay: Any = None  # Replay, with [replay] on
    pipeline: Any = None  # Pipeline, with [pipeline] staleness 1
    on_write: Any = None  # called with "checkpoint" before each write (the progress display's phase)
    last_write: float = dataclasses.field(default_factory=time.monotonic)
    unreported: float | None = None  # seconds of checkpoints not yet in a metrics row

    @property
    def config(self):
        return self.run.session.recipe.checkpoint

    def due(self, force: bool) -> bool:
        """Whether the iteration just completed (``state.iteration`` done) gets a checkpoint."""
        due = force or self.state.iteration % self.config.every == 0
        if self.config.every_minutes > 0:
            late = time.monotonic() - self.last_write >= 60.0 * self.config.every_minutes
            due = distributed.any_rank(due or late, self.run.ctx)
        return due

    def __call__(self) -> Path | None:
        if self.on_write is not None:
            self.on_write("checkpoint")
        self.last_write, start = time.monotonic(), time.perf_counter()
        try:
            return save_training_checkpoint(self.run_dir, self.run, self.state, self.update, self.layout, self.ema,
                                            self.replay, self.pipeline)
        finally:
            self.unreported = (self.unreported or 0.0) + time.perf_counter() - start

    def take_seconds(self) -> dict[str, float]:
        """``{"checkpoint": seconds}`` spent writing checkpoints since the last call (``{}`` when
        none was written). The loop puts it into the next metrics row it writes: a checkpoint
        follows its iteration's row, and ``metrics.jsonl`` is only appended to."""
        seconds, self.unreported = self.unreported, None
        return {} if seconds is None else {"checkpoint": seconds}

    def ensure_current(self) -> None:
        """After an early stop: the last completed iteration has a checkpoint. The main process
        decides, every process writes: a sharded (FSDP2) checkpoint and the replay buffer's
        gathered rollouts are collective, so a write by the main process alone waited for
        processes that had left (and crashed when they tore the group down)."""
        stale = self.run.ctx.is_main and checkpoint_iteration(latest_checkpoint(self.run_dir)) != self.state.iteration
        if distributed.any_rank(stale, self.run.ctx):
            self()
