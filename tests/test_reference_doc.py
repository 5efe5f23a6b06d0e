"""docs/reference.md is generated from the recipe schema and never stale.

Regenerate it with ``flowrl validate --explain --markdown > docs/reference.md``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from flowrl.commands.validate import reference_markdown, reference_sections
from flowrl.plugins import get_registry
from flowrl.recipe import COMPONENT_SECTIONS, LIST_SECTIONS, SECTIONS, RewardEntryConfig

REPO = Path(__file__).resolve().parents[1]
REGENERATE = "flowrl validate --explain --markdown > docs/reference.md"


def test_reference_doc_is_up_to_date():
    current = (REPO / "docs" / "reference.md").read_text(encoding="utf-8")
    assert current == reference_markdown(get_registry()), f"docs/reference.md is stale: run `{REGENERATE}`"


def test_reference_documents_every_key_of_every_table_and_builtin_component():
    reg = get_registry()
    doc = reference_markdown(reg)
    sections = {title: rows for title, _, rows in reference_sections(reg, distribution="flowrl-diffusion")}
    for name, cls in SECTIONS.items():
        assert {r[0] for r in sections[f"[{name}]"]} == {f.name for f in dataclasses.fields(cls)}
    assert {r[0] for r in sections["[[rewards]] (every entry)"]} == {"weight", "name", "chunk_weights", "frames"}
    assert {f.name for f in dataclasses.fields(RewardEntryConfig)} == {"weight", "name", "chunk_weights", "frames"}
    for section, kind in {**COMPONENT_SECTIONS, **LIST_SECTIONS}.items():
        brackets = f"[[{section}]]" if section in LIST_SECTIONS else f"[{section}]"
        for comp_name in reg.names(kind):
            comp = reg.get(kind, comp_name)
            if reg.plugins[comp.plugin].distribution != "flowrl-diffusion":
                continue
            rows = sections[f'{brackets} use = "{comp_name}"']
            keys = {f.name for f in dataclasses.fields(comp.params)} if comp.params else set()
            assert {r[0] for r in rows} == keys, (section, comp_name)
            assert f'## `{brackets} use = "{comp_name}"`' in doc
    # bounds, defaults and path handling are part of each row
    train = {r[0]: r for r in sections["[train]"]}
    assert train["group_size"][1] == "int in [2, 1000000000]" and train["group_size"][2] == "8"
    prompts = {r[0]: r for r in sections["[prompts]"]}
    assert "relative to the recipe" in prompts["source"][1]
