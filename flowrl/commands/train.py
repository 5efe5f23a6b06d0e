"""``flowrl train``: run (or resume) training; ``--num-processes N`` launches data parallelism."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import FlowrlError
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
        int, typer.Option("--num-processes", help="Launch N data-parallel processes on this machine (torchrun).")
    ] = 1,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate and print the resolved geometry, then stop.")] = False,
) -> None:
    """Train a policy with the recipe's components: rollout, rewards, advantages, update."""
    if recipe is None:
        if resume is None:
            raise FlowrlError("train needs a RECIPE (or --resume RUN_DIR)", hint="flowrl train recipes/quickstart.toml")
        recipe = resume / "recipe.toml"
    overrides = list(set_ or [])
    if output_dir is not None:
        overrides.append(f"run.output_dir={json.dumps(str(output_dir))}")
    if num_processes > 1 and "LOCAL_RANK" not in os.environ:
        from ..distributed import launch

        raise typer.Exit(launch(num_processes, sys.argv[1:]))
    resolved = load(recipe, overrides)
    from ..train import train as run_training  # torch, diffusers: only when a run starts

    run_training(resolved, resume=resume, dry_run=dry_run, console=console, registry=registry())
