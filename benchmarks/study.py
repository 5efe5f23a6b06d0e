"""The chunk-size study: the Chunk-GRPO paper's ablation on an embedded model, in a regime
where GRPO learns and the chunk ratio's clip acts, with seeds and 95% intervals. On the
compositional world (``--world compose``) it writes docs/study.md; on the first embedded world
(shapes, the default) docs/study_shapes.md; each with its tables and figures.

    OMP_NUM_THREADS=1 python benchmarks/study.py            # the study: 7 variants x 5 seeds
    python benchmarks/study.py --jobs 2 --seeds 5            # the same, explicitly
    python benchmarks/study.py --smoke --out /tmp/smoke      # a 2-iteration rehearsal of the pipeline
    python benchmarks/study.py --report-only                 # rewrite the report from finished runs
    OMP_NUM_THREADS=1 python benchmarks/study.py --world compose              # the compositional world (below)
    OMP_NUM_THREADS=1 python benchmarks/study.py --world compose --seed-list 47,48,49   # a later batch of seeds
    python benchmarks/study.py --world compose --report-only   # the report from the archive (+ a sweep in runs/)
    python benchmarks/study.py --world compose --amend-note --seed-list 48 --batch-note "CI beside it"  # then the report
    python benchmarks/study.py --world compose --smoke --seeds 1 --jobs 1 --sweep-dir /tmp/sc --out /tmp/sc
    # on a GPU machine the runs compute on CUDA ([run].device = "auto"): another study, its own archive
    OMP_NUM_THREADS=1 python benchmarks/study.py --world compose --seeds 20 --jobs 16 \
        --archive benchmarks/results/study_compose_h200 --out benchmarks/results/study_compose_h200/report

The regime records the device the runs compute on (``cpu``, or ``cuda (<GPU name>)``); an
archive holds one device's seeds and refuses another's (the numbers differ by device).

Run it from the repository root. It is resumable: run the same command again after an
interruption (``flowrl sweep`` skips the finished runs and resumes the interrupted one).

What is fixed before any run (and the same for every variant; docs/study_shapes.md says how it was
chosen):
- the base recipe ``recipes/study_embedded.toml``: reward = the verifier's soft prompt
  correctness (weight 1); the embedded CLIP reward (a second judge, not optimised) and the area
  logged with weight 0; trained on 72 of the 90 grammar prompts, evaluated on the other 18 x 4
  noises (ODE, fixed noise) every 10 iterations and at the end; 50 iterations of 4 prompts x 8
  samples; 33 sampling steps with the flow SDE kernel (a = 0.7) only in the first 16
  (``sde_window = [0, 16]``, sigma 1 -> 0.75), so T = 16 trainable transitions as in the paper;
  2 passes per rollout with clip range 5e-5 (the clip acts on the second pass); lr 5e-5; the
  same starting noise within a group;
- the variants below, which change only [chunker] and [selector]; every chunk variant trains
  half of its chunks per sample (the paper's fraction 0.5), GSPO trains its one chunk;
- seeds: run.seed = 42 + k, k = 0..4 (``--seeds 5``); the seed fixes the sampling noise, the
  chunk selection and the data order, so seed k of every variant sees the same prompts;
- the primary metric eval/verifier/mean; the baseline of the paired differences: step-level;
- equal iterations: every variant runs 50 iterations;
- equal wall time: the budget is the smallest total train time (sum of the per-iteration
  ``time/*`` fields except ``time/eval``) over ALL runs of the study, so every run reached it;
  each run is read at its last evaluation within that budget (``flowrl compare --at-wall-time``);
- the paper's orderings are judged by a fixed rule on the paired difference (same seed) of the
  metric between the two variants of a claim: "held" if the whole 95% t interval is on the
  claimed side of 0, "reversed" if it is wholly on the other side, "cannot be told apart" if it
  contains 0 (for the paper's one tie, step ~ 4 x [4]: an interval containing 0 is reported as
  "no difference detected", which is not evidence of equality). No correction for the number
  of claims is applied (say so when reading them).
- train time is wall-clock time per phase: run the study on an otherwise idle machine, or the
  equal-wall-time comparison measures the neighbours.

``--world compose`` runs the same 7 variants, seeds, claims and rules on the
compositional world (docs/compose.md) and writes ``study.md`` and ``study_compose/`` into
``--out`` (sweep: ``runs/study_compose_seeds_46-47`` for ``--seed-list 46,47``: each batch of seeds
its own). What differs, fixed before any run:
- the base recipe ``recipes/study_compose.toml`` (its comments give each choice): reward
  ``compose_geneval_exact`` (weight 1), ``compose_geneval_strict`` and ``compose_clip`` logged
  with weight 0; the six categories visited equally; 96 held-out prompts (16 a category) x 2
  noises, ODE at 16 steps, every 10 iterations and at the end; 17 steps with the flow SDE kernel
  (a = 0.7) in the first 16 transitions, so T = 16 and the paper's layouts apply unchanged; 2 passes
  per rollout at clip 5e-5, lr 5e-5, 8 prompts x 8 samples, 50 iterations; the dynamics variants
  take this sampler's own profile, ``recipes/profiles/compose_window16.json`` ([2, 3, 8, 3]);
- the primary metric ``eval/compose_geneval_strict/mean`` (GenEval's strict verdict; its mean over
  balanced categories is GenEval's overall), the second judge ``eval/compose_clip/mean``;
- the regime is recorded in ``SWEEP/regime.json`` before the first run (the base recipe's text and
  sha256, its profile's sha256, the overrides, variants, seeds, commit) and the report states it,
  and says so if the recipe or profile changed since;
- GenEval's per-category table of each run's final checkpoint (``flowrl eval RUN_DIR --suite
  geneval --seed 0 -o SWEEP/geneval/RUN.json``) and of the base model (``flowrl eval
  recipes/study_compose.toml --suite geneval --seed 0``), the same noise for every table: per
  variant the mean over seeds ± 95% t half-width per category, and each variant minus step-level
  paired by seed;
- the GenEval tables take 2 passes over the suite's 312 held-out images (``--seeds 2``, 624
  images, standard error about 0.018 on the overall; ``GENEVAL_PASSES``), fixed on 2026-11-30
  after the first batch began and before any of its runs finished, and the paper's claims are
  also judged on these tables' overall (the study's largest evaluation), beside the runs' own
  192-image final evaluation, their area under the curve and equal wall time;
- the clip fraction (and the other update diagnostics) per variant, as for shapes.

Seeds in batches (compose world): the bar (paired half-widths <= 0.02) needs more seeds than one
working session can run, and ``runs/`` does not outlive a session. So each finished seed (all 7
variants done) is added to ``benchmarks/results/study_compose/`` (``--archive``): every run's
metrics cut to the fields the report reads, its recipe, its GenEval table without per-image rows,
a ``sweep.json`` that ``flowrl compare`` reads like a live sweep, and each batch's regime and
machine. A later session runs new seeds with ``--seed-list`` and the report is written from the
whole archive; a batch whose regime (recipe and profile sha256, overrides, variants, metrics,
GenEval noise and passes) differs from the first batch's is refused. Seeds are paired within a
batch (all of a seed's runs are in one), so the equal-wall-time comparison stays paired even when
batches ran on different machines; the report lists each batch's CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from flowrl.processes import exits_with_parent
from flowrl.errors import FlowrlError  # noqa: E402
from flowrl.sweeps import parse_seed_list  # noqa: E402
from flowrl.stats import paired_interval, seeds_for_half_width, t_interval

REPO = Path(__file__).resolve().parents[1]

RECIPE = "recipes/study_embedded.toml"
HALF = "selector.use=uniform,selector.fraction=0.5"
#: name -> overrides (the chunker's `use` first: switching component resets its table)
VARIANTS = {
    "step": f"chunker.use=step,{HALF}",
    "gspo_16": "chunker.use=sequence,selector.use=all",
    "chunks_8_8": f"chunker.use=explicit,chunker.sizes=[8,8],{HALF}",
    "chunks_8x2": f"chunker.use=explicit,chunker.sizes=[2,2,2,2,2,2,2,2],{HALF}",
    "chunks_4x4": f"chunker.use=explicit,chunker.sizes=[4,4,4,4],{HALF}",
    "dynamics": HALF,  # the base recipe's dynamics chunks, uniform selection
    "dynamics_weighted": "",  # the base recipe as it is: dynamics chunks, weighted selection
}
BASELINE = "step"
PRIMARY = "eval/verifier/mean"
SECONDARY = "eval/embedded_clip/mean"
ARTEFACT = "eval/hf_share/mean"
#: The paper's claims (Table 3, HPSv3 on FLUX): (better, worse) pairs, or ("~", a, b) for a tie.
CLAIMS = [
    ("dynamics", "chunks_8_8", "dynamics-guided 15.236 > [8, 8] 15.173"),
    ("chunks_8_8", "gspo_16", "[8, 8] 15.173 > [16] 15.142"),
    ("gspo_16", "chunks_8x2", "[16] 15.142 > 8 x [2] 15.115"),
    ("chunks_8x2", "step", "8 x [2] 15.115 > step-level 15.080"),
    ("~", "step", "chunks_4x4", "step-level 15.080 ~ 4 x [4] 15.078"),
    ("dynamics", "step", "dynamics-guided 15.236 > step-level 15.080"),
    ("dynamics_weighted", "dynamics", "with weighted sampling 15.373 > dynamics-guided 15.236"),
]
SMOKE = ["train.iterations=2", "train.prompts_per_iteration=1", "train.group_size=2", "train.micro_batch_size=2",
         "prompts.num_eval=2", "log.eval_every=1"]


@dataclass(frozen=True)
class World:
    """What differs between the two embedded worlds: the base recipe, the metrics, their names in
    the report, where the sweep and the report go by default."""

    recipe: str
    primary: str
    secondary: str
    primary_text: str
    secondary_text: str
    sweep_dir: str
    report: str  # the report's file name under --out
    figures: str  # its tables' and figures' folder under --out
    archive: str | None = None  # where finished seeds are kept across sessions (committed), if anywhere


WORLDS = {
    "shapes": World(RECIPE, PRIMARY, SECONDARY, "verifier", "CLIP judge", "runs/study", "study_shapes.md",
                    "study_shapes"),
    # The compositional world (docs/compose.md). All 7 variants apply unchanged: its base recipe has
    # T = 16 trainable transitions too (17 steps, SDE in the first 16), so [16], [8, 8], 8 x [2] and
    # 4 x [4] tile it, and the dynamics variants take its own profile (profiles/compose_window16.json;
    # `flowrl sweep` validates every variant before the first run and stops on one that does not).
    "compose": World("recipes/study_compose.toml", "eval/compose_geneval_strict/mean", "eval/compose_clip/mean",
                     "GenEval strict", "compose_clip judge", "runs/study_compose", "study.md",
                     "study_compose", archive="benchmarks/results/study_compose"),
}
#: the noise of every GenEval table (each run's final checkpoint and the base model): the same
#: images for all, so a difference between two tables is the training's (docs/compose.md's base table)
GENEVAL_SEED = 0
#: passes over the suite's held-out images for each GenEval table: 2 x 312 = 624 images (standard
#: error about 0.018 on the overall, against 0.035 for the runs' own 192-image evaluation); fixed
#: on 2026-11-30 before the first compose study run finished, and recorded in every regime
GENEVAL_PASSES = 2


def flowrl(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "flowrl", *args]
    print("$ flowrl " + " ".join(args), flush=True)
    return subprocess.run(cmd, cwd=REPO, text=True, stdout=subprocess.PIPE, preexec_fn=exits_with_parent())


def compare(sweep_dir: Path, out: Path, metric: str, *extra: str) -> dict:
    proc = flowrl("compare", str(sweep_dir), "--baseline", BASELINE, "--metric", metric, "--format", "json",
                  "-o", str(out), *extra)
    if proc.returncode != 0:
        sys.exit(f"flowrl compare failed with exit status {proc.returncode}")
    return json.loads(proc.stdout)


def verdicts(result: dict, quantity: str) -> list[tuple[str, str, str]]:
    """(claim, paired difference text, verdict) for each of the paper's claims."""
    per_seed = {v["name"]: {r["seed"]: r[quantity] for r in v["runs"]} for v in result["variants"]}
    rows = []
    for claim in CLAIMS:
        tie = claim[0] == "~"
        a, b, text = claim[1:] if tie else claim
        iv = paired_interval(per_seed[a], per_seed[b], result["confidence"])
        if iv.half_width is None:
            rows.append((text, "n/a", "cannot be told apart (fewer than 2 paired seeds)"))
            continue
        diff = f"{a} - {b} = {iv.mean:+.4f} ± {iv.half_width:.4f} (n={iv.n})"
        if iv.lo <= 0.0 <= iv.hi:
            verdict = ("no difference detected (consistent with the tie; not evidence of equality)" if tie
                       else "cannot be told apart")
        elif tie:
            verdict = f"did not hold: {a if iv.lo > 0 else b} is higher"
        else:
            verdict = "held" if iv.lo > 0 else "reversed"
        rows.append((text, diff, verdict))
    return rows



