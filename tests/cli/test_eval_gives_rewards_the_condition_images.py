"""`flowrl eval RUN_DIR` of an image-editing run: every prompt carries a condition image, and a
reward that compares the edit with it (`condition_fidelity`) gets the images in its metadata, as
the run's own evaluation gives them. `flowrl eval` used to call the rewards without metadata, so
that reward refused every prompt ("needs every prompt to carry a condition image"). One
iteration of the randomly initialised embedded model keeps it cheap."""

from __future__ import annotations

import json

import pytest
from tiny_recipe import CLI, tiny_recipe

from flowrl.recipe import load_recipe
from flowrl.runlog import read_metrics

ROWS = [("a red circle on a blue background", "train"), ("a blue square on a green background", "train"),
        ("a green triangle on a red background", "test"), ("a red square on a white background", "test")]
RECIPE = tiny_recipe(CLI, run={"name": "edit_eval", "seed": 7},
                     prompts={"source": "edits.jsonl", "condition_column": "image", "split_column": "split"},
                     rewards=[{"use": "area"}, {"use": "condition_fidelity", "weight": 0.0}])


@pytest.fixture(scope="module")
def edit_run(tmp_path_factory):
    from PIL import Image
    from rich.console import Console

    from flowrl.train import train

    root = tmp_path_factory.mktemp("edit_eval")
    (root / "img").mkdir()
    rows = []
    for i, (prompt, split) in enumerate(ROWS):
        Image.new("RGB", (32, 32), (60 * i, 120, 200 - 40 * i)).save(root / "img" / f"{i}.png")
        rows.append(json.dumps({"prompt": prompt, "image": str(root / "img" / f"{i}.png"), "split": split}))
    (root / "edits.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    (root / "recipe.toml").write_text(RECIPE, encoding="utf-8")
    recipe = load_recipe(root / "recipe.toml", [f"run.output_dir={json.dumps(str(root / 'run'))}",
                                                f"prompts.source={json.dumps(str(root / 'edits.jsonl'))}"])
    return train(recipe, console=Console(file=open(root / "console.txt", "w"), width=200))


def test_eval_of_an_editing_run_scores_the_condition_reward_the_run_logged(edit_run, flowrl_cli):
    (evaluated,) = flowrl_cli.in_process([["eval", str(edit_run)]])
    assert evaluated.returncode == 0, evaluated.stdout + evaluated.stderr
    result = json.loads((edit_run / "checkpoints" / "iter_000001.eval.json").read_text())
    (final,) = [row for row in read_metrics(edit_run) if row.get("final")]
    for label in ("area", "condition_fidelity"):
        assert result["rewards"][label]["mean"] == pytest.approx(final[f"eval/{label}/mean"], rel=1e-6, abs=1e-7)
