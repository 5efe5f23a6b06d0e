"""``flowrl sweep``: a grid of settings x seeds, each run a ``flowrl train`` subprocess.

::

    flowrl sweep recipes/quickstart_hacking.toml --grid train.lr=1e-4,3e-4 --seeds 3 -j 2 -o runs/lr_sweep
    flowrl sweep recipes/quickstart_hacking.toml --grid "chunker.sizes=[2,3,4,7],[16]" --seeds 5
    flowrl sweep recipes/quickstart_hacking.toml --seeds 5 \\
        --variant "step:chunker.use=step,selector.use=uniform,selector.fraction=0.5" \\
        --variant "gspo:chunker.use=sequence,selector.use=all"
    flowrl sweep --resume runs/lr_sweep          # continue a killed sweep

Runs: the cross product of the named variants (or the recipe itself), the grid's values and the
seeds, run seed by seed (every setting at the first seed, then at the second, ...). Seed k of ``--seeds N`` sets ``run.seed = base + k`` (base: the recipe's ``run.seed``
after ``--set``); ``--seed-list 1,2,3`` names them. Each run is its own process
(``OMP_NUM_THREADS = --threads``, default 1) writing its own run directory
``SWEEP_DIR/runs/<variant>_seed<seed>/``; its output goes to ``SWEEP_DIR/logs/``.

Grid syntax: ``--grid KEY=V1,V2,...``; the values are TOML values as in ``--set`` (bare words
are strings), separated by the commas that are not inside brackets, braces or quotes, so
``chunker.sizes=[2,3,4,7],[16]`` has two values. Repeating ``--grid`` with the same key adds
values; different keys multiply. ``--variant NAME:KEY=V,KEY=V`` is a named set of overrides,
applied before the grid's (so ``chunker.use=step`` may reset the chunker table first).

The manifest ``SWEEP_DIR/sweep.json`` (written atomically after every change) records the recipe
and its sha256, the grid, variants and seeds, and per run: overrides, directory, status
(pending, running, done, failed, interrupted), exit code, wall time, attempts and, for a failed
run, the last lines of its stderr. Running the same command again, or ``flowrl sweep --resume
SWEEP_DIR``, continues: done runs are skipped, a run with a checkpoint continues with
``flowrl train --resume RUN_DIR``, a run without one starts over. Failed runs are retried.

Signals: Ctrl-C or SIGTERM stops launching runs and asks the running ones to checkpoint and stop
(one SIGINT each; a second signal stops them at once); the sweep then exits with 128 + the
signal number. On Linux a run also gets one SIGINT if the sweep process dies (even by SIGKILL).
Exit status: 0 when every run is done, 1 when any failed, 2 for bad input.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..errors import FlowrlError
from .base import SetOpt, app, console, load, options, table_console


def cli_flags() -> list[str]:
    """The global options this command was given, for every run it starts."""
    flags = ["--debug"] if options.debug else []
    for name in options.disabled_plugins:
        flags += ["--disable-plugin", name]
    return flags


@app.command()
def sweep(
    recipe: Annotated[Optional[Path], typer.Argument(help="Recipe to sweep (omit with --resume).")] = None,
    grid: Annotated[Optional[list[str]], typer.Option(
        "--grid", "-g", help="KEY=V1,V2,...: values to sweep (TOML, split at top-level commas: "
        "'chunker.sizes=[2,3,4,7],[16]'). Repeatable; different keys multiply.")] = None,
    variant: Annotated[Optional[list[str]], typer.Option(
        "--variant", help="NAME:KEY=V,KEY=V: a named set of overrides (repeatable); crossed with the grid.")] = None,
    seeds: Annotated[Optional[int], typer.Option("--seeds", min=1, help="Seeds per setting: run.seed = base + 0..N-1.")] = None,
    seed_list: Annotated[Optional[str], typer.Option("--seed-list", help="Explicit seeds, e.g. 1,2,3 (instead of --seeds).")] = None,
    jobs: Annotated[Optional[int], typer.Option(
        "--jobs", "-j", min=1, help="Runs at once, capped by the cores available / --threads (default 1, or the sweep's own).")] = None,
    threads: Annotated[Optional[int], typer.Option(
        "--threads", min=1, help="OMP_NUM_THREADS of each run (default 1, or the sweep's own).")] = None,
    output_dir: Annotated[Optional[Path], typer.Option("--output-dir", "-o", help="Sweep directory (default runs/sweep_<recipe>).")] = None,
    set_: SetOpt = None,
    resume: Annotated[Optional[Path], typer.Option("--resume", help="Continue the sweep in this directory.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate every combination, print the runs, run nothing.")] = False,
) -> None:
    """Run a grid of settings x seeds, one `flowrl train` process per run; resumable."""
    from ..sweeps import Sweep, define_sweep, jobs_and_threads, lock_sweep, open_sweep, resumed_manifest

    if resume is not None:
        if recipe is not None or grid or variant or seeds or seed_list or set_ or output_dir is not None:
            raise FlowrlError("--resume SWEEP_DIR continues a sweep as it was defined: give no RECIPE, --grid, "
                              "--variant, --seeds, --seed-list, --set or -o with it", where="--resume",
                              hint=f"flowrl sweep --resume {resume}")
        sweep_dir, manifest = resume, resumed_manifest(resume)
    else:
        sweep_dir, spec = define_sweep(recipe, grid, variant, seeds, seed_list, output_dir, set_, load)
        if not dry_run:
            from ..files import ensure_writable

            ensure_writable(sweep_dir, where="--output-dir" if output_dir is not None else "the sweep directory",
                            directory=True)
        manifest = open_sweep(recipe, sweep_dir, spec, load, write=not dry_run)
    if dry_run:
        _print_plan(manifest)
        return
    jobs, threads = jobs_and_threads(manifest, jobs, threads, console)
    lock = lock_sweep(sweep_dir)
    try:
        code = Sweep(sweep_dir, manifest, jobs, threads, console=console, cli_flags=cli_flags()).execute()
    finally:
        lock.close()
    if code:
        raise typer.Exit(code)



def _print_plan(manifest: dict[str, Any]) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"{len(manifest['runs'])} run(s)", title_justify="left")
    for col in ("run", "variant", "seed", "overrides", "status"):
        table.add_column(col, overflow="fold")
    for r in manifest["runs"]:
        table.add_row(escape(r["id"]), escape(r["variant"]), str(r["seed"]), escape(" ".join(r["overrides"]) or "-"), r["status"])
    table_console().print(table)
