"""Two processes where one has nothing to do in a phase: every process must still reach the same
collectives in the same order.

A reward plugin, installed the way a third party installs one (an entry point of a distribution
on the path), ties every group of process 1: its advantages are all zero, so in the update it
re-scores nothing (no rows at any position) and its on-policy probe is never fed. (Under ddp
it also evaluates nothing: the evaluation's 2 images are one batch, the main process's share.)
The runs keep evaluation, images and checkpoints on every iteration, as users run, with two passes over each rollout (the first on-policy through
the fast path, the second off-policy), under ddp and under FSDP2 (where process 1 must still make
the sharded denoiser's forwards alongside). Before the fix, ddp aborted in the first iteration
(the compute counter all-reduced tables of different lengths) and a process that fed nothing to
the on-policy check skipped its collective.
"""

from __future__ import annotations

import json
import os

import pytest
from engine_helpers import run_cli
from tiny_recipe import write_recipe

from flowrl.runlog import read_metrics

PLUGIN = '''
import os

import torch

from flowrl import hookimpl
from flowrl_plugins.embedded.rewards import foreground_area


def tied_on_process_1(images, prompts):
    if int(os.environ.get("RANK", "0")) == 1:  # every group of process 1 ties: zero advantages
        return torch.full((len(prompts),), 0.5)
    return foreground_area(images, prompts)


@hookimpl
def register_rewards(register):
    register("tied_on_process_1", tied_on_process_1, help="area, but constant on process 1")
'''

SETS = [
    "train.iterations=2", "train.prompts_per_iteration=2", "train.group_size=4", "train.micro_batch_size=2",
    "train.updates_per_rollout=2", "train.optimizer_steps_per_update=1", "checkpoint.every=1",
    "prompts.num_eval=2", "log.eval_every=1", "log.image_every=1",
]


@pytest.fixture(scope="module")
def plugin_path(plugin_site):
    """A directory holding a one-module distribution with a ``flowrl`` entry point."""
    return plugin_site("idle_rank_plugin", PLUGIN)


@pytest.mark.slow
@pytest.mark.parametrize("sets", [
    ["distributed.strategy='ddp'", "train.update_mode='lean'"],
    ["distributed.strategy='fsdp2'", "train.update_mode='chunk_graph'", "loss.beta=0.05"],
    # the KL measured at beta = 0 ([log].kl_every), each process training its own half of the chunks,
    # so that at some positions one process has rows to measure and the other forwards a stand-in
    ["distributed.strategy='fsdp2'", "train.update_mode='lean'", "log.kl_every=1", "selector.use='uniform'",
     "selector.fraction=0.5"],
], ids=["ddp_lean", "fsdp2_chunk_graph_kl", "fsdp2_lean_kl_measured"])
def test_a_process_with_nothing_to_do_keeps_step(tmp_path, plugin_path, sets):
    recipe = write_recipe(tmp_path)
    recipe.write_text(recipe.read_text().replace('use = "area"', 'use = "tied_on_process_1"'))
    out = tmp_path / "run"
    args = [a for s in (*SETS, *sets) for a in ("--set", s)]
    env_path = os.pathsep.join([str(plugin_path), os.environ.get("PYTHONPATH", "")])
    proc = run_cli(["train", str(recipe), *args, "-o", str(out), "--num-processes", "2"], timeout=300,
                   env={"PYTHONPATH": env_path})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    *rows, final = read_metrics(out)
    assert [r["iteration"] for r in rows] == [0, 1] and final["final"] and "eval/tied_on_process_1/mean" in final
    for row in rows:
        assert row["world_size"] == 2
        assert row["groups/all_equal_fraction"] == 0.5  # process 1's group tied, process 0's did not
        assert "on_policy/max_abs_log_ratio" in row  # checked, though process 1 fed the probe nothing
        assert row["on_policy/max_abs_log_ratio"] <= 1e-4
        assert "eval/tied_on_process_1/mean" in row and "compute/minimum" in row
        if "log.kl_every=1" in sets:
            assert row["kl/gaussian_exact"] >= 0 and row["compute/kl_monitor/forward"] > 0
    for it in (1, 2):
        state = json.loads((out / "checkpoints" / f"iter_{it:06d}" / "state.json").read_text())
        assert state["world_size"] == 2
    assert list((out / "images").rglob("*.png")), "no image written"
