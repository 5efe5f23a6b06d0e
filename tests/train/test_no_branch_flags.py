"""BranchGRPO is components, not flags: nothing in the training loop (``flowrl/train/``) reads an
attribute whose name starts with ``branch_``. The tree's shape is the ``[window] use = "branch"``
component's (:class:`flowrl.interfaces.SamplesTrees`), the tree advantage the ``[advantage] use =
"tree"`` component's (:class:`flowrl.interfaces.AdvantagesOnTrees`); the loop asks them through
their protocols. Read from the source, like tests/test_layering.py."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "flowrl" / "train"


def branch_attribute_reads(path: Path, root: Path = REPO) -> list[str]:
    """``file:line: name`` for every attribute read (``x.branch_...``, ``getattr(x, "branch_...")``)
    in a Python file (named relative to ``root``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute) and node.attr.startswith("branch_"):
            name = node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and str(node.args[1].value).startswith("branch_")):
            name = node.args[1].value
        if name is not None:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {name}")
    return sorted(found, key=lambda hit: int(hit.split(":")[1]))


def test_the_training_loop_reads_no_branch_attribute():
    found = [hit for path in sorted(TRAIN.rglob("*.py")) for hit in branch_attribute_reads(path)]
    assert not found, ("flowrl/train/ reads branch_* attributes; ask the [window] / [advantage] component "
                       "through its protocol instead:\n" + "\n".join(found))


def test_the_check_sees_a_planted_read(tmp_path):
    planted = tmp_path / "loop.py"
    planted.write_text("def f(recipe):\n    a = recipe.sampler.branch_steps\n    return getattr(recipe, 'branch_keep')\n")
    found = branch_attribute_reads(planted, tmp_path)
    assert found == ["loop.py:2: branch_steps", "loop.py:3: branch_keep"], found
