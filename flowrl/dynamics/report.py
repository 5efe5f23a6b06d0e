"""Reading a profile: the terminal report, the comparison of two profiles, and the plot.

Everything here takes a ``profile.json`` dict (:mod:`flowrl.dynamics.profile_file`); the
terminal functions print to the ``console`` they are given.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..errors import require
from .measure import CURVE_HELP, CURVES

_METHOD_STYLE = {"dp": ("tab:red", "-"), "curvature": ("tab:blue", "--"), "derivative": ("tab:green", ":")}

_PROFILE_COLOUR = {"base": "tab:orange", "trained": "black"}

_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float | None], boundaries: Sequence[int] = (), lo: float | None = None, hi: float | None = None) -> str:
    """A one-line unicode bar chart; ``|`` is drawn before each boundary position, ``·`` for None."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    lo = min(vals) if lo is None and vals else (lo or 0.0)
    hi = max(vals) if hi is None and vals else (hi or 1.0)
    span = hi - lo
    cuts = set(boundaries)
    out = []
    for i, v in enumerate(values):
        if i in cuts:
            out.append("|")
        if v is None or not math.isfinite(v):
            out.append("·")
        else:
            level = 0 if span <= 0 else int(round((v - lo) / span * (len(_BARS) - 1)))
            out.append(_BARS[min(max(level, 0), len(_BARS) - 1)])
    return "".join(out)


def compare_profiles(base: dict[str, Any], trained: dict[str, Any]) -> dict[str, Any]:
    """Per curve and trainable transition: base mean, trained mean and relative change."""
    positions = base["positions"] or list(range(len(base["trainable"])))
    out: dict[str, Any] = {"format": "flowrl-profile-compare", "positions": positions, "curves": {}, "proposals": {}}
    for name, entry in base["curves"].items():
        b = [entry["mean"][i] for i in positions]
        t = [trained["curves"][name]["mean"][i] for i in positions]
        out["curves"][name] = {
            "base": b, "trained": t,
            "relative_change": [(tv - bv) / bv if bv else None for bv, tv in zip(b, t)],
        }
    for name, by in base["proposals"].items():
        out["proposals"][name] = {
            m: {"base": by[m]["sizes"], "trained": trained["proposals"][name][m]["sizes"]} for m in by
        }
    return out


# ----------------------------------------------------------------------------- reporting


def _component(table: dict[str, Any]) -> str:
    """A component's recipe table as ``use(key=value, ...)`` (empty values left out)."""
    return f"{table.get('use')}(" + ", ".join(f"{k}={v}" for k, v in table.items() if k != "use" and v != "") + ")"


