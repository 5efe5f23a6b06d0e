"""Every concrete ``flowrl`` command in the README and docs/ parses as the CLI parses it: the
command and subcommand exist, every option is one of its options and every value has its type.

The commands run by other tests (the quickstart's, compose.md's, sweep.md's, profile.md's, the
distributed and install pages') are also checked here; the many that need a GPU, a download or
an hour are at least held to the CLI as it is. Synopses with placeholders (``RECIPE``, ``[-o
OUT]``, ``N``, ``...``) are left out: they describe, they are not run. Nothing is executed: each
line goes through the parser only (click's ``make_context``).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from flowrl.cli import app

REPO = Path(__file__).resolve().parents[1]
#: A word that marks a synopsis rather than a command: an upper-case placeholder, brackets, an
#: ellipsis, a choice list.
PLACEHOLDER = re.compile(r"^\[|\]$|\.\.\.|…|^[A-Z][A-Z0-9_]*(/[A-Z_]+)?(=.*)?$|\|")


def shell_lines(text: str) -> list[str]:
    """The lines of the page's ``bash``/``sh``/``console`` fences and its indented command lines,
    continuations joined, comments and prompts stripped."""
    lines, fence, out = text.splitlines(), None, []
    joined: list[str] = []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip()
            continue
        in_shell = fence in ("bash", "sh", "console")
        indented = fence is None and line.startswith("    ") and stripped.startswith("flowrl ")
        if (fence is not None and in_shell) or indented:
            stripped = stripped.removeprefix("$ ")
            joined.append(stripped.rstrip("\\").strip())
            if not stripped.endswith("\\"):
                out.append(" ".join(joined))
                joined = []
    return out


def documented_commands() -> list[tuple[str, str, bool]]:
    """``(page, command, whether it stands in a shell block)``: an inline mention in prose may name
    a command and one of its options without the arguments a run needs (`flowrl eval --suite`)."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found = []
    for page in pages:
        name = page.relative_to(REPO).as_posix()
        if name == "docs/reference.md":  # generated from the recipe schema
            continue
        text = page.read_text(encoding="utf-8")
        candidates = {}
        for command in re.findall(r"`(flowrl [^`\n]+)`", text):
            candidates[command] = False
        for line in shell_lines(text):
            for part in re.split(r"\s*(?:&&|\|\||;|\|)\s*", line.split(" #")[0]):
                if part.startswith("flowrl "):
                    candidates[part] = True
        for command, in_shell in candidates.items():
            try:
                words = shlex.split(command)[1:]
            except ValueError:
                continue
            if len(words) >= 2 and not any(PLACEHOLDER.search(w) for w in words):
                found.append((name, command, in_shell))
    return found


def parse(argv: list[str]) -> None:
    """``flowrl ARGV`` through the CLI's parser, down to the leaf command; raises its UsageError."""
    command = typer.main.get_command(app)
    ctx = command.make_context("flowrl", list(argv))
    args = list(getattr(ctx, "_protected_args", [])) + list(ctx.args)
    while hasattr(command, "resolve_command") and args:
        name, command, args = command.resolve_command(ctx, args)
        ctx = command.make_context(name, list(args), parent=ctx)
        args = list(getattr(ctx, "_protected_args", [])) + list(ctx.args) if hasattr(command, "resolve_command") else []


COMMANDS = documented_commands()


def test_the_pages_hold_the_commands_users_copy():
    assert len(COMMANDS) > 100 and sum(in_shell for _, _, in_shell in COMMANDS) > 40
    assert ("README.md", "flowrl plot runs/quickstart", False) in COMMANDS


@pytest.mark.parametrize("page, command, in_shell", COMMANDS, ids=[f"{p}:{c[:60]}" for p, c, _ in COMMANDS])
def test_every_documented_command_parses(page, command, in_shell):
    try:
        parse(shlex.split(command)[1:])
    except Exception as exc:
        name = type(exc).__name__
        if "Exit" in name:  # --help, and a group's own exit
            return
        if not in_shell and name in ("MissingParameter", "BadOptionUsage") and "requires an argument" in str(exc) \
                or not in_shell and name == "MissingParameter":
            return  # a mention in prose: the command and an option, named
        pytest.fail(f"{page}: `{command}`: {name}: {exc}")


@pytest.mark.parametrize("argv, message", [
    (["train", "x.toml", "--bogus"], "No such option: --bogus"),
    (["sample", "runs/x", "--steps", "many"], "valid integer"),
    (["trian", "x.toml"], "No such command 'trian'"),
    (["reward", "score", "area", "--nope"], "No such option: --nope"),
])
def test_the_parser_check_catches_a_misspelt_command_or_option(argv, message):
    with pytest.raises(Exception, match=re.escape(message)):
        parse(argv)
