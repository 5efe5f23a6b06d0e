"""Every file the recipes' comments and the other shipped Markdown cite exists.

tests/test_docs_references.py holds README.md and docs/*.md; the recipes are checked here too:
their header comments cite docs and other recipes. Here the same scanner reads every recipe in
recipes/, scripts/README.md and the model cards under plugins/. A path written as the output of a
command (``-o PATH``, ``--out PATH``) is something the command makes, not a reference.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_docs_references import LINK, cited_paths

REPO = Path(__file__).resolve().parents[1]
FILES = [*sorted((REPO / "recipes").glob("*.toml")), REPO / "scripts" / "README.md",
         *sorted((REPO / "plugins").rglob("MODEL_CARD.md"))]
OUTPUT = re.compile(r"(?:-o|--out|--output)[ =]+(\S+)")


def references(text: str) -> set[str]:
    outputs = {m.rstrip(".,;:`") for m in OUTPUT.findall(text)}
    return {p for p in cited_paths(text) if p not in outputs}


def test_outputs_of_commands_are_not_references():
    text = "#   flowrl profile recipes/a.toml -o recipes/profiles/new.json\n# see docs/api.md"
    assert references(text) == {"recipes/a.toml", "docs/api.md"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_cited_files_exist(path):
    text = path.read_text(encoding="utf-8")
    missing = sorted(p for p in references(text) if not (REPO / p).exists())
    assert not missing, f"{path.relative_to(REPO)} cites files that are not in the repository: {missing}"
    broken = [t for t in LINK.findall(text)
              if not re.match(r"[a-z][a-z0-9+.-]*:|#", t) and not (path.parent / t.split("#", 1)[0]).exists()]
    assert not broken, f"{path.relative_to(REPO)}: links to missing files: {broken}"
