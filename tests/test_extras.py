"""A missing optional dependency is one clear message that names the pip command to run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tiny_recipe import tiny_recipe

from flowrl.errors import MissingDependencyError, require


def test_require_names_the_extra_to_install():
    assert require("json", extra="dev", purpose="x") is json
    with pytest.raises(MissingDependencyError) as err:
        require("surely_not_an_installed_module_xyz", extra="clip", purpose="the 'clip' reward")
    text = err.value.format()
    assert "the 'clip' reward needs the optional package 'surely_not_an_installed_module_xyz'" in text
    assert 'pip install "flowrl-diffusion[clip]"' in text


# open_clip is hidden the way a missing package is (`import open_clip` raises ImportError), so
# the message is tested whether or not the `clip` extra is installed (the dev extra installs it).
HIDDEN_OPEN_CLIP = """
import sys
sys.modules["open_clip"] = None
from flowrl import cli
cli.main(sys.argv[1:])
"""


@pytest.mark.slow
def test_training_with_the_open_clip_backend_missing_says_which_extra(tmp_path):
    """End to end through the CLI: exit 2, the pip command, no traceback."""
    recipe = tmp_path / "r.toml"
    recipe.write_text(tiny_recipe(run=None, sampler={"steps": 3}, chunker={"use": "step", "size": None},
                                  train={"iterations": 1, "prompts_per_iteration": 1, "group_size": 2},
                                  log={"image_every": None}, rewards=[{"use": "clip"}]))
    proc = subprocess.run(
        [sys.executable, "-c", HIDDEN_OPEN_CLIP, "train", str(recipe), "-o", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert 'pip install "flowrl-diffusion[clip]"' in proc.stderr
    assert "Traceback" not in proc.stderr
