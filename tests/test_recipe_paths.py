"""Relative paths in a recipe resolve against the recipe file's directory.

Every key declared with ``param(..., path=...)`` (prompt files, profiles, weights, model
directories) is made absolute at load time, so a recipe means the same files from any current
directory, and the run's saved recipe records the absolute paths. ``--set`` values are relative
to the current directory (they are typed there). A path that only exists relative to the current
directory is refused with the fix.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tiny_recipe import tiny_recipe

from flowrl.config import fields_of
from flowrl.errors import RecipeError
from flowrl.plugins import get_registry
from flowrl.recipe import SECTIONS, load_recipe
from flowrl.runlog import read_metrics

REPO = Path(__file__).resolve().parents[1]

#: The tiny recipe with every kind of relative path: a profile, prompt files.
PATHS = {"run": {"name": "paths", "seed": None}, "model": {"random_init": None}, "sampler": {"steps": 17},
         "chunker": {"use": "dynamics", "size": None, "profile": "profiles/embedded.json"},
         "selector": {"use": "weighted", "fraction": 0.5, "profile": "profiles/embedded.json"},
         "train": {"iterations": 1, "micro_batch_size": 4},
         "prompts": {"source": "data/train.txt", "eval_source": "./data/eval.txt", "num_eval": 2}}
RECIPE = tiny_recipe(PATHS)


@pytest.fixture
def project(tmp_path):
    """A recipe in its own directory, with its prompt files and profile beside it."""
    home = tmp_path / "project"
    (home / "data").mkdir(parents=True)
    (home / "profiles").mkdir()
    shutil.copy(REPO / "recipes" / "profiles" / "embedded.json", home / "profiles" / "embedded.json")
    (home / "data" / "train.txt").write_text("a red circle on a blue background\na green square on a white background\n")
    (home / "data" / "eval.txt").write_text("a blue triangle on a black background\na red square on a white background\n")
    (home / "recipe.toml").write_text(RECIPE)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    return home, elsewhere


def test_paths_resolve_against_the_recipe_directory(project, monkeypatch):
    home, elsewhere = project
    monkeypatch.chdir(elsewhere)
    recipe = load_recipe(home / "recipe.toml")
    assert recipe.prompts.source == str(home / "data" / "train.txt")
    assert recipe.prompts.eval_source == str(home / "data" / "eval.txt")
    assert recipe.components["chunker"].params.profile == str(home / "profiles" / "embedded.json")
    assert recipe.components["selector"].params.profile == str(home / "profiles" / "embedded.json")
    saved = recipe.to_toml_dict()  # what the run directory records
    assert saved["prompts"]["source"] == str(home / "data" / "train.txt")
    # the same recipe loaded through a relative path from its own directory gives the same paths
    monkeypatch.chdir(home)
    assert load_recipe("recipe.toml").to_toml_dict()["prompts"] == saved["prompts"]


def test_words_empty_values_absolute_paths_and_hub_ids_stay(tmp_path):
    (tmp_path / "r.toml").write_text(
        '[prompts]\nsource = "model"\neval_source = ""\n[[rewards]]\nuse = "pickscore"\n'
        'model = "yuvalkirstain/PickScore_v1"\nprocessor = "/abs/processor"\n'
    )
    recipe = load_recipe(tmp_path / "r.toml")
    assert recipe.prompts.source == "model" and recipe.prompts.eval_source == ""
    params = recipe.rewards[0].params
    assert params.model == "yuvalkirstain/PickScore_v1" and params.processor == "/abs/processor"


def test_a_hub_style_value_that_is_a_directory_beside_the_recipe_is_a_path(tmp_path):
    (tmp_path / "org" / "clip").mkdir(parents=True)
    (tmp_path / "r.toml").write_text('[[rewards]]\nuse = "pickscore"\nmodel = "org/clip"\nprocessor = "./proc"\n')
    params = load_recipe(tmp_path / "r.toml").rewards[0].params
    assert params.model == str(tmp_path / "org" / "clip")  # exists beside the recipe
    assert params.processor == str(tmp_path / "proc")  # explicitly relative


def test_set_overrides_are_relative_to_the_current_directory(project, monkeypatch):
    home, elsewhere = project
    (elsewhere / "mine.txt").write_text("a red circle on a blue background\n")
    monkeypatch.chdir(elsewhere)
    recipe = load_recipe(home / "recipe.toml", ["prompts.source=mine.txt"])
    assert recipe.prompts.source == str(elsewhere / "mine.txt")
    assert recipe.prompts.eval_source == str(home / "data" / "eval.txt")  # untouched: from the file


def test_a_path_that_exists_only_from_the_current_directory_is_refused(project, monkeypatch):
    home, elsewhere = project
    (elsewhere / "cwd_only.txt").write_text("a red circle on a blue background\n")
    (home / "recipe.toml").write_text(tiny_recipe(PATHS, prompts={"source": "cwd_only.txt"}))
    monkeypatch.chdir(elsewhere)
    with pytest.raises(RecipeError) as info:
        load_recipe(home / "recipe.toml")
    text = info.value.format()
    assert "prompts.source" in text and "relative to the recipe file" in text
    assert "does not exist relative to the recipe's directory" in text and "../elsewhere/cwd_only.txt" in text


def test_every_documented_path_key_is_declared_a_path():
    """Keys whose documentation speaks of a file, directory or path are path keys (or say why not)."""
    import re

    words = re.compile(r"\b(path|file|directory|profile\.json)\b")
    # outputs (relative to the current directory, as --output-dir), a name used in one, a URL
    not_paths = {("run", "output_dir"), ("run", "name"), ("tracker:tensorboard", "log_dir"), ("tracker:wandb", "name"),
                 ("prompts", "condition_column"),
                 ("reward:http", "url"), ("reward:vlm_judge", "base_url")}
    found = []
    tables = [(name, cls) for name, cls in SECTIONS.items()]
    reg = get_registry()
    for kind, comps in reg.components.items():
        tables += [(f"{kind}:{name}", comp.params) for name, comp in comps.items() if comp.params is not None]
    for table, cls in tables:
        for f, _ in fields_of(cls):
            help_text = f.metadata.get("help", "").lower()
            if words.search(help_text) and (table, f.name) not in not_paths:
                found.append((table, f.name, bool(f.metadata.get("path"))))
    undeclared = [(t, k) for t, k, declared in found if not declared]
    assert not undeclared, f"documented as paths but not declared with param(..., path=...): {undeclared}"
    assert ("prompts", "source", True) in found and ("chunker:dynamics", "profile", True) in found


def test_train_from_another_directory_reads_the_recipes_files(project, flowrl_cli):
    """`flowrl train` run from an unrelated directory: prompts, eval prompts and the profile are
    the ones beside the recipe; the saved recipe names them absolutely."""
    home, elsewhere = project
    r = flowrl_cli.in_process([["train", str(home / "recipe.toml"), "-o", str(elsewhere / "run")]], cwd=elsewhere)[0]
    assert r.returncode == 0, r.stderr
    saved = (elsewhere / "run" / "recipe.toml").read_text()
    assert json.dumps(str(home / "data" / "train.txt")) in saved
    assert json.dumps(str(home / "profiles" / "embedded.json")) in saved
    row = read_metrics(elsewhere / "run")[0]
    assert "eval/area/mean" in row
