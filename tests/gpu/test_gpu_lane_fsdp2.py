"""FSDP2 in one process (``[distributed] strategy = "fsdp2"``, no launcher): flowrl then builds a
one-process group over an in-memory store itself (flowrl/distributed.py, ``setup``), on CUDA
``cpu:gloo,cuda:nccl`` so that the shards' collectives go over NCCL. On the CPU variant of the
lane the same group is gloo alone, which the tests check instead.

- bf16 (``MixedPrecisionPolicy``) with evaluation and image grids on: the run trains, its
  collectives ran on nccl (gloo on the CPU), its checkpoint is sharded (no rank gathers the model);
- fp32: one sharded process equals the unsharded run (``strategy = "none"``) to float32
  rounding, as 2 sharded processes equal 1 in tests/train/test_engine_fsdp2.py;
- killed after iteration 1 and resumed from the sharded checkpoint under deterministic
  algorithms: bit for bit the uninterrupted sharded run.

Tiny recipe of the engine tests (engine_helpers), 2-3 iterations: 54 s for the file on the 2-core CPU
(6 runs); not yet timed on a GPU.
"""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import TINY_RECIPE, write_recipe
from gpu_lane import (
    Killed,
    Watch,
    deterministic,
    finite_numbers,
    kill_after,
    read_rows,
    row_differences,
    train_run,
    weight_differences,
    weights,
    with_tracker,
)

from flowrl.plugins import temporary_plugin
from flowrl.train.checkpoint import latest_checkpoint

pytestmark = pytest.mark.gpu

FSDP2 = "distributed.strategy='fsdp2'"
SETS = ["train.iterations=2", "checkpoint.every=1", "train.optimizer_steps_per_update=1"]


def _group_seen() -> dict:
    """The process group as the loop has it, seen from a tracker inside the run."""
    import torch.distributed as dist

    seen = {"initialized": dist.is_initialized()}
    if seen["initialized"]:
        seen["backend"] = str(dist.get_backend())
        seen["world_size"] = dist.get_world_size()
        config = getattr(dist, "get_backend_config", None)
        seen["config"] = str(config()) if config else ""
    return seen


def _assert_sharded(run_dir, world_size=1):
    ckpt = latest_checkpoint(run_dir)
    state = json.loads((ckpt / "state.json").read_text())
    files = sorted(p.name for p in ckpt.iterdir())
    assert (ckpt / "sharded").is_dir() and "model.safetensors" not in files, files
    assert state["strategy"] == "fsdp2" and state["world_size"] == world_size


def test_one_process_fsdp2_trains_over_nccl_and_checkpoints_shards(lane, tmp_path):
    import torch.distributed as dist

    seen = []
    recipe = write_recipe(tmp_path, with_tracker(TINY_RECIPE, "lane_group"))
    with temporary_plugin(Watch("lane_group", lambda step, metrics: seen.append(_group_seen())), name="lane-group"):
        run_dir = train_run(recipe, tmp_path / "run", *lane.placed(), *SETS, FSDP2, "log.eval_every=1",
                            "prompts.num_eval=2", "log.image_every=1")
    assert seen and all(s["initialized"] and s["world_size"] == 1 for s in seen), seen
    where = seen[0]["backend"] + " " + seen[0]["config"]
    if lane.cuda:
        assert "nccl" in where, f"the one-process group on CUDA should run the shards' collectives on nccl: {where}"
    else:
        assert seen[0]["backend"] == "gloo", where
    assert not dist.is_initialized()  # the run took its group down
    rows = read_rows(run_dir)
    assert [r["iteration"] for r in rows] == [0, 1, 2] and rows[-1]["final"]
    assert all(not finite_numbers(r) for r in rows) and all(any(k.startswith("eval/") for k in r) for r in rows)
    assert rows[0]["grad_norm"] > 0 and rows[0]["on_policy/max_abs_log_ratio"] <= (1e-3 if lane.bf16 else 1e-6)
    assert list((run_dir / "images").rglob("*.png"))
    _assert_sharded(run_dir)
    saved = weights(run_dir)  # the shards read back whole
    assert saved and all(t.dtype == torch.float32 and bool(torch.isfinite(t).all()) for t in saved.values())


def test_one_sharded_process_equals_the_unsharded_run_in_fp32(lane, tmp_path):
    recipe = write_recipe(tmp_path)
    fp32 = [f"run.device={str(lane.device)!r}"]
    sharded = train_run(recipe, tmp_path / "sharded", *fp32, *SETS, FSDP2)
    whole = train_run(recipe, tmp_path / "whole", *fp32, *SETS, "distributed.strategy='none'")
    _assert_sharded(sharded)
    # the sharded run may add lockstep stand-in forwards (compute/*), never remove any
    wrong = row_differences(read_rows(sharded), read_rows(whole), rtol=1e-4, atol=1e-6,
                            ignore=("compute/", "world_size"))
    wrong += weight_differences(weights(sharded), weights(whole), atol=1e-6)
    assert not wrong, f"fp32 on {lane.device}: fsdp2 in one process != strategy none (rtol 1e-4, atol 1e-6): " + \
        "; ".join(wrong[:6])


def test_one_process_fsdp2_resumes_bit_for_bit_from_its_shards(lane, tmp_path):
    recipe = write_recipe(tmp_path)
    (tmp_path / "killed").mkdir()
    killed = write_recipe(tmp_path / "killed", with_tracker(TINY_RECIPE, "lane_kill_fsdp2"))
    sets = [*lane.placed(), *SETS, FSDP2, "train.iterations=3"]
    parts = tmp_path / "parts"
    with deterministic(True):
        whole = train_run(recipe, tmp_path / "whole", *sets)
        with temporary_plugin(Watch("lane_kill_fsdp2", kill_after(1)), name="lane-kill-fsdp2"), \
                pytest.raises(Killed):
            train_run(killed, parts, *sets)
        assert latest_checkpoint(parts).name == "iter_000001"
        _assert_sharded(parts)
        train_run(recipe, parts, *sets, resume=True)
    wrong = row_differences(read_rows(parts), read_rows(whole)) + weight_differences(weights(parts), weights(whole))
    assert not wrong, (f"fsdp2 {lane.precision} on {lane.device}, deterministic algorithms: resumed from the sharded "
                       "checkpoint must repeat the uninterrupted run bit for bit: " + "; ".join(wrong[:6]))
