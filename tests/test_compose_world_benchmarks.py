"""benchmarks/time_to_reward.py and benchmarks/study.py on the compositional world:
``--world compose`` takes recipes/study_compose.toml, GenEval's strict verdict as the held-out
metric and compose_clip as the second judge.

The fast tests check what the runs would be made of: every configuration's overrides validate on
both worlds' base recipes, the shapes world's configurations are today's, the seven study
variants validate on the compose recipe (T = 16), and the recipe's profile is of its own sampler.
The smoke runs of both benchmarks take minutes on the 2-core CPU (time_to_reward's about 2 min,
the study's about 5 min, most of it GenEval's table of each run's checkpoint), so they are in the
slow lane (``pytest -m slow``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from script_modules import benchmark_module

from flowrl.runlog import read_metrics

REPO = Path(__file__).resolve().parents[1]


def _bench(name: str):
    return benchmark_module(name)


@pytest.fixture(scope="module")
def ttr():
    module = _bench("time_to_reward")
    yield module
    sys.modules.pop(module.__name__, None)


@pytest.fixture(scope="module")
def study():
    module = _bench("study")
    yield module
    sys.modules.pop(module.__name__, None)


#: the configurations of the time-to-reward runs recorded in docs/benchmarks.md (the shapes default)
SHAPES_CONFIGS = ["flow_grpo", "dance_grpo", "gcpo", "replay", "egrpo", "egrpo_replay", "flash", "chunk8_replay",
                  "window", "branch", "branch_egrpo", "branch_egrpo4", "branch_tree", "nft", "nft_fast", "nft_fast4"]


@pytest.mark.parametrize("world", ["shapes", "compose"])
def test_every_config_validates_on_the_worlds_base_recipe(ttr, world):
    w = ttr.WORLDS[world]
    results = ttr.check(list(ttr.CONFIGS), w)
    assert all(v.startswith("ok") for v in results.values()), {k: v for k, v in results.items() if v.startswith("error")}
    # the layouts and the sampler the configs assume: T = 16 for every SDE-trained config
    for name in ("flow_grpo", "dance_grpo", "gcpo", "chunk_grpo", "gspo", "dppo", "branch_tree"):
        assert results[name].endswith("T=16"), (name, results[name])


def test_the_shapes_world_is_todays(ttr):
    w = ttr.WORLDS["shapes"]
    assert list(w.defaults) == SHAPES_CONFIGS
    assert (w.recipe, w.main, w.second, w.target_rise) == ("recipes/study_embedded.toml", "verifier", "embedded_clip", 0.03)
    assert ttr.overrides("nft_fast", w)[-1] == "log.eval_steps=33"  # the shapes runs' own override, unchanged


def test_the_compose_world(ttr):
    w = ttr.WORLDS["compose"]
    assert (w.recipe, w.main, w.second, w.target_rise) == (
        "recipes/study_compose.toml", "compose_geneval_strict", "compose_clip", 0.10)
    assert set(w.defaults) <= set(ttr.CONFIGS) and ttr.BASELINE in w.defaults
    assert not set(w.not_applicable) & set(w.defaults)
    # DiffusionNFT's fast rollouts keep this world's evaluation at GenEval's 16 steps
    assert "log.eval_steps=16" in ttr.overrides("nft_fast", w)


def test_the_compose_world_times_the_2026_objectives_as_their_recipes_run(ttr):
    w = ttr.WORLDS["compose"]
    results = ttr.check(["epg", "epg_onpolicy", "pepg", "vgrpo", "fdfo"], w)
    assert set(results) <= set(w.defaults)
    for name, loss in (("epg", "epg"), ("epg_onpolicy", "epg"), ("pepg", "pepg"), ("vgrpo", "vgrpo")):
        assert results[name].startswith(f"ok: chunker=step, selector=all, loss={loss}"), results[name]
        assert results[name].endswith("T=0")  # ODE rollouts: no SDE transition is trained
        assert {"likelihood.use='elbo'", "sampler.steps=10", "log.eval_steps=16"} <= set(ttr.overrides(name, w))
    assert "likelihood.decay_type=0" in ttr.overrides("epg_onpolicy", w)  # the quickstart's on-policy setting
    assert results["fdfo"].endswith("loss=fdfo, kernel=flow, T=16")  # paired SDE rollouts of the world's sampler
    # the shapes world's default set stays the runs it recorded
    assert not set(ttr.COMPOSE_ONLY) & set(ttr.WORLDS["shapes"].defaults)


def test_a_config_that_does_not_apply_is_skipped_with_its_reason(ttr, capsys):
    w = ttr.World(**{**ttr.WORLDS["compose"].__dict__, "not_applicable": {"gcpo": "tied to another profile"}})
    assert ttr.applicable(["flow_grpo", "gcpo"], w) == ["flow_grpo"]
    assert "skipping gcpo: it does not apply on this world: tied to another profile" in capsys.readouterr().out


def test_the_recipes_profile_is_of_its_own_sampler(ttr):
    profile = json.loads((REPO / "recipes" / "profiles" / "compose_window16.json").read_text())
    settings = profile["settings"]
    assert settings["model"]["use"] == "embedded_compose"
    assert (settings["steps"], settings["sde_window"], settings["kernel"]) == (17, [0, 16], {"use": "flow", "a": 0.7})
    assert sum(profile["trainable"]) == 16
    # the layout the time-to-reward descriptions quote is the one the dynamics chunker proposes
    sizes = profile["proposals"]["l1rel"]["dp"]["sizes"]
    assert ttr.WORLDS["compose"].dyn == str(sizes).replace(" ", "")


def test_the_study_variants_validate_on_the_compose_recipe(study, flowrl_cli):
    """``flowrl sweep --dry-run`` validates every variant as the study would run it."""
    argv = ["sweep", study.WORLDS["compose"].recipe, "--dry-run", "--seeds", "1"]
    for name, overrides in study.VARIANTS.items():
        argv += ["--variant", f"{name}:{overrides}"]
    (done,) = flowrl_cli.in_process([argv])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "7 run(s)" in done.stdout


@pytest.mark.slow
def test_time_to_reward_compose_smoke(ttr, tmp_path, flowrl_cli):
    out = tmp_path / "ttr"
    done = subprocess.run([sys.executable, "benchmarks/time_to_reward.py", "--world", "compose", "--smoke", "--out",
                           str(out)], cwd=REPO, env=flowrl_cli.env(OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert (report["world"], report["metric"], report["target_rise"]) == (
        "compose", "eval/compose_geneval_strict/mean", 0.10)
    assert list(report["configs"]) == list(ttr.WORLDS["compose"].smoke)
    assert "held-out GenEval strict (overall)" in (out / "report.md").read_text()
    assert (out / "time_to_reward.png").is_file() and "missing" not in report
    rows = read_metrics(out / "gcpo_s42")
    assert str(next(r["chunk_sizes"] for r in rows if "chunk_sizes" in r)).replace(" ", "") == ttr.WORLDS["compose"].dyn


@pytest.mark.slow
def test_study_compose_smoke(study, tmp_path, flowrl_cli):
    done = subprocess.run([sys.executable, "benchmarks/study.py", "--world", "compose", "--smoke", "--seeds", "1",
                           "--jobs", "1", "--sweep-dir", str(tmp_path / "sweep"), "--out", str(tmp_path / "out")],
                          cwd=REPO, env=flowrl_cli.env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = (tmp_path / "out" / "study.md").read_text()
    assert "SMOKE REHEARSAL: not a result." in text
    assert "## GenEval per category, final checkpoints" in text and "| color_attr | overall |" in text
    assert "clip fraction" in text
    regime = json.loads((tmp_path / "sweep" / "regime.json").read_text())
    assert regime["recipe"] == "recipes/study_compose.toml" and "recipes/profiles/compose_window16.json" in regime["profiles"]
    assert regime["device"] == "cpu"  # where the runs computed: one study never mixes devices
    tables = sorted(p.name for p in (tmp_path / "sweep" / "geneval").glob("*.json"))
    assert len(tables) == 1 + len(study.VARIANTS) and "base.json" in tables


def _fake_study_sweep(study, root: Path, seeds: list[int], regime_sets: list[str] | None = None,
                      sweep: Path | None = None, failed: tuple[str, ...] = (), jitter: float = 0.0,
                      device: str | None = None) -> Path:
    """A finished compose study sweep as `flowrl sweep` and `geneval_tables` leave it, without
    training: every variant's metrics (evaluations at 0, 10, 20 and the final row, update rows
    with the diagnostics the report reads), its recipe, and the GenEval tables (with per-image
    rows, which the archive drops). Each variant's scores differ by a fixed step per variant plus
    a per-seed offset, so paired differences are known; ``jitter`` moves chunks_8_8's GenEval
    overall up on even seeds and down on odd ones."""
    sweep = sweep or root / "sweep"
    runs = []
    cats = ["single_object", "two_object", "counting", "colors", "position", "color_attr"]

    def table(overall: float, iteration: int | None) -> dict:
        return {"suite": "geneval", "iteration": iteration, "overall": {"mean": overall, "sem": 0.018},
                "categories": {c: {"mean": overall, "sem": 0.05} for c in cats},
                "settings": {"repeats": study.GENEVAL_PASSES, "images": 624}, "per_image": [{"score": 1}] * 624}

    (sweep / "geneval").mkdir(parents=True, exist_ok=True)
    (sweep / "geneval" / "base.json").write_text(json.dumps(table(0.45, None)))
    for v, name in enumerate(study.VARIANTS):
        for seed in seeds:
            d = sweep / "runs" / f"{name}_seed{seed}"
            d.mkdir(parents=True)
            (d / "recipe.toml").write_text(f"[run]\nseed = {seed}\n")
            rows = []
            for it in range(21):
                score = 0.43 + 0.001 * it * (v + 1) + 0.003 * (seed % 7)
                evals = {"eval/compose_geneval_strict/mean": score, "eval/compose_geneval_strict/sem": 0.035,
                         "eval/compose_clip/mean": 0.45, "eval/hf_share/mean": 0.15} if it % 10 == 0 else {}
                if it < 20:
                    rows.append({"iteration": it, **evals, "time/rollout": 2.0, "time/update": 6.0 + v,
                                 "clip_fraction": 0.01 * (v + 1), "ratio_min": 0.99, "ratio_max": 1.01,
                                 "diag/log_ratio_std": 1e-5, "approx_kl_old": 1e-10, "groups/all_equal_fraction": 0.1,
                                 "chunk_sizes": [8, 8], "reward/compose_geneval_exact/std": 0.4})
                else:
                    rows.append({"iteration": it, "final": True, **evals})
            (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            wobble = jitter * (1 if seed % 2 == 0 else -1) if name == "chunks_8_8" else 0.0
            (sweep / "geneval" / f"{name}_seed{seed}.json").write_text(
                json.dumps(table(0.45 + 0.01 * v + 0.002 * (seed % 7) + wobble, 20)))
            runs.append({"id": f"{name}_seed{seed}", "variant": name, "seed": seed,
                         "status": "failed" if f"{name}_seed{seed}" in failed else "done",
                         "dir": f"runs/{name}_seed{seed}", "wall_time_s": 100.0})
    (sweep / "sweep.json").write_text(json.dumps({"spec": {"seeds": seeds}, "runs": runs, "elapsed_s": 600.0}))
    if (sweep / "regime.json").is_file():  # the study recorded it before the sweep began
        return sweep
    profile = "recipes/profiles/compose_window16.json"
    regime = {"world": "compose", "recipe": "recipes/study_compose.toml",
              "recipe_sha256": study.sha256(REPO / "recipes/study_compose.toml"),
              "recipe_text": "[run]\nseed = 42\n", "profiles": {profile: study.sha256(REPO / profile)},
              "sets": regime_sets or [], "variants": study.VARIANTS, "baseline": study.BASELINE, "seeds": seeds,
              "primary": study.WORLDS["compose"].primary, "secondary": study.WORLDS["compose"].secondary,
              "geneval_seed": study.GENEVAL_SEED, "commit": "0" * 40, "uncommitted_changes_to_recipe_or_profile": "",
              "recorded": "2026-11-30 05:00 UTC", "sweep_args": []}
    if device is not None:  # regimes recorded before the device was had none (the archived CPU batches)
        regime["device"] = device
    (sweep / "regime.json").write_text(json.dumps(regime))
    return sweep


def _flowrl_in_process(study, flowrl_cli, monkeypatch) -> None:
    """The study's `flowrl compare` calls run in this process (no interpreter start-up each)."""
    def in_process(*args):
        (done,) = flowrl_cli.in_process([list(args)])
        return subprocess.CompletedProcess(args, done.returncode, done.stdout, done.stderr)

    monkeypatch.setattr(study, "flowrl", in_process)


