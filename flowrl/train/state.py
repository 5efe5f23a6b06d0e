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
    update_mode       what ``[train] update_mode = "auto"`` chose (null until an off-policy step)
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
from ..interfaces import CheckpointsState
from ..plugins import Registry
from ..recipe import Recipe, dump_toml, read_toml, validate
from .checkpoint import (
    LATEST,
    MARKER,
    OBJECTIVE,
    checkpoint_iteration,
    is_sharded_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    load_sharded_checkpoint,
    save_checkpoint,
    save_sharded_checkpoint,
    set_rng_state,
)
from .ema import EMA_KEY
from .finetune import load_trainable_state_dict, trainable_state_dict


@dataclasses.dataclass
class TrainState:
    """Where a run is, besides its weights and optimizer."""

    iteration: int = 0  # completed iterations: the next one to run
    nonfinite_steps: int = 0


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


def save_training_checkpoint(run_dir: Path, state: TrainState, session, update, layout, geometry, ctx,
                             ema=None) -> Path | None:
    """Write a checkpoint of the whole training state, atomically (see the module docstring):
    the main process writes safetensors, or, under FSDP2, every process writes its shards
    (torch.distributed.checkpoint) and the main process completes it. Returns its path on the
    main process, None on the others."""
    recipe = session.recipe
    extra = {} if ema is None else {"ema": ema.state()}
    objective = update.objective if isinstance(update.objective, CheckpointsState) else None
    if objective is not None:  # an old policy, a reset reference, an adaptive gate
        extra["objective"] = objective.state_dict()
    tensors = {}
    if ema is not None:
        tensors[EMA_KEY] = ema.tensors()
    objective_tensors = objective.tensors() if objective is not None else {}
    if objective_tensors:
        tensors[OBJECTIVE] = objective_tensors
    info = {
        "iteration": state.iteration,
        "nonfinite_steps": state.nonfinite_steps,
        "lr_scheduler": update.scheduler.state_dict(),
        "data_position": state.iteration * geometry.prompts_per_iteration,
        "world_size": ctx.world_size,
        "chunk_sizes": list(layout.sizes),
        "selector_l1rel": layout.selector_l1rel,
        "update_mode": update.auto_mode,
        **extra,
    }
    root, name, recipe_toml = run_dir / "checkpoints", f"iter_{state.iteration:06d}", dump_toml(recipe.to_toml_dict())
    if update.strategy.sharded:  # every process writes its part; no process gathers the model
        return save_sharded_checkpoint(root, name, update.strategy, state=info, recipe_toml=recipe_toml,
                                       keep_last=recipe.checkpoint.keep_last, extra=tensors or None)
    if not ctx.is_main:
        return None
    return save_checkpoint(
        root, name,
        model=trainable_state_dict(session.model.denoiser),
        optimizer=update.optimizer.state_dict(),
        state=info,
        recipe_toml=recipe_toml,
        keep_last=recipe.checkpoint.keep_last,
        extra=tensors or None,
    )


def restore_training_state(run_dir: Path, session, update, layout, ctx, console: Console, ema=None) -> TrainState:
    """Load the latest checkpoint into the model, AdamW, the LR schedule, the RNG, the chunk
    layout and the EMA; a run directory without a checkpoint starts at iteration 0. A sharded
    checkpoint loads under any strategy and process count (DCP reshards it)."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        if ctx.is_main:
            console.print(f"[yellow]note:[/yellow] {run_dir} has no checkpoint yet; starting at iteration 0")
        return TrainState()
    objective = update.objective if isinstance(update.objective, CheckpointsState) else None
    if update.strategy.sharded or is_sharded_checkpoint(ckpt):
        # weights, AdamW, the RNG and (sharded like the weights) the EMA and the objective's
        # tensors, when the run kept them: DCP loads them in place
        marker = json.loads((ckpt / MARKER).read_text())
        with_ema = ema is not None and "ema" in marker
        extra = {EMA_KEY: ema.tensors()} if with_ema else {}
        objective_tensors = objective.tensors() if objective is not None and "objective" in marker else {}
        if objective_tensors:
            extra[OBJECTIVE] = objective_tensors
        state = load_sharded_checkpoint(ckpt, update.strategy, extra or None)
        saved = {"state": state, "ema": extra.get(EMA_KEY), "objective": extra.get(OBJECTIVE, {})}
    else:
        saved = load_checkpoint(ckpt)
        load_trainable_state_dict(session.model.denoiser, saved["model"])
        update.optimizer.load_state_dict(saved["optimizer"])
        set_rng_state(saved["rng"])
        state = saved["state"]
    update.scheduler.load_state_dict(state["lr_scheduler"])
    if ema is not None:
        restore_ema(ema, saved, ckpt)
    if objective is not None and "objective" in state:
        objective.load_state(state["objective"], saved.get("objective") or {})
    saved_world = state.get("world_size", ctx.world_size)
    if saved_world != ctx.world_size and session.recipe.train.optimizer_steps_per_update > 1 and ctx.is_main:
        console.print(
            f"[yellow]note:[/yellow] the run was saved with {saved_world} processes and resumes with "
            f"{ctx.world_size}; with optimizer_steps_per_update > 1 the grouping of samples into "
            "optimizer steps changes, so the continuation is valid but not bit-identical"
        )
    layout.restore(tuple(state.get("chunk_sizes", layout.sizes)), state.get("selector_l1rel"))
    update.auto_mode = state.get("update_mode")
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
        self.unreported: float | None = None  # seconds of checkpoints not yet in a metrics row

    def due(self, force: bool) -> bool:
        """Whether the iteration just completed (``state.iteration`` done) gets a checkpoint."""
        due = force or self.state.iteration % self.config.every == 0
        if self.config.every_minutes > 0:
            late = time.monotonic() - self.last_write >= 60.0 * self.config.every_minutes
            due = distributed.any_rank(due or late, self.ctx)
        return due

    def __call__(self) -> Path | None:
        self.last_write, start = time.monotonic(), time.perf_counter()
        try:
            return save_training_checkpoint(*self.parts, ema=self.ema)
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
        if self.ctx.is_main and checkpoint_iteration(latest_checkpoint(self.run_dir)) != self.state.iteration:
            self()
