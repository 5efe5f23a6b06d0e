"""The README's quickstart: what it says about the recipe is what the recipe does, and every
command it shows runs as written (on a 2-iteration run of the quickstart, in a scratch
directory). The 60-iteration run itself and its figures are measured, not re-run here: see the
README's table."""

from __future__ import annotations

import pytest

import csv
import re
import subprocess
import sys
from pathlib import Path

from flowrl.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
SECTION = README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
FLAT = " ".join(SECTION.split())


def test_the_readme_describes_the_shipped_quickstart_recipe():
    recipe = load_recipe(REPO / "recipes" / "quickstart.toml")
    t = recipe.train
    assert f"{t.iterations} iterations of {t.prompts_per_iteration} prompts x {t.group_size} samples with EPG on the final image's ELBO" in FLAT
    assert recipe.components["loss"].use == "epg" and recipe.components["likelihood"].use == "elbo"
    assert f"{recipe.sampler.steps}-step ODE rollouts" in FLAT and f"ELBO at {recipe.components['likelihood'].params.timesteps} forward-noised" in FLAT
    assert f"lr {t.lr:g}".replace("e-05", "e-5") in FLAT
    assert [r.use for r in recipe.rewards if r.weight] == ["verifier"]
    assert {r.use for r in recipe.rewards if not r.weight} == {"embedded_clip", "area"}
    rows = list(csv.DictReader((REPO / "recipes" / "prompts" / "shapes.csv").open(encoding="utf-8")))
    held_out = [r["prompt"] for r in rows if r["split"] == recipe.prompts.eval_split]
    trained = [r["prompt"] for r in rows if r["split"] == recipe.prompts.train_split]
    assert (len(trained), len(held_out)) == (72, 18) and not set(trained) & set(held_out)
    assert recipe.prompts.num_eval == len(held_out) and f"{recipe.prompts.eval_seeds} noises each" in FLAT
    assert f"evaluates, every {recipe.log.eval_every} iterations" in FLAT


@pytest.mark.slow
def test_every_quickstart_command_runs_as_written(tmp_path, flowrl_cli):
    commands = re.findall(r"`(flowrl [^`]+)`", SECTION) + re.findall(r"\.venv/bin/(flowrl train \S+)", SECTION)
    # each once, in order; a bare `flowrl plot` in the prose names a command, it is not one to run
    commands = [c for c in dict.fromkeys(commands) if "/" in c]
    (tmp_path / "recipes").symlink_to(REPO / "recipes")
    trains = sorted({c for c in commands if c.split()[1] == "train"})
    assert trains == ["flowrl train recipes/compose_nft.toml", "flowrl train recipes/quickstart.toml",
                      "flowrl train recipes/quickstart_hacking.toml"]
    shorter = ["--set", "train.iterations=2", "--set", "prompts.eval_seeds=1", "--set", "log.progress=false"]
    calls = [c.split()[1:] + shorter for c in trains]
    calls += [c.split()[1:] for c in commands if c.split()[1] != "train"]
    assert sorted(c[0] for c in calls[3:]) == ["diagnose", "diagnose", "plot", "sample"]  # both runs diagnosed
    results = flowrl_cli.in_process(calls, cwd=tmp_path)
    for r in results:
        assert r.returncode == 0 and "Traceback" not in r.stderr, (r.argv, r.stderr[-2000:])
    assert (tmp_path / "runs" / "quickstart" / "images" / "eval" / "evolution.png").is_file()
    assert (tmp_path / "runs" / "quickstart" / "samples" / "iter_000002" / "compare.png").is_file()
    assert (tmp_path / "runs" / "quickstart" / "rewards.png").is_file()
    assert (tmp_path / "runs" / "quickstart_hacking" / "metrics.jsonl").is_file()
    assert (tmp_path / "runs" / "compose_nft" / "metrics.jsonl").is_file()

    # the script behind the README's paragraph on the triangles' foot (fewer noises than its default)
    assert "python benchmarks/triangle_foot.py" in FLAT
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "triangle_foot.py"), "--noises", "1",
                           "--checkpoint", str(tmp_path / "runs" / "quickstart" / "checkpoints" / "iter_000002")],
                          env=flowrl_cli.env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("rises on") == 15  # 5 feet x (ground truth, base model, checkpoint)
