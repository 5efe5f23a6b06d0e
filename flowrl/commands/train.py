"""``flowrl train``: run (or resume) training; ``--num-processes N`` launches data parallelism."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import FlowrlError, os_write_error
from .base import SetOpt, app, console, load, registry


@app.command()
def train(
    recipe: Annotated[
        Optional[Path],
        typer.Argument(help="Path to a TOML recipe (see recipes/); with --resume it defaults to RUN_DIR/recipe.toml."),
    ] = None,
    set_: SetOpt = None,
    resume: Annotated[
        Optional[Path], typer.Option("--resume", help="Continue the run in this directory from its latest checkpoint.")
    ] = None,
    output_dir: Annotated[
        Optional[Path], typer.Option("--output-dir", "-o", help="Run directory (overrides run.output_dir).")
    ] = None,
    num_processes: Annotated[
        int, typer.Option("--num-processes", min=1, help="Launch N data-parallel processes on this machine (torchrun).")
    ] = 1,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate and print the resolved geometry, then stop.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an earlier run in the run directory: "
                                            "delete its metrics, checkpoints, images and recipe first.")] = False,
) -> None:
    """Train a policy with the recipe's components: rollout, rewards, advantages, update."""
    from ..train.run_dir import check_resume_directory

    if resume is not None:
        if overwrite:
            raise FlowrlError("--overwrite starts afresh and --resume continues: give one of them", where="--overwrite")
        check_resume_directory(resume)
    if recipe is None:
        if resume is None:
            raise FlowrlError("train needs a RECIPE (or --resume RUN_DIR)", hint="flowrl train recipes/quickstart.toml")
        recipe = resume / "recipe.toml"
    overrides = list(set_ or [])
    if output_dir is not None:
        overrides.append(f"run.output_dir={json.dumps(str(output_dir))}")
    resolved = load(recipe, overrides)  # the launcher too: a bad recipe is one message, before any process starts
    from ..recipe import check_devices
    from ..train.run_dir import HELD_FOR_WORKERS, hold_run_directory, lock_path

    check_devices(resolved)  # before a launcher or torchrun's process asks CUDA for a GPU the machine lacks
    launching = num_processes > 1 and "LOCAL_RANK" not in os.environ
    check_this_machine(resolved, num_processes if launching else None)
    run_dir = resume if resume is not None else resolved.output_dir
    where = "--resume" if resume is not None else "--output-dir" if output_dir is not None else "[run].output_dir"
    if overwrite and not dry_run:  # what the run would refuse, refused before the earlier run is deleted
        from ..recipe import check_startable

        check_startable(resolved, registry(), devices=False)  # (the devices: checked above)
    if launching:
        from ..distributed import launch

        argv = [a for a in sys.argv[1:] if a != "--overwrite"]
        if dry_run:
            raise typer.Exit(launch(num_processes, argv))
        # The launcher holds the run directory for its workers (they die with it), from before the
        # --overwrite clearing until the last of them has stopped.
        with hold_run_directory(run_dir, where=where, main=True):
            if overwrite:
                clear_run_directory(run_dir)
            code = launch(num_processes, argv, env={HELD_FOR_WORKERS: str(lock_path(run_dir))})
        raise typer.Exit(code)
    warn_about_fewer_processes_than_intended(resolved)
    from ..train import train as run_training  # torch, diffusers: only when a run starts

    if dry_run:
        run_training(resolved, resume=resume, dry_run=True, console=console, registry=registry())
        return
    with hold_run_directory(run_dir, where=where):  # before anything is cleared or written
        if overwrite:
            overwrite_run_directory(resolved.output_dir)
        try:
            finished = run_training(resolved, resume=resume, console=console, registry=registry())
        except OSError as exc:  # mid-run: a full disk or an unwritable path at a metrics or checkpoint write
            error = os_write_error(exc, run_dir, where=where, resume=f"flowrl train --resume {run_dir}")
            if error is None:
                raise
            raise error from exc
    if finished is not None and os.environ.get("RANK", "0") == "0":  # the main process of a launched run
        for line in evaluation_summary(resolved, finished) + warning_signs(resolved, finished):
            console.print(line, markup=False, highlight=False, soft_wrap=True)


