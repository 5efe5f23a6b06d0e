"""Fixtures for the training tests, the tests of flowrl/train/ (helpers in engine_helpers.py, the
recipe in tests/tiny_recipe.py)."""

from __future__ import annotations

import pytest
from engine_helpers import load, quiet_console
from tiny_recipe import write_recipe

from flowrl.runlog import read_metrics


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """The uninterrupted 4-iteration run every resume test compares with."""
    from flowrl.train import train

    root = tmp_path_factory.mktemp("reference")
    recipe_path = write_recipe(root)
    run_dir = train(load(recipe_path, f"run.output_dir={str(root / 'run')!r}"), console=quiet_console())
    return recipe_path, run_dir, read_metrics(run_dir)
