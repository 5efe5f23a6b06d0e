"""The ``flowrl`` command line (Typer).

Every error a user can cause prints one message (what, where, how to fix) and exits with
status 2, without a traceback; ``flowrl --debug ...`` shows the traceback.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from .errors import FlowrlError

app = typer.Typer(
    name="flowrl",
    help="Reinforcement learning for flow-matching text-to-image models (GRPO, GSPO, Chunk-GRPO).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)


class _State:
    debug = False
    disabled: list[str] = []


state = _State()

RecipeArg = Annotated[Path, typer.Argument(help="Path to a TOML recipe (see recipes/).")]
SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", "-s", help="Override a recipe key: section.key=value (TOML value). Repeatable."),
]


@app.callback()
def _main(
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks on errors.")] = False,
    disable_plugin: Annotated[
        Optional[list[str]],
        typer.Option("--disable-plugin", help="Skip a plugin by name (repeatable; also FLOWRL_DISABLE_PLUGINS=a,b)."),
    ] = None,
) -> None:
    state.debug = debug
    state.disabled = list(disable_plugin or [])


def _registry():
    from .plugins import get_registry

    return get_registry(state.disabled)


def _load(recipe: Path, overrides: Optional[list[str]]):
    from .recipe import load_recipe

    return load_recipe(recipe, overrides or [], registry=_registry())


@app.command()
def validate(
    recipe: Annotated[Optional[Path], typer.Argument(help="Recipe to check (omit with --explain to document every key).")] = None,
    set_: SetOpt = None,
    explain: Annotated[bool, typer.Option("--explain", help="Print the documentation of every key the recipe can use.")] = False,
) -> None:
    """Check a recipe without building anything heavy: tables, keys, types, ranges, components."""
    if recipe is None:
        if not explain:
            raise FlowrlError("validate needs a RECIPE path", hint="flowrl validate recipes/quickstart.toml")
        _explain(None)
        return
    resolved = _load(recipe, set_)
    if explain:
        _explain(resolved)
    T = resolved.num_trainable
    chunk = resolved.components["chunker"]
    from rich.markup import escape

    console.print(
        f"[green]ok[/green] {escape(str(recipe))}: model={resolved.components['model'].use}, "
        f"kernel={resolved.components['kernel'].use}, chunker={chunk.use}, "
        f"selector={resolved.components['selector'].use}, loss={resolved.components['loss'].use}, "
        f"rewards={[r.label for r in resolved.rewards]}, T={T} trainable transitions"
    )


def _explain(resolved) -> None:
    from rich.markup import escape

    from .config import explain as explain_rows
    from .recipe import COMPONENT_SECTIONS, LIST_SECTIONS, SECTIONS

    registry = _registry()

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
            names = registry.names(kind)
        for name in names:
            comp = registry.get(kind, name)
            brackets = f"[[{section}]]" if section in LIST_SECTIONS else f"[{section}]"
            table(f'{brackets} use = "{name}" - {comp.help}', comp.params)


@app.command()
def plugins(
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
) -> None:
    """List every plugin with its distribution, version and the components it registers."""
    registry = _registry()
    grouped = registry.by_plugin()
    if as_json:
        out = [
            {
                "plugin": name,
                "distribution": info.distribution,
                "version": info.version,
                "module": info.module,
                "components": {f"{c.kind}:{c.name}": c.help for c in grouped.get(name, [])},
            }
            for name, info in registry.plugins.items()
        ]
        typer.echo(json.dumps(out, indent=2))
        return
    t = Table(title="flowrl plugins")
    for col in ("plugin", "distribution", "version", "components"):
        t.add_column(col, overflow="fold")
    for name, info in registry.plugins.items():
        comps = ", ".join(f"{c.kind}:{c.name}" for c in sorted(grouped.get(name, []), key=lambda c: (c.kind, c.name)))
        t.add_row(name, info.distribution, info.version, comps or "-")
    console.print(t)


@app.command()
def train(
    recipe: Annotated[
        Optional[Path],
        typer.Argument(help="Path to a TOML recipe (see recipes/); with --resume it defaults to RUN_DIR/recipe.toml."),
    ] = None,
    set_: SetOpt = None,
    resume: Annotated[
        Optional[Path], typer.Option("--resume", help="Continue the run in this directory from its latest checkpoint.")
    ] = None,
    output_dir: Annotated[
        Optional[Path], typer.Option("--output-dir", "-o", help="Run directory (overrides run.output_dir).")
    ] = None,
    num_processes: Annotated[
        int, typer.Option("--num-processes", help="Launch N data-parallel processes on this machine (torchrun).")
    ] = 1,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate and print the resolved geometry, then stop.")] = False,
) -> None:
    """Train a policy with the recipe's components: rollout, rewards, advantages, update."""
    if recipe is None:
        if resume is None:
            raise FlowrlError("train needs a RECIPE (or --resume RUN_DIR)", hint="flowrl train recipes/quickstart.toml")
        recipe = resume / "recipe.toml"
    overrides = list(set_ or [])
    if output_dir is not None:
        overrides.append(f"run.output_dir={json.dumps(str(output_dir))}")
    if num_processes > 1 and "LOCAL_RANK" not in os.environ:
        from .distributed import launch

        raise typer.Exit(launch(num_processes, sys.argv[1:]))
    resolved = _load(recipe, overrides)
    from .engine import train as run_training

    run_training(resolved, resume=resume, dry_run=dry_run, console=console, registry=_registry())


@app.command()
def plot(
    run_dir: Annotated[Path, typer.Argument(help="A run directory containing metrics.jsonl.")],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="PNG path (default RUN_DIR/rewards.png).")] = None,
) -> None:
    """Draw the reward curves of a run to a PNG."""
    from .plotting import plot_run

    path = plot_run(run_dir, output)
    console.print(f"wrote {path}")


def _register_command_modules() -> None:
    import importlib

    from .commands import MODULES

    for name in MODULES:
        importlib.import_module(f"flowrl.commands.{name}")


_register_command_modules()


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point: run the app, turning user errors into one clean message."""
    import click

    # typer >= 0.2x vendors its own copy of click (typer._click), whose exceptions do not derive
    # from click's: catch both families, or a usage error becomes a traceback.
    exit_types = (click.exceptions.Exit, typer.Exit)
    abort_types = (click.exceptions.Abort, typer.Abort)
    usage_types = (click.ClickException, typer.TyperException)

    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        # standalone_mode=False returns a command's `raise typer.Exit(code)` as the value.
        code = app(args=argv, prog_name="flowrl", standalone_mode=False)
    except FlowrlError as exc:
        if debug:
            raise
        from rich.markup import escape

        # escape(): "[train]" or "[[rewards]]" in a message would otherwise be eaten as markup.
        err_console.print(f"[bold red]error:[/bold red] {escape(exc.format())}", highlight=False)
        sys.exit(exc.exit_code)
    except exit_types as exc:
        sys.exit(exc.exit_code)
    except abort_types:
        err_console.print("aborted")
        sys.exit(130)
    except usage_types as exc:
        if debug or not hasattr(exc, "show"):
            raise
        exc.show()
        sys.exit(getattr(exc, "exit_code", 2))
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
    if isinstance(code, int) and not isinstance(code, bool) and code != 0:
        sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
