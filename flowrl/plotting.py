"""``flowrl plot``: reward curves of a run as a PNG (matplotlib, the ``plot`` extra)."""

from __future__ import annotations

from pathlib import Path

from .artefacts import ARTEFACT_MEASURES
from .errors import FlowrlError, require
from .files import ensure_writable
from .runlog import read_metrics

#: The ratio-based update diagnostics. Their row of panels appears when a run logs them and they
#: carry more than rounding; an objective without trajectory log-probs (DiffusionNFT) logs none.
DIAGNOSTICS = ("diag/log_ratio_std", "clip_fraction", "approx_kl_old", "diag/step_log_ratio_std")


#: Scalars an objective logs about itself (DiffusionNFT, GARDO, the KL terms, the ELBO estimator, FDFO, DPO, SFT):
#: their own panel.
OBJECTIVE_PREFIXES = ("nft/", "gardo/", "kl/", "elbo/", "fdfo/", "dpo/", "sft/")

#: Below this, a run's ratio diagnostics are float rounding: every re-scoring was on-policy.
ROUNDING = 1e-6


def _integer_iterations(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _off_policy(records) -> bool:
    """Whether the ratio diagnostics carry information: some re-scoring left the old policy (a
    second optimizer step or pass), beyond float rounding. An on-policy run (one step per
    rollout) logs 1e-8 noise there, which is not worth a row of panels."""
    def big(key):
        return any(isinstance(r.get(key), (int, float)) and abs(r[key]) > ROUNDING for r in records)

    return big("diag/log_ratio_std") or big("clip_fraction") or big("approx_kl_old")


def plot_objective(records, keys, ax) -> None:
    """The objective's own scalars over iterations (log scale where they are positive and span
    more than two decades)."""
    values = []
    for key in keys:
        xs, ys = _series(records, key)
        ys = [float(y) for y in ys]
        ax.plot(xs, ys, label=key)
        values += ys
    positive = [v for v in values if v > 0]
    if positive and len(positive) == len(values) and max(positive) / min(positive) > 100:
        ax.set_yscale("log")
    ax.set_title("objective: " + ", ".join(sorted({k.split("/")[0] for k in keys})))
    ax.set_xlabel("iteration")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _series(records, key):
    pts = [(r["iteration"], r[key]) for r in records if isinstance(r.get(key), (int, float)) and not r.get("final")]
    return [p[0] for p in pts], [p[1] for p in pts]


ON_POLICY_NOTE = ("all 0: every re-scoring was on-policy\n(one optimizer step per rollout);\n"
                  "several steps or passes per rollout\nshow the policy's drift here")


def _all_zero(records, key) -> bool:
    vals = [x for r in records if isinstance(r.get(key), list) for x in r[key] if x is not None]
    return bool(vals) and all(x == 0 for x in vals)


def plot_unit_ratios(records, ax) -> None:
    """The per-chunk (unit) log-ratio spread over iterations, one line per unit."""
    rows = [(r["iteration"], r["diag/unit_log_ratio_std"]) for r in records
            if isinstance(r.get("diag/unit_log_ratio_std"), list) and r["diag/unit_log_ratio_std"]]
    if not rows:
        ax.axis("off")
        return
    for k in range(max(len(v) for _, v in rows)):
        pts = [(it, v[k]) for it, v in rows if k < len(v) and v[k] is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"unit {k}")
    if _all_zero(records, "diag/unit_log_ratio_std"):
        ax.text(0.5, 0.5, ON_POLICY_NOTE, transform=ax.transAxes, ha="center", va="center", fontsize=9, alpha=0.8)
    ax.set_title("unit (chunk) log-ratio std")
    ax.set_xlabel("iteration")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def plot_diagnostics(records, axes) -> None:
    """Three panels: the log-ratio mean ± spread of the re-scored steps, the per-step spread as an
    image (iteration x trainable position), and clip fraction / approximate KL to the old policy /
    share of groups whose rewards are all equal."""
    ax = axes[0]
    xs, mean = _series(records, "diag/log_ratio_mean")
    _, std = _series(records, "diag/log_ratio_std")
    if xs:
        (line,) = ax.plot(xs, mean, label="mean")
        ax.fill_between(xs, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2,
                        color=line.get_color(), label="± std")
        ax.legend()
    ax.set_title("step log-ratio log pi_theta - log pi_old")
    ax.set_xlabel("iteration")
    ax.grid(alpha=0.3)
    ax = axes[1]
    rows = [(r["iteration"], r["diag/step_log_ratio_std"]) for r in records
            if isinstance(r.get("diag/step_log_ratio_std"), list) and r["diag/step_log_ratio_std"]]
    if rows:
        width = max(len(v) for _, v in rows)
        grid = [[(x if x is not None else float("nan")) for x in v] + [float("nan")] * (width - len(v)) for _, v in rows]
        im = ax.imshow(list(zip(*grid)), aspect="auto", origin="lower", cmap="viridis",
                       extent=(rows[0][0] - 0.5, rows[-1][0] + 0.5, -0.5, width - 0.5))
        ax.figure.colorbar(im, ax=ax, fraction=0.05)
        ax.set_yticks(range(width) if width <= 16 else range(0, width, max(1, width // 8)))
        if _all_zero(records, "diag/step_log_ratio_std"):
            ax.text(0.5, 0.5, ON_POLICY_NOTE, transform=ax.transAxes, ha="center", va="center", fontsize=9,
                    color="white")
    ax.set_title("log-ratio std per trained position")
    ax.set_xlabel("iteration")
    ax.set_ylabel("trainable position t")
    ax = axes[2]
    for key, label in (("clip_fraction", "clip fraction"), ("groups/all_equal_fraction", "groups with equal rewards")):
        xs, ys = _series(records, key)
        if xs:
            ax.plot(xs, ys, label=label)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("iteration")
    ax.set_ylabel("fraction")
    ax.grid(alpha=0.3)
    xs, ys = _series(records, "approx_kl_old")
    if xs:
        twin = ax.twinx()
        twin.plot(xs, ys, color="tab:red", ls="--", label="approx KL to old (k3)")
        twin.set_ylabel("approx KL to old", color="tab:red")
        twin.legend(loc="center right", fontsize=8)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("clipping, KL to the old policy, zero-advantage groups")


def check_figure_path(path: Path, *, where: str) -> None:
    """A figure's file: a format matplotlib writes (named by its suffix) in a writable folder."""
    from matplotlib.figure import Figure

    ensure_writable(path, where=where, directory=False, suffix=".png")
    formats = Figure().canvas.get_supported_filetypes()
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in formats:
        raise FlowrlError(f"{path}: {'.' + suffix if suffix else 'no suffix'} is not a figure format matplotlib writes",
                          where=where, hint="end the name in " + ", ".join(f".{f}" for f in ("png", "pdf", "svg")))


def plot_run(run_dir: Path, output: Path | None = None, reference: dict | None = None) -> Path:
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise FlowrlError(f"no metrics.jsonl in {run_dir}", hint="pass the run directory of a `flowrl train` run")
    require("matplotlib", extra="plot", purpose="flowrl plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output = Path(output) if output else run_dir / "rewards.png"
    check_figure_path(output, where="--output" if output != run_dir / "rewards.png" else "the run's rewards.png")
    records = plottable(read_metrics(run_dir), run_dir / "metrics.jsonl")
    if not records:
        raise FlowrlError(f"{run_dir / 'metrics.jsonl'} holds no record yet: nothing to draw",
                          hint="plot a run after its first iteration has been logged")
    fig = run_figure(records, run_dir.name, reference)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output


def plottable(records: list[dict], path: Path) -> list[dict]:
    """The rows as the figures read them: each with an integer ``iteration`` (one message naming
    the row, else), and only its numbers and lists (the per-unit diagnostics): a null or a string
    is no point."""
    out = []
    for i, row in enumerate(records):
        iteration = row.get("iteration")
        if not isinstance(iteration, int) or isinstance(iteration, bool):
            raise FlowrlError(f"{path}: row {i + 1} has no integer 'iteration' ({iteration!r})",
                              hint="a metrics.jsonl flowrl wrote has one in every row: restore the file from a copy")
        out.append({k: v for k, v in row.items()
                    if k in ("iteration", "final") or isinstance(v, list)
                    or isinstance(v, (int, float)) and not isinstance(v, bool)})
    return out


#: Rewards whose largest values differ by more than this factor get panels of their own: on one
#: axis a PickScore near 22 would flatten a brightness in [0, 1] into a line.
SCALE_RATIO = 10.0


def scale_groups(records: list[dict], keys: list[str], ratio: float = SCALE_RATIO) -> list[list[str]]:
    """``keys`` in groups that share an axis: sorted by their largest absolute value over the run, a
    new group starting where a key's is more than ``ratio`` times its group's smallest (a key that
    is zero throughout joins the smallest group)."""
    magnitude = {k: max((abs(float(r[k])) for r in records if k in r), default=0.0) for k in keys}
    groups: list[list[str]] = []
    floor = 0.0
    for key in sorted(keys, key=lambda k: (magnitude[k], k)):
        m = magnitude[key]
        if groups and (floor == 0.0 or m <= ratio * floor):
            groups[-1].append(key)
            floor = floor or m
        else:
            groups.append([key])
            floor = m
    return groups


def _label(key: str) -> str:
    """``reward/pickscore/mean`` -> ``pickscore``."""
    return key.split("/", 1)[1].rsplit("/", 1)[0]


def _plot_training(records, keys, ax, title) -> None:
    for key in keys:
        xs = [r["iteration"] for r in records if key in r]
        ys = [r[key] for r in records if key in r]
        sd = [r.get(key[: -len("mean")] + "std", 0.0) for r in records if key in r]
        (line,) = ax.plot(xs, ys, label=_label(key))
        ax.fill_between(xs, [y - s for y, s in zip(ys, sd)], [y + s for y, s in zip(ys, sd)], alpha=0.15, color=line.get_color())
    ax.set_title(title)
    ax.set_xlabel("iteration")
    ax.legend()
    ax.grid(alpha=0.3)


def _plot_evaluation(records, keys, artefact_keys, ax, title, reference=None) -> None:
    said = False  # one legend entry for the reference, however many metrics it draws behind
    for key in keys:
        xs = [r["iteration"] for r in records if key in r]
        ys = [r[key] for r in records if key in r]
        sem = [r.get(key[: -len("mean")] + "sem", 0.0) for r in records if key in r]
        (line,) = ax.plot(xs, ys, marker="o", ms=3, label=_label(key))
        ax.fill_between(xs, [y - s for y, s in zip(ys, sem)], [y + s for y, s in zip(ys, sem)], alpha=0.15,
                        color=line.get_color())
        curve = (reference or {}).get("metrics", {}).get(key)
        if curve:  # the reference seeds' range behind the run, their mean dotted
            ax.fill_between(curve["iterations"], curve["low"], curve["high"], color=line.get_color(), alpha=0.07,
                            hatch="//", linewidth=0)
            ax.plot(curve["iterations"], curve["mean"], ls=":", color=line.get_color(),
                    label="_nolegend_" if said else f"reference: {len(reference['seeds'])} seeds' mean (dotted), range (hatched)")
            said = True
    ax.set_title(title)
    ax.set_xlabel("iteration")
    ax.grid(alpha=0.3)
    if not artefact_keys:
        ax.legend()
        return
    twin = ax.twinx()  # the texture a policy may learn, on its own scale, against the first evaluation
    for key in artefact_keys:
        xs = [r["iteration"] for r in records if key in r]
        ys = [r[key] for r in records if key in r]
        twin.plot(xs, ys, color="0.4", ls="--", marker="x", ms=4, label=f"{_label(key)} (artefacts, right axis)")
    twin.set_ylim(0.0, max(0.2, 1.2 * max(r[k] for r in records for k in artefact_keys if k in r)))
    twin.set_ylabel("artefact measure", color="0.4")
    lines, labels = ax.get_legend_handles_labels()
    more, more_labels = twin.get_legend_handles_labels()
    ax.legend(lines + more, labels + more_labels, fontsize=8)


def _titled(groups: list[list[str]], title: str) -> list[tuple[list[str], str]]:
    """One panel per scale group; with several, each title names its rewards on a second line."""
    if len(groups) <= 1:
        return [(g, title) for g in groups]
    return [(g, f"{title}\n{', '.join(_label(k) for k in g)}") for g in groups]


def run_figure(records: list[dict], title: str, reference: dict | None = None):
    """The figure ``flowrl plot`` saves, for a run's metrics rows: the training and the evaluation
    rewards (a panel per scale, :func:`scale_groups`), the objective's own metrics, and the ratio
    diagnostics of an off-policy run; a ``reference`` (:mod:`flowrl.reference_curves`) behind
    the evaluation."""
    import matplotlib.pyplot as plt

    train_keys = sorted({k for r in records for k in r if k.startswith("reward/") and k.endswith("/mean")})
    eval_keys = sorted({k for r in records for k in r if k.startswith("eval/") and k.endswith("/mean")})
    artefact_keys = [k for k in eval_keys if k[len("eval/") : -len("/mean")] in ARTEFACT_MEASURES]
    eval_keys = [k for k in eval_keys if k not in artefact_keys]
    objective_keys = sorted({k for r in records for k, v in r.items()
                             if k.startswith(OBJECTIVE_PREFIXES) and isinstance(v, (int, float)) and not isinstance(v, bool)})
    logged = any(k in r for r in records for k in DIAGNOSTICS)
    diag = logged and _off_policy(records)
    eval_panels = _titled(scale_groups(records, eval_keys), "evaluation reward (fixed prompts and seeds, ODE) ± sem")
    # an offline run (a [data] table) has no training reward: no empty panel for it, unless nothing else shows
    train_panels = _titled(scale_groups(records, train_keys) or ([] if eval_panels else [[]]),
                           "training reward (rollout mean ± std)")
    top = (len(train_panels) + len(eval_panels) + (1 if objective_keys else 0) + (1 if diag else 0))
    cols = 3 if diag or top >= 3 else top  # at most 3 a row: the panels wrap
    top_rows = -(-top // cols)
    rows = top_rows + (1 if diag else 0)
    fig, axes = plt.subplots(rows, cols, figsize=(max(5.2 * cols, 8.0), 4 * rows), squeeze=False)
    row = iter([ax for r in axes[:top_rows] for ax in r])
    for keys, name in train_panels:
        _plot_training(records, keys, next(row), name)
    for i, (keys, name) in enumerate(eval_panels):
        _plot_evaluation(records, keys, artefact_keys if i == 0 else [], next(row), name, reference)
    if objective_keys:
        plot_objective(records, objective_keys, next(row))
    if diag:
        plot_unit_ratios(records, next(row))
        plot_diagnostics(records, axes[-1])
    for ax in row:
        ax.axis("off")
    note = "\non-policy: every ratio diagnostic was float rounding (< 1e-6), not drawn" if logged and not diag else ""
    fig.suptitle(title + note)
    for ax in axes.flat:
        if ax.get_xlabel() == "iteration":
            _integer_iterations(ax)
    fig.tight_layout()
    return fig
