"""benchmarks/gpu_flux_iteration.py measures flowrl on the full-size FLUX.1-dev transformer on a
GPU (docs/benchmarks.md). What can be checked without one: the pipeline it builds has FLUX.1-dev's
shapes (built on the meta device, no memory), the flux adapter takes it in place of a download, and
the script runs end to end at a tiny size, reporting the run's own MFU and its FLOP count beside
the hand count."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from flowrl.runlog import is_phase_seconds
from flowrl.train.throughput import Throughput

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_flux_iteration as bench  # noqa: E402


def test_the_benchmark_builds_flux1_dev_at_full_size():
    pipe = bench.flux_dev_random("meta", None)
    transformer = sum(p.numel() for p in pipe.transformer.parameters())
    assert 11.85e9 < transformer < 11.95e9  # FLUX.1-dev: 11.9e9 parameters
    assert all(p.dtype == torch.bfloat16 for p in pipe.transformer.parameters())
    assert pipe.vae.config.latent_channels * 4 == pipe.transformer.config.in_channels
    assert pipe.text_encoder_2.config.d_model == pipe.transformer.config.joint_attention_dim
    assert pipe.text_encoder.config.projection_dim == pipe.transformer.config.pooled_projection_dim


def test_the_flux_adapter_takes_the_built_pipeline_instead_of_loading():
    from flowrl_plugins.diffusers_models.flux import FluxConfig, FluxModel

    built = []
    with bench.built_in_memory(lambda: built.append(bench.flux_dev_random("meta", (1, 1))) or built[-1]):
        model = FluxModel(FluxConfig(path="in-memory", height=64, width=64, max_sequence_length=16))
    assert model.pipe is built[0] and model.latent_shape == (16, 64)
    assert "_load" not in FluxModel.__dict__  # put back as it was


#: the script on the CPU, as small as it goes: one block of each kind at width 128, a small VAE,
#: 64 x 64 (16 image tokens), 16 text tokens, 2 samples, 3 sampling steps, warm-up + 1 iteration
TINY = ["--device", "cpu", "--layers", "1", "1", "--heads", "1", "--small-vae", "--size", "64",
        "--max-sequence-length", "16", "--iterations", "2", "--variants", "step",
        "--set", "train.group_size=2", "train.micro_batch_size=2", "sampler.steps=3"]


def test_the_benchmark_reports_the_runs_own_mfu_and_the_hand_flop_count(tmp_path, monkeypatch):
    """MFU per variant is what the run itself reported as ``speed/mfu`` (null without a peak), and
    the run's counted FLOPs (run_info.json) sit beside the hand count, equal to it."""
    monkeypatch.delenv("FLOWRL_PEAK_TFLOPS", raising=False)
    assert bench.main([*TINY, "--json", str(tmp_path / "cpu.json")]) == 0
    entry = json.loads((tmp_path / "cpu.json").read_text())["variants"]["step"]
    assert "mfu" in entry and entry["mfu"] is None and entry["peak_tflops"] is None  # a CPU has no known peak
    assert [set(r) for r in entry["speed"]] == [{"speed/images_per_second", "speed/eta_seconds",
                                                 "speed/model_tflops_per_second"}]
    flops = entry["flops"]
    assert flops["hand_equals_counted"] and flops["hand"]["attention"] == "none"  # the CPU kernel is not counted
    assert flops["counted"] == {k: flops["hand"][k] for k in bench.COUNTED}
    assert flops["hand"]["finetune"] == "lora" and flops["hand"]["checkpointing"]
    # checkpointing on: the model's F_fb (speed/mfu) leaves the recomputed block forwards out, the
    # count with recompute (speed/hfu) has them; both as the hand count says
    from flowrl.train.flux_flops import blocks_forward_flops

    counted = flops["counted"]
    recomputed = counted["velocity_forward_backward_with_recompute"] - counted["velocity_forward_backward"]
    hand = flops["hand"]
    assert recomputed == blocks_forward_flops(hand["image_tokens"], hand["text_tokens"], bench.transformer_config(
        (1, 1), 1), lora_rank=hand["lora_rank"], lora_targets=hand["lora_targets"], attention="none") > 0
    assert not any(bench.REPO.joinpath("recipes").glob(".gpu_flux_bench_*"))  # its recipe copy is not left there

    monkeypatch.setenv("FLOWRL_PEAK_TFLOPS", "0.5")
    assert bench.main([*TINY, "--json", str(tmp_path / "peak.json")]) == 0
    entry = json.loads((tmp_path / "peak.json").read_text())["variants"]["step"]
    (speed,) = entry["speed"]  # the measured iteration (iteration 1), as the trackers got it
    assert entry["peak_tflops"] == 0.5
    assert entry["mfu"] == speed["speed/mfu"] == speed["speed/model_tflops_per_second"] / 0.5
    assert entry["hfu"] == speed["speed/hfu"] > entry["mfu"]  # checkpointing on: HFU counts its recomputation
    # ... which is the run's formula on its own constants and seconds (flowrl.train.throughput)
    counted = entry["flops"]["counted"]
    f, fb = counted["velocity_forward"], counted["velocity_forward_backward"]
    compute, seconds = entry["compute"], entry["phase_seconds"]
    assert all(is_phase_seconds(k) for k in seconds)  # the update's parts are apart, in update_seconds
    assert set(entry["update_seconds"]) == {f"time/update/{p}" for p in ("micro_batches", "gradient_sync", "optimizer")}
    t_train = sum(v for k, v in seconds.items() if k.split("/")[1] not in Throughput.NOT_TRAINING)
    model_flops = compute["compute/rollout/forward"] * f + compute["compute/update/backward"] * fb
    assert entry["mfu"] == pytest.approx(model_flops / t_train / 1e12 / 0.5, rel=1e-6)
    hardware_flops = model_flops + compute["compute/update/backward"] * (
        counted["velocity_forward_backward_with_recompute"] - fb)
    assert entry["hfu"] == pytest.approx(hardware_flops / t_train / 1e12 / 0.5, rel=1e-6)
