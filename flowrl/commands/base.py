"""What every command shares: the Typer app, the consoles, the plugin registry and recipe loading.

Each module in :mod:`flowrl.commands` adds its command(s) to :data:`app` when imported;
:mod:`flowrl.cli` imports them all and runs the app. Heavy imports stay inside the command
functions, so ``flowrl --help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console

if TYPE_CHECKING:  # torch loads with the recipe module: only when a command needs it
    from ..plugins import Registry
    from ..recipe import Recipe

app = typer.Typer(
    name="flowrl",
    help="Reinforcement learning for flow-matching text-to-image models (GRPO, GSPO, Chunk-GRPO).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)


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
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Base seed (default: the recipe's run.seed, else 42).")]
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