def verdicts_section(verdict_rows: dict, note: str) -> str:
    """The report's rule and its verdict tables (the final checkpoints' GenEval table where there
    is one, the final evaluation, the area under the curve, equal wall time)."""
    geneval = f"""
Equal iterations, the final checkpoints' GenEval table ({GENEVAL_PASSES} x 312 images, overall):

{verdict_table(verdict_rows["geneval"])}
""" if "geneval" in verdict_rows else ""
    return f"""Rule (fixed before the runs): a claim "held" if the 95% t interval of the paired difference
lies wholly on the claimed side of 0, was "reversed" if it lies wholly on the other side, and
"cannot be told apart" if it contains 0. {len(CLAIMS)} claims are tested at 95% each, without a
correction for multiple comparisons.{note}
{geneval}
Equal iterations, final evaluation:

{verdict_table(verdict_rows["final"])}

Equal iterations, area under the curve:

{verdict_table(verdict_rows["auc"])}

Equal wall time:

{verdict_table(verdict_rows["wall"])}
"""

def half_widths(result: dict, quantity: str) -> list:
    """The paired 95% interval of every claim's difference (those with at least 2 seeds)."""
    per_seed = {v["name"]: {r["seed"]: r[quantity] for r in v["runs"]} for v in result["variants"]}
    out = []
    for claim in CLAIMS:
        a, b = (claim[1], claim[2]) if claim[0] == "~" else (claim[0], claim[1])
        iv = paired_interval(per_seed[a], per_seed[b], result["confidence"])
        if iv.half_width is not None:
            out.append(iv)
    return out


def verdict_table(rows: list[tuple[str, str, str]]) -> str:
    lines = ["| paper's claim | paired difference (95% t interval) | here |", "|---|---|---|"]
    lines += [f"| {c} | {d} | {v} |" for c, d, v in rows]
    return "\n".join(lines)


def load_runs(sweep_dir: Path, seeds: list[int], primary: str = PRIMARY,
              folder: str = "runs") -> dict[tuple[str, int], tuple[list[dict], list[dict]]]:
    """Each study run's metrics, read once: ``(variant, seed) -> (evaluation rows, update rows)``
    (``folder``: the sweep's ``runs``, or an archive's :data:`ARCHIVED_RUNS`)."""
    runs = {}
    for name in VARIANTS:
        for seed in seeds:
            text = (sweep_dir / folder / f"{name}_seed{seed}" / "metrics.jsonl").read_text()
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
            runs[name, seed] = ([r for r in rows if primary in r], [r for r in rows if "clip_fraction" in r])
    return runs


def _cell(values: list[float], digits: int = 4, signed: bool = False, sci: bool = False) -> str:
    iv = t_interval(values)
    kind = "e" if sci else "f"
    fmt = f"{{:{'+' if signed else ''}.{digits}{kind}}}"
    return fmt.format(iv.mean) + ("" if iv.half_width is None else f" ± {iv.half_width:.{digits}{kind}}")


