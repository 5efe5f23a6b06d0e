"""The Wan 2.2 TI2V-5B text-to-video adapter (``wan22``) on a tiny offline WanPipeline of the same
architecture (the 2.2 VAE: residual, 2 x 2 pixels folded into channels; ``expand_timesteps``): the
conformance suite, diffusers' own sampling with an Euler scheduler on flowrl's sigmas, the latent
geometry, per-token timesteps, decode against an independent computation, and a 2-iteration LoRA
run whose export WanPipeline loads and reproduces."""

from __future__ import annotations

import pytest
import torch
from wan_helpers import euler_on_flowrl_grid, image_prompts, ode_frames

from flowrl.errors import FlowrlError
from flowrl.testing.conformance import CHECK_NAMES, check_adapter

PROMPTS = ("a red cat", "the blue dog on the mat")
TINY = dict(dtype="fp32", height=32, width=32, num_frames=5, max_sequence_length=16)
RECIPE = "recipes/wan22_5b_lora.toml"
# z_dim 6; (5 - 1) / 4 + 1 latent frames; 32 / 8 (2 x 2 pixel folding, then 4x down-sampling)
LATENT = (6, 2, 4, 4)
MEAN = [0.1, -0.2, 0.3, 0.0, 0.05, -0.1]
STD = [1.5, 0.8, 1.2, 2.0, 0.9, 1.1]


@pytest.fixture(scope="module")
def tiny_wan22(tiny_dir):
    from flowrl.testing.tiny_pipelines import build_tiny_wan22

    return build_tiny_wan22(tiny_dir / "wan22")


@pytest.fixture(scope="module")
def make(tiny_wan22):
    from flowrl_plugins.diffusers_models.wan import Wan22Config, Wan22Model

    return lambda **kw: Wan22Model(Wan22Config(**{"path": str(tiny_wan22), **TINY, **kw}))


@pytest.fixture(scope="module")
def guided(make):
    """True CFG 5 (the 5B's default). Do not modify it."""
    return make()


@pytest.fixture(scope="module")
def plain(make):
    """No CFG (cfg_scale = 1). Do not modify it."""
    return make(cfg_scale=1.0)


def _euler_on_flowrl_grid(pipe, shift: float = 5.0):
    return euler_on_flowrl_grid(pipe, shift)


def _pipe_frames(pipe, prompts, noise, cfg, steps=4):
    return pipe(prompt=list(prompts), negative_prompt="", height=32, width=32, num_frames=5,
                num_inference_steps=steps, guidance_scale=cfg, latents=noise, output_type="pt",
                max_sequence_length=16).frames


def _ode_frames(model, prompts, noise, steps=4):
    return ode_frames(model, prompts, noise, steps)


def test_conforms(guided):
    report = check_adapter(guided)
    notes = {r.name: r.message for r in report.results}
    assert [r.name for r in report.results] == list(CHECK_NAMES)
    assert notes["decode"].startswith("clips (5, 3, 32, 32)")


@pytest.mark.parametrize("cfg", [5.0, 1.0])
def test_sampling_equals_the_wan_pipeline(guided, plain, cfg):
    # per-token timesteps, CFG, shift 5, the 48-channel-style latents' de-normalisation and the
    # VAE's pixel unfolding: all at once, against diffusers' WanPipeline (expand_timesteps = True)
    m = guided if cfg != 1.0 else plain
    assert m.pipe.config.expand_timesteps
    noise = torch.randn(2, *m.latent_shape, generator=torch.Generator().manual_seed(0))
    ours = _ode_frames(m, PROMPTS, noise)
    ref = _pipe_frames(_euler_on_flowrl_grid(m.pipe), PROMPTS, noise, cfg)
    assert ours.shape == (2, 5, 3, 32, 32) and ours.dtype == torch.float32
    assert ((ref > 0) & (ref < 1)).float().mean() > 0.3, "the comparison needs unclamped pixels"
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_the_transformer_gets_one_timestep_per_video_token(plain):
    seen = []
    hook = plain.denoiser.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["timestep"]), with_kwargs=True)
    try:
        plain.velocity(torch.zeros(2, *LATENT), torch.tensor([0.25, 0.5]), plain.encode_prompts(PROMPTS))
    finally:
        hook.remove()
    (t,) = seen
    assert t.shape == (2, plain.image_seq_len) == (2, 2 * 2 * 2)
    torch.testing.assert_close(t, torch.tensor([[250.0] * 8, [500.0] * 8]))


def test_video_latent_geometry(guided, make):
    assert guided.latent_shape == LATENT
    assert guided.vae_scale == 8 and guided.vae_scale_temporal == 4  # 2 (pixel folding) x 4
    with pytest.raises(FlowrlError, match="multiple of 16"):
        make(height=40)


def test_decode_denormalises_and_puts_frames_before_channels(guided):
    z = torch.randn(1, *LATENT, generator=torch.Generator().manual_seed(1))
    vae = guided.pipe.vae
    mean, std = torch.tensor(MEAN).view(1, 6, 1, 1, 1), torch.tensor(STD).view(1, 6, 1, 1, 1)
    with torch.no_grad():
        video = vae.decode(z * std + mean, return_dict=False)[0]  # [1, 3, 5, 32, 32]
    expected = (video.transpose(1, 2) / 2 + 0.5).clamp(0, 1)
    torch.testing.assert_close(guided.decode(z), expected)