def evaluation_summary(resolved, run_dir: Path) -> list[str]:
    """The run's first and last evaluation, every evaluated reward on one line (mean ± standard
    error, and the change in standard errors of the two combined in quadrature), the optimised ones
    (a weight or chunk weights; none in an offline run) first and marked: what the README's
    quickstart table reports. Nothing when the run has fewer than two evaluations."""
    import math

    from ..run_health import is_evaluation, optimised_labels
    from ..runlog import read_metrics

    if not (Path(run_dir) / "metrics.jsonl").is_file():
        return []
    rows = [r for r in read_metrics(run_dir) if is_evaluation(r)]
    if len(rows) < 2:
        return []
    first, last = rows[0], rows[-1]
    labels = [k.split("/")[1] for k in last if k.startswith("eval/") and k.endswith("/mean") and k.count("/") == 2]
    optimised = [label for label in optimised_labels(resolved) if label in labels]
    labels = optimised + sorted(set(labels) - set(optimised))
    p = resolved.prompts
    held_out = bool(p.split_column) and p.train_split != p.eval_split
    out = [f"{'held-out ' if held_out else ''}evaluation, iteration {first['iteration']} -> {last['iteration']} "
           f"({p.num_eval} prompts x {p.eval_seeds} noises; mean ± standard error):"]
    width = max(len(label) for label in labels)
    for label in labels:
        (m0, s0), (m1, s1) = [(r.get(f"eval/{label}/mean", math.nan), r.get(f"eval/{label}/sem", math.nan))
                              for r in (first, last)]
        spread = math.hypot(s0, s1)
        change = f"{(m1 - m0) / spread:+.1f} SE" if spread > 0 else f"{m1 - m0:+.4f}"
        note = "optimised" if label in optimised else "not optimised"
        out.append(f"  {label:<{width}}  {m0:.4f} ± {s0:.4f} -> {m1:.4f} ± {s1:.4f}  {change}  ({note})")
    return out


def warning_signs(resolved, run_dir: Path) -> list[str]:
    """The run's warning signs (:mod:`flowrl.run_health`), a line each, under a
    heading that names the command printing all its checks; nothing for a healthy run."""
    from ..run_health import optimised_labels, run_health
    from ..runlog import read_metrics

    if not (Path(run_dir) / "metrics.jsonl").is_file():
        return []
    warned = [c for c in run_health(read_metrics(run_dir), optimised_labels(resolved))
              if c.status != "ok"]
    if not warned:
        return []
    return [f"warning signs (all checks: flowrl diagnose {run_dir}):",
            *(f"  {c.name}: {c.detail}" for c in warned)]


def check_this_machine(resolved, launching: int | None) -> None:
    """What `flowrl validate` checks of this machine's memory, once per run before anything loads
    (:func:`flowrl.commands.machine.check_training_machine`): by the launcher of ``launching``
    processes, else by a lone process or rank 0 of an external launcher (not by the workers of
    this command's own launcher, which checked for them)."""
    from ..train.run_dir import HELD_FOR_WORKERS
    from .machine import check_training_machine

    if launching:
        check_training_machine(resolved, launching)
        return
    if HELD_FOR_WORKERS in os.environ or os.environ.get("RANK", "0") != "0":
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_training_machine(resolved, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))


def warn_about_fewer_processes_than_intended(resolved) -> None:
    """A warning, on the main process, when the run has fewer processes than the recipe's
    [distributed].num_processes. Not an error, and no processes are launched from it: the
    global batch does not depend on the process count, so the run is valid (a tiny test model
    trains a flagship recipe on one CPU), but each process then holds more samples (and under
    fsdp2 larger shards) than `flowrl plan RECIPE` estimated, which on GPUs ends in an
    out-of-memory error hours later. More processes than intended only lowers the memory."""
    intended = resolved.distributed.num_processes
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun and accelerate launch
    if world_size >= intended or os.environ.get("RANK", "0") != "0":
        return
    from rich.markup import escape

    console.print(
        "[yellow]warning:[/yellow] " + escape(
            f"the recipe is written for {intended} processes ([distributed].num_processes) and this run "
            f"has {world_size}: each process holds {intended / world_size:g} times the samples (and under "
            f"fsdp2 the shards) that `flowrl plan` estimated; launch it with --num-processes {intended}, "
            f"or check this run's memory with `flowrl plan {resolved.source} --num-processes {world_size}`"),
        highlight=False,
    )


#: What `flowrl train` writes into a run directory (trackers may add their own directories).
RUN_OUTPUTS = ("metrics.jsonl", "recipe.toml", "profile.json", "run_info.json", "inputs.json", "checkpoints", "images",
               "tensorboard", "wandb", "wandb_run.json")


def overwrite_run_directory(run_dir: Path, wait_s: float = 300.0) -> None:
    """The main process clears the directory; under an external launcher (torchrun, accelerate)
    the other processes wait until it has, so that none of them sees the earlier run."""
    import time

    if os.environ.get("RANK", "0") == "0":
        clear_run_directory(run_dir)
        return
    deadline = time.monotonic() + wait_s
    while (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists():
        if time.monotonic() > deadline:
            raise FlowrlError(f"--overwrite: {run_dir} still holds the earlier run after {wait_s:.0f} s",
                              where="--overwrite", hint="is the run directory on a filesystem every process shares?")
        time.sleep(0.2)


def clear_run_directory(run_dir: Path) -> None:
    """``--overwrite``: delete an earlier run's outputs (only the files and directories training
    writes, never anything else in the directory)."""
    import shutil

    removed = []
    for name in RUN_OUTPUTS:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        removed.append(name)
    if removed:
        console.print(f"--overwrite: removed the earlier run's {', '.join(removed)} from {run_dir}")