def diagnostics_table(runs: dict, seeds: list[int], world: World = WORLDS["shapes"]) -> str:
    """Per variant, over seeds (mean ± 95% t half-width): the held-out rise of the optimised
    reward, the second judge's and the artefact measure's change from the first evaluation to
    the last, and what the update did: the clip fraction, the share of iterations in which the
    clip acted, the spread of the unit ratios and of the unit log-ratios, the approximate KL to
    the old policy, and the groups whose rewards were all equal."""
    primary, secondary = world.primary, world.secondary
    head = (f"| variant | eval {world.primary_text}: first -> last | rise | {world.secondary_text} change | "
            "hf_share first -> last | "
            "clip fraction | iterations clipped | ratio max - min | unit log-ratio sd | approx KL (old) | "
            "all-equal groups |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name in VARIANTS:
        cols: dict[str, list[float]] = {k: [] for k in ("v0", "v1", "rise", "clip_change", "hf0", "hf1", "clip",
                                                         "clipped", "spread", "lr_sd", "kl", "equal")}
        for seed in seeds:
            evals, train = runs[name, seed]
            first, last = evals[0], evals[-1]
            cols["v0"].append(first[primary])
            cols["v1"].append(last[primary])
            cols["rise"].append(last[primary] - first[primary])
            cols["clip_change"].append(last[secondary] - first[secondary])
            cols["hf0"].append(first[ARTEFACT])
            cols["hf1"].append(last[ARTEFACT])
            cols["clip"].append(sum(r["clip_fraction"] for r in train) / len(train))
            cols["clipped"].append(sum(r["clip_fraction"] > 0 for r in train) / len(train))
            cols["spread"].append(sum(r["ratio_max"] - r["ratio_min"] for r in train) / len(train))
            cols["lr_sd"].append(sum(r["diag/log_ratio_std"] for r in train) / len(train))
            cols["kl"].append(sum(r["approx_kl_old"] for r in train) / len(train))
            cols["equal"].append(sum(r.get("groups/all_equal_fraction", 0.0) for r in train) / len(train))
        lines.append(
            f"| {name} | {_cell(cols['v0'])} -> {_cell(cols['v1'])} | {_cell(cols['rise'], signed=True)} | "
            f"{_cell(cols['clip_change'], signed=True)} | {_cell(cols['hf0'])} -> {_cell(cols['hf1'])} | "
            f"{_cell(cols['clip'])} | {_cell([100 * x for x in cols['clipped']], 0)}% | {_cell(cols['spread'], 1, sci=True)} | "
            f"{_cell(cols['lr_sd'], 1, sci=True)} | {_cell(cols['kl'], 1, sci=True)} | {_cell(cols['equal'], 3)} |")
    return "\n".join(lines)


def worst_texture_figures(runs: dict, sweep_dir: Path, figures: Path) -> tuple[str, float, float] | None:
    """Copy the first and final evaluation grids of the run whose ``hf_share`` rose the most
    (the worst texture the study trained) next to the report; returns (run, first, final).
    Only runs whose grids are in ``sweep_dir`` take part (an archive keeps no images: a report
    written from it shows the worst run of the sweep at hand); None when no run has its grids."""
    import shutil

    def grids(name: str, seed: int) -> list[Path]:
        return sorted((sweep_dir / "runs" / f"{name}_seed{seed}" / "images" / "eval").glob("iter_*.png"))

    candidates = {key: value for key, value in runs.items() if len(grids(*key)) >= 2}
    if not candidates:  # no stale picture of an earlier report's run stays beside this one
        for name in ("texture_first_eval.png", "texture_final_eval.png"):
            (REPO / figures / name).unlink(missing_ok=True)
        return None
    (name, seed), (evals, _) = max(candidates.items(), key=lambda kv: kv[1][0][-1][ARTEFACT] - kv[1][0][0][ARTEFACT])
    run_dir, first, final = sweep_dir / "runs" / f"{name}_seed{seed}", evals[0][ARTEFACT], evals[-1][ARTEFACT]
    grids = grids(name, seed)
    (REPO / figures).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(grids[0], REPO / figures / "texture_first_eval.png")
    shutil.copyfile(grids[-1], REPO / figures / "texture_final_eval.png")
    return run_dir.name, first, final


TEXTURE_FIGURES = ("texture_first_eval.png", "texture_final_eval.png")


def archived_texture(archive: Path, figures: Path, worst: tuple[str, float, float] | None):
    """The worst texture over every batch: the archive keeps the grids of the run whose
    ``hf_share`` rose the most (``texture/``), replaced when this report's sweep has a worse one,
    and puts them beside the report when the sweep at hand has no grids (a report from the
    archive alone)."""
    import shutil

    folder = archive / "texture"
    kept = json.loads((folder / "texture.json").read_text()) if (folder / "texture.json").is_file() else None
    if worst is not None and (kept is None or worst[2] - worst[1] >= kept["final"] - kept["first"]):
        for name in TEXTURE_FIGURES:
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(REPO / figures / name, folder / name)
        _write_atomic(folder / "texture.json", json.dumps({"run": worst[0], "first": worst[1], "final": worst[2]}))
        return worst
    if kept is None:
        return worst
    (REPO / figures).mkdir(parents=True, exist_ok=True)
    for name in TEXTURE_FIGURES:
        shutil.copyfile(folder / name, REPO / figures / name)
    return kept["run"], kept["first"], kept["final"]


def runs_device(name: str) -> str:
    """Where the runs compute: ``cpu``, or ``cuda (<GPU name>)`` where ``[run].device`` reaches a GPU
    (``auto`` does on a GPU machine). One study's seeds must share it: the numbers differ by device."""
    import torch

    from flowrl.distributed import resolve_device

    device = resolve_device(name)
    return f"cuda ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else device.type


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def regime_record(world: World, args, sweep_args: list[str]) -> dict:
    """What the runs are made of, written to ``SWEEP/regime.json`` before the first run (and kept:
    a later call compares against it): the base recipe's text and sha256, its profile's sha256,
    the overrides of every variant and of the whole study, the seeds, the commit."""
    from flowrl.recipe import load_recipe, profile_keys

    recipe = REPO / world.recipe
    resolved = load_recipe(recipe, list((SMOKE if args.smoke else []) + args.sets))
    profiles = sorted({v for _, v in profile_keys(resolved) if v})
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, text=True, capture_output=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", world.recipe, *profiles], cwd=REPO, text=True,
                           capture_output=True).stdout.strip()
    return {"world": args.world, "device": runs_device(resolved.run.device), "recipe": world.recipe,
            "recipe_sha256": sha256(recipe),
            "recipe_text": recipe.read_text(), "profiles": {str(Path(p).relative_to(REPO)) if Path(p).is_relative_to(REPO)
                                                            else p: sha256(Path(p)) for p in profiles},
            "sets": list((SMOKE if args.smoke else []) + args.sets), "variants": VARIANTS, "baseline": BASELINE,
            "seeds": args.seed_values, "primary": world.primary, "secondary": world.secondary,
            "geneval_seed": GENEVAL_SEED, "geneval_passes": GENEVAL_PASSES, "commit": commit, "uncommitted_changes_to_recipe_or_profile": dirty,
            "recorded": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "sweep_args": sweep_args}


def batch_sweep_dir(world: World, seeds: list[int]) -> str:
    """The default sweep directory of a batch: a world that keeps an archive (several batches,
    often in one machine's ``runs/``) gives each batch of seeds its own, named by the seeds asked
    for, so that running the same command again resumes it and a later batch starts beside it;
    the shapes world has one sweep."""
    if world.archive is None or not seeds:
        return world.sweep_dir
    return f"{world.sweep_dir}_seeds_{seeds_label(seeds)}"


def seeds_label(seeds: list[int]) -> str:
    """A batch's seeds in a file name: ``46-47`` for a run of consecutive seeds, ``46_49`` for
    others, ``50`` for one."""
    contiguous = len(seeds) > 1 and seeds == list(range(seeds[0], seeds[0] + len(seeds)))
    return f"{seeds[0]}-{seeds[-1]}" if contiguous else "_".join(map(str, seeds))


