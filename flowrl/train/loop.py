"""The training loop, top to bottom: one engine for the whole GRPO family.

    collect (prompts, rollout, images) -> rewards -> advantages -> update -> log, checkpoint

Step-level GRPO, GSPO, fixed chunks and Chunk-GRPO differ only in the components the recipe
names (chunker, selector, loss); nothing below branches on the algorithm. docs/architecture.md
maps each phase to the module that owns it.

Reproducibility: every random draw comes from a generator seeded by (seed, purpose, iteration,
global sample index) (:mod:`flowrl.seeding`), so rollouts, rewards and chunk selections do not
depend on the number of processes, and a resumed run repeats exactly what the uninterrupted one
would have done. (With ``optimizer_steps_per_update > 1`` which samples share an optimizer step
depends on the process layout; with 1 the whole update does not.)
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from rich.console import Console

from .. import distributed
from ..errors import FlowrlError
from ..geometry import resolve_geometry
from ..plugins import Registry, get_registry
from ..prompts import evaluation_prompts, read_prompts
from ..recipe import Recipe
from .checkpoint import checkpoint_iteration, latest_checkpoint
from .collect import assign_advantages, collect, score_rewards
from .evaluate import eval_metrics, evaluate
from .layout import ChunkLayout
from .outputs import RunOutputs
from .progress import GracefulInterrupt, PhaseTimer, progress_bar
from .session import Session
from .state import TrainState, check_run_directory, restore_training_state, resume_hint, save_training_checkpoint
from .update import PolicyUpdate


def train(recipe: Recipe, *, resume: Path | None = None, dry_run: bool = False,
          console: Console | None = None, registry: Registry | None = None) -> Path:
    """Run (or resume) training for a validated recipe; returns the run directory."""
    console = console or Console()
    registry = registry or get_registry()  # the CLI passes its own (honours --disable-plugin)
    cfg, train_cfg = recipe, recipe.train

    # ---- Setup: device, processes, batch geometry, run directory ----------------------------
    device, ctx = distributed.start(recipe.run.device)
    geometry = resolve_geometry(train_cfg, ctx.world_size, cfg.source)
    run_dir = Path(resume) if resume is not None else cfg.output_dir
    announce(console, ctx, cfg, geometry, run_dir)
    if dry_run:
        return run_dir
    check_run_directory(recipe, run_dir, resume, registry)

    # ---- Build: components, prompts, chunk layout, trainable parameters and optimizer --------
    session = Session.open(recipe, registry, device=device)
    prompts = read_prompts(cfg.prompts.source, session.model, f"{cfg.source}: [prompts].source", cfg.prompts)
    layout = ChunkLayout(session, prompts, ctx)  # a dynamics chunker profiles the model first
    update = PolicyUpdate(session, geometry, ctx)
    eval_set = evaluation_set(session)

    # ---- Resume: weights, optimizer, LR schedule, RNG, chunk layout, counters ---------------
    state = restore_training_state(run_dir, session, update, layout, ctx, console) if resume else TrainState()
    outputs = RunOutputs(run_dir, session, ctx, state.iteration)
    first_reward = recipe.rewards[0].label
    progress = progress_bar(console, cfg.log.progress and ctx.is_main)
    task = progress.add_task("training", total=train_cfg.iterations, completed=state.iteration, reward="-")
    interrupted = False
    try:
        with progress, GracefulInterrupt() as interrupt:
            for iteration in range(state.iteration, train_cfg.iterations):
                timer = PhaseTimer(device)
                record = {"iteration": iteration, "world_size": ctx.world_size}

                # ---- Adaptive chunking: re-profile the current policy, move the boundaries ----
                if layout.reprofile_due(iteration):
                    with timer("profile"):
                        record.update(layout.reprofile(iteration, console))

                # ---- Evaluate the current policy on the fixed set (before this update) ---------
                if eval_set and iteration % cfg.log.eval_every == 0:
                    with timer("eval"):
                        record.update(run_evaluation(session, eval_set, ctx))

                # ---- Collect: prompts and text embeddings, rollout, images; then the rewards ------
                batch = collect(session, geometry, ctx, prompts, iteration, timer)
                with timer("reward"):
                    score_rewards(batch, session.components.rewards)

                # ---- Advantages over whole groups (rewards gathered from every process) ---------
                with timer("advantage"):
                    assign_advantages(session, geometry, ctx, batch, len(layout.sizes), record)
                if distributed.any_rank(interrupt.requested, ctx):  # the iteration is redone on resume
                    interrupted = True
                    break

                # ---- Update: chunk selection, memory-lean chunk backward, KL, optimizer --------
                with timer("update"):
                    outcome = update.run(batch, layout.sizes)
                state.nonfinite_steps += outcome.skipped
                record.update(update_record(outcome, batch, state, layout, ctx))
                if outcome.skipped:
                    warn_skipped(console, ctx, iteration, batch, state, train_cfg)

                # ---- Log and checkpoint: the metrics row is on disk before the checkpoint --------
                state.iteration = iteration + 1
                if cfg.log.image_every and iteration % cfg.log.image_every == 0:
                    outputs.write_group_grid(batch, geometry.group_size, first_reward)
                stop = distributed.any_rank(interrupt.requested, ctx)
                last = state.iteration == train_cfg.iterations
                outputs.log_iteration(
                    record, timer, write_row=iteration % cfg.log.every == 0 or last or outcome.skipped,
                    checkpoint=partial(save_training_checkpoint, run_dir, state, session, update, layout, geometry, ctx)
                    if state.iteration % cfg.checkpoint.every == 0 or last or stop else None,
                )
                progress.update(task, advance=1, reward=f"{first_reward}={record.get(f'reward/{first_reward}/mean', float('nan')):.4f}")
                check_nonfinite_budget(state, train_cfg, cfg.source, run_dir)
                if stop:
                    interrupted = True
                    break

            # ---- Final evaluation ----------------------------------------------------------------
            if not interrupted and eval_set and state.iteration == train_cfg.iterations:
                outputs.write_row({"iteration": train_cfg.iterations, "final": True, **run_evaluation(session, eval_set, ctx)})
        if interrupted:
            finish_interrupted(console, ctx, run_dir, state, session, update, layout, geometry)
    finally:
        outputs.close()
        distributed.teardown()
    if interrupted:
        raise KeyboardInterrupt
    if ctx.is_main:
        console.print(f"done: {train_cfg.iterations} iterations in {run_dir}; reward curves: `flowrl plot {run_dir}`")
    return run_dir


# ------------------------------------------------------------------------------ the phases' helpers


def announce(console: Console, ctx, recipe: Recipe, geometry, run_dir: Path) -> None:
    if not ctx.is_main:
        return
    console.print(f"[bold]flowrl[/bold] {recipe.source} -> {run_dir}")
    console.print(f"geometry: {geometry.describe()}")
    if geometry.groups_split_across_processes:
        console.print(
            f"[yellow]note:[/yellow] {geometry.prompts_per_iteration} prompts over {ctx.world_size} processes "
            "split groups across processes; advantages use the rewards gathered from all of them"
        )


def evaluation_set(session) -> list[str]:
    """The run's fixed evaluation prompts (empty: no evaluation)."""
    p, source = session.recipe.prompts, session.recipe.source
    if not p.num_eval:
        return []
    pool = read_prompts(p.eval_source or p.source, session.model, f"{source}: [prompts].eval_source", p, role="eval")
    return evaluation_prompts(pool, session.recipe.run.seed, p.num_eval)


