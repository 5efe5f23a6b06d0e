"""`flowrl eval RUN_DIR` is the run's own evaluation, also when the run evaluated its EMA weights
(`[ema] evaluate = true`) and computed under bf16 autocast (`[distributed] mixed_precision =
"bf16"`): it scored the trained weights in float32 before, so its mean was not the logged one. One
iteration of the randomly initialised embedded model keeps it cheap."""

from __future__ import annotations

import json

import pytest
from tiny_recipe import CLI, tiny_recipe

from flowrl.recipe import load_recipe
from flowrl.runlog import read_metrics

RECIPE = tiny_recipe(CLI, run={"name": "ema_bf16_eval", "seed": 5}, train={"iterations": 2, "lr": 0.01},
                     ema={"enabled": True, "evaluate": True, "decay": 0.5},
                     distributed={"mixed_precision": "bf16"},
                     rewards=[{"use": "area"}, {"use": "verifier", "weight": 0.0}])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from rich.console import Console

    from flowrl.train import train

    root = tmp_path_factory.mktemp("ema_bf16_eval")
    (root / "recipe.toml").write_text(RECIPE, encoding="utf-8")
    recipe = load_recipe(root / "recipe.toml", [f"run.output_dir={json.dumps(str(root / 'run'))}",
                                                "train.on_policy_tolerance=1e-2"])
    return train(recipe, console=Console(file=open(root / "console.txt", "w"), width=200))


def test_eval_scores_the_ema_weights_in_the_runs_precision(run, flowrl_cli):
    (evaluated,) = flowrl_cli.in_process([["eval", str(run)]])
    assert evaluated.returncode == 0, evaluated.stdout + evaluated.stderr
    result = json.loads((run / "checkpoints" / "iter_000002.eval.json").read_text())
    assert result["settings"]["ema"] is True and result["settings"]["mixed_precision"] == "bf16"
    (final,) = [row for row in read_metrics(run) if row.get("final")]
    for label in ("area", "verifier"):
        assert result["rewards"][label]["mean"] == pytest.approx(final[f"eval/{label}/mean"], rel=1e-6, abs=1e-7)
