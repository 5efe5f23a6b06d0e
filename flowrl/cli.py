"""The ``flowrl`` command line (Typer): every command in :mod:`flowrl.commands`, and ``main``.

Every error a user can cause prints one message (what, where, how to fix) and exits with
status 2, without a traceback; ``flowrl --debug ...`` shows the traceback.
"""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import click
import typer
from rich.markup import escape

# Importing a command module adds its command(s) to the app.
from .commands import (  # noqa: F401
    compare,
    diagnose,
    doctor,
    embed,
    evaluate,
    export,
    plan,
    plot,
    plugins,
    profile,
    reward_score,
    reward_server,
    sample,
    selftest,
    sweep,
    train,
    validate,
)
from .commands.base import app, err_console, options
from .errors import FlowrlError, printable


def _print_version(value: bool) -> None:
    if value:
        from importlib import metadata

        from . import __version__
        from .errors import DISTRIBUTION

        try:
            version = metadata.version(DISTRIBUTION)  # ours: PyPI's "flowrl" is another project
        except metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
            version = __version__
        print(f"flowrl {version}")
        raise typer.Exit(0)


@app.callback()
def _main(
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks on errors (anywhere on the line).")] = False,
    version: Annotated[
        bool, typer.Option("--version", is_eager=True, callback=_print_version, help="Print flowrl's version and exit.")
    ] = False,
    disable_plugin: Annotated[
        Optional[list[str]],
        typer.Option("--disable-plugin", help="Skip a plugin by name (repeatable; also FLOWRL_DISABLE_PLUGINS=a,b)."),
    ] = None,
) -> None:
    options.debug = debug
    options.disabled_plugins = list(disable_plugin or [])


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point: run the app, turning user errors into one clean message."""
    # typer >= 0.2x vendors its own copy of click (typer._click), whose exceptions do not derive
    # from click's: catch both families, or a usage error becomes a traceback.
    exit_types = (click.exceptions.Exit, typer.Exit)
    abort_types = (click.exceptions.Abort, typer.Abort)
    usage_types = (click.ClickException, typer.TyperException)

    argv, debug = hoist_debug(list(sys.argv[1:] if argv is None else argv))
    try:
        # standalone_mode=False returns a command's `raise typer.Exit(code)` as the value.
        code = app(args=argv, prog_name="flowrl", standalone_mode=False)
    except FlowrlError as exc:
        if debug:
            raise
        # escape(): "[train]" or "[[rewards]]" in a message would otherwise be eaten as markup.
        err_console.print(f"[bold red]error:[/bold red] {escape(exc.format())}", highlight=False, soft_wrap=True)
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
    except OSError as exc:
        # A path the user named that cannot be read or written, met where no command checked it
        # first: one message, not a traceback (--debug shows where).
        if debug or not exc.filename:
            raise
        named = str(exc.filename) + (f" -> {exc.filename2}" if getattr(exc, "filename2", None) else "")
        err_console.print(f"[bold red]error:[/bold red] {escape(printable(named))}: "
                          f"{escape(exc.strerror or type(exc).__name__)}\n  hint: check the path (it must exist to be "
                          "read, its folder must be writable to be written); --debug shows where it was met",
                          highlight=False, soft_wrap=True)
        sys.exit(1)
    if isinstance(code, int) and not isinstance(code, bool) and code != 0:
        sys.exit(code)


def hoist_debug(argv: list[str]) -> tuple[list[str], bool]:
    """``--debug`` is accepted anywhere before a ``--``: it moves to the front, where the app's
    own option is (after a command, click would reject it as that command's unknown option)."""
    end = argv.index("--") if "--" in argv else len(argv)
    head, tail = argv[:end], argv[end:]
    debug = "--debug" in head
    rest = [a for a in head if a != "--debug"]
    return (["--debug"] if debug else []) + rest + tail, debug


if __name__ == "__main__":  # pragma: no cover
    main()
