"""docs/recipes.md's table of refused combinations is what `flowrl validate` refuses.

Prose in the docs said options were refused that trained (a KL term), or that work was not done
that was (the EMA sharded under FSDP2), while validation accepted what training refused after
the model loaded. The table "Refused combinations" is now the docs' one list of them: every row
(a recipe, its ``--set`` overrides, the message) is run through ``flowrl validate`` here, and the
claims elsewhere in the docs that these combinations are refused at validation point to it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "recipes.md"


def refused_rows() -> list[tuple[str, list[str], str]]:
    """``(recipe, overrides, message)`` for each row of the table under "## Refused combinations"."""
    text = DOC.read_text(encoding="utf-8").split("## Refused combinations", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`recipes/"):
            continue
        rows.append((cells[0].strip("`"), re.findall(r"`([^`]+)`", cells[1]), cells[2]))
    return rows


def test_the_table_is_there_and_names_the_combinations_the_docs_call_refused():
    rows = refused_rows()
    assert len(rows) >= 6, rows
    overrides = {o for _, sets, _ in rows for o in sets}
    # docs/distributed.md, "Not supported, and why", says these are refused at validation
    assert 'train.optimizer="adamw_8bit"' in overrides and "ema.on_cpu=true" in overrides
    distributed = (REPO / "docs" / "distributed.md").read_text(encoding="utf-8")
    assert distributed.count("refused at validation") >= 2


@pytest.mark.parametrize("recipe, overrides, message", refused_rows(), ids=lambda v: str(v)[:40])
def test_each_refused_combination_is_refused_by_validate(validate, recipe, overrides, message):
    code, err = validate(REPO / recipe, *overrides)
    flat = " ".join(err.split())
    assert code == 2, f"{recipe} {overrides} validated; docs/recipes.md says it is refused: {err}"
    assert err.startswith("error:") and err.count("\nerror:") == 0 and "Traceback" not in err, err
    assert message in flat, (message, flat)


def test_each_row_without_its_overrides_validates(validate):
    """So that a row is refused for its overrides, not for its recipe."""
    for recipe in sorted({r for r, _, _ in refused_rows()}):
        code, err = validate(REPO / recipe)
        assert code == 0, (recipe, err)


def test_the_docs_no_longer_claim_what_is_untrue():
    models = (REPO / "docs" / "models.md").read_text(encoding="utf-8")
    runs = (REPO / "docs" / "runs.md").read_text(encoding="utf-8")
    assert "`[loss].beta > 0` is refused" not in " ".join(models.split())
    assert "under FSDP2 is not done" not in " ".join(runs.split())