def _fake_sweeps(study, tmp_path: Path, monkeypatch, failing_seed: int | None = None) -> list[list[int]]:
    """`flowrl sweep` replaced by a finished fake sweep of the seeds asked for (made once per
    directory; a resumed one is left as it is); with ``failing_seed``, that seed's gspo_16 run
    fails and the sweep exits 1. Returns the seed lists the study asked for, in order."""
    sweeps, real_run = [], subprocess.run

    def fake_run(cmd, *a, **kw):
        if "sweep" not in cmd:
            return real_run(cmd, *a, **kw)
        seeds = [int(x) for x in cmd[cmd.index("--seed-list") + 1].split(",")]
        sweeps.append(seeds)
        sweep_dir = Path(cmd[cmd.index("-o") + 1])
        if not (sweep_dir / "sweep.json").exists():
            failed = (f"gspo_16_seed{failing_seed}",) if failing_seed is not None else ()
            _fake_study_sweep(study, tmp_path, seeds, sweep=sweep_dir, failed=failed)
        return subprocess.CompletedProcess(cmd, 1 if failing_seed in seeds else 0)

    monkeypatch.setattr(study.subprocess, "run", fake_run)
    return sweeps


def _report(study, flowrl_cli, monkeypatch, sweep: Path, archive: Path, out: Path, seeds: list[int]):
    _flowrl_in_process(study, flowrl_cli, monkeypatch)
    study.main(["--world", "compose", "--report-only", "--seed-list", ",".join(map(str, seeds)),
                "--sweep-dir", str(sweep), "--archive", str(archive), "--out", str(out)])
    return " ".join((out / "study.md").read_text().split())  # the report's words, unwrapped


