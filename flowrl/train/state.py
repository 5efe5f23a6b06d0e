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
import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from .. import distributed
from ..errors import FlowrlError
from ..plugins import Registry
from ..recipe import Recipe, dump_toml, read_toml, validate
from .checkpoint import LATEST, MARKER, checkpoint_iteration, latest_checkpoint, read_checkpoint, write_checkpoint
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


def resume_hint(run_dir: Path) -> str:
    return f"flowrl train {run_dir / 'recipe.toml'} --resume {run_dir}"


#: What a run directory holds; said whenever something is not one.
RUN_DIRECTORY = ("a run directory is what `flowrl train` writes: recipe.toml (the resolved recipe), "
                 "metrics.jsonl, images/ and checkpoints/iter_NNNNNN/")


def check_resume_directory(run_dir: Path) -> None:
    """``--resume PATH`` must name a run directory (one with the recipe.toml that training wrote)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FlowrlError(f"cannot resume: {run_dir} does not exist", where="--resume", hint=RUN_DIRECTORY)
    if (run_dir / MARKER).is_file():
        parent = run_dir.parent.parent if run_dir.parent.name == "checkpoints" else None
        raise FlowrlError(
            f"cannot resume: {run_dir} is a checkpoint directory, not a run directory", where="--resume",
            hint=f"pass the run directory{f' ({parent})' if parent else ''}: a run resumes from its latest checkpoint",
        )
    if not (run_dir / "recipe.toml").is_file():
        raise FlowrlError(
            f"cannot resume: {run_dir} is not a run directory (it has no recipe.toml)", where="--resume",
            hint=f"{RUN_DIRECTORY}; pass that directory (e.g. runs/quickstart)",
        )


def check_run_directory(recipe: Recipe, run_dir: Path, resume: Path | None, registry: Registry) -> None:
    """A new run must not overwrite an earlier one (checkpoints, or metrics without a checkpoint;
    ``flowrl train --overwrite`` clears it first); a resumed run must use its recipe."""
    if resume is None:
        if (run_dir / "checkpoints" / LATEST).exists():
            raise FlowrlError(
                f"{run_dir} already holds a run with checkpoints; a new run would overwrite it",
                where="[run].output_dir",
                hint=f"continue it with `{resume_hint(run_dir)}`, pass another --output-dir, "
                "or start afresh there with `flowrl train ... --overwrite` (deletes the old run's files)",
            )
        if (run_dir / "metrics.jsonl").is_file():
            raise FlowrlError(
                f"{run_dir} already holds the metrics.jsonl of an earlier run (it has no checkpoint to resume); "
                "a new run would overwrite them",
                where="[run].output_dir",
                hint="pass another --output-dir, or replace the old run with `flowrl train ... --overwrite`",
            )
        return
    check_resume_directory(run_dir)
    check_resumable_recipe(recipe, run_dir, registry)


def check_resumable_recipe(recipe: Recipe, run_dir: Path, registry: Registry) -> None:
    """A resumed run must use the recipe that wrote it; only iterations, [log], [checkpoint]
    and [[trackers]] (what is recorded, never what is trained) may change. A difference names
    every differing key with the run's value and the new one."""
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
        diff = recipe_differences(old, new)
        shown = [f"{key}: {a} in the run, {b} now" for key, a, b in diff[:6]]
        more = f"; and {len(diff) - 6} more" if len(diff) > 6 else ""
        raise FlowrlError(
            f"the recipe differs from the one that started {run_dir} in {len(diff)} key(s): " + "; ".join(shown) + more,
            where="--resume",
            hint=f"resume with `flowrl train {saved} --resume {run_dir}` (only iterations, [log], [checkpoint] and [[trackers]] may change)",
        )


