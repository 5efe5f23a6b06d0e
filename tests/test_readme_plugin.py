"""The README's "Writing a plugin" example runs as written.

The test takes the example's three code blocks out of README.md (the plugin module, its
pyproject.toml and the recipe entry), builds and installs that distribution with pip into a
temporary directory, and runs the real CLI against it: `flowrl plugins` lists the new reward
next to every built-in one (no "registered twice"), and `flowrl train` trains two iterations of
the embedded model with the README's `[[rewards]]` entry.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_recipe import tiny_recipe

from flowrl.runlog import read_metrics

REPO = Path(__file__).resolve().parents[1]

#: The README's entry appended to a tiny recipe on the embedded model (T = 4 transitions).
TINY = tiny_recipe(run={"name": "readme_plugin", "seed": 3}, model={"random_init": None},
                   train={"micro_batch_size": 4}, rewards=None)


def readme_plugin_blocks() -> dict[str, str]:
    """The fenced blocks of README.md's "Writing a plugin" section: the module (its first line
    names its path), the pyproject.toml and the recipe entry."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## Writing a plugin", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)
    out = {}
    for lang, body in blocks:
        first = body.splitlines()[0]
        if lang == "python":
            out["module_path"] = first.lstrip("# ").strip()
            out["module"] = body
        elif lang == "toml" and first.startswith("# pyproject.toml"):
            out["pyproject"] = body
        elif lang == "toml" and "[[rewards]]" in body:
            out["recipe"] = body
    assert set(out) == {"module_path", "module", "pyproject", "recipe"}, f"README plugin blocks changed: {sorted(out)}"
    return out


def reward_name(blocks: dict[str, str]) -> str:
    return re.search(r'use = "(\w+)"', blocks["recipe"]).group(1)


def test_readme_plugin_example_does_not_reuse_a_builtin_name():
    from flowrl.plugins import get_registry

    blocks = readme_plugin_blocks()
    registered = re.findall(r'register\("(\w+)"', blocks["module"])
    assert registered == [reward_name(blocks)]
    assert registered[0] not in get_registry().names("reward")
    hookspecs = (REPO / "flowrl" / "hookspecs.py").read_text(encoding="utf-8")
    for name in re.findall(r'register\("(\w+)"', hookspecs):
        assert name not in get_registry().names("reward"), f"flowrl/hookspecs.py's example registers built-in '{name}'"


@pytest.fixture(scope="module")
def installed_example(tmp_path_factory):
    """pip-install the README's distribution into a directory (offline, no build isolation)."""
    pytest.importorskip("setuptools", reason="building the example distribution needs setuptools")
    blocks = readme_plugin_blocks()
    root = tmp_path_factory.mktemp("readme_plugin")
    src = root / "dist"
    module = src / blocks["module_path"]
    module.parent.mkdir(parents=True)
    (module.parent / "__init__.py").write_text("")
    module.write_text(blocks["module"])
    (src / "pyproject.toml").write_text(blocks["pyproject"])
    site = root / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "-q", "--target", str(site), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recipe = root / "recipe.toml"
    recipe.write_text(TINY + blocks["recipe"])
    return blocks, site, recipe, root


@pytest.mark.slow
def test_readme_plugin_example_installs_and_trains(installed_example, flowrl_cli):
    blocks, site, recipe, root = installed_example
    name = reward_name(blocks)
    run_dir = root / "run"
    plugins, train = flowrl_cli.batch(
        [["plugins", "--json"], ["train", str(recipe), "-o", str(run_dir)]], pythonpath=[site], timeout=600
    )
    assert plugins.returncode == 0, plugins.stderr
    listing = {p["plugin"]: p for p in json.loads(plugins.stdout)}
    assert listing["my_rewards"]["distribution"] == "my-rewards"
    assert f"reward:{name}" in listing["my_rewards"]["components"]
    assert "reward:brightness" in listing["embedded"]["components"]  # the built-ins load beside it
    assert train.returncode == 0, train.stderr
    rows = read_metrics(run_dir)
    assert [r["iteration"] for r in rows] == [0, 1]
    for row in rows:
        assert row[f"reward/{name}/mean"] == row[f"reward/{name}/mean"]  # finite: the reward scored
    saved = (run_dir / "recipe.toml").read_text()
    assert f'use = "{name}"' in saved and "gain = 2.0" in saved  # the README's recipe key reached the run