def test_study_seeds_accumulate_in_the_archive_across_batches(study, tmp_path, flowrl_cli, monkeypatch):
    """A batch's finished seeds enter the committed archive (slim metrics, recipes, GenEval tables
    without per-image rows) and the report reads every batch: a second session's seeds join the
    first's, and the paired intervals are over all of them."""
    archive, out = tmp_path / "archive", tmp_path / "out"
    text = _report(study, flowrl_cli, monkeypatch, _fake_study_sweep(study, tmp_path / "a", [42, 43]), archive, out,
                   [42, 43])
    manifest = json.loads((archive / "sweep.json").read_text())
    assert [b["seeds"] for b in manifest["batches"]] == [[42, 43]]
    assert len(manifest["runs"]) == 2 * len(study.VARIANTS)
    table = json.loads((archive / "geneval" / "dynamics_seed43.json").read_text())
    assert "per_image" not in table and table["settings"]["repeats"] == study.GENEVAL_PASSES
    assert json.loads((archive / manifest["batches"][0]["regime"]).read_text())["geneval_passes"] == study.GENEVAL_PASSES
    row = json.loads((archive / study.ARCHIVED_RUNS / "step_seed42" / "metrics.jsonl").read_text().splitlines()[0])
    assert "reward/compose_geneval_exact/std" not in row and row["clip_fraction"] == 0.01
    assert "14 runs (7 variants x 2 seeds: 42, 43)" in text

    # a later session: seeds 44 and 45 from a fresh sweep folder join the same study
    text = _report(study, flowrl_cli, monkeypatch, _fake_study_sweep(study, tmp_path / "b", [44, 45]), archive, out,
                   [44, 45])
    manifest = json.loads((archive / "sweep.json").read_text())
    assert [b["seeds"] for b in manifest["batches"]] == [[42, 43], [44, 45]]
    assert "28 runs (7 variants x 4 seeds: 42, 43, 44, 45)" in text
    # GenEval overall: variant v scores 0.01 * v above step on every seed, so each claim's paired
    # difference is exact and its interval has zero width
    assert "dynamics - chunks_8_8 = +0.0300 ± 0.0000 (n=4)" in text
    assert "final checkpoints' GenEval table: widest paired half-width 0.000" in text and "**within 0.02**" in text

    # archiving the same seeds again adds nothing; a batch under another regime is refused
    _report(study, flowrl_cli, monkeypatch, tmp_path / "b" / "sweep", archive, out, [44, 45])
    assert len(json.loads((archive / "sweep.json").read_text())["batches"]) == 2
    other = _fake_study_sweep(study, tmp_path / "c", [46], regime_sets=["train.lr=1e-4"])
    with pytest.raises(SystemExit, match="differs from the archived study's in sets"):
        _report(study, flowrl_cli, monkeypatch, other, archive, out, [46])
    assert len(json.loads((archive / "sweep.json").read_text())["runs"]) == 4 * len(study.VARIANTS)
    # seeds run on a GPU are another study: refused from the CPU one, accepted by their own archive
    on_gpu = _fake_study_sweep(study, tmp_path / "d", [47], device="cuda (NVIDIA H200)")
    with pytest.raises(SystemExit, match=r"computed on cuda \(NVIDIA H200\), the archived study's on cpu"):
        _report(study, flowrl_cli, monkeypatch, on_gpu, archive, out, [47])
    assert len(json.loads((archive / "sweep.json").read_text())["runs"]) == 4 * len(study.VARIANTS)
    text = _report(study, flowrl_cli, monkeypatch, on_gpu, tmp_path / "gpu_archive", tmp_path / "gpu_out", [47])
    assert "runs on cuda (NVIDIA H200)" in text
    # a CPU batch recorded with its device joins the CPU study recorded without one
    _report(study, flowrl_cli, monkeypatch, _fake_study_sweep(study, tmp_path / "e", [48], device="cpu"), archive,
            out, [48])
    assert [b["seeds"] for b in json.loads((archive / "sweep.json").read_text())["batches"]][-1] == [48]