def print_profile(console: Console, data: dict[str, Any], curve: str = "l1rel") -> None:
    """The per-transition table, a sparkline per curve and the boundary proposals (fits 80 columns)."""
    s = data["settings"]
    sig = data["sigmas"]
    curves = data["curves"]
    proposals = data["proposals"]
    # an all-ODE sampler trains nothing: show its curves over every transition, without cuts
    positions = data["positions"] or list(range(len(data["trainable"])))

    console.print(escape(
        f"flowrl profile: {_component(s['model'])}, {s['steps']} steps, {_component(s['schedule'])}, "
        f"kernel {_component(s['kernel'])}; "
        f"{s['num_prompts']} prompts x {s['num_seeds']} seeds (seed {s['seed']}); sampled and segmented in "
        f"{data['elapsed_s']:.1f} s"
    ), highlight=False)

    def pct(vals, i):
        return "-" if vals is None or vals[i] is None or vals[i] != vals[i] else f"{100 * vals[i]:.1f}"

    t = Table(title="Per transition: mean over prompts and seeds; cv% = spread / mean across prompts (p) or seeds (s)",
              title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("i", "sigma", "dsigma", "T", "l1rel", "cv%p", "cv%s", "l1r/ds", "x0chg", "cv%p", "vchg"):
        t.add_column(col, justify="right")
    for i in range(len(data["trainable"])):
        t.add_row(
            str(i), f"{sig[i]:.3f}", f"{sig[i] - sig[i + 1]:.3f}", "y" if data["trainable"][i] else "-",
            f"{curves['l1rel']['mean'][i]:.3f}", pct(curves["l1rel"]["prompt_cv"], i), pct(curves["l1rel"]["seed_cv"], i),
            f"{curves['l1rel_norm']['mean'][i]:.3g}", f"{curves['x0_change']['mean'][i]:.3f}",
            pct(curves["x0_change"]["prompt_cv"], i), f"{curves['v_change']['mean'][i]:.3f}",
        )
    console.print(t)

    what = f"the T = {len(positions)} trainable transitions ('|' = dp boundaries)" if proposals else "all transitions"
    t = Table(title=f"Curves over {what}",
              title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("curve", "shape", "min", "max", "cv%p", "cv%s"):
        t.add_column(col, justify="left" if col in ("curve", "shape") else "right")
    for name in CURVES:
        entry = curves[name]
        y = [entry["mean"][i] for i in positions]
        summ = entry.get("summary", {})
        t.add_row(
            name, sparkline(y, proposals[name]["dp"]["boundaries"] if proposals else ()), f"{min(y):.4g}", f"{max(y):.4g}",
            "-" if summ.get("prompt_cv") is None else f"{100 * summ['prompt_cv']:.1f}",
            "-" if summ.get("seed_cv") is None else f"{100 * summ['seed_cv']:.1f}",
        )
        if name == curve:
            # first and second differences of the mean, between consecutive trainable steps
            for label, key, width in (("  d1", "d1", 1), ("  d2", "d2", 2)):
                d = [entry[key][i] for i in positions if i + width < len(entry["mean"]) and i + width in positions]
                if d:
                    t.add_row(label, sparkline(d), f"{min(d):.3g}", f"{max(d):.3g}", "", "", style="dim")
    console.print(t)
    for name in CURVES:
        console.print(escape(f"  {name}: {CURVE_HELP[name]}"), highlight=False)

    if not proposals:
        console.print("no trainable transition (the kernel injects no noise): no chunk proposals")
        return
    limits = s["segmentation"]
    t = Table(
        title=f"Chunk proposals: K = {limits['num_chunks'] or 'chosen'}, sizes in "
        f"[{limits['min_size']}, {limits['max_size'] or 'T'}] (bold: --curve {curve})",
        title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
    )
    for col in ("curve", "method", "sizes", "var.expl.", "layout"):
        t.add_column(col)
    for name in [curve] + [c for c in CURVES if c != curve]:
        y = [curves[name]["mean"][i] for i in positions]
        for method, p in data["proposals"][name].items():
            t.add_row(name, method, str(p["sizes"]), f"{100 * p['explained']:.1f}%", sparkline(y, p["boundaries"]),
                      style="bold" if name == curve else "dim")
    console.print(t)
    for method in data["proposals"][curve]:
        p = data["proposals"][curve][method]
        console.print(escape(f"# {curve}, {method}:\n{p['snippet']}"), highlight=False)


def print_comparison(console: Console, base, trained, summary, curve: str = "l1rel") -> None:
    t = Table(title=f"base vs {Path(summary.get('checkpoint', 'trained')).name}: mean over trainable transitions", title_justify="left")
    for col in ("curve", "base", "trained", "largest change", "at position"):
        t.add_column(col)
    for name in CURVES:
        c = summary["curves"][name]
        changes = [abs(v) if v is not None else 0.0 for v in c["relative_change"]]
        j = max(range(len(changes)), key=changes.__getitem__)
        t.add_row(
            name, sparkline(c["base"], lo=min(c["base"] + c["trained"]), hi=max(c["base"] + c["trained"])),
            sparkline(c["trained"], lo=min(c["base"] + c["trained"]), hi=max(c["base"] + c["trained"])),
            f"{100 * c['relative_change'][j]:+.1f}%" if c["relative_change"][j] is not None else "-", str(j),
        )
    console.print(t)
    t = Table(title=f"proposals on {curve}", title_justify="left")
    for col in ("method", "base", "trained"):
        t.add_column(col)
    for method, p in summary["proposals"][curve].items():
        t.add_row(method, str(p["base"]), str(p["trained"]))
    console.print(t)


def plot_profile(data: dict[str, Any], path: Path, *, curve: str = "l1rel", base: dict[str, Any] | None = None) -> Path:
    """Draw every curve (mean with its spread across prompts) and the chunk proposals for ``curve``.

    Top: one panel per curve, red lines at the ``dp`` boundaries. Bottom: the layouts of every
    method as rows of boxes labelled with their sizes. With ``base``, both profiles are drawn
    (``data`` is the trained one) and the layouts of both are listed.
    """
    require("matplotlib", extra="plot", purpose="the flowrl profile plot")
    import matplotlib
    import matplotlib.patches

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sig = data["sigmas"]
    n = len(data["trainable"])
    positions = data["positions"]
    if not data["proposals"] or (base is not None and not base["proposals"]):
        curve = ""
    ticks = [f"{i}\n{sig[i]:.2f}" for i in range(n)]
    profiles = [("trained", data)] if base is None else [("base", base), ("trained", data)]
    rows = [(label, method, d["proposals"][curve][method]) for label, d in profiles for method in d["proposals"].get(curve, {})]

    fig = plt.figure(figsize=(12, 7.5 + (0.7 + 0.25 * len(rows) if rows else 0)))
    grid = fig.add_gridspec(3 if rows else 2, 2, height_ratios=[1, 1, 0.16 * len(rows) + 0.2] if rows else [1, 1])
    axes = [fig.add_subplot(grid[r, c]) for r in range(2) for c in range(2)]

    for ax, name in zip(axes, CURVES):
        _draw_curve(ax, name, profiles, data, curve if rows else "", compare=base is not None)
        ax.set_xticklabels(ticks if name in CURVES[2:] else [], fontsize=7)
    handles, labels = axes[0].get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    axes[0].legend(unique.values(), unique.keys(), fontsize=8, loc="upper right")

    if rows:
        _draw_layouts(fig.add_subplot(grid[2, :]), rows, data, positions, ticks, curve, base is not None)
    else:
        for ax in axes[2:]:
            ax.set_xlabel("transition i (below: sigma_i); nothing trainable, no chunk proposals")

    fig.suptitle(_plot_title(data["settings"], compare=base is not None), fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _draw_curve(ax, name: str, profiles, data, curve: str, *, compare: bool) -> None:
    """One curve's panel: the mean of each profile with its spread across prompts, the ``dp``
    boundaries on ``curve`` (none when ``curve`` is empty), and the transitions not trained."""
    positions = data["positions"]
    n = len(data["trainable"])
    xs = list(range(n))

    def boundary_x(b: int) -> float:
        return (positions[b - 1] + positions[b]) / 2  # between the two trainable steps it separates

    for label, d in profiles:
        entry = d["curves"][name]
        mean = entry["mean"]
        colour = _PROFILE_COLOUR[label]
        shown = label if compare else "mean"
        ax.plot(xs, mean, marker="o", ms=3.5, color=colour, label=shown, zorder=4 if label == "base" else 3,
                ls="--" if label == "base" else "-")
        if entry.get("prompt_std"):
            lo = [m - s for m, s in zip(mean, entry["prompt_std"])]
            hi = [m + s for m, s in zip(mean, entry["prompt_std"])]
            ax.fill_between(xs, lo, hi, color=colour, alpha=0.2, lw=0, label=f"{shown} ± std across prompts")
    for label, d in profiles if curve else ():
        p = d["proposals"][curve]["dp"]
        for k, b in enumerate(p["boundaries"]):
            ax.axvline(boundary_x(b), color="tab:red", ls="--" if label == "base" else "-", lw=1.3, alpha=0.8,
                       label=(f"dp boundaries ({curve})" + (f", {label}" if compare else "")) if k == 0 else None)
    for i, tr in enumerate(data["trainable"]):
        if not tr and positions:  # all-ODE: nothing is trainable, hatching everything says nothing
            ax.axvspan(i - 0.5, i + 0.5, facecolor="none", hatch="///", edgecolor="0.75", lw=0, zorder=0,
                       label="not trainable")
    cv = data["curves"][name].get("summary", {}).get("prompt_cv")
    ax.set_title(f"{name}" + (f" (mean CV across prompts {100 * cv:.1f}%)" if cv is not None else "")
                 + f"\n{CURVE_HELP[name]}", fontsize=9.5)
    ax.grid(alpha=0.3)
    ax.set_xlim(-0.5, n - 0.5)
    ax.set_xticks(xs)


def _plot_title(s: dict[str, Any], *, compare: bool) -> str:
    title = (f"{_component(s['model'])}: {s['steps']} steps, schedule {_component(s['schedule'])}, "
             f"kernel {_component(s['kernel'])}; {s['num_prompts']} prompts x {s['num_seeds']} seeds")
    if compare:
        title += f"\nbase model vs {s.get('weights', 'trained')}"
    return title


def _draw_layouts(strip, rows, data, positions, ticks, curve, compare):
    """One row of boxes per (profile, method): each box a chunk, labelled with its size."""
    import matplotlib.patches

    n = len(data["trainable"])
    for r, (label, method, p) in enumerate(rows):
        y = len(rows) - 1 - r
        colour = _METHOD_STYLE.get(method, ("k", "-"))[0]
        start = 0
        for k, size in enumerate(p["sizes"]):
            a, b = positions[start] - 0.5, positions[start + size - 1] + 0.5
            strip.add_patch(matplotlib.patches.Rectangle((a, y - 0.4), b - a, 0.8, facecolor=colour,
                                                         alpha=0.55 if k % 2 == 0 else 0.3, edgecolor="white", lw=1.5))
            strip.text((a + b) / 2, y, str(size), ha="center", va="center", fontsize=9)
            start += size
        for i, tr in enumerate(data["trainable"]):
            if not tr:
                strip.add_patch(matplotlib.patches.Rectangle((i - 0.5, y - 0.4), 1, 0.8, facecolor="none",
                                                             hatch="///", edgecolor="0.75", lw=0))
    strip.set_yticks(range(len(rows)))
    strip.set_yticklabels(
        [f"{label + ' ' if compare else ''}{method} {p['sizes']} ({100 * p['explained']:.0f}% var.)"
         for label, method, p in reversed(rows)], fontsize=8,
    )
    strip.set_ylim(-0.6, len(rows) - 0.4)
    strip.set_xlim(-0.5, n - 0.5)
    strip.set_xticks(range(n))
    strip.set_xticklabels(ticks, fontsize=7)
    strip.set_xlabel("transition i (below: sigma_i); hatched = not trainable")
    lim = data["settings"].get("segmentation", {})
    strip.set_title(
        f"chunk proposals from {curve}: K = {lim.get('num_chunks') or 'chosen'}, sizes in "
        f"[{lim.get('min_size', 1)}, {lim.get('max_size') or 'T'}] (boxes = chunks, numbers = sizes)", fontsize=9.5,
    )
