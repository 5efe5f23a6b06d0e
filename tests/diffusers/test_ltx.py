"""The LTX-Video text-to-video adapter (``ltx``) on a tiny offline LTXPipeline: the conformance suite,
diffusers' own sampling (its FlowMatchEuler scheduler with dynamic shift and shift_terminal, the
same noise) against flowrl's ODE, the token packing and decode against an independent
computation, and a 2-iteration LoRA run whose export LTXPipeline loads and reproduces."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from flowrl.errors import FlowrlError
from flowrl.testing.conformance import CHECK_NAMES, check_adapter

PROMPTS = ("a red cat", "the blue dog on the mat")
TINY = dict(dtype="fp32", height=32, width=64, num_frames=9, max_sequence_length=16)
RECIPE = "recipes/ltx_lora.toml"
GRID = (3, 2, 4)  # (9 - 1) / 4 + 1 latent frames; 32 / 16 and 64 / 16 (the tiny VAE's factors)
LATENT = (24, 8)  # tokens x latent channels


@pytest.fixture(scope="module")
def tiny_ltx(tiny_dir):
    from flowrl.testing.tiny_pipelines import build_tiny_ltx

    return build_tiny_ltx(tiny_dir / "ltx")


@pytest.fixture(scope="module")
def make(tiny_ltx):
    from flowrl_plugins.diffusers_models.ltx import LTXConfig, LTXModel

    return lambda **kw: LTXModel(LTXConfig(**{"path": str(tiny_ltx), **TINY, **kw}))


@pytest.fixture(scope="module")
def guided(make):
    """True CFG 3 (the pipeline's default). Do not modify it."""
    return make()


@pytest.fixture(scope="module")
def plain(make):
    """No CFG (cfg_scale = 1). Do not modify it."""
    return make(cfg_scale=1.0)


def _pipe_frames(pipe, prompts, noise, cfg, steps=4):
    return pipe(prompt=list(prompts), negative_prompt="", height=32, width=64, num_frames=9, frame_rate=25,
                num_inference_steps=steps, guidance_scale=cfg, latents=noise, output_type="pt",
                max_sequence_length=16).frames


def _ode_frames(model, prompts, noise, steps=4):
    from flowrl.sampling.rollout import ode_sample

    text = model.encode_prompts(prompts)
    return model.decode(ode_sample(lambda i, x, s: model.velocity(x, s, text), noise, model.sigmas(steps)))


def test_conforms(guided):
    report = check_adapter(guided)
    notes = {r.name: r.message for r in report.results}
    assert [r.name for r in report.results] == list(CHECK_NAMES)
    assert notes["decode"].startswith("clips (9, 3, 32, 64)")


@pytest.mark.parametrize("cfg", [3.0, 1.0])
def test_sampling_equals_the_ltx_pipeline(guided, plain, cfg):
    # timestep = 1000 sigma, the dynamic-shift schedule with shift_terminal, CFG on the negative
    # prompt, the text mask, RoPE's grid and scale, the unpacking and de-normalisation: all at once
    m = guided if cfg != 1.0 else plain
    noise = torch.randn(2, *m.latent_shape, generator=torch.Generator().manual_seed(0))
    ours = _ode_frames(m, PROMPTS, noise)
    ref = _pipe_frames(m.pipe, PROMPTS, noise, cfg)
    assert ours.shape == (2, 9, 3, 32, 64) and ours.dtype == torch.float32
    assert ((ref > 0) & (ref < 1)).float().mean() > 0.3, "the comparison needs unclamped pixels"
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_schedule_is_the_pipelines_with_shift_terminal(guided):
    import numpy as np

    sched = guided.pipe.scheduler
    sigmas = guided.sigmas(4)
    assert float(sigmas[0]) == pytest.approx(1.0) and float(sigmas[-2]) == pytest.approx(0.1)
    # the pipeline's mu for 24 tokens, by hand: linear between (1024, 0.95) and (4096, 2.05)
    mu = 0.95 + (2.05 - 0.95) / (4096 - 1024) * (24 - 1024)
    sched.set_timesteps(sigmas=np.linspace(1.0, 0.25, 4), mu=mu)
    torch.testing.assert_close(sigmas, sched.sigmas.float())


def test_token_packing_and_decode(guided):
    # Independent route: tokens frame-major, then rows, then columns, channels last -> [B, C, F, h, w]
    tokens = torch.randn(1, *LATENT, generator=torch.Generator().manual_seed(1))
    z = tokens.reshape(1, *GRID, 8).permute(0, 4, 1, 2, 3)
    vae = guided.pipe.vae
    z = z * vae.latents_std.view(1, 8, 1, 1, 1) + vae.latents_mean.view(1, 8, 1, 1, 1)
    with torch.no_grad():
        video = vae.decode(z, None, return_dict=False)[0]  # [1, 3, 9, 32, 64]
    expected = (video.transpose(1, 2) / 2 + 0.5).clamp(0, 1)
    torch.testing.assert_close(guided.decode(tokens), expected)
    assert guided.latent_shape == LATENT and guided.grid == GRID and guided.rope_scale == (4 / 25, 16, 16)


def test_a_timestep_conditioned_vae_decodes_at_decode_timestep(tiny_dir):
    # LTX-Video 0.9.1+: the VAE's decoder takes a timestep; the pipeline with decode_noise_scale = 0
    # (no noise mixed in) is what flowrl's deterministic decode does
    from flowrl.testing.tiny_pipelines import build_tiny_ltx
    from flowrl_plugins.diffusers_models.ltx import LTXConfig, LTXModel

    path = build_tiny_ltx(tiny_dir / "ltx_tc", timestep_conditioning=True)
    m = LTXModel(LTXConfig(path=str(path), **{**TINY, "num_frames": 17}, cfg_scale=1.0, decode_timestep=0.05))
    assert m.pipe.vae.config.timestep_conditioning and m.latent_shape == (3 * 1 * 2, 8)  # factors 32 and 8
    noise = torch.randn(1, *m.latent_shape, generator=torch.Generator().manual_seed(8))
    ours = _ode_frames(m, PROMPTS[:1], noise)
    ref = m.pipe(prompt=list(PROMPTS[:1]), negative_prompt="", height=32, width=64, num_frames=17, frame_rate=25,
                 num_inference_steps=4, guidance_scale=1.0, latents=noise, output_type="pt", max_sequence_length=16,
                 decode_timestep=0.05, decode_noise_scale=0.0).frames
    assert ours.shape == (1, 17, 3, 32, 64)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    before = m.decode(noise)
    m.config = dataclasses.replace(m.config, decode_timestep=0.0)  # the adapter reads it at each decode
    assert (before - m.decode(noise)).abs().max() > 1e-4, "decode_timestep does not reach the VAE"


def test_frames_and_size_must_fit_the_vae(make):
    from flowrl_plugins.diffusers_models.ltx import LTXConfig

    with pytest.raises(ValueError, match="8k \\+ 1"):
        LTXConfig(num_frames=12)
    with pytest.raises(FlowrlError, match="multiple of 16"):
        make(height=40)


_SETS = ["model.height=32", "model.width=64", "model.num_frames=9", "model.max_sequence_length=16",
         "model.dtype=fp32", "model.vae_batch_size=8", "model.gradient_checkpointing=false",
         "train.iterations=2", "train.prompts_per_iteration=1", "train.group_size=2", "train.micro_batch_size=2",
         "train.optimizer_steps_per_update=1", "rewards.0.use=brightness", "log.progress=false",
         "log.image_every=1", "run.device=cpu",
         "train.lora_rank=4", "train.lora_alpha=8.0", "train.lr=0.05", "train.max_grad_norm=0"]


def test_lora_export_loads_into_ltx_pipeline_and_reproduces_the_policy(module_cli, tiny_ltx, tmp_path):
    from diffusers import LTXPipeline

    from flowrl.commands.inference import load_policy, resolve_source

    cli = module_cli.merged
    sets = []
    for item in [f"model.path={tiny_ltx}", *_SETS]:
        sets += ["--set", item]
    run = tmp_path / "run"
    code, text = cli("train", RECIPE, *sets, "-o", run)
    assert code == 0, text
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1]
    out = tmp_path / "lora"
    code, text = cli("export", run, "-o", out)
    assert code == 0, text
    noise = torch.randn(1, *LATENT, generator=torch.Generator().manual_seed(5))
    pipe = LTXPipeline.from_pretrained(tiny_ltx)
    base = _pipe_frames(pipe, PROMPTS[:1], noise, 3.0)
    pipe.load_lora_weights(out)
    tuned = _pipe_frames(pipe, PROMPTS[:1], noise, 3.0)
    assert (tuned - base).abs().max() > 1e-3, "the exported LoRA does not change the pipeline's output"
    policy = load_policy(resolve_source(run, None, [], None), "cpu")
    torch.testing.assert_close(tuned, _ode_frames(policy, PROMPTS[:1], noise), atol=1e-5, rtol=0)
