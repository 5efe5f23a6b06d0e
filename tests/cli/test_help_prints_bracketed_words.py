"""Help screens print every ``[word]`` of a help text as written: Typer renders help as
Rich markup, which took ``[ema]``, ``[distributed]``, ``[log]`` or ``[plot]`` for unknown tags and
dropped them ("runs with  enabled", "needs flowrl-diffusion"). The tests walk every command and
subcommand of the app (so a new one is covered without being listed here) and render its
``--help`` through flowrl's command line in this process (the ``flowrl_cli`` fixture)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import typer.main

from flowrl.cli import app
from flowrl.commands.base import literal_markup

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
#: A bracketed word: a recipe table (``[ema]``, ``[distributed]``), an extra (``[plot]``).
BRACKETED = re.compile(r"\[[a-z_.]+\]")
#: An install hint in a help text: ``flowrl-diffusion[plot]`` (written ``\[plot]`` where escaped by hand).
EXTRA = re.compile(r"flowrl-diffusion\\?\[([a-z_]+)\]")


def walk(command, path: tuple[str, ...] = ()):
    """``(path, command)`` for the app's group and every command and subcommand under it."""
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        if not sub.hidden:
            yield from walk(sub, (*path, name))


COMMANDS = dict(walk(typer.main.get_command(app)))


def help_texts(command) -> list[str]:
    """What the command's help screen shows that its authors wrote: its help (before a ``\\f``),
    its parameters' help, and for a group the first paragraph of each of its commands' help."""
    texts = [(command.help or "").split("\f")[0], command.epilog or ""]
    texts += [getattr(p, "help", None) or "" for p in command.params]
    for sub in getattr(command, "commands", {}).values():
        texts.append(sub.short_help or (sub.help or "").split("\n\n")[0])
    return [t for t in texts if t]


@pytest.fixture
def render_help(flowrl_cli):
    """``render_help(path) -> text``: ``flowrl PATH --help`` with rich's line wrapping and box undone."""

    def render(path: tuple[str, ...]) -> str:
        (result,) = flowrl_cli.in_process([[*path, "--help"]])
        assert result.returncode == 0, result.stdout + result.stderr
        return " ".join(result.stdout.replace("│", " ").split())

    return render


def test_the_walk_finds_every_command_and_subcommand():
    names = {" ".join(path) for path in COMMANDS}
    assert {"", "train", "sample", "compare", "plan", "reward", "reward serve"} <= names, names


@pytest.mark.parametrize("path", list(COMMANDS), ids=lambda p: " ".join(p) or "flowrl")
def test_help_prints_every_bracketed_word_of_its_help_texts(path, render_help):
    words = sorted({w for text in help_texts(COMMANDS[path]) for w in BRACKETED.findall(text)})
    out = render_help(path)
    missing = [w for w in words if w not in out]
    assert not missing, f"`flowrl {' '.join(path)} --help` drops {missing}:\n{out}"


def test_the_help_of_sample_export_and_plan_names_the_recipe_tables(render_help):
    """The screens of sample, export, plan and doctor name their recipe tables, in words."""
    assert "(runs with [ema] enabled)" in render_help(("sample",))
    assert "(runs with [ema] enabled)" in render_help(("export",))
    assert "[distributed].num_processes" in render_help(("plan",))
    assert "[distributed] table" in render_help(("doctor",))


def test_compare_help_names_the_plot_extra_as_pip_installs_it(render_help):
    assert "flowrl-diffusion[plot]" in render_help(("compare",))


def test_every_extra_a_help_text_names_is_an_extra_of_the_package():
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
                 ["optional-dependencies"])
    named = {(" ".join(path), extra) for path, command in COMMANDS.items()
             for text in help_texts(command) for extra in EXTRA.findall(text)}
    assert ("compare", "plot") in named, named
    unknown = [(path, extra) for path, extra in named if extra not in extras]
    assert not unknown, f"help texts name extras that pyproject.toml does not define: {unknown}"


@pytest.mark.parametrize("text, shown", [
    ("runs with [ema] enabled", "runs with [ema] enabled"),
    ("needs flowrl-diffusion\\[fleet]", "needs flowrl-diffusion[fleet]"),  # escaped by hand: unchanged
    ("[default: the recipe's [distributed].num_processes]", "[default: the recipe's [distributed].num_processes]"),
    ("USAGE [OPTIONS] [x]", "USAGE [OPTIONS] [x]"),
    ("a backslash \\\\[log] before", "a backslash \\\\[log] before"),
])
def test_literal_markup_makes_rich_print_the_text_as_written(text, shown):
    from rich.text import Text

    assert Text.from_markup(literal_markup(text)).plain == shown
    assert literal_markup(literal_markup(text)) == literal_markup(text)


def test_the_help_texts_themselves_stay_as_written_after_a_help_screen(capsys):
    command = COMMANDS[("sample",)]
    option = next(p for p in command.params if p.name == "ema")
    with command.make_context("sample", [], resilient_parsing=True) as ctx:
        command.get_help(ctx)  # rich prints the screen
    assert "[ema]" in capsys.readouterr().out
    assert option.help == "Sample the checkpoint's EMA weights (runs with [ema] enabled)."
    assert command.help == "Sample images with fixed per-prompt seeds (ODE), optionally hybrid trained/base."
