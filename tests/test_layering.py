"""The core package `flowrl` never imports the built-in plugins (`flowrl_plugins`): they are
ordinary plugins on top of it, found through entry points like any third-party plugin."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "flowrl"


def test_core_never_imports_the_builtin_plugins():
    offenders = []
    for path in sorted(CORE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            offenders += [f"{path.relative_to(CORE.parent)}:{node.lineno} imports {n}" for n in names
                          if n == "flowrl_plugins" or n.startswith("flowrl_plugins.")]
    assert not offenders, "\n".join(offenders)
