"""`flowrl train` ends with the first and last evaluation, and prints no transformers loading bar.

A new user's trial: the end of training printed only "done: N iterations" and the plot command,
not the held-out first -> last evaluation the README's quickstart table is about; and every
command that loads the embedded CLIP judge (the quickstart, the compose recipe) printed
transformers' `Loading weights: 100%|...| 94/94` bar.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tiny_recipe import CLI, tiny_recipe

from flowrl.recipe import load_recipe
from flowrl.runlog import read_metrics

# the optimised reward listed second, after a logged one of weight 0
RECIPE = tiny_recipe(CLI, run={"name": "ends", "seed": 4}, model={"random_init": None},
                     prompts={"source": "model", "split_column": "", "num_eval": 2, "eval_seeds": 2},
                     rewards=[{"use": "area", "weight": 0.0}, {"use": "verifier"}, {"use": "embedded_clip", "weight": 0.0}],
                     log={"eval_every": 1})
LINE = re.compile(r"^  (\w+)\s+(\d\.\d{4}) ± (\d\.\d{4}) -> (\d\.\d{4}) ± (\d\.\d{4})\s+([+-]\d+\.\d) SE\s+\((optimised|not optimised)\)$")


def test_train_prints_the_first_and_last_evaluation_and_no_loading_bar(tmp_path, flowrl_cli):
    (tmp_path / "ends.toml").write_text(RECIPE)
    [result] = flowrl_cli.batch([["train", "ends.toml", "-o", "run"]], cwd=tmp_path, timeout=300)  # a fresh process
    assert result.returncode == 0, result.stderr
    assert "Loading weights" not in result.stderr + result.stdout  # embedded_clip was loaded (transformers' CLIP)
    lines = result.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("evaluation, iteration 0 -> 1"))
    assert "(2 prompts x 2 noises; mean ± standard error):" in lines[start]
    rows = [LINE.match(line) for line in lines[start + 1 : start + 4]]
    assert all(rows), lines[start:]
    assert [(m.group(1), m.group(7)) for m in rows] == [("verifier", "optimised"), ("area", "not optimised"),
                                                       ("embedded_clip", "not optimised")]
    metrics = read_metrics(tmp_path / "run")
    first, last = metrics[0], [m for m in metrics if "eval/verifier/mean" in m][-1]
    verifier = rows[0]
    assert float(verifier.group(2)) == round(first["eval/verifier/mean"], 4)
    assert float(verifier.group(4)) == round(last["eval/verifier/mean"], 4)
    spread = (first["eval/verifier/sem"] ** 2 + last["eval/verifier/sem"] ** 2) ** 0.5
    assert float(verifier.group(6)) == round((last["eval/verifier/mean"] - first["eval/verifier/mean"]) / spread, 1)


def test_a_held_out_split_is_named_and_one_evaluation_prints_nothing(tmp_path):
    from flowrl.commands.train import evaluation_summary

    quickstart = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "quickstart.toml")
    rows = [{"iteration": 0, "eval/verifier/mean": 0.8, "eval/verifier/sem": 0.03, "eval/verifier/cosine/mean": 1.0},
            {"iteration": 1, "loss": 0.1},
            {"iteration": 2, "eval/verifier/mean": 0.9, "eval/verifier/sem": 0.04}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = evaluation_summary(quickstart, tmp_path)
    noises = quickstart.prompts.eval_seeds
    assert summary[0].startswith(f"held-out evaluation, iteration 0 -> 2 (18 prompts x {noises} noises")
    assert summary[1:] == ["  verifier  0.8000 ± 0.0300 -> 0.9000 ± 0.0400  +2.0 SE  (optimised)"]
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert evaluation_summary(quickstart, tmp_path) == []


def test_only_the_loading_bar_is_hidden():
    """transformers' other bars (and its progress-bar switch) are untouched by flowrl's hook."""
    from transformers.utils import logging as transformers_logging

    from flowrl.compat import ensure_torchvision_importable

    ensure_torchvision_importable()
    was_enabled = transformers_logging.is_progress_bar_enabled()  # other tests in this process may turn bars off
    transformers_logging.enable_progress_bar()
    try:
        loading = transformers_logging.tqdm(range(3), desc="Loading weights")
        other = transformers_logging.tqdm(range(3), desc="Downloading", disable=True)
    finally:
        if not was_enabled:
            transformers_logging.disable_progress_bar()
    assert isinstance(loading, transformers_logging.EmptyTqdm) and list(loading) == [0, 1, 2]
    assert not isinstance(other, transformers_logging.EmptyTqdm) and list(other) == [0, 1, 2]
