"""``flowrl diagnose RUN_DIR``: is this run healthy? The warning signs in its metrics.

::

    flowrl diagnose runs/my_run              # one line per check: ok or warn, with the figures
    flowrl diagnose runs/my_run --json       # the same for machines
    flowrl diagnose runs/my_run --strict     # exit 1 on a warning (scripts, sweeps)

It reads ``RUN_DIR/metrics.jsonl`` and the run's recipe (which rewards it optimises), during a
run or after it, and loads no model. The checks and their thresholds:
:mod:`flowrl.run_health`; docs/diagnosis.md shows them on the hacking lesson.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .base import app, console, load


@app.command()
def diagnose(
    run_dir: Annotated[Path, typer.Argument(help="A run directory written by `flowrl train` (metrics.jsonl, "
                                                 "recipe.toml).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    strict: Annotated[bool, typer.Option("--strict", help="Exit 1 when any check warns.")] = False,
    reference: Annotated[Optional[Path], typer.Option(
        "--reference", help="A reference file to hold the run's last evaluation against (default: the recipe's "
                            "shipped one, when the run's settings are its own).")] = None,
) -> None:
    """Read a run's metrics for the signs of an unhealthy run: hacking, artefacts, collapse, saturation."""
    from ..diagnostics.report import print_report, report_json
    from ..reference_curves import reference_checks, reference_for
    from ..run_health import optimised_labels, run_health
    from ..errors import FlowrlError
    from ..runlog import read_metrics

    run_dir = Path(run_dir)
    metrics, recipe_path = run_dir / "metrics.jsonl", run_dir / "recipe.toml"
    for path in (metrics, recipe_path):
        if not path.is_file():
            raise FlowrlError(f"{run_dir} is not a run directory (no {path.name})", where="RUN_DIR",
                              hint="pass the directory `flowrl train` writes (its -o / [run].output_dir)")
    recipe = load(recipe_path)
    rows = read_metrics(run_dir)
    checks = run_health(rows, optimised_labels(recipe))
    ref, note = reference_for(run_dir, reference)
    if ref is not None:
        checks += reference_checks(rows, ref, note.removeprefix("reference: "))
    elif note and not as_json:
        console.print(note, markup=False)
    if as_json:
        print(report_json("diagnose", checks, run_dir=str(run_dir)))
    else:
        print_report(console, f"flowrl diagnose {run_dir}", checks)
    if strict and any(c.status != "ok" for c in checks):
        raise typer.Exit(1)
