"""The training loop, top to bottom: one engine for the whole GRPO family.

    collect (prompts, rollout, images) -> rewards -> advantages -> update (-> replay) -> log, checkpoint

(with ``[pipeline]`` staleness 1 the next iteration's collect runs beside the update:
:mod:`flowrl.train.pipeline`)

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

import contextlib
from pathlib import Path

import torch
from rich.console import Console

from .. import distributed
from ..errors import FlowrlError, RecipeError, counted
from ..geometry import resolve_geometry
from ..interfaces import PlansMemory, SamplesTrees
from ..memory_plan import GB, estimate, peak
from ..plugins import Registry, get_registry
from ..recipe import Recipe, build_component, check_startable
from .accel import prepare_kernels
from .checkpoint import checkpoint_iteration, latest_checkpoint
from .collect import assign_advantages, collect
from .ema import WeightEMA
from .evaluate import RunEvaluator
from .layout import ChunkLayout
from .outputs import RunOutputs
from .pipeline import Pipeline
from .parallel import resolve_strategy
from .progress import RunDisplay, shown_reward
from .replay import Replay
from .run import Run
from .run_dir import check_run_directory, hold_run_directory, resume_hint, run_is_complete
from .session import Session
from .state import Checkpointer, TrainState, restore_training_state
from .stopping import Aborted, RunStop
from .throughput import Throughput
from .update import PolicyUpdate


def train(recipe: Recipe, *, resume: Path | None = None, dry_run: bool = False,
          console: Console | None = None, registry: Registry | None = None) -> Path:
    """Run (or resume) training for a validated recipe; returns the run directory."""
    console, cfg, train_cfg = console or Console(), recipe, recipe.train
    registry = registry or get_registry()  # the CLI passes its own (honours --disable-plugin)

    # ---- Setup: device, processes, batch geometry, run directory checks ----------------------
    device, ctx = distributed.start(recipe.run.device, recipe.distributed)  # checks the launcher agrees
    geometry = run_geometry(cfg, ctx, registry)
    run_dir = Path(resume) if resume is not None else cfg.output_dir
    announce(console, ctx, cfg, geometry, run_dir)
    if dry_run:
        return run_dir
    with run_directory_held(recipe, run_dir, resume, registry, ctx), oom_explained(recipe, geometry, ctx, registry):
        check_startable(recipe, registry)  # what `flowrl validate` checks: prompt files, trackers' extras

        # ---- Build: components (fsdp2 shards the denoiser onto the device), prompts, update, EMA -
        session = Session.open(recipe, registry, device=device, **session_options(recipe, ctx))
        run = Run(session, geometry, ctx)
        prompts, eval_set = session.run_prompts()  # with [prompts] embeddings: refused unless it holds them all
        update = PolicyUpdate(run)
        layout = ChunkLayout(session, prompts, ctx, run_dir if resume else None)  # a dynamics chunker profiles first
        kernels = prepare_kernels(session.model, train_cfg, device, cfg.source,  # [train].compile; attention in the loop
                                  probe_text=lambda: session.cache.get([prompts[0]], device), counter=update.counter, ctx=ctx)
        ema = WeightEMA.attach(session, update.optimizer)  # None unless [ema] enabled
        replay, pipeline = Replay.attach(run, prompts), Pipeline.attach(run, prompts, update.counter)  # None when off

        # ---- Resume: weights, optimizer, LR schedule, RNG, chunk layout, EMA, counters ----------
        state = restore_training_state(run_dir, run, update, layout, console, ema, replay, pipeline) if resume else TrainState()
        if resume and run_is_complete(run_dir, state.iteration, recipe, bool(eval_set)):
            return nothing_to_do(console, ctx, run_dir, train_cfg.iterations)
        throughput = Throughput(run, prompts[0], state.iteration, update.counter)  # FLOPs, once
        outputs = RunOutputs(run_dir, session, ctx, state.iteration, throughput.constants())  # creates the run dir
        display = RunDisplay(console, cfg.log.progress and ctx.is_main, train_cfg, state.iteration, shown_reward(recipe.rewards))
        evaluator = RunEvaluator(session, eval_set, ctx, outputs, ema, update.strategy.lockstep, display.say)
        saver = Checkpointer(run_dir, run, state, update, layout, ema, replay, pipeline, on_write=display.phase)
        try:  # the run's stop (signals, the STOP file): flowrl.train.stopping
            with display, RunStop(run_dir, ctx, display.say if ctx.is_main else None) as stop, kernels, pipeline or contextlib.nullcontext():
                with stop.iterations():  # a stop at a stop point abandons the iteration under way
                    for iteration in range(state.iteration, train_cfg.iterations):
                        if stop.agreed():  # e.g. while checkpointing
                            break
                        timer = display.timer(device, update.counter)
                        record = {"iteration": iteration, "world_size": ctx.world_size}

                        # ---- Adaptive chunking: re-profile the current policy, move the boundaries ----
                        if layout.reprofile_due(iteration):
                            with timer("profile"):
                                record.update(layout.reprofile(iteration, console))

                        # ---- Evaluate the current policy on the fixed set (before this update) ---------
                        if evaluator.due(iteration):
                            with timer("eval"), stop.evaluation(shared=evaluator.lockstep):
                                record.update(evaluator(iteration))
                        if stop.stopped:  # eval is redone on resume
                            break

                        # ---- Collect: prompts, text embeddings, rollout, images, rewards (pipelined: drawn earlier) --
                        batch = pipeline.take(iteration, timer) if pipeline else collect(run, prompts, iteration, timer)

                        # ---- Advantages over whole groups (rewards gathered from every process) ---------
                        with timer("advantage"):
                            assign_advantages(run, batch, len(layout.sizes), record)
                        if stop.agreed():  # redone on resume
                            break

                        # ---- Update: chunk selection, memory-lean chunk backward, KL, optimizer (EMA); replay ---
                        outcome, replayed, replay_skipped = update_and_replay(update, replay, pipeline, batch, layout.sizes, timer, stop)
                        state.nonfinite_steps += outcome.skipped + replay_skipped
                        record.update(update_record(outcome, batch, state, layout, update, ctx) | replayed)
                        warn_skipped(console, ctx, iteration, batch, state, train_cfg, outcome.skipped)

                        # ---- Log, then checkpoint (its seconds go into the next row: append-only metrics) --
                        state.iteration = iteration + 1
                        last = state.iteration == train_cfg.iterations
                        outputs.write_group_grid(batch, geometry.group_size, last)  # every [log].image_every
                        speed = throughput.measure(timer.seconds, outcome.trained, layout.sizes, state.iteration)
                        if iteration % cfg.log.every == 0 or last or outcome.skipped:
                            outputs.write_iteration(record, {**timer.seconds, **saver.take_seconds()}, speed)
                        if saver.due(last):
                            saver()
                        display.advance(record, speed)
                        check_nonfinite_budget(state, train_cfg, cfg.source, run_dir)

                # ---- Final evaluation (a stop abandons it: redone on resume) -------------------------
                if not stop.agreed() and eval_set and state.iteration == train_cfg.iterations:
                    display.phase("eval")
                    with stop.evaluation(shared=evaluator.lockstep):
                        outputs.write_row({"iteration": state.iteration, "final": True, **evaluator(state.iteration, final=True)})
                if stop.stopped:
                    finish_interrupted(console, ctx, run_dir, state, saver, stop)
        except Aborted:
            aborted(console, ctx, run_dir)
            raise
        finally:
            outputs.close()
            distributed.teardown()
        if stop.stopped:
            raise KeyboardInterrupt
        return done(console, ctx, run_dir, train_cfg.iterations)


# ------------------------------------------------------------------------------ the phases' helpers


def run_geometry(recipe: Recipe, ctx, registry: Registry):
    """The batch geometry on this process layout (:func:`~flowrl.geometry.resolve_geometry`), whole
    groups on each process where the ``[window]`` samples trees (:func:`refuse_split_trees`)."""
    geometry = resolve_geometry(recipe.train, ctx.world_size, recipe.source, recipe.group_size)
    return refuse_split_trees(recipe, geometry, ctx, registry)


def refuse_split_trees(recipe: Recipe, geometry, ctx, registry: Registry | None = None):
    """``geometry``, unless tree rollouts (a ``[window]`` that samples trees: BranchGRPO's
    ``branch``) meet groups split across processes: a tree shares a group's prefixes inside one
    process's rollout, a split group could not share them."""
    if geometry.groups_split_across_processes and isinstance(
            build_component(recipe, registry or get_registry(), "window"), SamplesTrees):
        window = recipe.components["window"].use
        raise RecipeError(
            f"[window] '{window}' samples each group as a tree, which needs whole groups on each process: "
            f"{geometry.prompts_per_iteration} prompts over {ctx.world_size} processes split groups",
            where=f"{recipe.source}: [window]",
            hint=f"make prompts_per_iteration a multiple of {ctx.world_size}, or sample without trees "
                 "([window] use = 'fixed')")
    return geometry


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