def _fake_ttr_run(ttr, name: str, args, rise_per_eval: float, seed: int = 42, **recipe_sets) -> None:
    """A finished time-to-reward run as `flowrl train` leaves it, without training: the recipe it
    resolved to (``recipe_sets`` changes it, as a run made with other settings), evaluations at 0,
    10, 20 and the final row, 10 train seconds and 100 forwards an iteration."""
    from flowrl.recipe import dump_toml, load_recipe

    run_dir = args.out / f"{name}_s{seed}"
    run_dir.mkdir(parents=True)
    sets = ttr.run_sets(name, seed, args, run_dir) + [f"{k.replace('__', '.')}={v}" for k, v in recipe_sets.items()]
    recipe = load_recipe(REPO / ttr.WORLDS["compose"].recipe, sets)
    (run_dir / "recipe.toml").write_text(dump_toml(recipe.to_toml_dict()))
    rows = []
    for it in range(21):
        evals = {"eval/compose_geneval_strict/mean": 0.4 + rise_per_eval * it / 10,
                 "eval/compose_geneval_strict/sem": 0.035, "eval/compose_clip/mean": 0.45,
                 "eval/compose_clip/sem": 0.035, "eval/hf_share/mean": 0.15} if it % 10 == 0 else {}
        rows.append({"iteration": it, "final": True, **evals} if it == 20 else
                    {"iteration": it, **evals, "time/rollout": 4.0, "time/update": 6.0, "compute/rollout/forward": 100.0})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_time_to_reward_keeps_finished_runs_in_its_archive(ttr, tmp_path, monkeypatch):
    """A finished run's evaluation curve goes into the archive; a later session with no run
    folder reuses it (no training) and summarises what the run folders gave; a run asked for with
    other settings is not taken from the archive, and its record is never overwritten; a run
    folder made with other settings is not archived as this run."""
    import argparse
    import shutil

    args = argparse.Namespace(world="compose", out=tmp_path / "runs", archive=None, iterations=20, eval_every=10,
                              jobs=2, smoke=False, seed_values=[42], configs=["flow_grpo", "nft"], target_rise=0.10,
                              regime_sha256=ttr.regime_sha256(ttr.WORLDS["compose"]))
    _fake_ttr_run(ttr, "flow_grpo", args, 0.06)
    _fake_ttr_run(ttr, "nft", args, 0.12)
    trained = []
    monkeypatch.setattr(ttr.subprocess, "run", lambda cmd, **kw: trained.append(cmd) or
                        subprocess.CompletedProcess(cmd, 0, "", "") if "train" in cmd else
                        subprocess.CompletedProcess(cmd, 0, "", ""))
    from_runs = ttr.summarise(args)  # from the run folders alone
    assert from_runs["configs"]["nft"]["runs"][42]["seconds"] == 100.0  # +0.12 at iteration 10
    assert from_runs["configs"]["flow_grpo"]["runs"][42]["seconds"] == 200.0

    args.archive = tmp_path / "archive"
    for name in args.configs:
        assert ttr.run(name, 42, args) is not None  # finished as asked in --out: archived, not trained
    assert not trained
    record = json.loads((args.archive / "nft_s42.json").read_text())
    assert record["overrides"] == ttr.overrides("nft", ttr.WORLDS["compose"]) and record["jobs"] == 2
    assert [p["iteration"] for p in record["points"]] == [0, 10, 20] and record["points"][1]["seconds"] == 100.0

    # the next session: no run folders, the same report from the archive alone
    shutil.rmtree(args.out)
    for name in args.configs:
        assert ttr.run(name, 42, args) is None
    assert not trained and ttr.summarise(args) == from_runs

    # other settings (here: one run at a time) are not taken from the archive; the run trains, and
    # the record of the two-at-a-time run stays as it was
    args.jobs = 1
    assert ttr.archived_points("nft", 42, args) is None
    ttr.run("nft", 42, args)
    assert len(trained) == 1 and json.loads((args.archive / "nft_s42.json").read_text()) == record
    args.jobs, args.regime_sha256 = 2, "0" * 64
    assert ttr.archived_points("nft", 42, args) is None

    # a finished folder made with other settings (lr) is retrained, not archived as this run
    args.regime_sha256, args.archive = ttr.regime_sha256(ttr.WORLDS["compose"]), tmp_path / "archive2"
    _fake_ttr_run(ttr, "nft", args, 0.12, train__lr=1e-3)
    ttr.run("nft", 42, args)
    assert len(trained) == 2 and not (args.archive / "nft_s42.json").exists()


