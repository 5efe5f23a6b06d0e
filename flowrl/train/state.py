"""What a training checkpoint holds, and how a run resumes from one.

A checkpoint (layout in :mod:`flowrl.train.checkpoint`) holds the trainable weights, AdamW's
state, the RNG states and ``state.json``::

    iteration         completed iterations: the next one to run
    nonfinite_steps   updates skipped so far for non-finite values
    lr_scheduler      the LR schedule's position
    data_position     prompts consumed (iteration x prompts per iteration)
    world_size        processes that wrote it
    chunk_sizes       the chunk layout in use (moved by adaptive re-profiling)
    selector_l1rel    the weighted selector's L1rel curve in use, or null
    ema               EMA updates and optimizer steps counted (only with [ema] enabled)

Resuming restores every one of them (and the EMA weights, ``ema.safetensors``), so a resumed run
repeats exactly what the uninterrupted run would have done. Only iterations, ``[log]``,
``[checkpoint]`` and ``[[trackers]]`` may differ from the recipe that started the run.

:class:`Checkpointer` decides when to write one: every ``[checkpoint].every`` iterations, every
``[checkpoint].every_minutes`` minutes, at the end, and when the run is stopped.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from rich.console import Console

from .. import distributed
from ..errors import FlowrlError
from ..plugins import Registry
from ..recipe import Recipe, dump_toml, read_toml, validate
from .checkpoint import LATEST, checkpoint_iteration, latest_checkpoint, load_checkpoint, save_checkpoint, set_rng_state
from .finetune import load_trainable_state_dict, trainable_state_dict


@dataclasses.dataclass
class TrainState:
    """Where a run is, besides its weights and optimizer."""

    iteration: int = 0  # completed iterations: the next one to run
    nonfinite_steps: int = 0


def resume_hint(run_dir: Path) -> str:
    return f"flowrl train {run_dir / 'recipe.toml'} --resume {run_dir}"


def check_run_directory(recipe: Recipe, run_dir: Path, resume: Path | None, registry: Registry) -> None:
    """A new run must not overwrite one with checkpoints; a resumed run must use its recipe."""
    if resume is None:
        if (run_dir / "checkpoints" / LATEST).exists():
            raise FlowrlError(
                f"{run_dir} already holds a run with checkpoints; a new run would overwrite it",
                where="[run].output_dir",
                hint=f"continue it with `{resume_hint(run_dir)}`, or pass another --output-dir",
            )
        return
    if not run_dir.is_dir():
        raise FlowrlError(f"cannot resume: {run_dir} does not exist", where="--resume")
    check_resumable_recipe(recipe, run_dir, registry)


def check_resumable_recipe(recipe: Recipe, run_dir: Path, registry: Registry) -> None:
    """A resumed run must use the recipe that wrote it; only iterations, [log], [checkpoint]
    and [[trackers]] (what is recorded, never what is trained) may change."""
    saved = run_dir / "recipe.toml"
    if not saved.is_file():
        return
    data = read_toml(saved)
    data.pop("trackers", None)  # may change, and the old tracker's plugin need not be installed
    old = validate(data, source=str(saved), registry=registry).to_toml_dict()
    new = recipe.to_toml_dict()
    for section in ("log", "checkpoint", "trackers"):
        old.pop(section, None)
        new.pop(section, None)
    for d in (old, new):
        d["train"].pop("iterations", None)
        d["run"].pop("output_dir", None)
    if old != new:
        diff = sorted(f"[{s}]" for s in set(old) | set(new) if old.get(s) != new.get(s))
        raise FlowrlError(
            f"the recipe differs from the one that started {run_dir} in {', '.join(diff)}",
            hint=f"resume with `flowrl train {saved} --resume {run_dir}` (only iterations, [log], [checkpoint] and [[trackers]] may change)",
        )


def save_training_checkpoint(run_dir: Path, state: TrainState, session, update, layout, geometry, ctx,
                             ema=None) -> Path | None:
    """Write a checkpoint of the whole training state (atomically, on the main process; see the
    module docstring)."""
    if not ctx.is_main:
        return None
    recipe = session.recipe
    extra = {} if ema is None else {"ema": ema.state()}
    return save_checkpoint(
        run_dir / "checkpoints",
        f"iter_{state.iteration:06d}",
        model=trainable_state_dict(session.model.denoiser),
        optimizer=update.optimizer.state_dict(),
        state={
            "iteration": state.iteration,
            "nonfinite_steps": state.nonfinite_steps,
            "lr_scheduler": update.scheduler.state_dict(),
            "data_position": state.iteration * geometry.prompts_per_iteration,
            "world_size": ctx.world_size,
            "chunk_sizes": list(layout.sizes),
            "selector_l1rel": layout.selector_l1rel,
            **extra,
        },
        recipe_toml=dump_toml(recipe.to_toml_dict()),
        keep_last=recipe.checkpoint.keep_last,
        extra=None if ema is None else {"ema": ema.tensors()},
    )


def restore_training_state(run_dir: Path, session, update, layout, ctx, console: Console, ema=None) -> TrainState:
    """Load the latest checkpoint into the model, AdamW, the LR schedule, the RNG, the chunk
    layout and the EMA; a run directory without a checkpoint starts at iteration 0."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        if ctx.is_main:
            console.print(f"[yellow]note:[/yellow] {run_dir} has no checkpoint yet; starting at iteration 0")
        return TrainState()
    saved = load_checkpoint(ckpt)
    load_trainable_state_dict(session.model.denoiser, saved["model"])
    update.optimizer.load_state_dict(saved["optimizer"])
    update.scheduler.load_state_dict(saved["state"]["lr_scheduler"])
    set_rng_state(saved["rng"])
    state = saved["state"]
    if ema is not None:
        restore_ema(ema, saved, ckpt)
    saved_world = state.get("world_size", ctx.world_size)
    if saved_world != ctx.world_size and session.recipe.train.optimizer_steps_per_update > 1 and ctx.is_main:
        console.print(
            f"[yellow]note:[/yellow] the run was saved with {saved_world} processes and resumes with "
            f"{ctx.world_size}; with optimizer_steps_per_update > 1 the grouping of samples into "
            "optimizer steps changes, so the continuation is valid but not bit-identical"
        )
    layout.restore(tuple(state.get("chunk_sizes", layout.sizes)), state.get("selector_l1rel"))
    if ctx.is_main:
        console.print(f"resumed from {ckpt} at iteration {state['iteration']}")
    return TrainState(iteration=state["iteration"], nonfinite_steps=state["nonfinite_steps"])