def recipe_differences(old: dict, new: dict) -> list[tuple[str, str, str]]:
    """``(key, old value, new value)`` of every key whose value differs between two resolved
    recipes: ``[train].lr``, ``[[rewards]] #2.weight``; an absent key or entry reads ``(absent)``."""
    def show(value) -> str:
        return "(absent)" if value is _ABSENT else json.dumps(value)

    out = []
    for section in sorted(set(old) | set(new), key=lambda s: (list(old) + list(new)).index(s)):
        a, b = old.get(section, _ABSENT), new.get(section, _ABSENT)
        if isinstance(a, list) or isinstance(b, list):
            a = a if isinstance(a, list) else []
            b = b if isinstance(b, list) else []
            pairs = [(f"[[{section}]] #{i + 1}", a[i] if i < len(a) else {}, b[i] if i < len(b) else {})
                     for i in range(max(len(a), len(b)))]
        else:
            pairs = [(f"[{section}]", a if isinstance(a, dict) else {}, b if isinstance(b, dict) else {})]
        for prefix, ta, tb in pairs:
            for key in list(dict.fromkeys([*ta, *tb])):
                va, vb = ta.get(key, _ABSENT), tb.get(key, _ABSENT)
                if va != vb:
                    out.append((f"{prefix}.{key}", show(va), show(vb)))
    return out


_ABSENT = object()


def save_training_checkpoint(run_dir: Path, run: Run, state: TrainState, update, layout, ema=None) -> Path | None:
    """Write a checkpoint of the whole training state, atomically (see the module docstring):
    every stateful part's ``state_dict()`` composed into ``state.json``, its named tensors beside
    it, the weights and AdamW through the strategy (:func:`~flowrl.train.checkpoint.write_checkpoint`:
    the main process writes safetensors, or under FSDP2 every process writes its shards). Returns
    its path on the main process, None on the others."""
    recipe, parts = run.session.recipe, stateful_parts(update, layout, ema)
    info = {
        **state.state_dict(),
        "data_position": state.iteration * run.geometry.prompts_per_iteration,
        "world_size": run.ctx.world_size,
        **{k: v for part in parts for k, v in part.state_dict().items()},
    }
    tensors = {k: v for part in parts if hasattr(part, "checkpoint_tensors") for k, v in part.checkpoint_tensors().items()}
    return write_checkpoint(run_dir / "checkpoints", f"iter_{state.iteration:06d}", update.strategy, state=info,
                            recipe_toml=dump_toml(recipe.to_toml_dict()), keep_last=recipe.checkpoint.keep_last,
                            extra=tensors)


def stateful_parts(update, layout, ema=None) -> list:
    """What a checkpoint keeps besides the counters (:class:`TrainState`) and the weights and
    AdamW (the strategy's): each has ``state_dict()`` (its entries of ``state.json``) and
    ``load_state_dict(state)``, or ``load_state_dict(state, tensors)`` with
    ``checkpoint_tensors()`` (``{name: tensors}``; a name is also the part's ``state.json`` key)."""
    return [update, layout] + ([ema] if ema is not None else [])


def restore_training_state(run_dir: Path, run: Run, update, layout, console: Console, ema=None) -> TrainState:
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
    parts = stateful_parts(update, layout, ema)
    like = {k: v for part in parts if hasattr(part, "checkpoint_tensors") for k, v in part.checkpoint_tensors().items()}
    state, tensors = read_checkpoint(ckpt, update.strategy, like)
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
    saved_world = state.get("world_size", ctx.world_size)
    if saved_world != ctx.world_size and run.session.recipe.train.optimizer_steps_per_update > 1 and ctx.is_main:
        console.print(
            f"[yellow]note:[/yellow] the run was saved with {saved_world} processes and resumes with "
            f"{ctx.world_size}; with optimizer_steps_per_update > 1 the grouping of samples into "
            "optimizer steps changes, so the continuation is valid but not bit-identical"
        )
    if ctx.is_main:
        console.print(f"resumed from {ckpt} at iteration {state['iteration']}")
    restored = TrainState()
    restored.load_state_dict(state)
    return restored


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
        self.last_write, start = time.monotonic(), time.perf_counter()
        try:
            return save_training_checkpoint(self.run_dir, self.run, self.state, self.update, self.layout, self.ema)
        finally:
            self.unreported = (self.unreported or 0.0) + time.perf_counter() - start

    def take_seconds(self) -> dict[str, float]:
        """``{"checkpoint": seconds}`` spent writing checkpoints since the last call (``{}`` when
        none was written). The loop puts it into the next metrics row it writes: a checkpoint
        follows its iteration's row, and ``metrics.jsonl`` is only appended to."""
        seconds, self.unreported = self.unreported, None
        return {} if seconds is None else {"checkpoint": seconds}

    def ensure_current(self) -> None:
        """After an early stop: the last completed iteration has a checkpoint (main process)."""
        if self.run.ctx.is_main and checkpoint_iteration(latest_checkpoint(self.run_dir)) != self.state.iteration:
            self()