def test_time_to_reward_report_only_trains_nothing_and_names_the_runs_still_missing(ttr, tmp_path, monkeypatch):
    """`--report-only` between sessions: the report holds the finished runs (archive or folder),
    pairs each config with the baseline on the seeds both have, names each missing run, and does
    not judge the bar of a config that lacks an asked seed. A seed the baseline never reached
    counts for a config that reached within half its whole run; one neither reached, or a ratio
    above 0.5, fails the half-time test. The same report comes from the archive alone; without
    --report-only a missing run is an error, never a silent gap."""
    import argparse
    import shutil

    args = argparse.Namespace(world="compose", out=tmp_path / "runs", archive=tmp_path / "archive", iterations=20,
                              eval_every=10, jobs=2, smoke=False,
                              regime_sha256=ttr.regime_sha256(ttr.WORLDS["compose"]))
    _fake_ttr_run(ttr, "flow_grpo", args, 0.06, seed=42)
    _fake_ttr_run(ttr, "flow_grpo", args, 0.04, seed=43)  # +0.08 after 20 iterations: never reaches +0.10
    _fake_ttr_run(ttr, "nft", args, 0.12, seed=42)
    _fake_ttr_run(ttr, "awm", args, 0.06, seed=42)  # flow_grpo's own pace on 42
    _fake_ttr_run(ttr, "awm", args, 0.04, seed=43)  # neither reached on 43
    for seed in (42, 43):
        _fake_ttr_run(ttr, "dgpo", args, 0.12, seed=seed)
    (args.out / "nft_s43").mkdir()  # a run stopped before it wrote anything
    real_run = subprocess.run
    monkeypatch.setattr(ttr.subprocess, "run", lambda cmd, **kw: pytest.fail(f"trained: {cmd}") if "train" in cmd
                        else real_run(cmd, **kw))
    out = args.out
    argv = ["--world", "compose", "--report-only", "--seed-list", "42,43", "--configs", "flow_grpo", "nft", "gcpo",
            "dgpo", "awm", "--archive", str(args.archive), "--iterations", "20", "--out", str(out)]
    assert ttr.main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert not args.archive.exists()  # a report archives nothing
    assert report["missing"] == {"nft": [43], "gcpo": [42, 43]}
    nft = report["configs"]["nft"]
    assert nft["reached"] == "1/1" and nft["time_ratio_per_seed"] == {"42": 0.5}
    assert nft["bar"]["complete"] is False and nft["bar"]["met"] is False
    assert report["configs"]["flow_grpo"]["reached"] == "1/2" and report["configs"]["gcpo"]["reached"] == "0/0"
    # dgpo: half of flow_grpo's time on seed 42; on 43 flow_grpo's whole run (200 s) was twice dgpo's time
    dgpo = report["configs"]["dgpo"]
    assert dgpo["time_ratio_bounds"] == {"42": ["=", 0.5], "43": ["<", 0.5]} and dgpo["time_ratio"]["n"] == 1
    # its bar is met: flow_grpo's time interval counts seed 43 at its whole run (200 s), above dgpo's 100 s
    assert dgpo["bar"] == {"half_time_every_seed": True, "intervals_apart": True, "clip_no_worse": True,
                           "complete": True, "met": True}
    assert report["configs"]["flow_grpo"]["seconds_censored_low"]["mean"] == 200.0
    awm = report["configs"]["awm"]
    assert awm["time_ratio_bounds"] == {"42": ["=", 1.0], "43": None} and awm["bar"]["half_time_every_seed"] is False
    assert "| 1.00 (n=1); neither reached on s43 |" in (out / "report.md").read_text()
    assert "| 0.50 (n=1); < 0.50 (s43) |" in (out / "report.md").read_text()
    # finals paired by seed: 0.64 against flow_grpo's 0.52 and 0.48
    assert dgpo["final_vs_baseline"]["n"] == 2 and dgpo["final_vs_baseline"]["mean"] == pytest.approx(0.14)
    assert nft["final_vs_baseline"]["n"] == 1  # its seed 43 is missing
    text = (out / "report.md").read_text()
    assert "| nft |" in text and "not judged (seeds missing)" in text
    assert "- nft: seed(s) 43 not run yet; left out, never imputed" in text
    assert "- gcpo: seed(s) 42, 43 not run yet" in text
    assert (out / "time_to_reward.png").stat().st_size > 10_000  # the several-seed chart, gcpo (no runs) left out
    assert "| gcpo |" in text and text.split("| gcpo |")[1].split("\n")[0].count("n/a") >= 6  # no run: n/a, not "not reached"

    # the next session: the runs archived, their folders gone, the same report
    for name, seed in (("flow_grpo", 42), ("flow_grpo", 43), ("nft", 42), ("awm", 42), ("awm", 43), ("dgpo", 42),
                       ("dgpo", 43)):
        assert ttr.run(name, seed, args) is not None  # finished as asked: archived, not trained
    shutil.rmtree(out)
    assert ttr.main(argv) == 0
    assert json.loads((out / "report.json").read_text()) == report

    # without --report-only every asked run is made (or taken) first; one that still is not there
    # stops the report instead of leaving a silent gap
    args.report_only, args.seed_values, args.configs = False, [42, 43], ["flow_grpo", "nft"]
    args.target_rise = 0.10
    with pytest.raises(SystemExit, match="nft seed 43: neither the archive nor .* holds a finished run"):
        ttr.summarise(args)


