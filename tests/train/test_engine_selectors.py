"""Flash-GRPO's and E-GRPO's selections under data parallelism: 2 gloo processes select what 1
process selects, with a prompt group split across the processes (docs/objectives.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import load, quiet_console, run_cli

from flowrl.runlog import read_metrics
from flowrl.train import train

REPO = Path(__file__).resolve().parents[2]
# 3 prompts x 4 samples over 2 processes: 6 each, so prompt 1's group is split
SMALL = ["train.iterations=1", "train.prompts_per_iteration=3", "train.group_size=4", "train.micro_batch_size=2",
         "prompts.num_eval=0", "log.image_every=0", "log.progress=false", "sampler.steps=9", "model.random_init=true",
         "sampler.sde_window=[0, 8]"]  # the recipes' SDE window [0, 16] at 9 steps: all 8 transitions


@pytest.mark.slow
@pytest.mark.parametrize("name", ["quickstart_flash", "quickstart_egrpo"])
def test_two_processes_select_what_one_selects(tmp_path, name):
    recipe = REPO / "recipes" / f"{name}.toml"
    one, two = tmp_path / "one", tmp_path / "two"
    sets = [a for s in SMALL for a in ("--set", s)]
    proc = run_cli(["train", str(recipe), *sets, "-o", str(two), "--num-processes", "2"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    train(load(recipe, *SMALL, f"run.output_dir={str(one)!r}"), console=quiet_console())
    [r2], [r1] = read_metrics(two), read_metrics(one)
    assert r2["world_size"] == 2 and r1["world_size"] == 1
    units = r1["trained_units"]
    assert r2["trained_units"] == units and len(units) == 12
    if name == "quickstart_flash":
        assert all(len(u) == 1 for u in units)
        assert all(units[4 * g: 4 * g + 4] == [units[4 * g]] * 4 for g in range(3))  # group 1 spans both processes
    assert r2["compute/update/forward"] == r1["compute/update/forward"]
