"""`flowrl eval` never replaces a run's own evaluation with an ad-hoc one, and refuses a run
without a checkpoint.

``flowrl eval RUN_DIR --prompt ...`` used to overwrite ``<checkpoint>.eval.json`` (the run's own
evaluation, whose means equal what the run logged) with the scores of other prompts. A run
directory before its first checkpoint asked for ``-o`` and, given it, silently evaluated the base
model. One iteration of the randomly initialised embedded model keeps the run cheap.
"""

from __future__ import annotations

import json
import shutil

import pytest
from tiny_recipe import CLI, tiny_recipe

from flowrl.recipe import load_recipe

RECIPE = tiny_recipe(CLI, run={"name": "adhoc_eval", "seed": 5})

PROMPT = "a red circle on a blue background"


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, flowrl_cli):
    import os

    from rich.console import Console

    from flowrl.train import train

    root = tmp_path_factory.mktemp("adhoc_eval")
    (root / "recipe.toml").write_text(RECIPE, encoding="utf-8")
    recipe = load_recipe(root / "recipe.toml", [f"run.output_dir={json.dumps(str(root / 'run'))}"])
    run = train(recipe, console=Console(file=open(os.devnull, "w"), width=200))
    fresh = root / "fresh_run"  # a run directory before its first checkpoint
    fresh.mkdir()
    shutil.copy(run / "recipe.toml", fresh / "recipe.toml")
    calls = {
        "own": ["eval", str(run)],
        "adhoc_1": ["eval", str(run), "--prompt", PROMPT, "--seeds", "2"],
        "adhoc_2": ["eval", str(run), "--seed", "9"],
        "named": ["eval", str(run), "--prompt", PROMPT, "--name", "circle"],
        "fresh": ["eval", str(fresh)],
        "fresh_o": ["eval", str(fresh), "-o", str(root / "base.json")],
    }
    results = dict(zip(calls, flowrl_cli.batch(list(calls.values()), timeout=600)))
    return root, run, results


@pytest.mark.slow
def test_an_adhoc_evaluation_goes_to_a_new_file_and_says_where(evaluated):
    _, run, results = evaluated
    for name in ("own", "adhoc_1", "adhoc_2", "named"):
        assert results[name].returncode == 0, results[name].stderr
    checkpoints = run / "checkpoints"
    own = json.loads((checkpoints / "iter_000001.eval.json").read_text())
    # still the run's own evaluation after three other evaluations of the same checkpoint
    assert own["settings"]["protocol"] == "run" and own["settings"]["num_prompts"] == 2
    assert own["settings"]["seed"] == 5 and own["settings"]["seeds_per_prompt"] == 1
    first = json.loads((checkpoints / "iter_000001.adhoc-1.json").read_text())
    assert [r["prompt"] for r in first["per_image"]] == [PROMPT, PROMPT]
    second = json.loads((checkpoints / "iter_000001.adhoc-2.json").read_text())
    assert second["settings"]["seed"] == 9
    assert json.loads((checkpoints / "iter_000001.circle.json").read_text())["settings"]["protocol"] == "explicit"
    out = results["adhoc_1"].flat_out
    assert str(checkpoints / "iter_000001.adhoc-1.json") in out, out
    assert "ad-hoc evaluation (--prompt, --seeds)" in out and "iter_000001.eval.json" in out
    assert "ad-hoc" not in results["own"].flat_out


@pytest.mark.slow
def test_eval_says_that_plus_minus_is_a_standard_error(evaluated):
    _, _, results = evaluated
    out = results["own"].flat_out
    assert "mean +- standard error of the mean" in out and "area: " in out, out


@pytest.mark.slow
@pytest.mark.parametrize("call", ["fresh", "fresh_o"])
def test_a_run_without_a_checkpoint_is_refused_with_or_without_o(evaluated, call):
    root, _, results = evaluated
    r = results[call]
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert sum(line.startswith("error:") for line in r.stderr.splitlines()) == 1, r.stderr
    assert "has no checkpoint yet" in r.flat_err and "recipe.toml -o base_eval.json" in r.flat_err, r.flat_err
    assert not (root / "base.json").exists()  # the base model was not evaluated in the run's name
