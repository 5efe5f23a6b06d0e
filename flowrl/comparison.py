"""Comparing variants over seeds: the library behind ``flowrl compare`` (its command is
``flowrl/commands/compare.py``). What is read and computed: the command's docstring there, and
docs/sweep.md.

:func:`discover` finds the runs (sweep directories, run directories, directories of runs),
:func:`load_curve` reads one run's evaluation curve, :func:`compare_runs` gives per-variant
means with Student t intervals and differences paired by seed, and :func:`to_markdown`,
:func:`to_csv`, :func:`table_rows` and :func:`plot` render the result.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import re
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from .errors import FlowrlError, suggest
from .files import read_jsonl
from .runlog import is_phase_seconds
from .stats import Interval, cumulative, curve_auc, paired_interval, t_interval, value_at_budget
from .sweeps import MANIFEST, run_entries_problem

FORMATS = ("table", "md", "csv", "json")
QUANTITIES = ("final", "best", "auc")
_SEED_SUFFIX = re.compile(r"[_-]seed\d+$")


@dataclasses.dataclass
class RunRef:
    dir: Path
    variant: str
    seed: int | None
    source: str
    from_sweep: bool
    wall_time_s: float | None = None


@dataclasses.dataclass
class RunCurve:
    ref: RunRef
    xs: list[int]
    ys: list[float]
    costs: list[float]  # train seconds spent before each evaluation
    train_time_s: float
    contiguous: bool

    def summary(self) -> dict[str, float]:
        return {"final": self.ys[-1], "best": max(self.ys), "auc": curve_auc(self.xs, self.ys)}


# ----------------------------------------------------------------------------- reading


def _recipe(run_dir: Path) -> dict[str, Any]:
    try:
        return tomllib.loads((run_dir / "recipe.toml").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def discover(paths: list[Path], notes: list[str]) -> list[RunRef]:
    """Every run under ``paths`` (sweep directories, run directories, directories of runs)."""
    refs: list[RunRef] = []
    for path in paths:
        if not path.exists():
            raise FlowrlError(f"{path} does not exist", where="RUN_OR_SWEEP_DIRS", hint="pass sweep or run directories")
        if (path / MANIFEST).is_file():
            refs += _sweep_runs(path, notes)
        elif (path / "metrics.jsonl").is_file():
            refs.append(_plain_run(path, path.name))
        elif path.is_dir():
            found = []
            for d in sorted(p for p in path.iterdir() if p.is_dir()):
                if (d / MANIFEST).is_file():
                    found += _sweep_runs(d, notes)
                elif (d / "metrics.jsonl").is_file():
                    found.append(_plain_run(d, path.name))
            if not found:
                raise FlowrlError(f"no runs in {path}: no {MANIFEST}, no metrics.jsonl and no run directories in it",
                                  where=str(path), hint="pass a `flowrl sweep` directory or `flowrl train` run directories")
            refs += found
        else:
            raise FlowrlError(f"{path} is not a directory", where="RUN_OR_SWEEP_DIRS", hint="pass sweep or run directories")
    # a variant name used by two different sources, one of them a sweep: tell them apart
    sources: dict[str, set[str]] = {}
    for r in refs:
        sources.setdefault(r.variant, set()).add(r.source)
    clash = {v for v, s in sources.items() if len(s) > 1 and any(r.from_sweep for r in refs if r.variant == v)}
    for r in refs:
        if r.variant in clash:
            r.variant = f"{r.source}/{r.variant}"
    return refs


def _sweep_runs(sweep_dir: Path, notes: list[str]) -> list[RunRef]:
    try:
        manifest = json.loads((sweep_dir / MANIFEST).read_text(encoding="utf-8"))
        runs = manifest["runs"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise FlowrlError(f"{sweep_dir / MANIFEST} is not a flowrl sweep manifest ({exc})", where=str(sweep_dir)) from exc
    problem = run_entries_problem(runs)
    if problem is not None:
        raise FlowrlError(f"{sweep_dir / MANIFEST} is not a sweep manifest flowrl wrote: {problem}",
                          where=str(sweep_dir), hint="restore it from a copy of the sweep")
    refs, skipped = [], []
    for run in runs:
        run_dir = sweep_dir / run["dir"]
        if run.get("status") != "done" or not (run_dir / "metrics.jsonl").is_file():
            skipped.append(f"{run['id']} ({run.get('status')})")
            continue
        refs.append(RunRef(run_dir, run["variant"], run.get("seed"), sweep_dir.name, True, run.get("wall_time_s")))
    if skipped:
        notes.append(f"{sweep_dir}: left out {len(skipped)} run(s) not done: {', '.join(skipped)}")
    return refs


def _plain_run(run_dir: Path, source: str) -> RunRef:
    seed = _recipe(run_dir).get("run", {}).get("seed")
    return RunRef(run_dir, _SEED_SUFFIX.sub("", run_dir.name) or run_dir.name, seed if isinstance(seed, int) else None,
                  source, False)


def default_metric(refs: list[RunRef]) -> str:
    recipe = _recipe(refs[0].dir)
    rewards = recipe.get("rewards") or []
    if rewards and isinstance(rewards[0], dict) and rewards[0].get("use"):
        return f"eval/{rewards[0].get('name') or rewards[0]['use']}/mean"
    for record in read_jsonl(refs[0].dir / "metrics.jsonl"):
        keys = sorted(k for k in record if k.startswith("eval/") and k.endswith("/mean"))
        if keys:
            return keys[0]
    raise FlowrlError(f"{refs[0].dir} logged no evaluation", where=str(refs[0].dir / "metrics.jsonl"),
                      hint="train with [prompts].num_eval > 0 to evaluate on a fixed set")


def load_curve(ref: RunRef, metric: str) -> RunCurve:
    records = read_jsonl(ref.dir / "metrics.jsonl")
    points: dict[int, float] = {}
    step_cost: dict[int, float] = {}
    for r in records:
        it = r.get("iteration")
        if not isinstance(it, int):
            continue
        if isinstance(r.get(metric), (int, float)):
            points[it] = float(r[metric])
        if not r.get("final"):
            step_cost[it] = sum(float(v) for k, v in r.items()
                                if is_phase_seconds(k) and k != "time/eval" and isinstance(v, (int, float)))
    if not points:
        available = sorted({k for r in records for k in r if k.startswith("eval/") and k.endswith("/mean")})
        raise FlowrlError(f"run {ref.dir} has no '{metric}' values", where="--metric",
                          hint=f"available: {', '.join(available)}" if available else
                          "it logged no evaluation: train with [prompts].num_eval > 0")
    iters = sorted(step_cost)
    finals = [r["iteration"] for r in records if r.get("final") and isinstance(r.get("iteration"), int)]
    contiguous = iters == list(range(max([len(iters)] + finals)))  # every iteration up to the final one logged
    before = cumulative([step_cost[i] for i in iters])  # before[k]: cost of iterations iters[:k]
    xs = sorted(points)
    costs = [before[sum(1 for i in iters if i < x)] for x in xs]
    return RunCurve(ref, xs, [points[x] for x in xs], costs, before[-1], contiguous)


# ----------------------------------------------------------------------------- statistics


def compare_runs(curves: list[RunCurve], baseline: str | None, confidence: float = 0.95,
                 at_wall_time: float | None = None) -> dict[str, Any]:
    """The whole comparison as a JSON-able dict (what every output format shows)."""
    variants: dict[str, list[RunCurve]] = {}
    for c in curves:
        variants.setdefault(c.ref.variant, []).append(c)
    for name, runs in variants.items():
        seeds = [c.ref.seed for c in runs if c.ref.seed is not None]
        dupes = sorted({s for s in seeds if seeds.count(s) > 1})
        if dupes:
            dirs = [str(c.ref.dir) for c in runs if c.ref.seed == dupes[0]]
            raise FlowrlError(f"variant '{name}' has more than one run with seed {dupes[0]}: {', '.join(dirs)}",
                              hint="pass each run once, or give the runs distinct directory names")
    if baseline is None:
        baseline = next(iter(variants))
    elif baseline not in variants:
        raise FlowrlError(f"no variant named '{baseline}'", where="--baseline", hint=suggest(baseline, variants))
    quantities = list(QUANTITIES) + (["at_wall_time"] if at_wall_time is not None else [])
    per_run: dict[str, list[dict[str, Any]]] = {}
    for name, runs in variants.items():
        rows = []
        for c in runs:
            row: dict[str, Any] = {"dir": str(c.ref.dir), "seed": c.ref.seed, **c.summary(),
                                   "iterations": c.xs[-1], "train_time_s": c.train_time_s, "wall_time_s": c.ref.wall_time_s}
            if at_wall_time is not None:
                if not c.contiguous:
                    raise FlowrlError(f"run {c.ref.dir} did not log every iteration, so its train time is unknown",
                                      where="--at-wall-time", hint="train with [log].every = 1")
                if c.costs[0] > at_wall_time:  # its first evaluation came later (e.g. only the final one)
                    raise FlowrlError(
                        f"run {c.ref.dir} has no value of the metric within {at_wall_time:g} s of train time (its "
                        f"first is at {c.costs[0]:.1f} s, iteration {c.xs[0]})", where="--at-wall-time",
                        hint=f"give a budget of at least {c.costs[0]:.1f} s, or a metric the runs log from the start")
                i, ended = value_at_budget(list(zip(c.costs, c.ys)), at_wall_time)
                row["at_wall_time"] = c.ys[i]
                row["at_wall_time_iteration"] = c.xs[i]
                row["at_wall_time_ended_before"] = ended
            rows.append(row)
        per_run[name] = rows

    def by_seed(name: str, q: str) -> dict[Any, float]:
        return {r["seed"]: r[q] for r in per_run[name] if r["seed"] is not None}

    out_variants = []
    for name, rows in per_run.items():
        entry: dict[str, Any] = {"name": name, "n": len(rows), "seeds": [r["seed"] for r in rows]}
        for q in quantities + ["train_time_s", "iterations"]:
            entry[q] = t_interval([r[q] for r in rows], confidence).as_dict()
        walls = [r["wall_time_s"] for r in rows]
        entry["wall_time_s"] = t_interval(walls, confidence).as_dict() if all(w is not None for w in walls) else None
        if at_wall_time is not None:
            entry["at_wall_time_iteration"] = t_interval([r["at_wall_time_iteration"] for r in rows], confidence).as_dict()
            entry["at_wall_time_runs_ended_before"] = sum(bool(r["at_wall_time_ended_before"]) for r in rows)
        entry["paired"] = None if name == baseline else {
            q: paired_interval(by_seed(name, q), by_seed(baseline, q), confidence).as_dict() for q in quantities
        }
        entry["runs"] = rows
        out_variants.append(entry)
    return {
        "metric": None, "baseline": baseline, "confidence": confidence, "interval": "student-t",
        "auc": "trapezoid area under the evaluation curve over iterations divided by the iterations spanned",
        "at_wall_time_s": at_wall_time, "variants": out_variants,
    }


def band(curves: list[RunCurve], confidence: float, x_of=None) -> tuple[list[float], list[float], list[float | None], list[float | None]]:
    """Per evaluated iteration: x (or the mean of ``x_of``), mean, and the t interval's bounds."""
    xs = sorted({x for c in curves for x in c.xs})
    out_x, mean, lo, hi = [], [], [], []
    for x in xs:
        vals = [c.ys[c.xs.index(x)] for c in curves if x in c.xs]
        iv: Interval = t_interval(vals, confidence)
        xv = [x_of(c, c.xs.index(x)) for c in curves if x in c.xs] if x_of else [x]
        out_x.append(sum(xv) / len(xv))
        mean.append(iv.mean)
        lo.append(iv.lo)
        hi.append(iv.hi)
    return out_x, mean, lo, hi


