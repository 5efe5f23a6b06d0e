"""Code shape, read from the source: the training loop fits on a screen, no other function is long.

- ``flowrl.train.loop.train`` is at most :data:`TRAIN_MAX` lines;
- every other function or method in ``flowrl/`` (nested ones included) is at most
  :data:`FUNCTION_MAX` lines.

A function's length counts from its ``def`` line to its last line, docstring, comments and
blank lines inside it included (decorators are not counted). Split a long function into helpers
whose names say what each part does.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "flowrl"

TRAIN = ("flowrl/train/loop.py", "train")
TRAIN_MAX = 100
FUNCTION_MAX = 80


def function_lengths(source: str) -> list[tuple[str, int, int]]:
    """``(qualified name, def line, length in lines)`` of every function defined in ``source``."""
    out: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                out.append((name, child.lineno, child.end_lineno - child.lineno + 1))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return out


def _package_functions() -> list[tuple[str, str, int, int]]:
    """``(file relative to the repo, qualified name, def line, length)`` over ``flowrl/``."""
    rows = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        for name, line, length in function_lengths(path.read_text(encoding="utf-8")):
            rows.append((rel, name, line, length))
    return rows


def test_counter_sees_a_planted_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_MAX))
    source = (
        "import os\n\n"
        "@decorator\n"
        f"def long_one():\n    '''doc'''\n{body}\n    return x0\n\n"
        "class C:\n"
        "    def short(self):\n"
        "        def inner():\n"
        "            return 1\n"
        "        return inner()\n"
    )
    lines = source.splitlines()
    short = lines.index("    def short(self):") + 1
    lengths = {name: (line, length) for name, line, length in function_lengths(source)}
    # def line + docstring + FUNCTION_MAX assignments + return; the decorator is not counted
    assert lengths["long_one"] == (4, FUNCTION_MAX + 3)
    assert lengths["C.short"] == (short, 4)
    assert lengths["C.short.inner"] == (short + 1, 2)
    assert len(lengths) == 3


def test_train_fits_on_a_screen():
    rows = [r for r in _package_functions() if (r[0], r[1]) == TRAIN]
    assert rows, f"{TRAIN[0]} defines no function {TRAIN[1]}"
    (rel, name, line, length), = rows
    assert length <= TRAIN_MAX, f"{rel}:{line} {name} is {length} lines (at most {TRAIN_MAX})"


def test_no_other_function_is_long():
    offenders = [
        f"{rel}:{line} {name} ({length} lines)"
        for rel, name, line, length in _package_functions()
        if (rel, name) != TRAIN and length > FUNCTION_MAX
    ]
    assert not offenders, f"functions over {FUNCTION_MAX} lines:\n" + "\n".join(offenders)
