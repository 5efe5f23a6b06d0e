"""Benchmark: one-step-off pipelining (``[pipeline]``) against the synchronous loop.

Two measurements on the embedded model, in the learning regime of docs/study_shapes.md
(``recipes/study_embedded.toml``: 33 steps, SDE in the first 16, 4 prompts x 8 samples, two
passes per rollout, full fine-tuning):

``time``: wall time per iteration of the engine's own loop (``flowrl.train.train``), the
variants (``--variants``, default all) run one after the other in a seeded random order in every round (so that all of them
share the machine's load drift):

- ``synchronous``: ``staleness = 0`` (rollout, then update);
- ``in_order``: ``staleness = 1, overlap = false`` (the next rollout drawn by the copy first,
  then the update: the same work plus the re-scoring, no overlap);
- ``overlapped``: ``staleness = 1`` (the next rollout drawn in a worker thread beside the update);
- ``process``: ``staleness = 1, worker = "process"`` (drawn beside the update in a rollout
  process of its own, on the same CPU: no GIL shared with the update).

An iteration's wall time is the time between the metrics rows of two consecutive iterations
(a tracker records ``time.perf_counter`` when each row is logged); iteration 0 (model warm-up,
and the pipelined variants' first rollout drawn before anything else) is left out. Evaluation
and image grids are off, the only checkpoint is written after the last row. Reported: per
variant the median over rounds of each run's median iteration time, and the per-round ratios
against the synchronous run (median and quartiles), plus the load average. The overlap needs a
second free core: on a 2-core machine shared with other jobs the ratio is bounded by the load.

``learn``: does the one-step-stale policy still learn? The study recipe for ``--iterations``
(default 20) with ``staleness`` 0 and 1, per seed: the held-out verifier (18 prompts never
trained on, 4 noises each, ODE sampling) and the CLIP judge (logged with weight 0, not
optimised) at the first and the last evaluation, ``hf_share`` (the artefact measure), and the
pipelined run's importance-weight diagnostics.

Run (one thread per process)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pipeline.py time --rounds 5
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pipeline.py learn --seeds 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from flowrl import hookimpl  # noqa: E402
from flowrl.plugins import temporary_plugin  # noqa: E402
from flowrl.recipe import load_recipe  # noqa: E402
from flowrl.runlog import read_metrics  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "study_embedded.toml"
VARIANTS = {
    "synchronous": ["pipeline.staleness=0"],
    "in_order": ["pipeline.staleness=1", "pipeline.overlap=false"],
    "overlapped": ["pipeline.staleness=1", "pipeline.overlap=true"],
    "process": ["pipeline.staleness=1", "pipeline.worker='process'"],
}


class RowClock:
    """A tracker plugin that records when each iteration's metrics row is logged."""

    def __init__(self):
        self.stamps: dict[int, float] = {}

    @hookimpl
    def register_trackers(self, register):
        stamps = self.stamps

        class Tracker:
            def log_metrics(self, step, metrics):
                if "lr" in metrics:  # an iteration's row (not the final evaluation's)
                    stamps[step] = time.perf_counter()

            def log_image(self, step, name, image):
                pass

            def close(self):
                pass

        register("row_clock", lambda: Tracker())


def quiet():
    from rich.console import Console

    return Console(file=open(os.devnull, "w"))


def train_once(out: Path, sets: list[str], clock: RowClock | None = None) -> Path:
    from flowrl.train import train

    text = RECIPE.read_text()
    if clock is not None:
        text += '\n[[trackers]]\nuse = "row_clock"\n'
    recipe_path = RECIPE.parent / f".pipeline_bench_{os.getpid()}.toml"  # the recipe's relative paths hold
    recipe_path.write_text(text)
    try:
        recipe = load_recipe(recipe_path, [*sets, f"run.output_dir={str(out)!r}", "log.progress=false"])
    finally:
        recipe_path.unlink()
    return train(recipe, console=quiet())


