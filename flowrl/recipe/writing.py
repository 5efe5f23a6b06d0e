"""Writing a recipe as TOML: :func:`dump_toml` writes the resolved recipe
(:meth:`~flowrl.recipe.schema.Recipe.to_toml_dict`, every default filled in) into a run's
directory, a checkpoint and a hub card, so that it loads back as the same recipe.
"""

from __future__ import annotations

from typing import Any


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def dump_toml(data: dict[str, Any]) -> str:
    """Write a recipe dict (tables of scalars/lists, arrays of tables) as TOML."""
    lines: list[str] = []
    for key, value in data.items():
        if isinstance(value, dict):
            lines.append(f"[{key}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in value.items()]
            lines.append("")
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for entry in value:
                lines.append(f"[[{key}]]")
                lines += [f"{k} = {_toml_value(v)}" for k, v in entry.items()]
                lines.append("")
        else:
            lines.insert(0, f"{key} = {_toml_value(value)}")
    return "\n".join(lines)
