"""`flowrl eval RUN_DIR` evaluates exactly the prompts the run evaluated.

The run's prompts are a CSV whose prompt column is not called ``prompt`` and whose rows carry a
split: training reads the ``train`` rows, evaluation the held-out ``test`` rows. ``flowrl eval``
used to read the table through its own copy of the evaluation set, scoring every row (or failing
with "no column 'prompt'"); it now takes the run's own (flowrl.train.evaluate.evaluation_set).
One iteration of the randomly initialised embedded model keeps it cheap.
"""

from __future__ import annotations

import csv
import json

import pytest
from tiny_recipe import CLI, tiny_recipe

from flowrl.recipe import load_recipe
from flowrl.runlog import read_metrics

TRAIN_ROWS = [f"a {c} {s} on a white background" for c, s in
              [("red", "circle"), ("blue", "square"), ("green", "triangle"), ("red", "square"), ("blue", "triangle")]]
HELD_OUT_ROWS = [f"a {c} {s} on a black background" for c, s in
                 [("blue", "circle"), ("green", "square"), ("red", "triangle"), ("green", "circle")]]

RECIPE = tiny_recipe(CLI, run={"name": "split_eval", "seed": 3},
                     prompts={"source": "prompts.csv", "text_column": "caption", "split_column": "part", "num_eval": 3})


@pytest.fixture(scope="module")
def split_run(tmp_path_factory):
    from flowrl.train import train

    root = tmp_path_factory.mktemp("split_eval")
    with (root / "prompts.csv").open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, ["caption", "part"])
        writer.writeheader()
        rows = [{"caption": p, "part": "train"} for p in TRAIN_ROWS]
        rows += [{"caption": p, "part": "test"} for p in HELD_OUT_ROWS]
        writer.writerows(sorted(rows, key=lambda r: r["caption"]))  # the splits interleaved
    (root / "recipe.toml").write_text(RECIPE, encoding="utf-8")
    recipe = load_recipe(root / "recipe.toml", [f"run.output_dir={json.dumps(str(root / 'run'))}"])
    from rich.console import Console

    return train(recipe, console=Console(file=open(root / "console.txt", "w"), width=200))


def test_eval_of_a_run_scores_exactly_its_held_out_evaluation_prompts(split_run, flowrl_cli):
    from flowrl.train.evaluate import evaluation_set

    run = split_run
    (evaluated,) = flowrl_cli.in_process([["eval", str(run)]])
    assert evaluated.returncode == 0, evaluated.stderr
    result = json.loads((run / "checkpoints" / "iter_000001.eval.json").read_text())
    assert result["settings"]["protocol"] == "run" and result["settings"]["num_prompts"] == 3
    prompts = [r["prompt"] for r in result["per_image"]]
    # held-out rows only, never a training row, and the very prompts the run's evaluation drew
    assert len(set(prompts)) == 3 and set(prompts) <= set(HELD_OUT_ROWS), prompts
    recipe = load_recipe(run / "recipe.toml")
    assert prompts == list(map(str, evaluation_set(recipe, None)))
    # and the same images: the score the run logged at its final evaluation
    final = [row for row in read_metrics(run) if row.get("final")]
    assert len(final) == 1
    assert result["rewards"]["area"]["mean"] == pytest.approx(final[0]["eval/area/mean"], rel=1e-6, abs=1e-7)
