"""``flowrl compare``: variants over seeds, with 95% Student t intervals and paired differences.

::

    flowrl compare runs/study                                    # a sweep directory
    flowrl compare runs/study --baseline step --metric verifier -o docs/study
    flowrl compare runs/a_seed1 runs/a_seed2 runs/b_seed1 runs/b_seed2 --format md
    flowrl compare runs/study --at-wall-time 600                 # equal training time

What it reads: a sweep directory (its ``sweep.json`` names every run, its variant and seed;
runs not ``done`` are left out, with a note), a run directory (``metrics.jsonl``), or a directory
holding run directories. A run outside a sweep belongs to the variant named by its directory
with a trailing ``_seed<N>`` / ``-seed<N>`` removed, and its seed is ``[run].seed`` of its
``recipe.toml``.

Per run, on the evaluation curve of the metric (default: the first reward's
``eval/<label>/mean``; ``--metric verifier`` is short for ``eval/verifier/mean``), with x the
number of completed iterations (the evaluation logged at iteration i, before its update, and
the final one at i = iterations):

- final: the value at the last evaluation; best: the largest value over all evaluations
  (including the one before training);
- AUC: the trapezoid area under the curve over x, divided by the x span: the curve's average
  height, in the metric's units;
- train time: the sum of the per-iteration ``time/*`` fields except ``time/eval`` (evaluation
  is measurement, the same for every variant); wall time: the run's processes (sweep manifest);
- ``--at-wall-time S``: the value at the last evaluation whose policy cost at most S seconds of
  train time to reach (the cumulative train time of the iterations before it).

Per variant: the mean over seeds and the half-width of the two-sided Student t interval
(``t_{(1+c)/2, n-1} s / sqrt(n)``, c = 0.95 by default; n/a with fewer than 2 seeds). Against the
baseline variant: the differences paired by seed (only seeds both have), their mean and t
interval. Output: a terminal table, Markdown, CSV or JSON (``--format``); ``-o DIR`` writes all
four and the figure ``DIR/compare.png`` (curves, mean and t band per variant; matplotlib, the
``plot`` extra).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..errors import FlowrlError, require, suggest
from .base import app, err_console, table_console


def print_table(result: dict[str, Any]) -> None:
    from rich.markup import escape
    from rich.table import Table

    from ..comparison import legend, table_rows

    header, rows = table_rows(result)
    table = Table(title=escape(f"{result['metric']} (baseline: {result['baseline']})"), title_justify="left")
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i == 0 else "right", overflow="fold")
    for r in rows:
        table.add_row(*(escape(c) for c in r))
    out = table_console()  # piped into a log: as wide as the cells, never folded mid-word
    out.print(table)
    for line in legend(result):
        out.print(escape(line), style="dim", highlight=False)



# ----------------------------------------------------------------------------- command


@app.command()
def compare(
    dirs: Annotated[list[Path], typer.Argument(
        metavar="RUN_OR_SWEEP_DIRS...", help="Sweep directories (sweep.json), run directories (metrics.jsonl), or directories holding runs.")],
    baseline: Annotated[Optional[str], typer.Option("--baseline", "-b", help="Variant the paired differences are taken against (default: the first).")] = None,
    metric: Annotated[Optional[str], typer.Option(
        "--metric", "-m", help="Evaluation metric, e.g. eval/verifier/mean or just verifier (default: the first reward's).")] = None,
    fmt: Annotated[str, typer.Option("--format", "-f", help="Output on stdout: table, md, csv or json.")] = "table",
    output_dir: Annotated[Optional[Path], typer.Option(
        "--output-dir", "-o", help="Also write compare.md, .csv, .json and the figure compare.png here.")] = None,
    at_wall_time: Annotated[Optional[float], typer.Option(
        "--at-wall-time", min=0.0, help="Also compare at equal train time: the last evaluation within SECONDS.")] = None,
    confidence: Annotated[float, typer.Option("--confidence", min=0.5, max=0.999, help="Confidence of the t intervals.")] = 0.95,
    figure: Annotated[bool, typer.Option("--figure/--no-figure", help="With -o, draw compare.png (needs flowrl-diffusion[plot]).")] = True,
) -> None:
    """Compare variants over seeds: final, best and AUC of an eval metric, t intervals, paired differences."""
    from ..comparison import FORMATS, compare_runs, default_metric, discover, load_curve, plot, to_csv, to_markdown

    if fmt not in FORMATS:
        raise FlowrlError(f"unknown format '{fmt}'", where="--format", hint=suggest(fmt, FORMATS))
    if output_dir is not None and figure:
        require("matplotlib", extra="plot", purpose="the figure of flowrl compare (or pass --no-figure)")
    if output_dir is not None:
        from ..files import ensure_writable

        ensure_writable(output_dir, where="--output-dir", directory=True)
    notes: list[str] = []
    refs = discover(list(dirs), notes)
    if not refs:
        raise FlowrlError("no finished runs to compare", where="RUN_OR_SWEEP_DIRS", hint="; ".join(notes) or None)
    if metric is None:
        metric = default_metric(refs)
    elif "/" not in metric:
        metric = f"eval/{metric}/mean"
    curves = [load_curve(r, metric) for r in refs]
    result = compare_runs(curves, baseline, confidence, at_wall_time)
    result["metric"] = metric
    result["notes"] = notes
    for n in notes:
        err_console.print(f"note: {n}", highlight=False, markup=False)
    if fmt == "table":
        print_table(result)
    else:
        text = {"md": to_markdown, "csv": to_csv, "json": lambda r: json.dumps(r, indent=2) + "\n"}[fmt](result)
        typer.echo(text, nl=False)
    if output_dir is not None:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "compare.md").write_text(to_markdown(result), encoding="utf-8")
        (output_dir / "compare.csv").write_text(to_csv(result), encoding="utf-8")
        (output_dir / "compare.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        written = ["compare.md", "compare.csv", "compare.json"]
        if figure:
            plot(curves, result, output_dir / "compare.png")
            written.append("compare.png")
        err_console.print(f"wrote {', '.join(str(output_dir / w) for w in written)}", highlight=False, markup=False)