def run_evaluation(session, prompts: list[str], ctx) -> dict[str, float]:
    """``eval/<reward>/mean`` and ``/sem`` on the fixed set (computed on the main process)."""
    if not ctx.is_main:
        return {}
    recipe = session.recipe
    scores = evaluate(session.model, session.sampler.sigmas, session.components.rewards, prompts,
                      recipe.prompts.eval_seeds, recipe.run.seed, session.cache, recipe.train.micro_batch_size * 4)
    return eval_metrics(scores)


def update_record(outcome, batch, state: TrainState, layout: ChunkLayout, ctx) -> dict:
    """The update's part of the metrics row, in its documented order."""
    record = {"lr": outcome.lr}
    if outcome.on_policy is not None:
        record["on_policy/max_abs_log_ratio"] = outcome.on_policy
    if outcome.skipped:
        record["skipped_nonfinite"] = True
    record["nonfinite_steps"] = state.nonfinite_steps
    record.update(outcome.metrics)
    if batch.advantages is not None:  # something was trained
        everyone = distributed.all_gather_cat(outcome.trained, ctx)  # [S, K], global sample order
        record["trained_units"] = [torch.nonzero(row).flatten().tolist() for row in everyone]
    record["chunk_sizes"] = list(layout.sizes)
    return record


def warn_skipped(console: Console, ctx, iteration: int, batch, state: TrainState, train_cfg) -> None:
    if ctx.is_main:
        what = "reward" if batch.advantages is None else "loss or gradient"
        console.print(
            f"[yellow]warning:[/yellow] iteration {iteration}: non-finite {what}; update skipped "
            f"({state.nonfinite_steps} so far, at most {train_cfg.max_nonfinite_steps} tolerated)"
        )


def check_nonfinite_budget(state: TrainState, train_cfg, source: str, run_dir: Path) -> None:
    if state.nonfinite_steps > train_cfg.max_nonfinite_steps:
        raise FlowrlError(
            f"stopping: {state.nonfinite_steps} updates skipped for non-finite values "
            f"(at most max_nonfinite_steps = {train_cfg.max_nonfinite_steps} are tolerated)",
            where=f"{source}: [train].max_nonfinite_steps",
            hint=f"inspect {run_dir / 'metrics.jsonl'} (skipped_nonfinite); check the reward, or lower the learning rate",
        )


def finish_interrupted(console: Console, ctx, run_dir: Path, state: TrainState, *checkpoint_parts) -> None:
    """After Ctrl-C: make sure the last completed iteration is checkpointed, say how to resume."""
    if not ctx.is_main:
        return
    if checkpoint_iteration(latest_checkpoint(run_dir)) != state.iteration:
        save_training_checkpoint(run_dir, state, *checkpoint_parts, ctx)
    console.print(
        f"interrupted after {state.iteration} completed iteration(s); checkpoint written. "
        f"Continue with `{resume_hint(run_dir)}`"
    )
