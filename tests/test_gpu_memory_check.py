"""benchmarks/gpu_memory_check.py compares ``flowrl plan``'s peak with ``max_memory_allocated`` of
real runs on a GPU. A GPU is lent for minutes, so the script must work the first time:
here its whole logic runs on the CPU at reduced size (``--device cpu --reduced``, the plans
computed, the measured figures null), the measured branch runs against a faked CUDA allocator,
a failing or skipped configuration (or a failing plan) is recorded without losing the others, and
the full-size pipelines it builds (on the meta device: no memory) have the published shapes."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_memory_check as bench

NAMES = ["flux", "sd3", "wan"]


def _finite_positive(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def _run(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "memory.json"
    assert bench.main([*args, "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_every_configuration_runs_and_is_planned_on_the_cpu(tmp_path):
    result = _run(tmp_path, "--device", "cpu", "--reduced")
    for key in ("device", "torch", "diffusers", "transformers", "date", "args", "seconds"):
        assert result[key] is not None, key
    assert result["cuda_overhead_gib"] == pytest.approx(1.5)
    assert list(result["configurations"]) == NAMES
    for name, entry in result["configurations"].items():
        assert entry["status"] == "ok" and entry["error"] is None, (name, entry.get("traceback"))
        assert (REPO / entry["recipe"]).is_file()
        assert set(bench.COMMON) <= set(entry["overrides"]) and 'model.dtype="fp32"' in entry["overrides"]
        assert entry["iterations"] == 2  # the run really trained, twice
        assert entry["compute"]["compute/update/backward"] > 0
        for key in ("planned_gib", "planned_tensors_gib", "planned_published_gib", "seconds", "train_seconds"):
            assert _finite_positive(entry[key]), (name, key, entry[key])
        assert entry["planned_tensors_gib"] == pytest.approx(entry["planned_gib"] - 1.5)
        assert {"encode", "rollout", "decode", "update"} <= set(entry["planned_phases_gib"])
        assert all(_finite_positive(v) for v in entry["planned_phases_gib"].values())
        assert max(entry["planned_phases_gib"].values()) == pytest.approx(entry["planned_tensors_gib"])
        items = {line["item"] for line in entry["plan_lines"]}
        assert {"denoiser weights", "LoRA weights", "activations, forward with grad"} <= items
        assert entry["measured_gib"] is None and entry["ratio"] is None  # no CUDA allocator here
    text = (REPO / "recipes" / "lora_single_gpu_sd3.toml").read_text()
    assert 'path = "stabilityai/stable-diffusion-3.5-medium"' in text  # the SD3.5-M recipe


class FakeAllocator:
    """torch.cuda's memory statistics on the CPU: every reset starts a larger peak."""

    def __init__(self):
        self.resets = 0

    def reset_peak_memory_stats(self, *a):
        self.resets += 1

    def max_memory_allocated(self, *a):
        return (self.resets + 1) * 2**20

    def max_memory_reserved(self, *a):
        return (self.resets + 2) * 2**20

    def memory_allocated(self, *a):
        return 0

    def memory_reserved(self, *a):
        return 0

    def mem_get_info(self, *a):
        return 70 * 2**30, 80 * 2**30


def test_the_measured_figures_on_a_faked_allocator_kept_when_a_plan_fails(tmp_path, monkeypatch):
    fake = FakeAllocator()
    for name in ("reset_peak_memory_stats", "max_memory_allocated", "max_memory_reserved", "memory_allocated",
                 "memory_reserved", "mem_get_info"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "measuring", lambda device: True)
    plan = bench.plan

    def published_plan_fails(recipe, overrides):
        if not any(o.startswith("model.path=") for o in overrides):
            raise ValueError("no configs for that hub id")
        return plan(recipe, overrides)

    monkeypatch.setattr(bench, "plan", published_plan_fails)
    entry = _run(tmp_path, "--device", "cpu", "--reduced", "--only", "flux")["configurations"]["flux"]
    assert entry["status"] == "failed" and entry["error"] == "the plan failed: ValueError: no configs for that hub id"
    assert entry["iterations"] == 2  # measured all the same
    phases = entry["measured_phases_gib"]
    assert {"start-up", "encode", "rollout", "decode", "reward", "update", "other"} <= set(phases)
    assert entry["measured_gib"] == pytest.approx(max(phases.values())) and entry["measured_gib"] > 0
    assert entry["ratio"] == pytest.approx(entry["measured_gib"] / entry["planned_tensors_gib"])
    assert entry["ratio_with_overhead"] == pytest.approx(entry["measured_gib"] / entry["planned_gib"])
    assert entry["outside_torch_gib"] == pytest.approx(10.0)
    assert entry["baseline_gib"] == 0.0 and entry["allocated_after_gib"] == 0.0
    assert fake.resets > 2 * len(phases)  # read and reset at every phase's start and end


def test_a_failing_configuration_is_recorded_and_the_next_runs(tmp_path, monkeypatch):
    def boom(device, reduced, dtype):
        raise RuntimeError("no such pipeline")

    configurations = {k: dataclasses.replace(v, build=boom) for k, v in bench.CONFIGURATIONS.items()}
    monkeypatch.setattr(bench, "CONFIGURATIONS", configurations)
    result = _run(tmp_path, "--device", "cpu", "--reduced", "--only", "flux,wan")
    assert list(result["configurations"]) == ["flux", "wan"]
    for entry in result["configurations"].values():
        assert entry["status"] == "failed" and entry["error"] == "RuntimeError: no such pipeline"
        assert "boom" in entry["traceback"]


def test_the_budget_skips_configurations(tmp_path):
    result = _run(tmp_path, "--device", "cpu", "--reduced", "--only", "sd3,wan", "--budget-s", "1e-9")
    for entry in result["configurations"].values():
        assert entry["status"] == "skipped" and entry["error"] is None and "--budget-s" in entry["skipped"]


def test_a_cpu_run_needs_the_reduced_sizes(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu"])
    assert "--reduced" in capsys.readouterr().err


def test_the_pipelines_have_the_published_shapes():
    sd3 = bench.build_sd3("meta", False, torch.bfloat16)
    t = sd3.transformer
    elements = sum(p.numel() for p in t.parameters()) + sum(b.numel() for b in t.buffers())
    assert 2.46e9 < elements < 2.48e9  # SD3.5 Medium, its positional table included
    assert all(x.dtype == torch.bfloat16 for x in [*t.parameters(), *t.buffers()])
    assert sd3.text_encoder.config.hidden_size + sd3.text_encoder_2.config.hidden_size == t.config.pooled_projection_dim
    assert sd3.text_encoder_3.config.d_model == t.config.joint_attention_dim
    assert sd3.vae.config.latent_channels == t.config.in_channels and len(sd3.vae.config.block_out_channels) == 4

    wan = bench.build_wan("meta", False, torch.bfloat16)
    t = wan.transformer
    assert 1.41e9 < sum(p.numel() for p in t.parameters()) < 1.43e9  # Wan 2.1 T2V 1.3B
    assert t.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32  # as from_pretrained keeps it
    assert t.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    assert wan.text_encoder.config.d_model == t.config.text_dim
    assert wan.vae.config.z_dim == t.config.in_channels and wan.vae.config.base_dim == 96
