"""benchmarks/memory_plan.py's core on a tiny FLUX transformer: FSDP2 really shards under the
fake process group, and torch's memory tracker sees the shards.

The benchmark itself (full-size models, minutes of CPU) is not run here; this checks that the
function it is built on measures what it says: at world size 2 every parameter is a DTensor
with Shard(0), and the tracker's parameter bytes are the full fp32 bytes / 2, the gradient
shards the same, and the AdamW state twice that.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from script_modules import benchmark_module

pytest.importorskip("diffusers")


def _bench():
    return benchmark_module("memory_plan")


# Every dimension even, so that sharding over 2 ranks needs no padding and halves exactly.
TINY_FLUX = {
    "patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 2, "attention_head_dim": 16,
    "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32, "guidance_embeds": True,
    "axes_dims_rope": [4, 6, 6],
}


def test_fsdp_tracker_sees_half_the_parameters_at_world_size_2():
    bench = _bench()
    family = dataclasses.replace(bench.FLUX1, config=TINY_FLUX)
    # As the flagship recipe: per-block fully_shard, bf16 compute, activation checkpointing.
    r = bench.track_fsdp(family, 2, img=16, txt=8, checkpointing=True)

    assert r["all_dtensor_shard0"], "fully_shard did not turn every parameter into a Shard(0) DTensor"
    full = sum(p.numel() for p in family.build().parameters()) * 4
    assert r["full_param_bytes"] == full
    assert r["local_param_bytes"] * 2 == full
    # What torch's tracker counted: sharded fp32 parameters and gradients, AdamW's two moments
    # (plus one 4-byte step counter per parameter tensor).
    assert r["params"] == full // 2
    assert r["grads"] == full // 2
    n_tensors = len(list(family.build().parameters()))
    assert r["optimizer"] == full + 4 * n_tensors
    assert r["activations"] > 0 and r["peak"] > r["params"] + r["grads"] + r["optimizer"]
    # The process group is the benchmark's own and is gone afterwards.
    assert not torch.distributed.is_initialized()


def test_the_tracked_kl_reference_is_built_as_flowrl_builds_it():
    """The KL items track the reference the diffusers adapters keep: flowrl's own frozen copy of
    the float32 model in the bf16 compute dtype, sharded like the model (they tracked a float32
    copy, twice what a run holds), in the steady state and at start-up."""
    bench = _bench()
    family = dataclasses.replace(bench.FLUX1, config=TINY_FLUX)
    full = sum(p.numel() for p in family.build().parameters()) * 4
    r = bench.track_fsdp(family, 2, img=16, txt=8, checkpointing=True, iterations=1, reference=True)
    assert r["reference_sharded"] and r["reference_bytes"] * 2 * 2 == full  # bf16, halved by the shards
    s = bench.track_startup(family, 2, reference=True)
    assert s["reference_bytes"] * 2 * 2 == full
    assert s["after"] == full // 2 + full // 4  # the model's fp32 shards and the reference's bf16 ones
    assert not torch.distributed.is_initialized()


def test_per_block_extrapolation_is_exact_on_a_linear_quantity():
    bench = _bench()
    family = bench.FLUX1
    # A(d, s) = 5 + 3 d + 2 s for every key: the fit must recover it at the full depth.
    runs = {d: {k: 5 + 3 * d[0] + 2 * d[1] for k in bench.KEYS} for d in bench.reduced_depths(family)}
    ext = bench.extrapolate(family, runs)
    assert ext["per_block"]["activations"] == {"double": 3, "single": 2}
    assert ext["outside"]["activations"] == 5
    assert ext["value"]["peak"] == 5 + 3 * 19 + 2 * 38