def restore_ema(ema, saved: dict, ckpt: Path) -> None:
    if saved["ema"] is None or "ema" not in saved["state"]:
        raise FlowrlError(
            f"{ckpt} holds no EMA weights, but the recipe has [ema] enabled = true",
            where="[ema].enabled", hint="resume with the recipe that started the run (the EMA cannot start late)",
        )
    ema.restore(saved["ema"], saved["state"]["ema"])


def run_is_complete(run_dir: Path, state: TrainState, recipe: Recipe, evaluates: bool) -> bool:
    """True when a resumed run has nothing left to do: every iteration is done and, when the run
    evaluates, the final evaluation's row is in ``metrics.jsonl`` (a run stopped during that
    evaluation still has it to do)."""
    if state.iteration < recipe.train.iterations:
        return False
    if not evaluates:
        return True
    path = Path(run_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return any(r.get("final") and r.get("iteration") == recipe.train.iterations for r in rows)


class Checkpointer:
    """Writes the training checkpoint when one is due: every ``[checkpoint].every`` iterations,
    when ``[checkpoint].every_minutes`` have passed since the last one (all processes take the
    same decision), at the end, and when the run stops early."""

    def __init__(self, run_dir: Path, state: TrainState, session, update, layout, geometry, ctx, ema=None):
        self.parts = (run_dir, state, session, update, layout, geometry, ctx)
        self.ema, self.ctx, self.state, self.run_dir = ema, ctx, state, run_dir
        self.config = session.recipe.checkpoint
        self.last_write = time.monotonic()

    def due(self, force: bool) -> bool:
        """Whether the iteration just completed (``state.iteration`` done) gets a checkpoint."""
        due = force or self.state.iteration % self.config.every == 0
        if self.config.every_minutes > 0:
            late = time.monotonic() - self.last_write >= 60.0 * self.config.every_minutes
            due = distributed.any_rank(due or late, self.ctx)
        return due

    def __call__(self) -> Path | None:
        self.last_write = time.monotonic()
        return save_training_checkpoint(*self.parts, ema=self.ema)

    def ensure_current(self) -> None:
        """After an early stop: the last completed iteration has a checkpoint (main process)."""
        if self.ctx.is_main and checkpoint_iteration(latest_checkpoint(self.run_dir)) != self.state.iteration:
            self()
