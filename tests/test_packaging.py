"""Packaging: what `pip install flowrl-diffusion` ships, its entry points, and the CLI's help screens.

The full install check (wheel and sdist into fresh environments, the quickstart run from outside
the checkout) is scripts/check_install.py: it installs torch, too slow for the suite."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import typer.main

from flowrl import cli
from flowrl.plugins import ENTRY_POINT_GROUP

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
#: source directory -> import name, as [tool.setuptools] package-dir maps them
ROOTS = {"flowrl": "flowrl", "plugins": "flowrl_plugins"}


def _package_dirs() -> dict[str, Path]:
    found = {}
    for src, name in ROOTS.items():
        for init in (REPO / src).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / src)
            if any(part.startswith((".", "__")) for part in rel.parts):
                continue
            found[".".join((name, *rel.parts))] = init.parent
    return found


def test_the_distribution_name_is_ours_and_installed():
    """`flowrl` on PyPI is an unrelated JAX library whose import package is also `flowrl`:
    the distribution is flowrl-diffusion; the import name and command stay."""
    import flowrl

    assert PYPROJECT["project"]["name"] == flowrl.DISTRIBUTION == "flowrl-diffusion"
    assert metadata.distribution(flowrl.DISTRIBUTION).metadata["Name"] == "flowrl-diffusion"
    assert PYPROJECT["project"]["scripts"] == {"flowrl": "flowrl.cli:main"}


def test_no_text_tells_a_user_to_install_the_other_flowrl():
    """Installing the name `flowrl` (with or without extras) would get the JAX library from PyPI."""
    import re

    install = re.compile(r"pip install\s+[\"']?flowrl(?![-\w])|(?<![\w/.-])flowrl\[[a-z,]+\]")
    found = {}
    for path in [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "flowrl").rglob("*.py"),
                 *(REPO / "plugins").rglob("*.py"), *(REPO / "recipes").glob("*.toml")]:
        hits = install.findall(path.read_text(encoding="utf-8"))
        if hits:
            found[path.relative_to(REPO).as_posix()] = len(hits)
    assert not found, f"name the distribution flowrl-diffusion (pip install \"flowrl-diffusion[x]\"): {found}"


def test_package_dir_mapping():
    assert PYPROJECT["tool"]["setuptools"]["package-dir"] == {"flowrl": "flowrl", "flowrl_plugins": "plugins"}


def test_every_package_directory_is_listed():
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found = _package_dirs()
    assert {"flowrl", "flowrl_plugins"} <= set(found)
    missing = sorted(set(found) - listed)
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {missing}"
    stale = sorted(listed - set(found))
    assert not stale, f"listed in pyproject.toml but no such package directory: {stale}"


def _declared_entry_points() -> dict[str, str]:
    return PYPROJECT["project"]["entry-points"][ENTRY_POINT_GROUP]


def test_declared_entry_points_are_installed():
    installed = {
        ep.name: ep.value
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)
        if ep.dist is not None and ep.dist.metadata["Name"] == "flowrl-diffusion"
    }
    assert installed == _declared_entry_points(), (
        "the installed metadata differs from pyproject.toml: reinstall with `pip install -e .`"
    )


@pytest.mark.parametrize("name", sorted(_declared_entry_points()))
def test_entry_point_loads(name):
    (ep,) = [ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    plugin = ep.load()
    assert plugin.__name__ == ep.value  # a module, as every built-in plugin is


def test_console_script_is_cli_main():
    (ep,) = [ep for ep in metadata.entry_points(group="console_scripts") if ep.name == "flowrl"]
    assert ep.value == PYPROJECT["project"]["scripts"]["flowrl"]
    assert ep.load() is cli.main


def _commands():
    group = typer.main.get_command(cli.app)
    return {name: cmd for name, cmd in group.commands.items() if not cmd.hidden}


def test_python_m_flowrl_help(flowrl_cli):
    proc = subprocess.run(
        [sys.executable, "-m", "flowrl", "--help"],
        cwd=REPO, env=flowrl_cli.env(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    for option in ("--debug", "--disable-plugin"):
        assert option in proc.stdout
    for name in _commands():
        assert name in proc.stdout, f"command {name} missing from `flowrl --help`"


def test_core_commands_exist():
    assert {"validate", "plugins", "train"} <= set(_commands())


@pytest.mark.parametrize("name", sorted(_commands()))
def test_command_help_mentions_its_options(name, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    cmd = _commands()[name]
    cli.main([name, "--help"])  # returns normally: exit status 0
    out = capsys.readouterr().out
    assert "Usage" in out and name in out
    assert cmd.help and cmd.help.split()[0] in out, f"command {name} needs a docstring"
    for p in cmd.params:
        if p.param_type_name == "option":
            assert any(opt in out for opt in p.opts), f"`flowrl {name} --help` does not show {p.opts}"
            assert p.help, f"option {p.opts} of `flowrl {name}` has no help text"
        else:
            assert p.name.upper() in out.upper(), f"`flowrl {name} --help` does not show argument {p.name}"


def test_what_diffusers_pipelines_import_unguarded_is_a_dependency():
    # diffusers' Wan image-to-video pipeline calls ftfy.fix_text without checking it is installed
    # (a NameError on an H200 image without ftfy); its text-to-video pipeline skips the cleaning
    # without it, so the same prompt would embed differently on two installs
    import re

    import diffusers

    source = (Path(diffusers.__file__).parent / "pipelines" / "wan" / "pipeline_wan_i2v.py").read_text()
    assert "ftfy.fix_text" in source
    declared = {re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].lower() for d in PYPROJECT["project"]["dependencies"]}
    assert "ftfy" in declared