def done(console: Console, ctx, run_dir: Path, iterations: int) -> Path:
    if ctx.is_main:
        console.print(f"done: {counted(iterations, 'iteration')} in {run_dir}; reward curves: `flowrl plot {run_dir}`")
    return run_dir


def nothing_to_do(console: Console, ctx, run_dir: Path, iterations: int) -> Path:
    """A resumed run that is already complete: nothing is run, nothing in it is touched."""
    if ctx.is_main:
        console.print(f"nothing to do: {run_dir} has completed {'its' if iterations == 1 else 'all'} "
                      f"{counted(iterations, 'iteration')} and its final "
                      f"evaluation (raise train.iterations with --set to train further)")
    distributed.teardown()
    return run_dir


def update_and_replay(update: PolicyUpdate, replay: Replay | None, pipeline: Pipeline | None, batch, sizes,
                      timer, stop: RunStop) -> tuple:
    """The iteration's update, then (with ``[replay]`` on) the replayed rollouts' updates and the
    rollout kept for later: ``(outcome, replay and pipeline metrics, replayed updates skipped)``.
    Pipelined, the next rollout is drawn meanwhile (waited for at the end), and a rollout an
    older policy drew is importance-weighted first. A stop inside leaves the training state
    part-way through the iteration (:meth:`RunStop.changing_state`)."""
    corrected = {}
    with stop.changing_state():
        if pipeline is not None:
            pipeline.start_next(batch)
            batch, corrected = pipeline.corrected(batch, sizes, timer)
        with timer("update"):
            outcome = update.run(batch, sizes)
        replayed, skipped = replay(update, batch, sizes, timer) if replay is not None else ({}, 0)
        if pipeline is not None:
            pipeline.settle(timer)
    return outcome, corrected | replayed, skipped


