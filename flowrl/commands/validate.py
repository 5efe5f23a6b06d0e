"""``flowrl validate``: check a recipe without loading a model; ``--explain`` documents every key."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from ..errors import DISTRIBUTION, FlowrlError
from .base import TEXT_WIDTH_WITHOUT_TERMINAL, SetOpt, app, console, load, registry, table_console


@app.command()
def validate(
    recipe: Annotated[Optional[Path], typer.Argument(help="Recipe to check (omit with --explain to document every key).")] = None,
    set_: SetOpt = None,
    explain: Annotated[bool, typer.Option("--explain", help="Print the documentation of every key the recipe can use.")] = False,
    markdown: Annotated[bool, typer.Option("--markdown", help="With --explain and no RECIPE: print docs/reference.md (Markdown).")] = False,
    gpu_memory: Annotated[Optional[float], typer.Option(
        "--gpu-memory", min=1.0, max=100_000.0, help="Check the recipe for a machine whose GPUs have this much memory (GB), "
        "not for this one: the memory plan's verdict against it, and no check of this machine's CUDA devices "
        "[default: this machine: its GPU, or where PyTorch sees none, its CPU and RAM].")] = None,
) -> None:
    """Check a recipe without building anything heavy: tables, keys, types, ranges, components,
    prompt files, trackers' extras, and this machine: the CUDA devices the recipe names, the
    memory the plan needs on the device the run gets here."""
    if markdown:
        if recipe is not None or not explain:
            raise FlowrlError("--markdown documents every key of every component: use `flowrl validate --explain --markdown`",
                              where="--markdown", hint="flowrl validate --explain --markdown > docs/reference.md")
        print(reference_markdown(registry()), end="")
        return
    if recipe is None:
        if not explain:
            raise FlowrlError("validate needs a RECIPE path", hint="flowrl validate recipes/quickstart.toml")
        explain_recipe(None)
        return
    resolved = load(recipe, set_)
    from ..recipe import check_startable
    from .machine import check_memory

    # what train would reject before building the model (this machine's devices unless --gpu-memory
    # asks for another machine's verdict)
    check_startable(resolved, registry(), devices=gpu_memory is None)
    check_memory(recipe, list(set_ or []), resolved, gpu_memory)
    if explain:
        explain_recipe(resolved)
    from ..recipe import uses_units

    c = resolved.components
    # what the run uses: the kernel, chunks and T only where the objective trains trajectory units
    units = uses_units(resolved, registry())
    parts = [f"model={c['model'].use}"]
    if units:
        parts += [f"kernel={c['kernel'].use}", f"chunker={c['chunker'].use}", f"selector={c['selector'].use}"]
    parts.append(f"loss={c['loss'].use}")
    if "likelihood" in c and c["likelihood"].use != "trajectory":
        parts.append(f"likelihood={c['likelihood'].use}")
    parts.append(f"rewards={[r.label for r in resolved.rewards]}")
    if units:
        parts.append(f"T={resolved.num_trainable} trainable transitions")
    console.print(f"[green]ok[/green] {escape(str(recipe))}: " + ", ".join(parts))


def reference_sections(reg, resolved=None, *, distribution: str | None = None) -> list[tuple[str, str, list[tuple[str, str, str, str]]]]:
    """``(title, description, rows)`` for every table a recipe can hold, rows being ``(key,
    type with bounds, default, description)`` from the schema validation uses: the plain
    tables, then every registered component of every component table (only the recipe's own
    components when ``resolved`` is given; only those of one ``distribution``, when given), the
    keys of every ``[[rewards]]`` entry included."""
    from ..config import explain as explain_rows
    from ..recipe import COMPONENT_SECTIONS, LIST_SECTIONS, SECTIONS, RewardEntryConfig

    out = [(f"[{name}]", "", explain_rows(cls)) for name, cls in SECTIONS.items()]
    for section, kind in list(COMPONENT_SECTIONS.items()) + list(LIST_SECTIONS.items()):
        listed = section in LIST_SECTIONS
        brackets = f"[[{section}]]" if listed else f"[{section}]"
        if section == "rewards":
            out.append((f"{brackets} (every entry)", "Keys of every entry, besides `use` and the reward's own.",
                        explain_rows(RewardEntryConfig)))
        if resolved is not None:
            names = sorted({c.use for c in getattr(resolved, section)}) if listed else [resolved.components[section].use]
        else:
            names = [n for n in reg.names(kind)
                     if distribution is None or reg.plugins[reg.get(kind, n).plugin].distribution == distribution]
        default = None if listed else reg.default(kind)
        for name in names:
            comp = reg.get(kind, name)
            note = f" (the default when the recipe has no {brackets} table)" if name == default else ""
            out.append((f'{brackets} use = "{name}"', comp.help + note, explain_rows(comp.params)))
    return out


def explain_recipe(resolved) -> None:
    """One table per recipe table: every key with its type, default and meaning. Piped output
    is not cut to 80 columns (key names never wrap), nor wider than a reader takes in."""
    out = table_console(TEXT_WIDTH_WITHOUT_TERMINAL)
    for title, description, rows in reference_sections(registry(), resolved):
        t = Table(title=escape(f"{title} - {description}" if description else title), title_justify="left")
        t.add_column("key", no_wrap=True)
        t.add_column("type", overflow="fold")
        t.add_column("default", overflow="fold")
        t.add_column("meaning", overflow="fold")
        for row in rows:
            t.add_row(*(escape(str(c)) for c in row))
        if not rows:
            t.add_row("(no parameters)", "", "", "")
        out.print(t)


def reference_markdown(reg) -> str:
    """docs/reference.md: every key of every table and of every component flowrl ships (the
    built-in plugins: other installed plugins are left out)."""
    def cell(text: str) -> str:
        return str(text).replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")

    lines = [
        "# Recipe reference",
        "",
        "Every key of every recipe table and of every registered component: its type (with the bounds",
        "validation enforces), its default and what it does. Generated from the schema the recipe",
        "validator uses by `flowrl validate --explain --markdown > docs/reference.md`;",
        "`tests/test_reference_doc.py` fails when this file is stale. `docs/recipes.md` explains the",
        "format; `flowrl validate --explain RECIPE` prints the keys of one recipe's components.",
        "",
    ]
    for title, description, rows in reference_sections(reg, distribution=DISTRIBUTION):
        lines += [f"## `{title}`", ""]
        if description:
            lines += [cell(description), ""]
        if not rows:
            lines += ["No parameters: `use` only.", ""]
            continue
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        lines += [f"| `{k}` | {cell(t)} | `{cell(d)}` | {cell(h)} |" for k, t, d, h in rows]
        lines.append("")
    return "\n".join(lines)