def test_the_documented_compose_table_is_the_archives_report(ttr, tmp_path):
    """docs/benchmarks.md's time-to-reward table on the compositional world is what the documented
    `--report-only` command writes from the committed archive (seeds as the prose says), cell for cell."""
    doc = (REPO / "docs" / "benchmarks.md").read_text()
    command = "python benchmarks/time_to_reward.py --world compose --report-only --out runs/ttr_compose_report"
    assert command in doc and "`--report-only` command above (its default `--seeds 5`: seeds 42-46)" in doc
    assert ttr.main([*command.split()[2:], "--out", str(tmp_path)]) == 0
    table = (tmp_path / "report.md").read_text().strip().split("\n\n", 1)[1]
    assert table.split("\n\n")[0] in doc  # the table itself
    assert "missing" not in json.loads((tmp_path / "report.json").read_text())


def test_docs_study_md_is_the_archives_report(study, tmp_path, flowrl_cli, monkeypatch):
    """docs/study.md is what `python benchmarks/study.py --world compose --report-only` writes from
    the committed archive, word for word: a batch added to the archive without the page written
    again (or a page edited by hand) fails here."""
    _flowrl_in_process(study, flowrl_cli, monkeypatch)
    study.main(["--world", "compose", "--report-only", "--sweep-dir", str(tmp_path / "no_sweep"),
                "--out", str(tmp_path / "out")])
    written = (tmp_path / "out" / "study.md").read_text()
    assert written == (REPO / "docs" / "study.md").read_text()


def test_the_regime_hash_is_the_same_in_any_checkout(ttr, tmp_path, monkeypatch):
    """The archive serves every clone: the recipe resolves to absolute paths (prompts, profile),
    which the hash takes relative to the checkout (a clean clone once found no archived run)."""
    import shutil

    here = ttr.regime_sha256(ttr.WORLDS["compose"])
    shutil.copytree(REPO / "recipes", tmp_path / "elsewhere" / "recipes")
    monkeypatch.setattr(ttr, "REPO", tmp_path / "elsewhere")
    assert ttr.regime_sha256(ttr.WORLDS["compose"]) == here
    # and a changed value still changes it
    recipe = tmp_path / "elsewhere" / ttr.WORLDS["compose"].recipe
    recipe.write_text(recipe.read_text().replace("num_eval = 96", "num_eval = 95"))
    assert ttr.regime_sha256(ttr.WORLDS["compose"]) != here
    # a setting added since, at its neutral default, leaves it alone; at another value it counts
    recipe.write_text(recipe.read_text().replace("num_eval = 95", "num_eval = 96"))
    assert ttr.regime_sha256(ttr.WORLDS["compose"]) == here
    recipe.write_text(recipe.read_text().replace("[log]\n", "[log]\nkl_every = 10\n", 1))
    assert "kl_every = 10" in recipe.read_text() and ttr.regime_sha256(ttr.WORLDS["compose"]) != here
    # every archived record carries this regime
    records = list((REPO / "benchmarks/results/time_to_reward_compose").glob("*.json"))
    assert records and {json.loads(r.read_text())["regime_sha256"] for r in records} == {here}


def test_time_to_reward_ratio_keeps_censored_seeds_as_bounds(ttr):
    """A seed where only one of the pair reached the target is a bound on the ratio, not a gap:
    the config's time over the baseline's whole run (the baseline would need more) and the
    reverse; the half-time bar counts a bound below 0.5 and never one above."""
    hit = lambda t, total=500.0: {"reached": True, "seconds": t, "total_seconds": total}  # noqa: E731
    miss = lambda total: {"reached": False, "seconds": None, "total_seconds": total}  # noqa: E731
    assert ttr.ratio_bound(hit(100.0), hit(400.0)) == ("=", 0.25)
    assert ttr.ratio_bound(hit(100.0), miss(800.0)) == ("<", 0.125)
    assert ttr.ratio_bound(miss(300.0), hit(150.0)) == (">", 2.0)
    assert ttr.ratio_bound(miss(300.0), miss(800.0)) is None
    text = ttr.fmt_bounds({42: ("=", 0.25), 43: ("<", 0.125), 44: None})
    assert text == "; < 0.12 (s43); neither reached on s44"


