"""``flowrl sample --help`` names the output directory the command writes when no ``-o`` is given
(it once said ``samples/<name>`` while a recipe's or a ``--model``'s sample goes to
``runs/samples/<name>``). The help is derived from what :func:`default_output` uses, and this test
compares the two for each kind of source."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.commands.inference import Source
from flowrl.commands.sample import default_output


@pytest.fixture
def sample_help(flowrl_cli) -> str:
    """``flowrl sample --help`` with rich's line wrapping and box undone."""
    (result,) = flowrl_cli.in_process([["sample", "--help"]])
    assert result.returncode == 0, result.stdout + result.stderr
    return " ".join(result.stdout.replace("│", " ").split())


@pytest.mark.parametrize("label", ["quickstart.toml", "embedded"], ids=["recipe", "model"])
def test_the_help_names_where_a_recipe_or_model_sample_goes(label, sample_help):
    src = Source(recipe=None, from_recipe=label.endswith(".toml"), checkpoint=None, run_dir=None, label=label)
    written = default_output(src, "samples")
    assert written.name == ("embedded" if label == "embedded" else "quickstart")
    said = f"{written.parent.as_posix()}/<name>"
    assert said == "runs/samples/<name>"
    assert said in sample_help
    assert " samples/<name>" not in sample_help.replace(said, "")  # the old, wrong default is gone


def test_the_help_names_where_a_run_sample_goes(sample_help):
    src = Source(recipe=None, from_recipe=True, checkpoint=Path("RUN_DIR/checkpoints/iter_000002"),
                 run_dir=Path("RUN_DIR"), label="RUN_DIR/iter_000002")
    assert default_output(src, "samples") == Path("RUN_DIR/samples/iter_000002")
    assert "RUN_DIR/samples/<checkpoint>" in sample_help
