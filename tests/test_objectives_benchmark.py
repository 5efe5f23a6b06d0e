"""benchmarks/objectives.py compares what its docstring says it compares.

Its hacking comparison once named ``quickstart`` as the hacking baseline; when the quickstart
became EPG on prompt correctness, ``objectives.py hacking`` silently compared GARDO against a
run that does not hack. These checks read the recipes, so a renamed or retargeted recipe fails
here instead of in a results file.
"""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import pytest
from script_modules import benchmark_module

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    yield benchmark_module("objectives")
    sys.modules.pop("flowrl_bench_objectives", None)


def _recipe(name: str) -> dict:
    return tomllib.loads((REPO / "recipes" / f"{name}.toml").read_text(encoding="utf-8"))


def test_the_hacking_runs_differ_from_their_baseline_only_in_the_objective(bench):
    baseline, *methods = bench.HACKING
    base = _recipe(baseline)
    assert base["rewards"][0]["use"] == "area" and base["rewards"][0].get("weight", 1.0) > 0  # the gameable reward
    assert {r["use"]: r.get("weight", 1.0) for r in base["rewards"]}.get("verifier") == 0  # the judge, logged
    for name in methods:
        other = _recipe(name)
        differing = {k for k in base.keys() | other.keys() if k != "run" and base.get(k) != other.get(k)}
        assert differing <= {"loss", "advantage"}, (name, differing)


def test_the_stored_hacking_results_name_the_benchmarks_recipes(bench):
    stored = json.loads((REPO / "benchmarks" / "results" / "objectives_hacking.json").read_text(encoding="utf-8"))
    assert list(stored) == bench.HACKING


def test_every_recipe_the_learn_benchmark_names_exists_and_optimises_a_reward(bench):
    for name in bench.LEARN:
        main, second = bench.judges(name)
        assert main != second, name