def test_an_interrupted_study_batch_archives_only_its_finished_seeds(study, tmp_path, flowrl_cli, monkeypatch):
    """A sweep stopped during its last seed: that seed is left out whole (never half its variants),
    and its unfinished run gets no GenEval table."""
    sweep = _fake_study_sweep(study, tmp_path / "a", [42, 43])
    manifest = json.loads((sweep / "sweep.json").read_text())
    for r in manifest["runs"]:
        if r["id"] == "dynamics_seed43":
            r["status"] = "running"
    (sweep / "sweep.json").write_text(json.dumps(manifest))
    (sweep / "geneval" / "dynamics_seed43.json").unlink()
    archive = tmp_path / "archive"
    text = _report(study, flowrl_cli, monkeypatch, sweep, archive, tmp_path / "out", [42, 43])
    assert [b["seeds"] for b in json.loads((archive / "sweep.json").read_text())["batches"]] == [[42]]
    assert not (archive / study.ARCHIVED_RUNS / "step_seed43").exists() and not (sweep / "geneval" / "dynamics_seed43.json").exists()
    assert "7 runs (7 variants x 1 seed: 42)" in text and "no interval yet (fewer than 2 seeds)" in text


def test_a_new_study_batch_runs_only_unarchived_seeds_and_refuses_another_regime_first(study, tmp_path, flowrl_cli,
                                                                                       monkeypatch):
    """The default command of a later session skips the archived seeds; a batch under another
    regime is refused before any run; a sweep that fails still archives its finished seeds, writes
    the report, and exits non-zero."""
    archive, out = tmp_path / "archive", tmp_path / "out"
    _report(study, flowrl_cli, monkeypatch, _fake_study_sweep(study, tmp_path / "a", [42, 43]), archive, out, [42, 43])
    sweeps = _fake_sweeps(study, tmp_path, monkeypatch, failing_seed=47)
    common = ["--world", "compose", "--archive", str(archive), "--out", str(out)]
    study.main([*common, "--seeds", "4", "--sweep-dir", str(tmp_path / "b")])
    assert sweeps == [[44, 45]]
    manifest = json.loads((archive / "sweep.json").read_text())
    assert [b["seeds"] for b in manifest["batches"]] == [[42, 43], [44, 45]]
    assert manifest["batches"][1]["runs_wall_s"] == 2 * len(study.VARIANTS) * 100.0

    with pytest.raises(SystemExit, match="differs from the study archived .* in sets"):
        study.main([*common, "--seed-list", "46", "--set", "train.lr=1e-4", "--sweep-dir", str(tmp_path / "c")])
    assert sweeps == [[44, 45]] and not (tmp_path / "c" / "sweep.json").exists()
    # on a GPU machine ("auto" reaches CUDA) a batch for the CPU study is refused before any run
    with monkeypatch.context() as on_gpu:
        on_gpu.setattr(study, "runs_device", lambda name: "cuda (NVIDIA H200)")
        with pytest.raises(SystemExit, match=r"would compute on cuda \(NVIDIA H200\), the study archived .* on cpu"):
            study.main([*common, "--seed-list", "46", "--sweep-dir", str(tmp_path / "g")])
    assert sweeps == [[44, 45]] and not (tmp_path / "g" / "sweep.json").exists()

    with pytest.raises(SystemExit, match="flowrl sweep exited with 1"):
        study.main([*common, "--seed-list", "46,47", "--sweep-dir", str(tmp_path / "d")])
    manifest = json.loads((archive / "sweep.json").read_text())
    assert [b["seeds"] for b in manifest["batches"]] == [[42, 43], [44, 45], [46]]
    assert "35 runs (7 variants x 5 seeds: 42, 43, 44, 45, 46)" in " ".join((out / "study.md").read_text().split())


