"""benchmarks/gpu_flux_iteration.py measures flowrl on the full-size FLUX.1-dev transformer on a
GPU (docs/benchmarks.md). What can be checked without one: the pipeline it builds has FLUX.1-dev's
shapes (built on the meta device, no memory), and the flux adapter takes it in place of a download."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

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