# ----------------------------------------------------------------------------- formatting


def _cell(iv: dict[str, Any] | None, digits: int, signed: bool = False) -> str:
    if iv is None or iv["mean"] is None:
        return "-"
    sign = "+" if signed else ""
    text = f"{iv['mean']:{sign}.{digits}f}"
    return text + (f" ± {iv['half_width']:.{digits}f}" if iv["half_width"] is not None else " (n/a)")


def _columns(result: dict[str, Any]) -> list[tuple[str, str, int, bool]]:
    """(header, key, digits, paired?) of the table."""
    cols = [("final", "final", 4, False), ("best", "best", 4, False), ("AUC", "auc", 4, False)]
    if result["at_wall_time_s"] is not None:
        cols.append((f"at {result['at_wall_time_s']:g} s", "at_wall_time", 4, False))
    cols += [("Δ final", "final", 4, True), ("Δ AUC", "auc", 4, True)]
    if result["at_wall_time_s"] is not None:
        cols.append((f"Δ at {result['at_wall_time_s']:g} s", "at_wall_time", 4, True))
    return cols


def table_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    cols = _columns(result)
    header = ["variant", "n"] + [c[0] for c in cols] + ["train s", "wall s"]
    rows = []
    for v in result["variants"]:
        row = [v["name"], str(v["n"])]
        for _, key, digits, paired in cols:
            if not paired:
                row.append(_cell(v[key], digits))
            elif v["paired"] is None:
                row.append("baseline")
            else:
                p = v["paired"][key]
                row.append(_cell(p, digits, signed=True) + (f" (n={p['n']})" if p["n"] != v["n"] else ""))
        row += [_cell(v["train_time_s"], 1), _cell(v["wall_time_s"], 1)]
        rows.append(row)
    return header, rows


