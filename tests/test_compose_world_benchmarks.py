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

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.runlog import read_metrics

REPO = Path(__file__).resolve().parents[1]


def _bench(name: str):
    path = REPO / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"flowrl_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


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
    assert (out / "time_to_reward.png").is_file()
    rows = read_metrics(out / "gcpo_s42")
    assert str(next(r["chunk_sizes"] for r in rows if "chunk_sizes" in r)).replace(" ", "") == ttr.WORLDS["compose"].dyn


@pytest.mark.slow
def test_study_compose_smoke(study, tmp_path, flowrl_cli):
    done = subprocess.run([sys.executable, "benchmarks/study.py", "--world", "compose", "--smoke", "--seeds", "1",
                           "--jobs", "1", "--sweep-dir", str(tmp_path / "sweep"), "--out", str(tmp_path / "out")],
                          cwd=REPO, env=flowrl_cli.env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = (tmp_path / "out" / "study_compose.md").read_text()
    assert "SMOKE REHEARSAL: not a result." in text
    assert "## GenEval per category, final checkpoints" in text and "| color_attr | overall |" in text
    assert "clip fraction" in text
    regime = json.loads((tmp_path / "sweep" / "regime.json").read_text())
    assert regime["recipe"] == "recipes/study_compose.toml" and "recipes/profiles/compose_window16.json" in regime["profiles"]
    tables = sorted(p.name for p in (tmp_path / "sweep" / "geneval").glob("*.json"))
    assert len(tables) == 1 + len(study.VARIANTS) and "base.json" in tables
