"""``[run].name`` is one folder of the default output directory ``runs/{name}``: an empty name
made the run directory ``runs/`` itself, and ``x/../../etc`` one outside ``runs/``."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.errors import RecipeError
from flowrl.plugins import get_registry
from flowrl.recipe import read_toml, validate

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["", "  ", ".", "..", "x/../../etc", "/etc"])
def test_a_name_that_is_no_folder_name_is_refused(name):
    data = read_toml(REPO / "recipes" / "quickstart.toml")
    data["run"]["name"] = name
    with pytest.raises(RecipeError, match=r"\[run\]: name must be a folder name"):
        validate(data, registry=get_registry())


@pytest.mark.parametrize("name", ["quickstart", "my run", "lr-3e-4_seed42", "émile"])
def test_folder_names_pass(name):
    data = read_toml(REPO / "recipes" / "quickstart.toml")
    data["run"]["name"] = name
    assert validate(data, registry=get_registry()).output_dir == Path("runs") / name