def time_variants(args) -> dict:
    rng = random.Random(args.seed)
    common = [f"train.iterations={args.iterations}", "prompts.num_eval=0", "log.image_every=0",
              f"checkpoint.every={args.iterations}"]
    chosen = list(dict.fromkeys(["synchronous", *args.variants]))
    per_variant: dict[str, list[float]] = {v: [] for v in chosen}
    ratios: dict[str, list[float]] = {v: [] for v in chosen if v != "synchronous"}
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = list(chosen)
            rng.shuffle(order)
            medians = {}
            for name in order:
                clock = RowClock()
                with temporary_plugin(clock, name="row-clock"):
                    train_once(Path(tmp) / f"{name}_{r}", common + VARIANTS[name], clock)
                steps = [clock.stamps[i] - clock.stamps[i - 1] for i in range(1, args.iterations)]
                medians[name] = statistics.median(steps)
                per_variant[name].append(medians[name])
            for name in ratios:
                ratios[name].append(medians[name] / medians["synchronous"])
            print(f"round {r}: " + ", ".join(f"{k} {v:.2f} s" for k, v in medians.items()), flush=True)
    return {
        "rounds": args.rounds, "iterations": args.iterations, "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "median_iteration_seconds": {k: statistics.median(v) for k, v in per_variant.items()},
        "per_round_seconds": per_variant,
        "ratio_to_synchronous": {k: {"median": statistics.median(v), "quartiles": quartiles(v), "rounds": v}
                                 for k, v in ratios.items()},
    }


def quartiles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [values[0], values[0]]
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


def learn(args) -> dict:
    out: dict[str, dict] = {}
    root = Path(args.out)
    for seed in range(42, 42 + args.seeds):
        for staleness in (0, 1):
            name = f"staleness{staleness}_seed{seed}"
            start = time.perf_counter()
            run_dir = train_once(root / name, [f"run.seed={seed}", f"train.iterations={args.iterations}",
                                              f"pipeline.staleness={staleness}", "log.image_every=0"])
            rows = read_metrics(run_dir)
            evals = [r for r in rows if "eval/verifier/mean" in r]
            first, last = evals[0], evals[-1]
            trained = [r for r in rows if "lr" in r]
            ess = [r["pipeline/ess_fraction"] for r in trained if "pipeline/ess_fraction" in r]
            spread = [r["pipeline/weight_max"] - r["pipeline/weight_min"] for r in trained if "pipeline/weight_max" in r]
            out[name] = {
                "seconds": time.perf_counter() - start, "run_dir": str(run_dir),
                **{f"{k}_{when}": r.get(f"eval/{k}/mean") for when, r in (("first", first), ("last", last))
                   for k in ("verifier", "embedded_clip", "hf_share")},
                **{f"{k}_sem_{when}": r.get(f"eval/{k}/sem") for when, r in (("first", first), ("last", last))
                   for k in ("verifier", "embedded_clip")},
                "ess_fraction_min": min(ess) if ess else None,
                "ess_fraction_mean": statistics.mean(ess) if ess else None,
                "weight_spread_mean": statistics.mean(spread) if spread else None,
                "truncated_fraction_max": max((r.get("pipeline/truncated_fraction", 0.0) for r in trained), default=0.0),
            }
            print(name, json.dumps(out[name]), flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    t = sub.add_parser("time")
    t.add_argument("--rounds", type=int, default=5)
    t.add_argument("--iterations", type=int, default=5)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--json", default="")
    t.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS),
                   help="the variants beside synchronous (default: all)")
    lp = sub.add_parser("learn")
    lp.add_argument("--seeds", type=int, default=1)
    lp.add_argument("--iterations", type=int, default=20)
    lp.add_argument("--out", default="runs/pipeline_bench")
    lp.add_argument("--json", default="")
    args = parser.parse_args(argv)
    result = time_variants(args) if args.what == "time" else learn(args)
    result = {"what": args.what, "args": vars(args), "torch": torch.__version__, "machine": platform.machine(),
              "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "result": result}
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
