"""Data parallelism: 2 gloo processes under torchrun equal 1 process on the same global batch."""

from __future__ import annotations

import json

from engine_helpers import assert_records_close, assert_weights_close, final_weights, load, quiet_console, run_cli

from flowrl.runlog import read_metrics
from flowrl.train import train

# 3 prompts x 4 samples over 2 processes: 6 samples each, so prompt 1's group is split across
# the processes on purpose and its advantages need the gathered rewards.
ONE_STEP = [
    "train.iterations=1", "train.prompts_per_iteration=3", "train.group_size=4", "train.micro_batch_size=2",
    "train.updates_per_rollout=1", "train.optimizer_steps_per_update=1",
]


def test_two_processes_equal_one(tmp_path, reference_run):
    recipe_path, _, _ = reference_run
    two, one = tmp_path / "two", tmp_path / "one"
    sets = [a for s in ONE_STEP for a in ("--set", s)]
    proc = run_cli(["train", str(recipe_path), *sets, "-o", str(two), "--num-processes", "2"], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = " ".join(proc.stdout.split())
    assert "world size 2" in out and "6 per process" in out and "split groups across processes" in out

    train(load(recipe_path, *ONE_STEP, f"run.output_dir={str(one)!r}"), console=quiet_console())

    [rec2], [rec1] = read_metrics(two), read_metrics(one)
    # the world size inside the run, not just what was asked for
    assert rec2["world_size"] == 2 and rec1["world_size"] == 1
    state = json.loads((two / "checkpoints" / "iter_000001" / "state.json").read_text())
    assert state["world_size"] == 2
    rec2.pop("world_size"), rec1.pop("world_size")
    assert len(rec2["trained_units"]) == 12  # gathered from both processes, in global order
    assert_records_close(rec2, rec1, rtol=1e-4, atol=1e-6)
    assert_weights_close(final_weights(two), final_weights(one), atol=1e-6)
    # ... and the step really moved them (lr 3e-3): equal because both processes did their share
    from flowrl_plugins.embedded.plugin import EmbeddedConfig, EmbeddedModel

    initial = dict(EmbeddedModel(EmbeddedConfig(random_init=True)).denoiser.named_parameters())
    moved = max((w - initial[k].detach()).abs().max().item() for k, w in final_weights(one).items())
    assert moved > 1e-4
