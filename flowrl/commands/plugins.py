"""``flowrl plugins``: every plugin, its distribution and version, and what it registers."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from .base import app, console, registry, table_console


@app.command()
def plugins(
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
) -> None:
    """List every plugin with its distribution, version and the components it registers."""
    reg = registry()
    grouped = reg.by_plugin()
    if as_json:
        out = [
            {
                "plugin": name,
                "distribution": info.distribution,
                "version": info.version,
                "module": info.module,
                "components": {f"{c.kind}:{c.name}": c.help for c in grouped.get(name, [])},
            }
            for name, info in reg.plugins.items()
        ]
        typer.echo(json.dumps(out, indent=2))
        return
    t = Table(title="flowrl plugins")
    for col in ("plugin", "distribution", "version", "components"):
        t.add_column(col, overflow="fold")
    for name, info in reg.plugins.items():
        comps = ", ".join(f"{c.kind}:{c.name}" for c in sorted(grouped.get(name, []), key=lambda c: (c.kind, c.name)))
        t.add_row(name, info.distribution, info.version, comps or "-")
    table_console().print(t)
