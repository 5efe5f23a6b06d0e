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
) -> None:
    """Draw the reward curves of a run to a PNG."""
    from ..plotting import plot_run  # matplotlib and torch: only when drawing

    path = plot_run(run_dir, output)
    console.print(f"wrote {path}")