def update_record(outcome, batch, state: TrainState, layout: ChunkLayout, update: PolicyUpdate, ctx) -> dict:
    """The update's part of the metrics row, in its documented order."""
    record = {"lr": outcome.lr}
    if outcome.on_policy is not None:
        record["on_policy/max_abs_log_ratio"] = outcome.on_policy
    if outcome.skipped:
        record["skipped_nonfinite"] = True
    record["nonfinite_steps"] = state.nonfinite_steps
    record.update(outcome.metrics)
    record.update(update.take_seconds())  # time/update/<part>: replayed rollouts' updates included
    if batch.advantages is not None:  # something was trained
        everyone = distributed.all_gather_cat(outcome.trained, ctx)  # [S, K], global sample order
        record["trained_units"] = [torch.nonzero(row).flatten().tolist() for row in everyone]
    record["chunk_sizes"] = list(layout.sizes)
    record.update(update.counter.take(ctx))  # the iteration's model work against its minimum
    return record


def warn_skipped(console: Console, ctx, iteration: int, batch, state: TrainState, train_cfg, skipped: bool) -> None:
    if skipped and ctx.is_main:
        what = "reward" if not batch.trainable else "loss or gradient"
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


def finish_interrupted(console: Console, ctx, run_dir: Path, state: TrainState, saver: Checkpointer,
                       stop: RunStop) -> None:
    """After a stop: make sure the last completed iteration is checkpointed, say how to resume. A
    stop in the update left weights part-way through an iteration: then nothing is written, and
    the run resumes from its latest checkpoint."""
    if stop.state_changed:
        if ctx.is_main:
            console.print(f"interrupted in the update of iteration {state.iteration}, whose weights are part-way "
                          f"through it: no checkpoint written; {resumes_from(run_dir)}")
        return
    saver.ensure_current()
    if ctx.is_main:
        console.print(
            f"interrupted after {counted(state.iteration, 'completed iteration')}; checkpoint written. "
            f"Continue with `{resume_hint(run_dir)}`"
        )


def aborted(console: Console, ctx, run_dir: Path) -> None:
    """After a second Ctrl-C or SIGTERM: no new checkpoint; say where the run resumes from."""
    if ctx.is_main:
        console.print(f"aborted: stopped at once, no checkpoint written; {resumes_from(run_dir)}")


