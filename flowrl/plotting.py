"""``flowrl plot``: reward curves of a run as a PNG (matplotlib, the ``plot`` extra)."""

from __future__ import annotations

from pathlib import Path

from .errors import FlowrlError, require
from .runlog import read_metrics


def plot_run(run_dir: Path, output: Path | None = None) -> Path:
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise FlowrlError(f"no metrics.jsonl in {run_dir}", hint="pass the run directory of a `flowrl train` run")
    require("matplotlib", extra="plot", purpose="flowrl plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    train_keys = sorted({k for r in records for k in r if k.startswith("reward/") and k.endswith("/mean")})
    eval_keys = sorted({k for r in records for k in r if k.startswith("eval/") and k.endswith("/mean")})
    fig, axes = plt.subplots(1, 2 if eval_keys else 1, figsize=(11 if eval_keys else 6, 4), squeeze=False)
    ax = axes[0][0]
    for key in train_keys:
        xs = [r["iteration"] for r in records if key in r]
        ys = [r[key] for r in records if key in r]
        std_key = key[: -len("mean")] + "std"
        sd = [r.get(std_key, 0.0) for r in records if key in r]
        (line,) = ax.plot(xs, ys, label=key[len("reward/") : -len("/mean")])
        ax.fill_between(xs, [y - s for y, s in zip(ys, sd)], [y + s for y, s in zip(ys, sd)], alpha=0.15, color=line.get_color())
    ax.set_title("training reward (rollout mean ± std)")
    ax.set_xlabel("iteration")
    ax.legend()
    ax.grid(alpha=0.3)
    if eval_keys:
        ax = axes[0][1]
        for key in eval_keys:
            xs = [r["iteration"] for r in records if key in r]
            ys = [r[key] for r in records if key in r]
            ax.plot(xs, ys, marker="o", ms=3, label=key[len("eval/") : -len("/mean")])
        ax.set_title("evaluation reward (fixed prompts and seeds, ODE)")
        ax.set_xlabel("iteration")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    output = Path(output) if output else run_dir / "rewards.png"
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output
