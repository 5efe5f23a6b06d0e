"""The README's quickstart command line installs what its own last suggestion needs.

The quickstart ends with `flowrl plot runs/quickstart`. The test finds that suggestion in the
README, runs the command with matplotlib hidden to learn which extra it asks for, and checks
that the quickstart's `pip install` line installs that extra (and that the extra provides the
module).
"""

from __future__ import annotations

import pytest

import json
import re
import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")


def quickstart() -> str:
    return README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]


def installed_extras(section: str) -> set[str]:
    """Extras of the `pip install ... -e <spec>` in the quickstart's first shell block."""
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    spec = re.search(r"pip install [^&]*?-e (\"[^\"]+\"|'[^']+'|\S+)", block).group(1).strip("\"'")
    match = re.fullmatch(r"\.(?:\[([\w,\s-]+)\])?", spec)
    assert match, f"unexpected install spec {spec!r}"
    return {e.strip() for e in (match.group(1) or "").split(",") if e.strip()}


def suggestions_for_the_run(section: str) -> list[list[str]]:
    """The commands the quickstart suggests running on its run directory (runs/quickstart)."""
    commands = [c.split()[1:] for c in re.findall(r"`(flowrl [^`]+)`", section) if "runs/quickstart" in c]
    assert commands, "the quickstart suggests no command on its run"
    return commands


HIDE = """
import sys
sys.modules[{module!r}] = None  # as if the package were not installed
from flowrl import cli
cli.main({argv!r})
"""


@pytest.mark.slow
def test_the_quickstart_install_covers_its_last_suggested_command(tmp_path, flowrl_cli):
    section = quickstart()
    suggestions = suggestions_for_the_run(section)
    plots = [s for s in suggestions if s[0] == "plot"]
    assert plots, "the quickstart does not end with `flowrl plot runs/quickstart`"
    argv = plots[-1]
    run = tmp_path / "quickstart"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"iteration": i, "reward/area/mean": 0.1 * i}) + "\n"
                                               for i in range(3)))
    argv = [argv[0], str(run), *argv[2:]]
    proc = subprocess.run([sys.executable, "-c", HIDE.format(module="matplotlib", argv=argv)],
                          env=flowrl_cli.env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    needed = re.search(r'pip install "flowrl-diffusion\[(\w+)\]"', " ".join(proc.stderr.split())).group(1)
    assert needed in installed_extras(section), f"the quickstart installs {installed_extras(section)}, `flowrl {argv[0]}` needs [{needed}]"
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("matplotlib") for req in extras[needed])
    # with the extra installed (this environment) the suggestion works as written
    ok = subprocess.run([sys.executable, "-m", "flowrl", *argv], env=flowrl_cli.env(), capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert (run / "rewards.png").is_file()