def resumes_from(run_dir: Path) -> str:
    """``the run resumes from ... with `COMMAND```: its latest checkpoint, or the start."""
    ckpt = latest_checkpoint(run_dir)
    where = (f"its latest checkpoint ({counted(checkpoint_iteration(ckpt), 'iteration')})" if ckpt
             else "the start (no checkpoint yet)")
    return f"the run resumes from {where} with `{resume_hint(run_dir)}`"


@contextlib.contextmanager
def run_directory_held(recipe: Recipe, run_dir: Path, resume: Path | None, registry: Registry, ctx):
    """One writer per run directory for the block (:mod:`flowrl.train.run_dir`; the command
    usually holds it already, then this only checks): taking it creates the directory, so an OS
    error is one message before any model loads. Then: may this run write there?"""
    with hold_run_directory(run_dir, where="--resume" if resume is not None else "[run].output_dir", main=ctx.is_main):
        check_run_directory(recipe, run_dir, resume, registry)
        yield


@contextlib.contextmanager
def oom_explained(recipe: Recipe, geometry, ctx, registry: Registry):
    """An allocation failure in the block (building the run, or training) is one message naming
    the recipe keys that set the size (:func:`out_of_memory`)."""
    try:
        yield
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        if not is_allocation_failure(exc):
            raise
        raise out_of_memory(recipe, geometry, ctx, registry, exc) from exc


#: What torch and Python say when memory runs out: CUDA's OutOfMemoryError, the CPU allocator's
#: RuntimeError ("DefaultCPUAllocator: can't allocate memory"), MemoryError.
ALLOCATION_FAILURES = ("out of memory", "can't allocate memory", "defaultcpuallocator", "cannot allocate memory")
#: Model keys that set the size of every image and latent (whichever the model has).
IMAGE_SIZE_KEYS = ("resolution", "image_size", "height", "width")


def is_allocation_failure(exc: BaseException) -> bool:
    return isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or any(
        text in str(exc).lower() for text in ALLOCATION_FAILURES)


def out_of_memory(recipe: Recipe, geometry, ctx, registry: Registry, exc: BaseException) -> FlowrlError:
    """An allocation failure while training, as one message: the recipe keys that set the size,
    with their values, and what ``flowrl plan`` expected (where that needs no model load)."""
    t = recipe.train
    keys = [f"[train].prompts_per_iteration = {t.prompts_per_iteration}, group_size = {t.group_size} "
            f"({geometry.samples_per_process} samples per process), micro_batch_size = {t.micro_batch_size}",
            f"[sampler].steps = {recipe.sampler.steps}"]
    params = recipe.components["model"].params
    sizes = [f"{k} = {getattr(params, k)}" for k in IMAGE_SIZE_KEYS if isinstance(getattr(params, k, None), int)]
    if sizes:
        keys.append(f"[model].{', '.join(sizes)}")
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    return FlowrlError(
        f"out of memory ({first_line}); the batch is set by {'; '.join(keys)}{planned_memory(recipe, ctx, registry)}",
        where=f"{recipe.source}: [train]",
        hint="lower [train].micro_batch_size (the update's batch), prompts_per_iteration or group_size (the rollout), "
        "or the image size; with several GPUs, more processes or [distributed].strategy = 'fsdp2'; "
        f"`flowrl plan {recipe.source}` shows where the memory goes",
    )


def planned_memory(recipe: Recipe, ctx, registry: Registry) -> str:
    """``; flowrl plan expects ...`` when the model states its sizes (PlansMemory): never a
    model load here, right after memory ran out."""
    if not isinstance(recipe.components["model"].params, PlansMemory):
        return ""
    try:
        total, phase = peak(estimate(recipe, registry, ctx.process_count)[2])
    except Exception:  # an estimate is a courtesy here: never hide the allocation failure behind another error
        return ""
    return f"; `flowrl plan` expects a peak of ~{total / GB:.1f} GB per process (in the {phase} phase)"


def session_options(recipe: Recipe, ctx) -> dict[str, bool]:
    """How :meth:`Session.open` builds the run. The denoiser is placed on the device, unless the
    run shards it with FSDP2 (the launcher may have asked for it), which moves it there block by
    block; then only rank 0 loads its weights and the other processes receive them as it is
    sharded. The rewards are built unless nothing scores: an offline run (``[data]``) that
    evaluates nothing (its training reads no reward)."""
    sharded = resolve_strategy(recipe.distributed, ctx.process_count) == "fsdp2"
    return {"place_denoiser": not sharded, "receive_weights": sharded and ctx.process_rank != 0,
            "rewards": not recipe.data.enabled or bool(recipe.prompts.num_eval)}

