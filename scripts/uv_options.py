#!/usr/bin/env python3
"""Print pip's effective configuration as `uv pip install` options, one per line.

uv reads neither pip.conf nor the PIP_* variables, so on a machine whose packages come from
configured indexes and wheel folders (this project's CI machines) a bare `uv pip install` would
look elsewhere. This turns what `pip config list` reports (environment over the `install`
section over `global`) into uv's flags:

- index-url, extra-index-url, find-links, constraint -> the options of the same name;
- cert -> --native-tls (uv then trusts the system store, where a configured bundle lives);
- --index-strategy unsafe-best-match always: pip takes the best version across every index,
  uv by default the first index that has the package.

With these, `uv pip install` gives the same environment as `pip install`: on this machine the
`pip freeze` of the two is identical for `-c constraints/cpu.txt -e ".[dev]"`.

    .venv/bin/python scripts/uv_options.py        # what .ci/run passes to uv
"""

from __future__ import annotations

import subprocess
import sys

LIST_OPTIONS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
                "find-links": "--find-links", "constraint": "--constraint"}
PRECEDENCE = (":env:", "install", "global")  # pip's own order: the first that sets a key wins


def pip_config(python: str = sys.executable) -> dict[str, str]:
    """pip's effective settings ``{key: value}``, read through ``python -m pip config list``."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True).stdout
    found: dict[tuple[str, str], str] = {}
    for line in out.splitlines():
        name, sep, value = line.partition("=")
        section, dot, key = name.rpartition(".")
        if sep and dot:
            found[(section, key)] = value.strip().strip("'\"")
    return {key: found[(section, key)] for section in reversed(PRECEDENCE) for (s, key) in found if s == section}


def uv_options(config: dict[str, str]) -> list[str]:
    """uv flags for pip settings ``config`` (see the module docstring)."""
    options = ["--index-strategy", "unsafe-best-match"]
    for key, flag in LIST_OPTIONS.items():
        for value in config.get(key, "").split():
            options += [flag, value]
    if config.get("cert"):
        options.append("--native-tls")
    return options


if __name__ == "__main__":
    print("\n".join(uv_options(pip_config())))
