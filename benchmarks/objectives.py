"""The objectives of docs/objectives.md on the embedded model (issue 14): does each recipe learn,
and how much reward hacking do the anti-hacking regularisers prevent?

    OMP_NUM_THREADS=1 python benchmarks/objectives.py learn              # every recipe, seed 42
    OMP_NUM_THREADS=1 python benchmarks/objectives.py hacking --seeds 3  # quickstart vs gardo vs diversity
    python benchmarks/objectives.py learn --smoke --out /tmp/smoke        # 2-iteration rehearsal

Run from the repository root. Finished runs are reused (delete ``--out`` to start over).

``learn``: each recipe trains its 30 iterations; the evaluation reward (``eval/area/mean``: the
fixed evaluation prompts and seeds, ODE sampling) before training (iteration 0) and after the
last iteration (the final evaluation) are compared. The rise is reported in standard errors,
``(final - initial) / sqrt(sem_initial^2 + sem_final^2)`` (the two evaluations use the same
prompts and noise, so this independent-samples SE is conservative); the bar is >= 3.

``hacking``: the quickstart (Chunk-GRPO on the area reward), the same with GARDO's gated KL and
reference reset (``quickstart_gardo``), and with the group-diversity advantage
(``quickstart_diversity``), over ``--seeds`` seeds (run.seed = 42 + k). For each: the final
evaluation's area reward and verifier score (prompt correctness, logged with weight 0) minus
the initial ones. "Correctness loss prevented" is ``1 - loss_method / loss_quickstart`` with
``loss = initial verifier - final verifier`` (per seed, then the mean); "reward cost" is
``gain_quickstart - gain_method`` of the area reward. GARDO's gate reads the verifier as its
auxiliary reward, i.e. the regulariser sees the score it is judged by: say so when quoting it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LEARN = ["quickstart", "quickstart_guard", "quickstart_mixgrpo", "quickstart_mixgrpo_flash", "quickstart_fast",
         "quickstart_nft", "quickstart_gardo", "quickstart_diversity"]
HACKING = ["quickstart", "quickstart_gardo", "quickstart_diversity"]


def run(recipe: str, seed: int, out: Path, smoke: bool) -> Path:
    run_dir = out / f"{recipe}_s{seed}"
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and any(json.loads(line).get("final") for line in metrics.read_text().splitlines() if line):
        return run_dir
    cmd = [sys.executable, "-m", "flowrl", "train", f"recipes/{recipe}.toml", "--overwrite",
           "--set", f"run.output_dir={run_dir}", "--set", f"run.seed={seed}", "--set", "log.eval_every=10",
           "--set", "log.image_every=0", "--set", "log.progress=false"]
    if smoke:
        cmd += ["--set", "train.iterations=2", "--set", "prompts.num_eval=4"]
    t0 = time.time()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{recipe} seed {seed} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    print(f"  ran {recipe} seed {seed} in {time.time() - t0:.0f} s", flush=True)
    return run_dir


def evals(run_dir: Path) -> tuple[dict, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    first = next(r for r in rows if "eval/area/mean" in r)
    final = next(r for r in rows if r.get("final"))
    return first, final


def rise(first: dict, final: dict, key: str) -> tuple[float, float]:
    d = final[f"eval/{key}/mean"] - first[f"eval/{key}/mean"]
    se = math.hypot(first[f"eval/{key}/sem"], final[f"eval/{key}/sem"])
    return d, d / se if se > 0 else float("inf")


def map_runs(jobs: int, tasks):
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(lambda t: run(*t), tasks))


def learn(args) -> dict:
    dirs = map_runs(args.jobs, [(r, 42, args.out, args.smoke) for r in args.recipes])
    table = {}
    print(f"\n{'recipe':28s} {'area before':>12s} {'area after':>11s} {'rise':>8s} {'rise/SE':>8s} {'bar':>5s}"
          f" {'verifier before':>16s} {'after':>7s}")
    for recipe, d in zip(args.recipes, dirs):
        first, final = evals(d)
        delta, z = rise(first, final, "area")
        table[recipe] = {"area_before": first["eval/area/mean"], "area_after": final["eval/area/mean"],
                         "area_sem_before": first["eval/area/sem"], "area_sem_after": final["eval/area/sem"],
                         "rise": delta, "rise_se": z, "verifier_before": first["eval/verifier/mean"],
                         "verifier_after": final["eval/verifier/mean"]}
        print(f"{recipe:28s} {first['eval/area/mean']:12.4f} {final['eval/area/mean']:11.4f} {delta:8.4f} {z:8.1f}"
              f" {'ok' if z >= 3 else 'FAIL':>5s} {first['eval/verifier/mean']:16.4f} {final['eval/verifier/mean']:7.4f}")
    return table


def hacking(args) -> dict:
    seeds = [42 + k for k in range(args.seeds)]
    tasks = [(r, s, args.out, args.smoke) for r in HACKING for s in seeds]
    map_runs(args.jobs, tasks)
    per = {r: [] for r in HACKING}
    for r in HACKING:
        for s in seeds:
            first, final = evals(args.out / f"{r}_s{s}")
            per[r].append({"seed": s,
                           "area_gain": final["eval/area/mean"] - first["eval/area/mean"],
                           "verifier_loss": first["eval/verifier/mean"] - final["eval/verifier/mean"],
                           "area_after": final["eval/area/mean"], "verifier_after": final["eval/verifier/mean"]})

    def ms(xs):
        m = statistics.fmean(xs)
        return m, (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan"))

    print(f"\n{len(seeds)} seeds; mean ± SE over seeds")
    print(f"{'recipe':24s} {'area gain':>16s} {'verifier loss':>16s} {'loss prevented':>16s} {'reward cost':>16s}")
    summary = {}
    base = {row["seed"]: row for row in per["quickstart"]}
    for r in HACKING:
        rows = per[r]
        gain, loss = ms([x["area_gain"] for x in rows]), ms([x["verifier_loss"] for x in rows])
        prevented = ms([1 - x["verifier_loss"] / base[x["seed"]]["verifier_loss"] for x in rows
                        if base[x["seed"]]["verifier_loss"] > 0]) if r != "quickstart" else (0.0, 0.0)
        cost = ms([base[x["seed"]]["area_gain"] - x["area_gain"] for x in rows])
        summary[r] = {"runs": rows, "area_gain": gain, "verifier_loss": loss, "loss_prevented": prevented,
                      "reward_cost": cost}
        print(f"{r:24s} {gain[0]:8.4f} ± {gain[1]:.4f} {loss[0]:8.4f} ± {loss[1]:.4f} "
              f"{prevented[0]:8.2f} ± {prevented[1]:.2f} {cost[0]:8.4f} ± {cost[1]:.4f}")
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["learn", "hacking"])
    p.add_argument("--out", type=Path, default=REPO / "runs" / "objectives")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--recipes", nargs="*", default=LEARN)
    p.add_argument("--smoke", action="store_true", help="2 iterations, 4 evaluation prompts")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result = learn(args) if args.what == "learn" else hacking(args)
    (args.out / f"{args.what}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
