"""Benchmark: the update's time under FSDP2 on 2 processes with ``[train].update_group`` 1 and 4
(docs/benchmarks.md, "Grouped update forwards").

Workload: ``recipes/quickstart_hacking.toml`` (the embedded model, 4 prompts x 8 samples, 17
steps, chunks [2, 3, 4, 7], half of them trained per sample) under ``distributed.strategy =
"fsdp2"``, launched with torchrun on 2 processes over gloo, ``--iterations`` iterations, no
evaluation or images. Each iteration's update is one optimizer step on the fast path, so
``update_group = 4`` forwards up to 4 steps of a chunk at once and each FSDP2 group gathers its
weights once per group instead of once per step. Side by side: ``--rounds`` rounds, each
running both settings in a seeded random order; the figure is the median over rounds of each
run's median ``time/update`` (iterations after the first), and their ratio.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/grouped_update.py [--rounds 3] [--iterations 4]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from flowrl.runlog import read_metrics  # noqa: E402
from flowrl.processes import exits_with_parent  # noqa: E402  (no benchmark child outlives this script)

GROUPS = (1, 4)


def run_once(group: int, iterations: int, out: Path) -> float:
    """Median ``time/update`` (s) of one 2-process run, iterations after the first."""
    sets = [f"train.update_group={group}", f"train.iterations={iterations}", "distributed.strategy='fsdp2'",
            "prompts.num_eval=0", "log.image_every=0", "log.progress=false", f"checkpoint.every={iterations}",
            f"run.output_dir={str(out)!r}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "flowrl",
           "train", str(REPO / "recipes" / "quickstart_hacking.toml"), *[a for s in sets for a in ("--set", s)]]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=exits_with_parent())
    rows = read_metrics(out)
    times = [r["time/update"] for r in rows if "time/update" in r and r.get("iteration", 0) >= 1]
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "grouped_update.json"))
    args = parser.parse_args()
    rng, medians = random.Random(args.seed), {g: [] for g in GROUPS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for group in rng.sample(GROUPS, len(GROUPS)):
                medians[group].append(run_once(group, args.iterations, Path(tmp) / f"r{r}_g{group}"))
                print(f"round {r}: update_group {group}: {medians[group][-1]:.3f} s per update", flush=True)
    summary = {str(g): statistics.median(v) for g, v in medians.items()}
    result = {"per_round": {str(g): v for g, v in medians.items()}, "median_s": summary,
              "ratio_group4_to_group1": summary["4"] / summary["1"], "rounds": args.rounds,
              "iterations": args.iterations, "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count()}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
