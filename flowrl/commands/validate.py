"""``flowrl validate``: check a recipe without loading a model; ``--explain`` documents every key."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from ..errors import FlowrlError
from .base import SetOpt, app, console, load, registry


@app.command()
def validate(
    recipe: Annotated[Optional[Path], typer.Argument(help="Recipe to check (omit with --explain to document every key).")] = None,
    set_: SetOpt = None,
    explain: Annotated[bool, typer.Option("--explain", help="Print the documentation of every key the recipe can use.")] = False,
) -> None:
    """Check a recipe without building anything heavy: tables, keys, types, ranges, components,
    prompt files, trackers' extras."""
    if recipe is None:
        if not explain:
            raise FlowrlError("validate needs a RECIPE path", hint="flowrl validate recipes/quickstart.toml")
        explain_recipe(None)
        return
    resolved = load(recipe, set_)
    from ..recipe import check_startable

    check_startable(resolved, registry())  # what train would reject before building the model
    if explain:
        explain_recipe(resolved)
    c = resolved.components
    console.print(
        f"[green]ok[/green] {escape(str(recipe))}: model={c['model'].use}, kernel={c['kernel'].use}, "
        f"chunker={c['chunker'].use}, selector={c['selector'].use}, loss={c['loss'].use}, "
        f"rewards={[r.label for r in resolved.rewards]}, T={resolved.num_trainable} trainable transitions"
    )


def explain_recipe(resolved) -> None:
    """One table per recipe table: every key with its type, default and meaning."""
    from ..config import explain as explain_rows
    from ..recipe import COMPONENT_SECTIONS, LIST_SECTIONS, SECTIONS

    reg = registry()

    def table(title, cls):
        t = Table(title=escape(title), title_justify="left", show_lines=False)
        for col in ("key", "type", "default", "meaning"):
            t.add_column(col, overflow="fold")
        for row in explain_rows(cls):
            t.add_row(*(escape(str(c)) for c in row))
        console.print(t)

    for name, cls in SECTIONS.items():
        table(f"[{name}]", cls)
    for section, kind in list(COMPONENT_SECTIONS.items()) + list(LIST_SECTIONS.items()):
        if resolved is not None and section in COMPONENT_SECTIONS:
            names = [resolved.components[section].use]
        elif resolved is not None and section in LIST_SECTIONS:
            names = sorted({c.use for c in getattr(resolved, section)})
        else:
            names = reg.names(kind)
        for name in names:
            comp = reg.get(kind, name)
            brackets = f"[[{section}]]" if section in LIST_SECTIONS else f"[{section}]"
            table(f'{brackets} use = "{name}" - {comp.help}', comp.params)
