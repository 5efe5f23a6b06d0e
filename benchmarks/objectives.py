"""The objectives of docs/objectives.md on the embedded model: does each recipe learn,
and how much reward hacking do the anti-hacking regularisers prevent?

    OMP_NUM_THREADS=1 python benchmarks/objectives.py learn              # every recipe, seed 42
    OMP_NUM_THREADS=1 python benchmarks/objectives.py learn --seeds 3 --recipes quickstart_awm quickstart_dppo
    OMP_NUM_THREADS=1 python benchmarks/objectives.py learn --seeds 3 --images --out runs/elbo \
        --recipes quickstart_epg quickstart_pepg quickstart_par quickstart_vgrpo quickstart_fdfo
    OMP_NUM_THREADS=1 python benchmarks/objectives.py learn --seeds 3 --images --recipes offline_sft offline_dpo
    OMP_NUM_THREADS=1 python benchmarks/objectives.py hacking --seeds 3  # hacking run vs gardo vs diversity
    python benchmarks/objectives.py learn --smoke --out /tmp/smoke        # 2-iteration rehearsal

Run from the repository root. Finished runs are reused (delete ``--out`` to start over).

``learn``: each recipe trains its iterations; the evaluation of the reward it optimises (the
first ``[[rewards]]`` entry with a positive weight in the recipe: ``eval/<label>/mean``, the fixed
evaluation prompts and seeds, ODE sampling) before training (iteration 0) and after the last
iteration (the final evaluation) are compared. The rise is reported in standard errors,
``(final - initial) / sqrt(sem_initial^2 + sem_final^2)`` (the two evaluations use the same
prompts and noise, so this independent-samples SE is conservative); the bar is >= 3. The second
judge (``embedded_clip`` where the recipe logs it, else the verifier) is reported beside it, its
change in the same standard errors. ``--seeds N`` runs seeds 42 .. 42 + N - 1 (default 1 for
``learn``) and adds the mean ± standard error over seeds; ``--images`` keeps each recipe's
``log.image_every`` (evaluation grids), which the benchmark otherwise turns off. The offline
recipes (``offline_sft``, ``offline_dpo``) train on tables of the base model's samples, written
first by ``flowrl sample --tables`` where they are missing (``OFFLINE_TABLES``).

``hacking``: the reward-hacking lesson (``quickstart_hacking``: Chunk-GRPO on the area reward),
the same with GARDO's gated KL and reference reset (``quickstart_gardo``), and with the
group-diversity advantage (``quickstart_diversity``), over ``--seeds`` seeds (run.seed = 42 + k).
For each: the final evaluation's area reward and verifier score (prompt correctness, logged with
weight 0) minus the initial ones. "Correctness loss prevented" is ``1 - loss_method / loss_hacking``
with ``loss = initial verifier - final verifier`` (per seed, then the mean); "reward cost" is
``gain_hacking - gain_method`` of the area reward. GARDO's gate reads the verifier as its
auxiliary reward, i.e. the regulariser sees the score it is judged by: say so when quoting it.
"""

from __future__ import annotations

import argparse
import json
import tomllib
import math
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from flowrl.processes import exits_with_parent  # noqa: E402  (no benchmark child outlives this script)

REPO = Path(__file__).resolve().parents[1]
LEARN = ["quickstart", "quickstart_epg", "quickstart_pepg", "quickstart_par", "quickstart_vgrpo", "quickstart_fdfo",
         "quickstart_guard", "quickstart_mixgrpo", "quickstart_mixgrpo_flash", "quickstart_fast",
         "quickstart_nft", "quickstart_gardo", "quickstart_diversity", "quickstart_awm", "quickstart_dppo",
         "quickstart_dpo", "quickstart_dgpo", "offline_sft", "offline_dpo"]
#: The tables the offline recipes read (their [data].path), and the command that writes each
#: (docs/objectives.md, "Offline SFT and DPO"): the base model's own samples of the training prompts.
OFFLINE_TABLES = {
    "offline_sft": ("runs/offline_data16/best.jsonl", ["--seeds", "16", "-o", "runs/offline_data16"]),
    "offline_dpo": ("runs/offline_data/pairs.jsonl", ["--seeds", "8", "-o", "runs/offline_data"]),
}


def offline_table(recipe: str) -> None:
    """Write the table an offline recipe trains on, unless it is there."""
    table, options = OFFLINE_TABLES[recipe]
    if (REPO / table).is_file():
        return
    cmd = [sys.executable, "-m", "flowrl", "sample", f"recipes/{recipe}.toml", "--prompts", "recipes/prompts/shapes.csv",
           "--set", "prompts.eval_split=train", "--tables", *options]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, preexec_fn=exits_with_parent())
    if done.returncode:
        raise SystemExit(f"the table for {recipe} could not be written:\n{done.stderr[-4000:]}")
#: The hacking comparison: its baseline first (the recipes differ only in [objective]).
HACKING = ["quickstart_hacking", "quickstart_gardo", "quickstart_diversity"]


