"""A resumed run reads the files its run started with (flowrl.train.inputs): the recipe holds
only their paths, so a prompt table edited between the stop and the resume used to change every
later batch without a word. Now the run records their sha256 in RUN_DIR/inputs.json, and a
resume whose files changed is one message naming the key and the file."""

from __future__ import annotations

import json
import shutil

from engine_helpers import REPO, load, quiet_console
from tiny_recipe import write_recipe

from flowrl.train import train
from flowrl.train.inputs import INPUTS_FILE, input_files


def test_a_resume_whose_prompt_table_changed_is_refused_and_resumes_once_restored(tmp_path, flowrl_cli):
    table = tmp_path / "prompts.csv"
    shutil.copy(REPO / "recipes" / "prompts" / "shapes.csv", table)
    recipe_path = write_recipe(tmp_path)
    sets = [f"prompts.source={str(table)!r}", "prompts.split_column='split'", "checkpoint.every=1",
            f"run.output_dir={str(tmp_path / 'run')!r}", "train.iterations=1"]
    recipe = load(recipe_path, *sets)
    assert set(input_files(recipe)) == {"prompts.source"}
    run = train(recipe, console=quiet_console())
    record = json.loads((run / INPUTS_FILE).read_text())
    assert record["prompts.source"]["path"] == str(table) and len(record["prompts.source"]["sha256"]) == 64

    original, rows = table.read_bytes(), (run / "metrics.jsonl").read_text()
    table.write_bytes(original + b"a blue square on red,train\n")  # one more training prompt
    resume = ["train", str(run / "recipe.toml"), "--resume", str(run), "--set", "train.iterations=2"]
    (refused,) = flowrl_cli.in_process([resume], cwd=tmp_path)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    flat = " ".join(refused.stderr.split())
    assert "1 file(s) the run started with changed since: prompts.source" in flat and str(table) in flat
    assert (run / "metrics.jsonl").read_text() == rows  # nothing written

    table.write_bytes(original)
    (resumed,) = flowrl_cli.in_process([resume], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((run / INPUTS_FILE).read_text()) == record  # the record of the run's start, kept