def legend(result: dict[str, Any]) -> list[str]:
    c = round(result["confidence"] * 100, 6)
    lines = [
        f"metric: {result['metric']}; mean over seeds ± half-width of the {c:g}% Student t interval "
        f"(t quantile with n-1 degrees of freedom times s/sqrt(n)); n/a: fewer than 2 seeds.",
        f"Δ: difference from the baseline '{result['baseline']}', paired by seed (mean ± t half-width over the pairs).",
        "final: last evaluation; best: highest evaluation; AUC: trapezoid area under the evaluation curve over "
        "iterations divided by the iterations spanned (the curve's average height).",
        "train s: sum of the per-iteration time/* fields except time/eval; wall s: the run's process time (sweep manifest).",
    ]
    if result["at_wall_time_s"] is not None:
        ended = sum(v["at_wall_time_runs_ended_before"] for v in result["variants"])
        lines.append(f"at {result['at_wall_time_s']:g} s: the last evaluation whose policy took at most that much train time"
                     + (f"; {ended} run(s) ended before that budget (their final value is used)." if ended else "."))
    return lines


def to_markdown(result: dict[str, Any]) -> str:
    header, rows = table_rows(result)
    esc = [[c.replace("|", "\\|") for c in r] for r in [header] + rows]
    lines = ["| " + " | ".join(esc[0]) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in esc[1:]]
    return "\n".join(lines + [""] + legend(result)) + "\n"


