"""The Wan 2.1 text-to-video adapter on a tiny offline WanPipeline: the conformance suite (with and
without CFG), diffusers' own sampling with an Euler scheduler on flowrl's sigmas, the video latent
geometry and decode against independent computations, the recipe trained for 2 iterations (LoRA
and full fine-tuning), and a LoRA export that WanPipeline loads and reproduces."""

from __future__ import annotations

import json

import pytest
import torch
from wan_helpers import euler_on_flowrl_grid, ode_frames

from flowrl.errors import FlowrlError
from flowrl.runlog import read_metrics
from flowrl.testing.conformance import CHECK_NAMES, check_adapter

PROMPTS = ("a red cat", "the blue dog on the mat")
TINY = dict(dtype="fp32", height=32, width=32, num_frames=5, max_sequence_length=16)
RECIPE = "recipes/wan21_1p3b_lora.toml"
LATENT = (4, 2, 8, 8)  # z_dim 4; (5 - 1) / 4 + 1 latent frames; 32 / 4 (the tiny VAE's spatial factor)


@pytest.fixture(scope="module")
def tiny_wan(tiny_dir):
    from flowrl.testing.tiny_pipelines import build_tiny_wan

    return build_tiny_wan(tiny_dir / "wan")


@pytest.fixture(scope="module")
def make(tiny_wan):
    from flowrl_plugins.diffusers_models.wan import WanConfig, WanModel

    return lambda **kw: WanModel(WanConfig(**{"path": str(tiny_wan), **TINY, **kw}))


@pytest.fixture(scope="module")
def guided(make):
    """True CFG 5 (Wan's default). Do not modify it."""
    return make()


@pytest.fixture(scope="module")
def plain(make):
    """No CFG (cfg_scale = 1). Do not modify it."""
    return make(cfg_scale=1.0)


def _euler_on_flowrl_grid(pipe, shift: float = 3.0):
    return euler_on_flowrl_grid(pipe, shift)


def _pipe_frames(pipe, prompts, noise, cfg, steps=5):
    return pipe(prompt=list(prompts), negative_prompt="", height=32, width=32, num_frames=5,
                num_inference_steps=steps, guidance_scale=cfg, latents=noise, output_type="pt",
                max_sequence_length=16).frames


def _ode_frames(model, prompts, noise, steps=5):
    return ode_frames(model, prompts, noise, steps)


# ---- conformance and the pipeline's own sampling --------------------------------------------


@pytest.mark.parametrize("which", ["guided", "plain"])
def test_conforms(request, which):
    report = check_adapter(request.getfixturevalue(which))
    notes = {r.name: r.message for r in report.results}
    assert [r.name for r in report.results] == list(CHECK_NAMES)
    assert "timestep = 1000 * sigma" in notes["sigma_direction"]
    assert notes["decode"].startswith("clips (5, 3, 32, 32)")


@pytest.mark.parametrize("cfg", [5.0, 1.0])
def test_sampling_equals_the_wan_pipeline(guided, plain, cfg):
    # timestep = 1000 sigma, CFG on the negative prompt, the shifted schedule, the latents'
    # de-normalisation and the frame order: all at once, against diffusers' WanPipeline.
    m = guided if cfg != 1.0 else plain
    noise = torch.randn(2, *m.latent_shape, generator=torch.Generator().manual_seed(0))
    ours = _ode_frames(m, PROMPTS, noise)
    ref = _pipe_frames(_euler_on_flowrl_grid(m.pipe), PROMPTS, noise, cfg)
    assert ours.shape == (2, 5, 3, 32, 32) and ours.dtype == torch.float32
    assert ((ref > 0) & (ref < 1)).float().mean() > 0.3, "the comparison needs unclamped pixels"
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_video_latent_geometry(guided):
    assert guided.latent_shape == LATENT
    assert guided.image_seq_len == 2 * 4 * 4  # F_lat x (h / 2) x (w / 2) tokens of patch (1, 2, 2)
    assert guided.vae_scale == 4 and guided.vae_scale_temporal == 4


def test_decode_denormalises_and_puts_frames_before_channels(guided):
    # Independent route: z * std + mean per channel by hand, the VAE's [B, 3, F, H, W], transposed.
    z = torch.randn(1, *LATENT, generator=torch.Generator().manual_seed(1))
    vae = guided.pipe.vae
    mean = torch.tensor([0.1, -0.2, 0.3, 0.0]).view(1, 4, 1, 1, 1)
    std = torch.tensor([1.5, 0.8, 1.2, 2.0]).view(1, 4, 1, 1, 1)
    with torch.no_grad():
        video = vae.decode(z * std + mean, return_dict=False)[0]  # [1, 3, 5, 32, 32]
    expected = (video.transpose(1, 2) / 2 + 0.5).clamp(0, 1)
    torch.testing.assert_close(guided.decode(z), expected)


def test_the_vae_stays_float32_under_a_bf16_model(make):
    m = make(dtype="bf16")
    assert m.denoiser.dtype == torch.bfloat16 and m.pipe.vae.dtype == torch.float32
    clips = m.decode(torch.randn(1, *LATENT, generator=torch.Generator().manual_seed(3)))
    assert clips.shape == (1, 5, 3, 32, 32) and clips.dtype == torch.float32
    assert make(dtype="bf16", vae_dtype="auto").pipe.vae.dtype == torch.bfloat16


