"""What every command shares: the Typer app, the consoles, the plugin registry and recipe loading.

Each module in :mod:`flowrl.commands` adds its command(s) to :data:`app` when imported;
:mod:`flowrl.cli` imports them all and runs the app. Heavy imports stay inside the command
functions, so ``flowrl --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
import typer.core
from rich.console import Console

if TYPE_CHECKING:  # torch loads with the recipe module: only when a command needs it
    from ..plugins import Registry
    from ..recipe import Recipe

#: The GPU `flowrl plan` judges a recipe against unless --gpu-memory says otherwise (GB), and the
#: one `flowrl validate` assumes for a GPU whose memory it cannot read.
DEFAULT_GPU_MEMORY_GB = 80.0


class _PlainFlags:
    """Help screens show no ``<bool>`` after an on/off flag (``--dry-run``, ``--help``): a flag
    takes no value, so there is no value type to show."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for p in params:
            if getattr(p, "is_bool_flag", False) and not p.metavar:
                p.metavar = ""
        return params


#: What Rich reads as a markup tag (``rich.markup.RE_TAGS``), with the backslashes before it: in help
#: text, a recipe's ``[ema]``, ``[distributed].num_processes`` or an extra's ``flowrl-diffusion[plot]``.
_MARKUP_TAG = re.compile(r"(\\*)(\[[a-z#/@][^[]*?])")


def literal_markup(text: str | None) -> str | None:
    """``text`` with every ``[word]`` escaped, so that Rich prints it as written instead of
    reading it as a markup tag and dropping it. A tag already escaped (``\\[fleet]``) stays as
    it is, so escaping twice changes nothing."""

    def escape(match: re.Match) -> str:
        backslashes, tag = match.groups()
        if len(backslashes) % 2:  # already escaped
            return match.group(0)
        return backslashes * 2 + "\\" + tag  # as rich.markup.escape: the backslashes stay literal

    return _MARKUP_TAG.sub(escape, text) if text else text


#: The help texts a help screen prints: of the command, of its parameters, of a group's commands.
_HELP_ATTRIBUTES = ("help", "short_help", "epilog")


@contextlib.contextmanager
def _literal_help_texts(command, ctx) -> Iterator[None]:
    """For the block, the help texts of ``command``, its parameters and (a group) its commands
    with their markup escaped (:func:`literal_markup`); restored afterwards, so that the
    texts themselves stay as written."""
    objects = [command, *command.get_params(ctx), *getattr(command, "commands", {}).values()]
    saved = [(obj, name, getattr(obj, name)) for obj in objects for name in _HELP_ATTRIBUTES
             if isinstance(getattr(obj, name, None), str)]
    try:
        for obj, name, text in saved:
            setattr(obj, name, literal_markup(text))
        yield
    finally:
        for obj, name, text in saved:
            setattr(obj, name, text)


class _LiteralHelp:
    """Help screens print help texts as written: Typer renders them as Rich markup, which drops
    every ``[word]`` (a recipe table such as ``[ema]``, an extra such as ``[plot]``) as an
    unknown tag. Help texts are plain text here, so every command's are escaped centrally."""

    def format_help(self, ctx, formatter):
        if getattr(self, "rich_markup_mode", None) != "rich":
            return super().format_help(ctx, formatter)
        with _literal_help_texts(self, ctx):
            return super().format_help(ctx, formatter)


class FlowrlCommand(_LiteralHelp, _PlainFlags, typer.core.TyperCommand):
    pass


class FlowrlGroup(_LiteralHelp, _PlainFlags, typer.core.TyperGroup):
    pass


class FlowrlTyper(typer.Typer):
    """A Typer app whose commands and groups use the classes above."""

    def __init__(self, **kwargs):
        kwargs.setdefault("cls", FlowrlGroup)
        super().__init__(**kwargs)

    def command(self, *args, **kwargs):
        kwargs.setdefault("cls", FlowrlCommand)
        return super().command(*args, **kwargs)


app = FlowrlTyper(
    name="flowrl",
    help="Reinforcement learning for flow-matching text-to-image models (GRPO, GSPO, Chunk-GRPO).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)

#: Where no terminal gives a width (a pipe, a log, a Slurm output file) rich assumes 80 columns
#: and folds table cells mid-word. A table of figures then takes the width its cells need (a log
#: has no width to fit) ...
TABLE_WIDTH_WITHOUT_TERMINAL = 1000
#: ... and a table of prose (``flowrl validate --explain``) wraps its text at spaces within lines
#: a reader can take in.
TEXT_WIDTH_WITHOUT_TERMINAL = 120


def table_console(width_without_terminal: int = TABLE_WIDTH_WITHOUT_TERMINAL) -> Console:
    """The console to print tables on: :data:`console` on a terminal, or where ``COLUMNS`` says
    how wide the output is; otherwise one ``width_without_terminal`` columns wide."""
    import os

    if console.is_terminal or os.environ.get("COLUMNS", "").strip().isdigit():
        return console
    return Console(width=width_without_terminal)


class Options:
    """The global options (``flowrl --debug --disable-plugin NAME ...``), set before a command runs."""

    debug = False
    disabled_plugins: list[str] = []


options = Options()

RecipeArg = Annotated[Path, typer.Argument(help="Path to a TOML recipe (see recipes/).")]
SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", "-s", help="Override a recipe key: section.key=value (TOML value). Repeatable."),
]

# Arguments and options that several commands (sample, eval, profile) share, word for word.
SourceArg = Annotated[
    Optional[Path],
    typer.Argument(help="A run directory (latest checkpoint), a checkpoint directory, or a recipe."),
]
CheckpointOpt = Annotated[Optional[Path], typer.Option("--checkpoint", help="A specific checkpoint directory of the run.")]
PromptOpt = Annotated[Optional[list[str]], typer.Option("--prompt", "-p", help="A prompt (repeatable).")]
NumPromptsOpt = Annotated[int, typer.Option("--num-prompts", min=0, help="Use the first N prompts (0 = all).")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", min=0, max=2**63 - 1,
                                                help="Base seed (default: the recipe's run.seed, else 42).")]
ScheduleOpt = Annotated[
    str, typer.Option("--schedule", help="'auto' (recipe's, else the model's own), 'model', or a schedule name.")
]
DeviceOpt = Annotated[
    Optional[str], typer.Option("--device", help="'auto', 'cpu', 'cuda' (default: the recipe's run.device).")
]


def registry() -> Registry:
    """The plugin registry, without the plugins disabled on the command line."""
    from ..plugins import get_registry

    return get_registry(options.disabled_plugins)


def load(recipe: Path, overrides: Optional[list[str]] = None) -> Recipe:
    """Read, override and validate a recipe against the registry."""
    from ..recipe import load_recipe

    return load_recipe(recipe, list(overrides or []), registry=registry())
