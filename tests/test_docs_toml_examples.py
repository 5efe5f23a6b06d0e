"""Every TOML example in the README and docs/ is a recipe, or a part of one, that validates.

A page shows a recipe in pieces: a ``[chunker]`` table, a ``[[rewards]]`` entry. Each piece is
put into the recipe it belongs to (by default the shipped Chunk-GRPO recipe
``recipes/quickstart_hacking.toml``; :data:`BASES` names another for the pieces of another
world) and validated as ``flowrl validate`` validates a recipe file, paths relative to
``recipes/``: an unknown key, a misspelt component or a combination validation refuses fails
here, not in a user's run. A block holding ``[model]`` and ``[[rewards]]`` is a whole recipe.
Blocks that are not recipes are listed in :data:`NOT_RECIPES` with the test that covers them.
"""

from __future__ import annotations

import copy
import re
import tomllib
from pathlib import Path

import pytest

from flowrl.plugins import get_registry
from flowrl.recipe import read_toml, validate
from flowrl.recipe.loading import resolve_paths

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
DEFAULT_BASE = "quickstart_hacking.toml"
#: (page, the block's first line) -> the recipe the piece belongs to.
BASES = {
    ("docs/video.md", "[[rewards]]"): "quickstart_video.toml",
    ("docs/objectives.md", "[loss]"): "offline_dpo.toml",
}
#: (page, the block's first line) -> why it is no recipe, and what tests it.
NOT_RECIPES = {
    ("README.md", "# pyproject.toml (beside my_rewards/, which also holds an empty __init__.py)"):
        "a plugin's pyproject.toml: tests/test_readme_plugin.py installs it",
    ("README.md", "[[rewards]]"):
        "the plugin's reward, installed by tests/test_readme_plugin.py, which trains this entry",
}
#: Pages generated from results (their recipes are records, checked by the tests of their generators).
GENERATED = {"docs/reference.md", "docs/study.md", "docs/study_shapes.md"}


def examples() -> list[tuple[str, int, str]]:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    out = []
    for page in pages:
        name = page.relative_to(REPO).as_posix()
        if name in GENERATED:
            continue
        text = page.read_text(encoding="utf-8")
        for m in re.finditer(r"```toml\n(.*?)```", text, re.S):
            out.append((name, text[: m.start()].count("\n") + 2, m.group(1)))
    return out


def merged(base: dict, piece: dict) -> dict:
    """``piece`` put into ``base``: a plain table's keys update the base's table; a component
    table naming ``use`` replaces it; ``[[rewards]]`` entries replace the base's, but for the
    base's trained reward when none of them trains (a reward logged with weight 0 beside it)."""
    out = copy.deepcopy(base)
    for key, value in piece.items():
        if key == "rewards":
            trained = [r for r in out.get("rewards", []) if r.get("weight", 1.0) > 0][:1]
            out["rewards"] = copy.deepcopy(value)
            if not any(r.get("weight", 1.0) > 0 for r in value):
                out["rewards"] = trained + out["rewards"]
        elif isinstance(value, dict) and isinstance(out.get(key), dict) and "use" not in value:
            out[key] = {**out[key], **copy.deepcopy(value)}
        else:
            out[key] = copy.deepcopy(value)
    return out


@pytest.mark.parametrize("page, line, block", examples(), ids=lambda v: str(v) if isinstance(v, (str, int)) else "")
def test_every_toml_example_validates_as_part_of_its_recipe(page, line, block):
    first = block.splitlines()[0].strip()
    if (page, first) in NOT_RECIPES:
        pytest.skip(NOT_RECIPES[(page, first)])
    piece = tomllib.loads(block)
    whole = "model" in piece and "rewards" in piece
    data = piece if whole else merged(read_toml(RECIPES / BASES.get((page, first), DEFAULT_BASE)), piece)
    resolve_paths(data, RECIPES, get_registry(), f"{page}:{line}", from_file=True)
    validate(data, source=f"{page}:{line}", registry=get_registry())


def test_the_lists_of_exceptions_name_blocks_that_exist():
    firsts = {(page, block.splitlines()[0].strip()) for page, _, block in examples()}
    assert set(BASES) <= firsts and set(NOT_RECIPES) <= firsts