def amend_batch_note(archive: Path, seeds: list[int], note: str) -> None:
    """Set the note of the archived batch of exactly ``seeds``: what ran beside a batch is known
    for sure only once its runs have ended."""
    manifest_path = archive / "sweep.json"
    if not manifest_path.is_file():
        sys.exit(f"--amend-note: no seed is archived in {archive} yet")
    manifest = json.loads(manifest_path.read_text())
    batch = next((b for b in manifest["batches"] if sorted(b["seeds"]) == sorted(seeds)), None)
    if batch is None:
        sys.exit(f"--amend-note: no archived batch holds exactly the seeds {seeds}; the batches are "
                 + "; ".join(",".join(map(str, b["seeds"])) for b in manifest["batches"])
                 + " (give one of them with --seed-list)")
    batch["note"] = note
    _write_atomic(manifest_path, json.dumps(manifest, indent=1))


def complete_seeds(sweep_dir: Path, seeds: list[int]) -> list[int]:
    """The seeds of ``seeds`` whose every variant the sweep has finished (an interrupted sweep's
    last seed is left out whole, so every pair stays paired)."""
    manifest = json.loads((sweep_dir / "sweep.json").read_text())
    done = {(r["variant"], r["seed"]) for r in manifest["runs"] if r["status"] == "done"}
    return [s for s in seeds if all((name, s) in done for name in VARIANTS)]


def geneval_tables(world: World, args, sweep_dir: Path, seeds: list[int]) -> tuple[dict, dict[tuple[str, int], dict]]:
    """GenEval's table (per category and overall) of the base model and of each run's final
    checkpoint, by ``flowrl eval ... --suite geneval --seed GENEVAL_SEED --seeds GENEVAL_PASSES``:
    the same noise for every table. Written to ``SWEEP/geneval/`` and reused when already there
    (for the run's final iteration and as many passes)."""
    folder = sweep_dir / "geneval"
    folder.mkdir(parents=True, exist_ok=True)
    sets = [a for s in (SMOKE if args.smoke else []) + args.sets for a in ("--set", s)]
    todo = {("base", -1): (["eval", world.recipe, *sets], folder / "base.json", None)}
    for name in VARIANTS:
        for seed in seeds:
            run_dir = sweep_dir / "runs" / f"{name}_seed{seed}"
            last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
            final = max(r["iteration"] for r in last)
            todo[name, seed] = (["eval", str(run_dir)], folder / f"{name}_seed{seed}.json", final)

    def one(item):
        (cmd, path, final) = item
        if path.is_file():
            table = json.loads(path.read_text())
            if table["settings"].get("repeats") == GENEVAL_PASSES and (final is None or table.get("iteration") == final):
                return
        proc = flowrl(*cmd, "--suite", "geneval", "--seed", str(GENEVAL_SEED), "--seeds", str(GENEVAL_PASSES),
                      "-o", str(path))
        if proc.returncode != 0:
            sys.exit(f"flowrl {' '.join(cmd)} --suite geneval failed with exit status {proc.returncode}")

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(one, todo.values()))
    tables = {key: json.loads(path.read_text()) for key, (_, path, _) in todo.items()}
    return tables.pop(("base", -1)), tables


def category_tables(base: dict, tables: dict[tuple[str, int], dict], seeds: list[int]) -> tuple[str, str]:
    """GenEval per category: (each variant's final accuracy, mean over seeds ± 95% t half-width,
    with the base model's row; each variant minus step-level, paired by seed, 95% t interval)."""
    cats = [*base["categories"], "overall"]

    def value(t: dict, c: str) -> float:
        return t["overall"]["mean"] if c == "overall" else t["categories"][c]["mean"]

    head = "| variant | " + " | ".join(cats) + " |"
    rule = "|" + "---|" * (len(cats) + 1)
    finals = [head, rule, "| base model (one table; ± its standard error) | " + " | ".join(
        f"{value(base, c):.3f} ± {(base['overall'] if c == 'overall' else base['categories'][c])['sem']:.3f}"
        for c in cats) + " |"]
    diffs = [head.replace("| variant |", f"| variant - {BASELINE} |"), rule]
    for name in VARIANTS:
        finals.append(f"| {name} | " + " | ".join(_cell([value(tables[name, s], c) for s in seeds], 3)
                                                 for c in cats) + " |")
        if name == BASELINE:
            continue
        cells = []
        for c in cats:
            iv = paired_interval({s: value(tables[name, s], c) for s in seeds},
                                 {s: value(tables[BASELINE, s], c) for s in seeds})
            cells.append(f"{iv.mean:+.3f}" + ("" if iv.half_width is None else f" ± {iv.half_width:.3f}"))
        diffs.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(finals), "\n".join(diffs)


def category_intervals(base: dict, tables: dict[tuple[str, int], dict], seeds: list[int]) -> list:
    """Every variant's paired difference from step-level in every GenEval category (overall left
    out): the per-category table's intervals, for the precision line."""
    return [paired_interval({s: tables[name, s]["categories"][c]["mean"] for s in seeds},
                            {s: tables[BASELINE, s]["categories"][c]["mean"] for s in seeds})
            for name in VARIANTS if name != BASELINE for c in base["categories"]]


def geneval_result(tables: dict[tuple[str, int], dict], seeds: list[int]) -> dict:
    """The final checkpoints' GenEval overall in the shape :func:`verdicts` reads (a ``flowrl
    compare`` result), so the paper's claims are also judged on the study's largest evaluation."""
    return {"confidence": 0.95, "variants": [
        {"name": name, "runs": [{"seed": s, "geneval": tables[name, s]["overall"]["mean"]} for s in seeds]}
        for name in VARIANTS]}


#: the per-iteration fields an archived run keeps (with every ``eval/`` and ``time/`` field): what
#: the report, ``flowrl compare`` and the diagnostics read; the rest stays in the run's folder
ARCHIVED_FIELDS = ("iteration", "final", "world_size", "clip_fraction", "ratio_min", "ratio_max", "ratio_mean",
                   "approx_kl_old", "diag/log_ratio_std", "groups/all_equal_fraction",
                   "chunk_sizes", "num_units", "grad_norm", "loss", "lr", "nonfinite_steps",
                   "reward/compose_geneval_exact/mean", "reward/compose_geneval_strict/mean", "reward/compose_clip/mean")
#: the archive's folder of runs: not `runs/`, which the repository ignores wherever it is (a test checks
#: that git keeps every archived file)
ARCHIVED_RUNS = "run_records"
#: what of the regime must agree for two batches of seeds to be one study
REGIME_KEYS = ("recipe_sha256", "profiles", "sets", "variants", "primary", "secondary", "geneval_seed", "geneval_passes")


def cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def archive_batch(sweep_dir: Path, archive: Path, seeds: list[int], regime: dict, jobs: int,
                  base: dict, tables: dict[tuple[str, int], dict], note: str | None = None) -> list[int]:
    """Add this sweep's finished seeds to the study's archive and return the seeds archived now.

    ``runs/`` does not outlive a working session here, and the study needs more seeds than one
    session can run, so every batch of seeds is kept in a slim, committed sweep: each run's
    metrics cut to :data:`ARCHIVED_FIELDS`, its recipe and its GenEval table (without per-image
    rows), and a ``sweep.json`` manifest that ``flowrl compare`` reads as it reads a live sweep.
    A seed enters only with all its variants done (a partial seed would unbalance the pairs), and
    only under the regime of the seeds already archived (``REGIME_KEYS``)."""
    import shutil

    if "when" in regime and regime["when"] != "before the first run":
        sys.exit(f"{sweep_dir} has no regime recorded before its runs (regime.json was written with the report): "
                 "its runs cannot be shown to be the archived study's, so they are not archived")
    regime = {**regime, "geneval_passes": GENEVAL_PASSES}  # the tables' own: geneval_tables made them so
    manifest_path = archive / "sweep.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {
        "kind": "benchmarks/study.py archive: one study, seeds added in batches", "runs": [], "batches": []}
    if manifest["batches"]:
        first = json.loads((archive / manifest["batches"][0]["regime"]).read_text())
        differ = [k for k in REGIME_KEYS if first.get(k) != regime.get(k)]
        if differ:
            sys.exit(f"the regime of {sweep_dir} differs from the archived study's in {', '.join(differ)}: "
                     f"archive it elsewhere (--archive DIR) or run the archived regime")
        # batches recorded before the device was recorded all ran on this project's CPUs
        if first.get("device", "cpu") != regime.get("device", "cpu"):
            sys.exit(f"the runs of {sweep_dir} computed on {regime.get('device', 'cpu')}, the archived study's on "
                     f"{first.get('device', 'cpu')}: one study's seeds share a device (the numbers differ by "
                     "device); archive these elsewhere (--archive DIR, and --out DIR for their report)")
    live = json.loads((sweep_dir / "sweep.json").read_text())
    done = {(r["variant"], r["seed"]): r for r in live["runs"] if r["status"] == "done"}
    have = {r["seed"] for r in manifest["runs"]}
    new = [s for s in seeds if s not in have and all((v, s) in done for v in VARIANTS)]
    if not new:
        return []
    for seed in new:
        for name in VARIANTS:
            run, src = done[name, seed], sweep_dir / done[name, seed]["dir"]
            dst = archive / ARCHIVED_RUNS / f"{name}_seed{seed}"
            rows = [json.loads(line) for line in (src / "metrics.jsonl").read_text().splitlines() if line.strip()]
            slim = [{k: v for k, v in r.items() if k in ARCHIVED_FIELDS or k.startswith(("eval/", "time/"))} for r in rows]
            _write_atomic(dst / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in slim))
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / "recipe.toml", dst / "recipe.toml")
            table = {k: v for k, v in tables[name, seed].items() if k != "per_image"}
            _write_atomic(archive / "geneval" / f"{name}_seed{seed}.json", json.dumps(table, indent=1))
            manifest["runs"].append({"id": f"{name}_seed{seed}", "variant": name, "seed": seed, "status": "done",
                                     "dir": f"{ARCHIVED_RUNS}/{name}_seed{seed}", "wall_time_s": run.get("wall_time_s")})
    if not (archive / "geneval" / "base.json").is_file():
        _write_atomic(archive / "geneval" / "base.json",
                      json.dumps({k: v for k, v in base.items() if k != "per_image"}, indent=1))
    name = f"regimes/seeds_{seeds_label(new)}.json"
    _write_atomic(archive / name, json.dumps({**regime, "seeds": new}, indent=1))
    # the batch's cost: its own runs' wall time (a resumed sweep's running total would count the
    # time of seeds archived earlier, or not at all, again)
    run_seconds = sum(done[v, s].get("wall_time_s") or 0.0 for v in VARIANTS for s in new)
    manifest["batches"].append({"seeds": new, "regime": name, "recorded": regime["recorded"],
                                "commit": regime["commit"], "cpu": cpu_model(),
                                "device": regime.get("device", "cpu"), "jobs": jobs,
                                "runs_wall_s": round(run_seconds, 1), **({"note": note} if note else {}),
                                "archived": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")})
    _write_atomic(manifest_path, json.dumps(manifest, indent=1))
    return new


def archived(archive: Path) -> tuple[dict, list[int], dict, dict[tuple[str, int], dict]]:
    """The archive's manifest, its seeds (every variant done), and its GenEval tables (base, runs)."""
    if not (archive / "sweep.json").is_file():
        sys.exit(f"no seed is archived in {archive} yet: run the study (a finished seed is archived when it ends)")
    manifest = json.loads((archive / "sweep.json").read_text())
    seeds = sorted({r["seed"] for r in manifest["runs"]})
    base = json.loads((archive / "geneval" / "base.json").read_text())
    tables = {(name, s): json.loads((archive / "geneval" / f"{name}_seed{s}.json").read_text())
              for name in VARIANTS for s in seeds}
    return manifest, seeds, base, tables


def compose_report(*, world: World, smoke: bool, command: str, report_dir: Path, batches: list[dict], regime: dict,
                   regime_changed: list[str], runs: dict, seeds: list[int], equal_it: dict, md: str, md_clip: str,
                   md_wall: str, budget: float, verdict_rows: dict, tally: dict, widths: dict[str, list[float]],
                   base: dict, tables: dict, worst: tuple[str, float, float] | None) -> str:
    """The compositional world's study report (docs/study.md by default)."""
    n_runs = sum(v["n"] for v in equal_it["variants"])
    rose = sum(evals[-1][world.primary] > evals[0][world.primary] for evals, _ in runs.values())
    clipped_runs = sum(sum(r["clip_fraction"] for r in train) > 0 for _, train in runs.values())
    clip_by_variant = {name: [sum(r["clip_fraction"] for r in runs[name, s][1]) / len(runs[name, s][1]) for s in seeds]
                       for name in VARIANTS}
    finals, diffs = category_tables(base, tables, seeds)
    widths = {**widths, "categories": [iv for iv in category_intervals(base, tables, seeds) if iv.half_width is not None]}
    layouts = []
    for name, overrides in VARIANTS.items():
        sizes = next((r["chunk_sizes"] for r in runs[name, seeds[0]][1] if "chunk_sizes" in r), None)
        layouts.append(f"| {name} | `{overrides or '(none: the base recipe)'}` | {sizes} |")
    profiles = ", ".join(f"`{p}` (sha256 `{h[:16]}…`)" for p, h in regime["profiles"].items()) or "none"
    changed = ("\n\n**The base recipe or its profile changed after the runs began** (" + ", ".join(regime_changed) +
               "): the runs used the recorded versions; this report's regime text is the recorded one.") \
        if regime_changed else ""
    batch_rows = "\n".join(
        f"| {', '.join(map(str, b['seeds']))} | {b['recorded']} | `{b['commit'][:12]}` | {b.get('cpu', 'unknown')}"
        f"{'' if b.get('device', 'cpu') == 'cpu' else ', runs on ' + b['device']} | "
        f"{b['jobs']} | {b['runs_wall_s'] / 60:.1f} | {b.get('note') or 'not recorded'} |" for b in batches)
    run_minutes = sum(b["runs_wall_s"] for b in batches) / 60
    report_dir = report_dir.relative_to(REPO) if report_dir.is_relative_to(REPO) else report_dir

    def width_line(key: str, label: str) -> str:
        ivs = widths.get(key) or []
        if not ivs:
            return f"  - {label}: no interval yet (fewer than 2 seeds)."
        w = [iv.half_width for iv in ivs]
        needed = max(seeds_for_half_width(iv.sd, 0.02) for iv in ivs)
        widest = f"{max(w):.3f}" if abs(max(w) - 0.02) >= 0.0005 else f"{max(w):.4f}"  # never "0.020, wider"
        return (f"  - {label}: widest paired half-width {widest} (narrowest {min(w):.3f}); "
                + ("**within 0.02**." if max(w) <= 0.02 else
                   f"**wider than 0.02**: if the per-seed spread of the differences stays as measured (largest "
                   f"sd {max(iv.sd for iv in ivs):.3f}), about {needed} seeds bring every one to 0.02 (t quantile "
                   "of that many seeds)."))

    if worst is None:
        texture = ("No run of this report has its evaluation grids on disk or in the archive, so no texture "
                   "figure is shown.")
    else:
        worst_run, worst_first, worst_final = worst
        texture = f"""The largest `hf_share` rise of the study, `{worst_run}` ({worst_first:.3f} -> {worst_final:.3f}; its
grids are kept in the archive): its first evaluation (the base model) and its final one, the same
held-out prompts and noise.

![first evaluation]({world.figures}/texture_first_eval.png)
![final evaluation]({world.figures}/texture_final_eval.png)"""
    fig = world.figures
    return f"""# Study on the compositional world: chunk sizes and weighted sampling, with seeds

Generated by `{command}` (`benchmarks/study.py`; its docstring lists every choice, and
`{world.recipe}` the regime, all fixed before the runs). {n_runs} runs ({len(VARIANTS)} variants x
{len(seeds)} seed{"s" if len(seeds) != 1 else ""}: {", ".join(map(str, seeds))}), {run_minutes:.1f} min of run wall time (summed over runs) in {len(batches)} batch(es),
read from `{report_dir}`.{" SMOKE REHEARSAL: not a result." if smoke else ""}

| seeds | regime recorded | commit | CPU | runs at once | runs' wall time, summed (min) | load beside the runs |
|---|---|---|---|---|---|---|
{batch_rows}

A batch is the seeds one working session ran; its runs' slim records (metrics, recipe, GenEval
table) are kept in `{report_dir}` so that later sessions add seeds to the same study. Every
batch must carry the first batch's regime (the script refuses another). What else ran on the
machine beside a batch's runs is its note (`--batch-note TEXT`, or `--amend-note` once the runs
have ended): their train times, and so the equal-wall-time comparison, include that load.

## The regime, as recorded {regime.get("when", "before the first run")}

Recorded on {regime["recorded"]} (commit `{regime["commit"][:12]}`{", with uncommitted changes to the recipe or profile" if regime["uncommitted_changes_to_recipe_or_profile"] else ""}):
the base recipe `{regime["recipe"]}` (sha256 `{regime["recipe_sha256"][:16]}…`), its profile {profiles},
the overrides of every variant {("`" + " ".join(regime["sets"]) + "`") if regime["sets"] else "(none)"}.{changed}

| variant | overrides of the base recipe | chunk sizes the runs used |
|---|---|---|
{chr(10).join(layouts)}

- held-out metric: `{world.primary}` (GenEval's strict verdict; the evaluation visits the six
  categories equally, so its mean is GenEval's overall); second judge, never optimised:
  `{world.secondary}`; artefact measure: `{ARTEFACT}`; baseline of the paired differences: {BASELINE}.
- GenEval per category: each run's final checkpoint and the base model, by `flowrl eval RUN_DIR
  --suite geneval --seed {GENEVAL_SEED} --seeds {regime.get("geneval_passes", 1)}` (every held-out prompt,
  the suite's own images per prompt, {regime.get("geneval_passes", 1)} pass(es), 16 ODE steps, the same
  noise for every table); the tables are in `{report_dir / "geneval"}`.
- Intervals: mean over seeds ± half-width of the 95% Student t interval; differences against
  {BASELINE} are paired by seed (same prompts, noise and chunk draws).

<details><summary>The base recipe, as recorded</summary>

Its comments were written before the first run and are kept as they were (the recipe's sha256 is
part of the regime): where they say "not yet measured" or "no run recorded yet", this page's
tables now answer.

```toml
{regime["recipe_text"].rstrip()}
```

</details>

## In short

- The held-out GenEval strict score rose from the first evaluation to the last in {rose} of
  {len(runs)} runs; the clip acted (a clip fraction above zero, averaged over the run) in
  {clipped_runs} of {len(runs)} runs, and in every variant on average: {", ".join(
      f"{n} {sum(v) / len(v):.4f}" for n, v in clip_by_variant.items())}.
- The paper's orderings on the final checkpoints' GenEval table: {tally["geneval"]["held"]} held,
  {tally["geneval"]["reversed"]} reversed, {tally["geneval"]["cannot be told apart"]} cannot be told apart; on the final
  evaluation of the runs: {tally["final"]["held"]} held, {tally["final"]["reversed"]} reversed,
  {tally["final"]["cannot be told apart"]} cannot be told apart; at equal wall time: {tally["wall"]["held"]} held,
  {tally["wall"]["reversed"]} reversed, {tally["wall"]["cannot be told apart"]} cannot be told apart.
- Precision against the bar (every paired half-width at most 0.02):
{width_line("geneval", "final checkpoints' GenEval table")}
{width_line("final", "the runs' final evaluation")}
{width_line("wall", "equal wall time")}
{width_line("categories", "the GenEval table per category (each variant minus step in each of the six categories)")}

## What each variant did (first and last evaluation; update diagnostics over all iterations)

{diagnostics_table(runs, seeds, world)}

"clip fraction" is the share of trained units whose ratio fell outside the clip range, averaged over the run's
iterations; "iterations clipped" the share of iterations in which it cut any.

{texture}

## GenEval per category, final checkpoints

{finals}

Paired by seed against {BASELINE} (95% t interval of the per-seed differences):

{diffs}

## Equal iterations ({world.primary})

{md}
![evaluation curves]({fig}/equal_iterations/compare.png)

## Equal wall time (budget {budget:g} s of train time: the smallest total over all runs)

Train time is wall-clock time per phase: a run's train time includes its neighbours' load, and
batches may have run on different machines (the batch table), so read this comparison as noisier
than the equal-iteration one; pairs are within a batch, as every seed's runs are.

{md_wall}
![evaluation curves against train time]({fig}/equal_wall_time/compare.png)

## The second judge ({world.secondary}, not trained on)

{md_clip}
## The paper's orderings, here

{verdicts_section(verdict_rows, " The paper's numbers are HPSv3 on FLUX, not this world.")}"""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", choices=list(WORLDS), default="shapes",
                    help="shapes: recipes/study_embedded.toml (default); compose: recipes/study_compose.toml, "
                         "GenEval's strict verdict, per-category tables")
    ap.add_argument("--seeds", type=int, default=5, help="seeds per variant: 42, 43, ... (default 5)")
    ap.add_argument("--seed-list", default=None, metavar="S1,S2,...",
                    help="these seeds instead of --seeds (a later batch of the same study, e.g. 47,48,49)")
    ap.add_argument("--archive", default=None, metavar="DIR",
                    help="compose world: where finished seeds are added and the report is read from (default "
                         "benchmarks/results/study_compose; with --smoke or 'none': a private one in the sweep)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (default 2: this machine's cores)")
    ap.add_argument("--sweep-dir", default=None,
                    help="the sweep directory (default runs/study; with --world compose each batch its own, "
                         "runs/study_compose_seeds_46-47 for --seed-list 46,47)")
    ap.add_argument("--out", default="docs",
                    help="where the report and its figures go (shapes: study_shapes.md, study_shapes/; compose: "
                         "study.md, study_compose/; default docs)")
    ap.add_argument("--smoke", action="store_true", help="a tiny rehearsal: 2 iterations, 1 prompt x 2 samples")
    ap.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE",
                    help="a recipe override applied to EVERY variant (a retune of the whole study); repeatable")
    ap.add_argument("--batch-note", default=None, metavar="TEXT",
                    help="compose world: what else ran on the machine beside this batch's runs, kept with the batch "
                         "and shown in the report's batch table (the runs' train times, and so the equal-wall-time "
                         "comparison, include that load)")
    ap.add_argument("--amend-note", action="store_true",
                    help="compose world: set the --batch-note of the archived batch of --seed-list (once its runs "
                         "have ended and what ran beside them is known), then write the report as --report-only")
    ap.add_argument("--report-only", action="store_true", help="write the report from the finished runs (no sweep)")
    args = ap.parse_args(argv)
    world = WORLDS[args.world]
    if args.amend_note and (world.archive is None or args.seed_list is None or not args.batch_note):
        sys.exit("--amend-note sets the note of an archived batch of the compose world: give --world compose, "
                 "the batch's seeds (--seed-list) and the note (--batch-note TEXT)")
    if args.seed_list is not None:  # as `flowrl sweep --seed-list` reads it
        try:
            args.seed_values = sorted(parse_seed_list(args.seed_list))
        except FlowrlError as e:
            sys.exit(str(e))
    else:
        args.seed_values = [42 + k for k in range(args.seeds)]
    sweep_dir = REPO / Path(args.sweep_dir or batch_sweep_dir(world, args.seed_values))
    out = Path(args.out)
    has_sweep = (sweep_dir / "sweep.json").is_file()
    # the compose world reports from an archive of finished seeds: the committed one, or (a smoke
    # rehearsal, --archive none) a private one inside the sweep, so that every report takes one path
    archive = None
    if args.world != "shapes":
        if args.archive not in (None, "none"):
            archive = REPO / args.archive
        elif args.archive is None and not args.smoke and world.archive:
            archive = REPO / world.archive
        else:
            archive = sweep_dir / "report"
    if args.amend_note:
        amend_batch_note(archive, args.seed_values, args.batch_note)
        print(f"the note of the batch of seeds {args.seed_values} in {archive}: {args.batch_note}", flush=True)
        args.report_only, has_sweep = True, False  # the report from the archive alone
    if args.report_only and not has_sweep and (archive is None or not (archive / "sweep.json").is_file()):
        sys.exit(f"--report-only: no sweep in {sweep_dir} and no archived seed to report from")
    if args.report_only and has_sweep and args.seed_list is None:  # the sweep's own seeds, whatever they are
        args.seed_values = json.loads((sweep_dir / "sweep.json").read_text())["spec"]["seeds"]
    archived_seeds: set[int] = set()
    if archive is not None and (archive / "sweep.json").is_file():
        archived_seeds = {r["seed"] for r in json.loads((archive / "sweep.json").read_text())["runs"]}
    if has_sweep and not args.report_only:
        # resuming: the sweep holds the seeds asked for, less those archived when it began; any
        # other sweep is refused here (`flowrl sweep` would refuse it only after this script's checks)
        live = sorted(json.loads((sweep_dir / "sweep.json").read_text())["spec"]["seeds"])
        if not set(live) <= set(args.seed_values) or not set(args.seed_values) - set(live) <= archived_seeds:
            sys.exit(f"{sweep_dir} holds the sweep of seeds {live}, and this batch asks for {args.seed_values}: "
                     f"give the same seeds to resume it, or another --sweep-dir (by default each batch of seeds "
                     f"has its own: {batch_sweep_dir(world, args.seed_values)})")
        args.seed_values = live
    if not args.report_only and not has_sweep and archived_seeds & set(args.seed_values):
        print(f"seeds {sorted(archived_seeds & set(args.seed_values))} are archived in {archive} already: "
              "not run again", flush=True)
        args.seed_values = [s for s in args.seed_values if s not in archived_seeds]
    sweep_args = [world.recipe, "--seed-list", ",".join(map(str, args.seed_values)), "--jobs", str(args.jobs),
                  "-o", str(sweep_dir)]
    for name, overrides in VARIANTS.items():
        sweep_args += ["--variant", f"{name}:{overrides}"]
    for s in (SMOKE if args.smoke else []) + args.sets:
        sweep_args += ["--set", s]
    start = time.monotonic()
    regime, regime_changed = None, []
    if args.world != "shapes" and (has_sweep or (not args.report_only and args.seed_values)):  # before the first run
        path = sweep_dir / "regime.json"
        now = regime_record(world, args, sweep_args)
        if archived_seeds:  # a new batch must be the archived study's: refuse before any run
            first = json.loads((archive / json.loads((archive / "sweep.json").read_text())["batches"][0]["regime"])
                               .read_text())
            differ = [k for k in REGIME_KEYS if first.get(k) != {**now, "geneval_passes": GENEVAL_PASSES}.get(k)]
            if differ:
                sys.exit(f"this batch's regime differs from the study archived in {archive} in {', '.join(differ)}: "
                         "run the archived regime, or give another --archive DIR")
            if not args.report_only and first.get("device", "cpu") != now["device"]:
                sys.exit(f"this batch's runs would compute on {now['device']}, the study archived in {archive} on "
                         f"{first.get('device', 'cpu')}: one study's seeds share a device; give another --archive DIR "
                         "(and --out DIR)")
        if path.is_file():
            regime = json.loads(path.read_text())
            if not args.report_only and regime.get("device", "cpu") != now["device"]:
                sys.exit(f"the runs in {sweep_dir} began on {regime.get('device', 'cpu')} and would go on on "
                         f"{now['device']}: finish them there, or start the batch in another --sweep-dir")
            regime_changed = [k for k in ("recipe_sha256", "profiles", "sets", "variants", "seeds") if regime[k] != now[k]]
            if regime_changed:
                print(f"warning: the regime differs from the one recorded in {path} when the runs began: "
                      f"{', '.join(regime_changed)}", flush=True)
        else:  # with --report-only and no record, the runs were made without one: say so
            regime = {**now, "when": "when the report was written (no record from before the runs)"
                      if args.report_only else "before the first run"}
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(regime, indent=1))
    sweep_failed = None
    if not args.report_only and args.seed_values:
        # killing this script stops the sweep as Ctrl-C does (its runs checkpoint): no orphan keeps training
        proc = subprocess.run([sys.executable, "-m", "flowrl", "sweep", *sweep_args], cwd=REPO,
                              preexec_fn=exits_with_parent())
        if proc.returncode != 0:  # archive the seeds that did finish, then stop with the sweep's status
            sweep_failed = f"flowrl sweep exited with {proc.returncode}; run this script again to resume"
            print(sweep_failed, flush=True)
        has_sweep = True
    primary, secondary, recipe = world.primary, world.secondary, world.recipe

    # the compose world: GenEval tables of this sweep's finished seeds, those seeds into the
    # archive, and the report from the archive (every batch so far)
    report_dir, seeds, batches = sweep_dir, args.seed_values, []
    if args.world != "shapes":
        if has_sweep:
            finished = complete_seeds(sweep_dir, args.seed_values)
            if len(finished) < len(args.seed_values):
                print(f"the finished seeds: {finished} of {args.seed_values}", flush=True)
            if finished:
                base, tables = geneval_tables(world, args, sweep_dir, finished)
                added = archive_batch(sweep_dir, archive, finished, regime, args.jobs, base, tables, args.batch_note)
                print(f"archived seeds {added or 'none (already there)'} in {archive}", flush=True)
        if not (archive / "sweep.json").is_file():
            sys.exit(sweep_failed or f"no seed of {sweep_dir} has all its variants finished: nothing to report")
        manifest, seeds, base, tables = archived(archive)
        report_dir, batches = archive, manifest["batches"]
        regime = json.loads((archive / batches[0]["regime"]).read_text())
        regime_changed = []
    else:
        if sweep_failed:
            sys.exit(sweep_failed)
        sweep_seconds = json.loads((sweep_dir / "sweep.json").read_text())["elapsed_s"]

    figures = out / world.figures
    equal_it = compare(report_dir, figures / "equal_iterations", primary)
    compare(report_dir, figures / "equal_iterations_clip", secondary)  # writes the second judge's table and figure
    budget = min(r["train_time_s"] for v in equal_it["variants"] for r in v["runs"])
    budget = math.floor(budget * 10) / 10 if budget >= 1 else budget  # rounded down: every run reached it
    equal_wall = compare(report_dir, figures / "equal_wall_time", primary, "--at-wall-time", str(budget))

    md = (REPO / figures / "equal_iterations" / "compare.md").read_text()
    md_clip = (REPO / figures / "equal_iterations_clip" / "compare.md").read_text()
    md_wall = (REPO / figures / "equal_wall_time" / "compare.md").read_text()
    command = "OMP_NUM_THREADS=1 python benchmarks/study.py" + (
        f" --world {args.world}" if args.world != "shapes" else "") + (" --smoke" if args.smoke else "") + (
        f" --seeds {args.seeds}" if args.seeds != 5 and args.seed_list is None else "")
    if args.world != "shapes":  # the report covers every archived batch, each run by its own seeds
        command = (f"{command} --seed-list SEEDS` for each batch below, and `python benchmarks/study.py --world "
                   f"{args.world}{' --smoke' if args.smoke else ''} --report-only")
    n_runs = sum(v["n"] for v in equal_it["variants"])
    runs = load_runs(report_dir, seeds, primary, ARCHIVED_RUNS if args.world != "shapes" else "runs")
    worst = worst_texture_figures(runs, sweep_dir, figures)
    if args.world != "shapes":
        worst = archived_texture(archive, figures, worst)
    rose = sum(evals[-1][primary] > evals[0][primary] for evals, _ in runs.values())
    n_runs_all = len(runs)
    clipped_runs = sum(sum(r["clip_fraction"] for r in train) > 0 for _, train in runs.values())
    textured = sum(sum(runs[name, s][0][-1][ARTEFACT] - runs[name, s][0][0][ARTEFACT] for s in seeds) > 0
                   for name in VARIANTS)
    results = {"final": (equal_it, "final"), "auc": (equal_it, "auc"), "wall": (equal_wall, "at_wall_time")}
    if args.world != "shapes":
        results = {"geneval": (geneval_result(tables, seeds), "geneval"), **results}
    verdict_rows = {q: verdicts(result, quantity) for q, (result, quantity) in results.items()}
    widths = {q: half_widths(result, quantity) for q, (result, quantity) in results.items()}
    tally = {q: {v: sum(r[2].split(":")[0].split(" (")[0] == v for r in rows)
                 for v in ("held", "reversed", "cannot be told apart", "no difference detected")}
             for q, rows in verdict_rows.items()}
    if args.world != "shapes":
        text = compose_report(world=world, smoke=args.smoke, command=command, report_dir=report_dir,
                              batches=batches, regime=regime, regime_changed=regime_changed, runs=runs, seeds=seeds,
                              equal_it=equal_it, md=md, md_clip=md_clip, md_wall=md_wall, budget=budget,
                              verdict_rows=verdict_rows, tally=tally, widths=widths, base=base, tables=tables,
                              worst=worst)
        (REPO / out / world.report).write_text(text, encoding="utf-8")
        print(f"wrote {out / world.report} and {figures}/ in {(time.monotonic() - start) / 60:.1f} min")
        if sweep_failed:
            sys.exit(sweep_failed)
        return
    worst_run, worst_first, worst_final = worst or ("(no grids on disk)", float("nan"), float("nan"))
    text = f"""# Study: chunk sizes and weighted sampling on the embedded model, with seeds

Generated by `{command}` (`benchmarks/study.py`; its docstring lists every choice, all fixed
before the runs). {n_runs} runs ({len(VARIANTS)} variants x {len(seeds)} seeds), sweep time
{sweep_seconds / 60:.1f} min with {args.jobs} runs at once on this project's 2-core CPU machine.{" SMOKE REHEARSAL: not a result." if args.smoke else ""}

## In short

- The held-out verifier (18 prompts never trained on) rose from the first evaluation to the
  last in {rose} of {n_runs_all} runs (table "What each variant did"). The second judge and the artefact
  measure are in the same table: read them before the reward.
- The clip acted (a clip fraction above zero, averaged over the run) in {clipped_runs} of
  {n_runs_all} runs; the second pass runs at clip range 5e-5. Per variant: the table.
- The images are not as clean as the quickstart's. `hf_share` (the artefact measure) rose in
  {textured} of {len(VARIANTS)} variants (mean over seeds; table), and the grids show a faint
  periodic pattern on flat backgrounds in the runs where it rose most (the largest rise,
  `{worst_run}`: {worst_first:.3f} -> {worst_final:.3f}; its grids are below). DiffusionNFT,
  the quickstart's objective when this study ran, ended below the base model's `hf_share` on all
  three seeds (docs/benchmarks.md, "End-to-end figures").
- The paper's orderings at equal iterations (final evaluation): {tally["final"]["held"]} held,
  {tally["final"]["reversed"]} reversed, {tally["final"]["cannot be told apart"]} cannot be told apart
  (the tie: {"no difference detected" if tally["final"]["no difference detected"] else "see the table"}); at equal wall time:
  {tally["wall"]["held"]} held, {tally["wall"]["reversed"]} reversed, {tally["wall"]["cannot be told apart"]} cannot be told apart.
  With {len(seeds)} seeds and gains of a few hundredths, differences between layouts smaller than about
  the paired intervals' half-widths cannot be resolved here; that is a statement about this
  scale, not about FLUX.

## Why the earlier study measured nothing, and how this regime was chosen

The previous study (lr 3e-4, clip 5e-3, all 16 transitions of a 17-step sampler trained by the
SDE, one optimizer step per rollout) lowered the verifier in every variant. Its own diagnostics
show why: `clip_fraction` 0, `approx_kl_old` 0 and `ratio_max` 1 in every iteration (one
optimizer step per rollout is taken at ratio exactly 1, so chunk and step level differ only in
per-step weights), and a policy gradient dominated by the last, low-noise transitions, whose
per-batch direction is close to noise; Adam turns that noise into an lr-sized random walk of
every weight, which draws a checkerboard (docs/diagnosis.md has the numbers and the method).

The regime was fixed from those measurements and one pilot run before any study run, and is
the same for every variant:

- the SDE noise (and so every trained transition) is confined to the high-noise part of the
  trajectory, where the reward's variance arises: 33 steps, SDE in the first 16
  (sigma 1 -> 0.75), ODE after; T = 16, as in the paper, so its chunk layouts apply unchanged;
- 2 passes per rollout at clip range 5e-5 (GCPO's), so the second pass is off-policy and the
  chunk ratio and its clip take part;
- lr 5e-5 (the largest rate at which the earlier measurements kept the images mostly clean);
  the same starting noise within a group; 50 iterations (the budget of 35 runs on 2 cores);
- evaluation on 18 prompts the run never trains on, 4 noises each.

The dynamics-guided chunks come from the profile of this very sampler
(`recipes/profiles/embedded_window16.json`, `flowrl profile`): [2, 2, 4, 8].

## What each variant did (first and last evaluation; update diagnostics over all iterations)

{diagnostics_table(runs, seeds)}

The worst texture of the study, `{worst_run}`: its first evaluation (the base model) and its
final one, the same held-out prompts and noise.

![first evaluation](study_shapes/texture_first_eval.png)
![final evaluation](study_shapes/texture_final_eval.png)

`hf_share` is the evaluation's artefact measure (share of high-frequency energy, base model
about 0.05; the hacking recipe's checkerboard reaches about 0.5). "ratio max - min" is the spread
of the unit importance ratios, "unit log-ratio sd" the standard deviation of the per-unit
log-ratios, both per iteration and averaged.

## Setting

- Model and sampler: the embedded tiny FLUX-architecture model, 33 sampling steps with the
  flow SDE kernel (a = 0.7) in steps 0-15 and ODE after (16 trainable transitions), shift 3
  (`{recipe}`).
- Reward (chosen before any run): the verifier's soft prompt correctness, weight 1. The embedded
  CLIP reward is logged with weight 0 as an independent judge of the same alignment.
- Variants (only [chunker] and [selector] differ): step-level (8 of 16 steps per sample),
  GSPO (one chunk [16], all of it), [8, 8], 8 x [2], 4 x [4] (half of the chunks per sample),
  dynamics-guided chunks [2, 2, 4, 8] (half trained), and the same with weighted sampling
  (chunk probability proportional to its mean L1rel).
- Seeds: run.seed = {', '.join(map(str, seeds))}; differences are paired by seed.
- Intervals: mean over seeds ± half-width of the 95% Student t interval (n - 1 degrees of
  freedom); paired differences against step-level use the same interval over the per-seed
  differences.

## Equal iterations ({primary})

{md}
![evaluation curves](study_shapes/equal_iterations/compare.png)

## Equal wall time (budget {budget:g} s of train time: the smallest total over all runs)

Train time is wall-clock time per phase. These runs shared the 2-core machine with other work
(two study runs at a time, and at times a test suite), so a run's train time includes its
neighbours' load; read this comparison as noisier than the equal-iteration one.

{md_wall}
![evaluation curves against train time](study_shapes/equal_wall_time/compare.png)

## The second judge ({secondary}, not trained on)

{md_clip}
## The paper's orderings, here

{verdicts_section(verdict_rows, "")}"""
    (REPO / out / world.report).write_text(text, encoding="utf-8")
    print(f"wrote {out / world.report} and {figures}/ in {(time.monotonic() - start) / 60:.1f} min")


if __name__ == "__main__":
    main()