def test_each_study_batch_has_its_own_default_sweep_and_another_batchs_sweep_is_refused(study, tmp_path,
                                                                                       flowrl_cli, monkeypatch):
    """A later batch on a machine whose runs/ still holds the last batch's sweep starts its own
    (the default directory is named by its seeds) instead of failing on the old one; the same
    seeds resume their sweep, also after some of them were archived; a --sweep-dir that holds
    another batch is refused before any run, saying how to go on."""
    compose = study.WORLDS["compose"]
    assert study.batch_sweep_dir(compose, [42, 43, 44, 45]) == "runs/study_compose_seeds_42-45"
    assert study.batch_sweep_dir(compose, [46, 47]) == "runs/study_compose_seeds_46-47"
    assert study.batch_sweep_dir(compose, [46, 49]) == "runs/study_compose_seeds_46_49"
    assert study.batch_sweep_dir(compose, [50]) == "runs/study_compose_seeds_50"
    assert study.batch_sweep_dir(study.WORLDS["shapes"], [42, 43]) == "runs/study"  # one sweep, no archive

    archive, out = tmp_path / "archive", tmp_path / "out"
    _report(study, flowrl_cli, monkeypatch, _fake_study_sweep(study, tmp_path / "a", [42, 43]), archive, out, [42, 43])
    sweeps = _fake_sweeps(study, tmp_path, monkeypatch)
    common = ["--world", "compose", "--archive", str(archive), "--out", str(out)]
    old = tmp_path / "a" / "sweep"  # holds seeds 42 and 43, archived
    with pytest.raises(SystemExit, match=r"holds the sweep of seeds \[42, 43\], and this batch asks for \[44, 45\]: "
                                         r"give the same seeds to resume it, or another --sweep-dir .*seeds_44-45"):
        study.main([*common, "--seed-list", "44,45", "--sweep-dir", str(old)])
    assert sweeps == []

    # --seeds 4 asks for 42-45 and runs 44 and 45; the same command again resumes that sweep. What
    # ran beside a batch is kept with it and shown in the batch table
    note = "the slow test lane beside the first runs"
    study.main([*common, "--seeds", "4", "--sweep-dir", str(tmp_path / "b"), "--batch-note", note])
    study.main([*common, "--seeds", "4", "--sweep-dir", str(tmp_path / "b")])
    assert sweeps == [[44, 45], [44, 45]]
    batches = json.loads((archive / "sweep.json").read_text())["batches"]
    assert [b["seeds"] for b in batches] == [[42, 43], [44, 45]] and batches[1]["note"] == note
    table = (out / "study.md").read_text()
    assert "| load beside the runs |" in table and f"| 2 | 23.3 | {note} |" in table and "| not recorded |" in table


def test_a_batch_note_is_amended_after_its_runs_and_the_report_shows_it(study, tmp_path, flowrl_cli, monkeypatch):
    """What ran beside a batch is known for sure only once it has ended: --amend-note sets the
    note of the archived batch of exactly --seed-list and writes the report, running nothing; a
    batch that is not archived is refused, naming the ones that are."""
    archive, out = tmp_path / "archive", tmp_path / "out"
    _report(study, flowrl_cli, monkeypatch, _fake_study_sweep(study, tmp_path / "a", [42, 43]), archive, out, [42, 43])
    sweeps = _fake_sweeps(study, tmp_path, monkeypatch)
    common = ["--world", "compose", "--archive", str(archive), "--out", str(out)]
    (out / "study.md").unlink()
    note = "a clean-clone CI run beside the last runs"
    study.main([*common, "--amend-note", "--seed-list", "42,43", "--batch-note", note])
    assert sweeps == []
    manifest = json.loads((archive / "sweep.json").read_text())
    assert [b.get("note") for b in manifest["batches"]] == [note]
    assert f"| {note} |" in (out / "study.md").read_text()
    assert manifest["batches"][0]["regime"] == "regimes/seeds_42-43.json"
    assert (archive / manifest["batches"][0]["regime"]).is_file()
    with pytest.raises(SystemExit, match=r"no archived batch holds exactly the seeds \[42\]; the batches are 42,43"):
        study.main([*common, "--amend-note", "--seed-list", "42", "--batch-note", note])
    with pytest.raises(SystemExit, match="give --world compose, the batch's seeds"):
        study.main([*common, "--amend-note", "--seed-list", "42,43"])
    assert study.seeds_label([48]) == "48" and study.seeds_label([46, 47]) == "46-47"
    assert study.seeds_label([46, 49]) == "46_49"


def test_the_report_says_how_many_seeds_the_bar_needs_when_an_interval_is_too_wide(study, tmp_path, flowrl_cli,
                                                                                  monkeypatch):
    """A claim whose paired differences spread: its half-width is reported against 0.02 with the
    seeds that spread would need (the t quantile's own count, flowrl.stats.seeds_for_half_width)."""
    from flowrl.stats import paired_interval, seeds_for_half_width

    seeds = [42, 43, 44, 45]
    sweep = _fake_study_sweep(study, tmp_path / "a", seeds, jitter=0.04)
    text = _report(study, flowrl_cli, monkeypatch, sweep, tmp_path / "archive", tmp_path / "out", seeds)
    # chunks_8_8 (v = 2) against dynamics (v = 5) and gspo_16 (v = 1): differences -0.01 -+ 0.04 / 0.01 +- 0.04
    iv = paired_interval({s: 0.05 for s in seeds}, {s: 0.02 + 0.04 * (1 if s % 2 == 0 else -1) for s in seeds})
    needed = seeds_for_half_width(iv.sd, 0.02)
    assert f"final checkpoints' GenEval table: widest paired half-width {iv.half_width:.3f}" in text
    assert f"**wider than 0.02**: if the per-seed spread of the differences stays as measured (largest sd {iv.sd:.3f}), " \
           f"about {needed} seeds bring every one to 0.02" in text
    assert needed > 4


@pytest.mark.parametrize("archive", ["benchmarks/results/study_compose", "benchmarks/results/time_to_reward_compose"])
def test_git_keeps_every_file_of_the_committed_archives(archive):
    """The archives exist to outlive `runs/`, which the repository ignores wherever it appears: no
    archived file may fall under an ignore rule (the study's run records once did)."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    files = [str(p.relative_to(REPO)) for p in (REPO / archive).rglob("*") if p.is_file()]
    assert files, f"{archive} is empty"
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *files], cwd=REPO, capture_output=True, text=True)
    assert ignored.stdout == "", f"ignored by git: {ignored.stdout.split()[:5]}"