def run(recipe: str, seed: int, out: Path, smoke: bool, images: bool = False) -> Path:
    run_dir = out / f"{recipe}_s{seed}"
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and any(json.loads(line).get("final") for line in metrics.read_text().splitlines() if line):
        return run_dir
    cmd = [sys.executable, "-m", "flowrl", "train", f"recipes/{recipe}.toml", "--overwrite",
           "--set", f"run.output_dir={run_dir}", "--set", f"run.seed={seed}", "--set", "log.eval_every=10",
           "--set", "log.progress=false"]
    if not images:
        cmd += ["--set", "log.image_every=0"]
    if smoke:
        cmd += ["--set", "train.iterations=2", "--set", "prompts.num_eval=4"]
    t0 = time.time()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, preexec_fn=exits_with_parent())
    if done.returncode:
        raise SystemExit(f"{recipe} seed {seed} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    print(f"  ran {recipe} seed {seed} in {time.time() - t0:.0f} s", flush=True)
    return run_dir


def judges(recipe: str) -> tuple[str, str]:
    """(the reward the recipe optimises, the second judge): the label of its first [[rewards]]
    entry with a positive weight; ``embedded_clip`` if the recipe logs it (else the verifier)."""
    entries = tomllib.loads((REPO / "recipes" / f"{recipe}.toml").read_text()).get("rewards", [])
    labels = [e.get("label", e["use"]) for e in entries]
    main = next(e.get("label", e["use"]) for e in entries if e.get("weight", 1.0) > 0)
    second = "embedded_clip" if "embedded_clip" in labels and main != "embedded_clip" else "verifier"
    return main, second


def evals(run_dir: Path) -> tuple[dict, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    first = next(r for r in rows if any(k.startswith("eval/") for k in r))
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
    seeds = [42 + k for k in range(args.seeds or 1)]
    for recipe in args.recipes:
        if recipe in OFFLINE_TABLES:
            offline_table(recipe)
    dirs = map_runs(args.jobs, [(r, s, args.out, args.smoke, args.images) for r in args.recipes for s in seeds])
    table = {}
    print(f"\n{'recipe':24s} {'seed':>4s} {'reward':>10s} {'before':>14s} {'after':>14s} {'rise':>7s} {'rise/SE':>7s}"
          f" {'bar':>4s} {'2nd judge':>13s} {'before':>7s} {'after':>7s} {'change/SE':>9s}")
    for recipe in args.recipes:
        main, second = judges(recipe)
        runs = []
        for s in seeds:
            first, final = evals(args.out / f"{recipe}_s{s}")
            delta, z = rise(first, final, main)
            d2, z2 = rise(first, final, second)
            runs.append({"seed": s, "reward": main, "before": first[f"eval/{main}/mean"],
                         "after": final[f"eval/{main}/mean"], "sem_before": first[f"eval/{main}/sem"],
                         "sem_after": final[f"eval/{main}/sem"], "rise": delta, "rise_se": z, "second": second,
                         "second_before": first[f"eval/{second}/mean"], "second_after": final[f"eval/{second}/mean"],
                         "second_change": d2, "second_change_se": z2})
            r = runs[-1]
            if "eval/hf_share/mean" in final:  # the artefact measure (a checkerboard raises it)
                r["hf_share_before"], r["hf_share_after"] = first["eval/hf_share/mean"], final["eval/hf_share/mean"]
            print(f"{recipe:24s} {s:4d} {main:>10s} {r['before']:7.4f}±{r['sem_before']:.4f} "
                  f"{r['after']:7.4f}±{r['sem_after']:.4f} {delta:7.4f} {z:7.1f} {'ok' if z >= 3 else 'FAIL':>4s}"
                  f" {second:>13s} {r['second_before']:7.4f} {r['second_after']:7.4f} {z2:9.1f}")
        table[recipe] = {"runs": runs}
        if len(runs) > 1:
            for key in ("rise", "rise_se", "second_change", "second_change_se"):
                xs = [r[key] for r in runs]
                table[recipe][key] = (statistics.fmean(xs), statistics.stdev(xs) / math.sqrt(len(xs)))
            m = table[recipe]
            print(f"{recipe:24s} mean ± SE over {len(runs)} seeds: rise {m['rise'][0]:.4f} ± {m['rise'][1]:.4f} "
                  f"({m['rise_se'][0]:.1f} ± {m['rise_se'][1]:.1f} SE); {second} change {m['second_change'][0]:.4f} "
                  f"± {m['second_change'][1]:.4f}")
    return table


def hacking(args) -> dict:
    seeds = [42 + k for k in range(args.seeds or 3)]
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
    base = {row["seed"]: row for row in per[HACKING[0]]}
    for r in HACKING:
        rows = per[r]
        gain, loss = ms([x["area_gain"] for x in rows]), ms([x["verifier_loss"] for x in rows])
        prevented = ms([1 - x["verifier_loss"] / base[x["seed"]]["verifier_loss"] for x in rows
                        if base[x["seed"]]["verifier_loss"] > 0]) if r != HACKING[0] else (0.0, 0.0)
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
    p.add_argument("--seeds", type=int, default=None, help="seeds 42 .. (default: 1 for learn, 3 for hacking)")
    p.add_argument("--images", action="store_true", help="keep each recipe's evaluation image grids")
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