def test_cfg_is_the_true_cfg_combination(guided, plain):
    text = guided.encode_prompts(PROMPTS)
    x = torch.randn(2, *LATENT, generator=torch.Generator().manual_seed(2))
    s = torch.tensor([0.7, 0.2])
    v = guided.velocity(x, s, text)
    v_c = plain.velocity(x, s, {"prompt_embeds": text["prompt_embeds"]})
    v_u = plain.velocity(x, s, {"prompt_embeds": text["negative_prompt_embeds"]})
    torch.testing.assert_close(v, v_u + 5.0 * (v_c - v_u), atol=1e-5, rtol=1e-5)


def test_schedule_is_the_flow_shift(make, guided):
    # s u / (1 + (s - 1) u) on u = linspace(1, 0, N + 1), in float64 by hand
    for shift, m in ((3.0, guided), (5.0, make(flow_shift=5.0))):
        u = torch.linspace(1.0, 0.0, 7, dtype=torch.float64)
        torch.testing.assert_close(m.sigmas(6), (shift * u / (1 + (shift - 1) * u)).float(), atol=2e-7, rtol=0)


def test_lora_presets_name_wan_modules(guided, make):
    assert guided.lora_targets == ["to_q", "to_k", "to_v", "to_out.0"]
    assert make(lora_preset="attention_ff").lora_targets[-2:] == ["ffn.net.0.proj", "ffn.net.2"]


def test_frames_and_size_must_fit_the_vae(make, tiny_wan):
    from flowrl_plugins.diffusers_models.wan import WanConfig

    with pytest.raises(ValueError, match="4k \\+ 1"):
        WanConfig(num_frames=32)
    with pytest.raises(FlowrlError, match="multiple of 8"):
        make(height=36)


# ---- training the recipe, and exports ------------------------------------------------------

_TINY_SETS = ["model.height=32", "model.width=32", "model.num_frames=5", "model.max_sequence_length=16",
              "model.dtype=fp32", "model.vae_batch_size=8", "model.gradient_checkpointing=false"]
_GEOMETRY = ["train.iterations=2", "train.prompts_per_iteration=1", "train.group_size=2", "train.micro_batch_size=2",
             "train.optimizer_steps_per_update=1", "rewards.0.use=brightness", "log.progress=false",
             "log.image_every=1", "run.device=cpu"]
# Large steps, so that two updates visibly move the policy (these runs test plumbing, not learning).
_LORA = ["train.lora_rank=4", "train.lora_alpha=8.0", "train.lr=0.05", "train.max_grad_norm=0"]
_FULL = ["train.finetune=full", "train.lr=0.002", "train.max_grad_norm=0"]


@pytest.fixture(scope="module")
def cli(module_cli):
    return module_cli.merged


def _train(cli, path, out, extra=()):
    sets = []
    for item in [f"model.path={path}", *_TINY_SETS, *_GEOMETRY, *extra]:
        sets += ["--set", item]
    code, text = cli("train", RECIPE, *sets, "-o", out)
    assert code == 0, text
    return out


@pytest.fixture(scope="module")
def lora_run(cli, tiny_wan, tmp_path_factory):
    return _train(cli, tiny_wan, tmp_path_factory.mktemp("runs") / "wan_lora", _LORA)


def test_recipe_trains_lora_two_iterations(lora_run):
    from safetensors.torch import load_file

    from flowrl.recipe import load_recipe

    recipe = load_recipe(RECIPE)
    assert recipe.components["model"].use == "wan" and recipe.train.finetune == "lora"
    records = read_metrics(lora_run)
    assert [r["iteration"] for r in records] == [0, 1]
    assert all(r["on_policy/max_abs_log_ratio"] <= 1e-6 for r in records)
    state = load_file(str(lora_run / "checkpoints" / "iter_000002" / "model.safetensors"))
    assert state and all("lora_" in k for k in state) and any("attn2.to_k" in k for k in state)
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in state.items()), "LoRA B never moved"


def test_full_finetune_trains_two_iterations(cli, tiny_wan, tmp_path):
    from safetensors.torch import load_file

    run = _train(cli, tiny_wan, tmp_path / "wan_full", _FULL)
    state = load_file(str(run / "checkpoints" / "iter_000002" / "model.safetensors"))
    assert not any("lora_" in k for k in state) and "patch_embedding.weight" in state
    base = load_file(str(tiny_wan / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert (state["blocks.0.attn1.to_q.weight"] - base["blocks.0.attn1.to_q.weight"]).abs().max() > 0


def test_lora_export_loads_into_wan_pipeline_and_reproduces_the_policy(lora_run, tiny_wan, cli, tmp_path):
    from diffusers import WanPipeline

    from flowrl.commands.inference import load_policy, resolve_source

    out = tmp_path / "lora"
    code, text = cli("export", lora_run, "-o", out)
    assert code == 0, text
    info = json.loads((out / "flowrl_export.json").read_text())
    assert info["format"] == "diffusers_lora" and info["iteration"] == 2
    noise = torch.randn(1, *LATENT, generator=torch.Generator().manual_seed(5))
    pipe = _euler_on_flowrl_grid(WanPipeline.from_pretrained(tiny_wan))
    base = _pipe_frames(pipe, PROMPTS[:1], noise, 5.0)
    pipe.load_lora_weights(out)
    tuned = _pipe_frames(pipe, PROMPTS[:1], noise, 5.0)
    assert (tuned - base).abs().max() > 1e-3, "the exported LoRA does not change the pipeline's output"
    policy = load_policy(resolve_source(lora_run, None, [], None), "cpu")
    torch.testing.assert_close(tuned, _ode_frames(policy, PROMPTS[:1], noise), atol=1e-5, rtol=0)
