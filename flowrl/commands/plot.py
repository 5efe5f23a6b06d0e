"""``flowrl plot``: the reward curves of a run as a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .base import app, console


@app.command()
def plot(
    run_dir: Annotated[Path, typer.Argument(help="A run directory containing metrics.jsonl.")],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="PNG path (default RUN_DIR/rewards.png).")] = None,
    reference: Annotated[Optional[Path], typer.Option(
        "--reference", help="A reference file to draw behind the evaluation (default: the recipe's shipped one, "
                            "recipes/reference/<run.name>.json, when the run's settings are its own).")] = None,
    no_reference: Annotated[bool, typer.Option("--no-reference", help="Draw no reference.")] = False,
) -> None:
    """Draw the reward curves of a run to a PNG."""
    from ..plotting import plot_run  # matplotlib and torch: only when drawing
    from ..reference_curves import reference_for

    ref, note = (None, "") if no_reference else reference_for(run_dir, reference)
    path = plot_run(run_dir, output, ref)
    if note:
        console.print(note, markup=False)
    console.print(f"wrote {path}")