def to_csv(result: dict[str, Any]) -> str:
    quantities = list(QUANTITIES) + (["at_wall_time"] if result["at_wall_time_s"] is not None else [])
    fields = ["variant", "n", "seeds"]
    for q in quantities + ["train_time_s", "wall_time_s"]:
        fields += [f"{q}_mean", f"{q}_lo", f"{q}_hi"]
    for q in quantities:
        fields += [f"delta_{q}_mean", f"delta_{q}_lo", f"delta_{q}_hi", f"delta_{q}_n"]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    w.writeheader()
    for v in result["variants"]:
        row: dict[str, Any] = {"variant": v["name"], "n": v["n"], "seeds": " ".join(str(s) for s in v["seeds"])}
        for q in quantities + ["train_time_s", "wall_time_s"]:
            iv = v[q] or {}
            row.update({f"{q}_mean": iv.get("mean"), f"{q}_lo": iv.get("lo"), f"{q}_hi": iv.get("hi")})
        for q in quantities:
            p = (v["paired"] or {}).get(q) or {}
            row.update({f"delta_{q}_mean": p.get("mean"), f"delta_{q}_lo": p.get("lo"),
                        f"delta_{q}_hi": p.get("hi"), f"delta_{q}_n": p.get("n")})
        w.writerow({k: ("" if val is None else val) for k, val in row.items()})
    return buf.getvalue()


def plot(curves: list[RunCurve], result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants: dict[str, list[RunCurve]] = {}
    for c in curves:
        variants.setdefault(c.ref.variant, []).append(c)
    budget = result["at_wall_time_s"]
    fig, axes = plt.subplots(1, 2 if budget is not None else 1, figsize=(12 if budget is not None else 7, 4.5), squeeze=False)
    panels = [(axes[0][0], None, "iteration")]
    if budget is not None:
        panels.append((axes[0][1], lambda c, i: c.costs[i], "train time (s), mean over seeds"))
    c = round(result["confidence"] * 100, 6)
    for ax, x_of, xlabel in panels:
        for name, runs in variants.items():
            xs, mean, lo, hi = band(runs, result["confidence"], x_of)
            (line,) = ax.plot(xs, mean, marker="o", ms=2.5, lw=1.4, label=f"{name} (n={len(runs)})")
            ok = [i for i, v in enumerate(lo) if v is not None]
            if ok:
                ax.fill_between([xs[i] for i in ok], [lo[i] for i in ok], [hi[i] for i in ok], alpha=0.15, color=line.get_color())
        if x_of is not None:
            ax.axvline(budget, color="grey", ls="--", lw=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(result["metric"])
        ax.grid(alpha=0.3)
    axes[0][0].set_title(f"mean over seeds, {c:g}% Student t band")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