def test_defaults_are_the_5b_models(guided):
    from flowrl_plugins.diffusers_models.wan import Wan22Config

    c = Wan22Config()
    assert (c.path, c.height, c.width, c.num_frames, c.cfg_scale, c.flow_shift) == (
        "Wan-AI/Wan2.2-TI2V-5B-Diffusers", 704, 1280, 121, 5.0, 5.0)
    u = torch.linspace(1.0, 0.0, 5, dtype=torch.float64)
    torch.testing.assert_close(guided.sigmas(4), (5 * u / (1 + 4 * u)).float(), atol=2e-7, rtol=0)


# ---- image-to-video -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def i2v(make):
    """Image-to-video, true CFG 5. Do not modify it."""
    return make(image_to_video=True)


_image_prompts = image_prompts


def test_image_to_video_conforms(i2v):
    report = check_adapter(i2v)
    notes = {r.name: r.message for r in report.results}
    assert notes["condition"].startswith("condition (32, 32)")


def test_image_to_video_equals_the_wan_i2v_pipeline(i2v):
    # WanImageToVideoPipeline with expand_timesteps on the same components: the image's latent
    # frame in place of the first, its tokens at timestep 0, overwritten before decoding
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    rows, path = _image_prompts(PROMPTS)
    p = i2v.pipe
    pipe = _euler_on_flowrl_grid(WanImageToVideoPipeline(
        tokenizer=p.tokenizer, text_encoder=p.text_encoder, vae=p.vae, transformer=p.transformer,
        scheduler=p.scheduler, expand_timesteps=True))
    noise = torch.randn(2, *LATENT, generator=torch.Generator().manual_seed(4))
    ref = pipe(image=Image.open(path).convert("RGB"), prompt=list(PROMPTS), negative_prompt="", height=32, width=32,
               num_frames=5, num_inference_steps=4, guidance_scale=5.0, latents=noise, output_type="pt",
               max_sequence_length=16).frames
    ours = _ode_frames(i2v, rows, noise)
    assert ((ref > 0) & (ref < 1)).float().mean() > 0.3, "the comparison needs unclamped pixels"
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_image_to_video_keeps_the_first_frame_clean(i2v):
    from flowrl.sampling.rollout import ode_sample

    rows, _ = _image_prompts(PROMPTS[:1])
    text = i2v.encode_prompts(rows)
    seen = []
    hook = i2v.denoiser.register_forward_pre_hook(lambda m, a, kw: seen.append(kw), with_kwargs=True)
    try:
        x = torch.randn(1, *LATENT, generator=torch.Generator().manual_seed(6))
        out = ode_sample(lambda i, x, s: i2v.velocity(x, s, text), x, i2v.sigmas(3))
    finally:
        hook.remove()
    t = seen[0]["timestep"]  # CFG: [uncond; cond], 2 x 2 x 2 tokens, the first frame's 4 at 0
    assert t.shape == (2, 8) and (t[:, :4] == 0).all() and (t[:, 4:] == 1000.0).all()
    torch.testing.assert_close(seen[0]["hidden_states"][:, :, :1], text["condition_latents"].repeat(2, 1, 1, 1, 1))
    torch.testing.assert_close(out[:, :, :1], text["condition_latents"], atol=1e-6, rtol=0)


def test_image_to_video_needs_a_condition_image(i2v):
    with pytest.raises(FlowrlError, match="condition image"):
        i2v.encode_prompts(["a red cat"])


# ---- training the recipe, and the LoRA export ------------------------------------------------

_SETS = ["model.height=32", "model.width=32", "model.num_frames=5", "model.max_sequence_length=16",
         "model.dtype=fp32", "model.vae_batch_size=8", "model.gradient_checkpointing=false",
         "train.iterations=2", "train.prompts_per_iteration=1", "train.group_size=2", "train.micro_batch_size=2",
         "train.optimizer_steps_per_update=1", "rewards.0.use=brightness", "log.progress=false",
         "log.image_every=1", "run.device=cpu",
         "train.lora_rank=4", "train.lora_alpha=8.0", "train.lr=0.05", "train.max_grad_norm=0"]


def test_lora_export_loads_into_wan_pipeline_and_reproduces_the_policy(module_cli, tiny_wan22, tmp_path):
    from diffusers import WanPipeline

    from flowrl.commands.inference import load_policy, resolve_source

    out = module_cli.train_two_iterations_and_export(RECIPE, [f"model.path={tiny_wan22}", *_SETS], tmp_path)
    run = tmp_path / "run"
    noise = torch.randn(1, *LATENT, generator=torch.Generator().manual_seed(5))
    pipe = _euler_on_flowrl_grid(WanPipeline.from_pretrained(tiny_wan22))
    base = _pipe_frames(pipe, PROMPTS[:1], noise, 5.0)
    pipe.load_lora_weights(out)
    tuned = _pipe_frames(pipe, PROMPTS[:1], noise, 5.0)
    assert (tuned - base).abs().max() > 1e-3, "the exported LoRA does not change the pipeline's output"
    policy = load_policy(resolve_source(run, None, [], None), "cpu")
    torch.testing.assert_close(tuned, _ode_frames(policy, PROMPTS[:1], noise), atol=1e-5, rtol=0)
