"""The LTX-Video adapter (``ltx``) on a tiny offline LTXPipeline: the conformance suite, diffusers'
own sampling (its FlowMatchEuler scheduler with dynamic shift and shift_terminal, the same noise)
against flowrl's ODE, the token packing and decode against an independent computation, a
2-iteration LoRA run whose export LTXPipeline loads and reproduces; and image-to-video
(``image_to_video``) against LTXImageToVideoPipeline, its clean first frame, and a 2-iteration
run from a prompt table with condition images."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from flowrl.errors import FlowrlError
from flowrl.runlog import read_metrics
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


# ---- image-to-video -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def i2v(make):
    """Image-to-video, true CFG 3. Do not modify it."""
    return make(image_to_video=True)


@pytest.fixture(scope="module")
def i2v_plain(make):
    """Image-to-video without CFG. Do not modify it."""
    return make(image_to_video=True, cfg_scale=1.0)


def _image_prompts(prompts):
    """Prompt rows, each with its own seeded random 32 x 64 image (LTXImageToVideoPipeline takes
    one image per prompt)."""
    from flowrl.prompts import PromptRow
    from flowrl.testing.conformance import condition_image_paths

    paths = condition_image_paths((32, 64), len(prompts))
    return [PromptRow(p, path) for p, path in zip(prompts, paths)], paths


def test_image_to_video_conforms(i2v):
    report = check_adapter(i2v)
    notes = {r.name: r.message for r in report.results}
    assert [r.name for r in report.results] == list(CHECK_NAMES)
    assert notes["condition"].startswith("condition (32, 64)")


@pytest.mark.parametrize("cfg, scaling", [(3.0, None), (1.0, None), (1.0, 0.7)])
def test_image_to_video_equals_the_ltx_i2v_pipeline(i2v, i2v_plain, make, cfg, scaling, monkeypatch):
    # LTXImageToVideoPipeline on the same components, from its own image preprocessing, encoding and
    # noise: the image's latent frame first, its tokens at timestep 0, the scheduler stepping the
    # other frames only. The pipeline samples the image's latent from the VAE's posterior; flowrl
    # takes its mode, so the pipeline is given the mode here (the one difference, docs/video.md).
    # A VAE scaling_factor other than the published 1.0: the pipeline normalises the image without it
    # and decodes with it, and so does flowrl.
    import diffusers.pipelines.ltx.pipeline_ltx_image2video as i2v_module
    from diffusers import LTXImageToVideoPipeline
    from PIL import Image

    m = i2v if cfg != 1.0 else i2v_plain
    if scaling is not None:
        m = make(image_to_video=True, cfg_scale=cfg)  # its own VAE, whose config this test changes
        m.pipe.vae.register_to_config(scaling_factor=scaling)
    monkeypatch.setattr(i2v_module, "retrieve_latents", lambda out, generator=None, sample_mode="sample":
                        out.latent_dist.mode())
    rows, paths = _image_prompts(PROMPTS)
    p = m.pipe
    pipe = LTXImageToVideoPipeline(tokenizer=p.tokenizer, text_encoder=p.text_encoder, vae=p.vae,
                                   transformer=p.transformer, scheduler=p.scheduler)
    ref = pipe(image=[Image.open(q).convert("RGB") for q in paths], prompt=list(PROMPTS), negative_prompt="",
               height=32, width=64, num_frames=9, frame_rate=25, num_inference_steps=4, guidance_scale=cfg,
               generator=torch.Generator().manual_seed(4), output_type="pt", max_sequence_length=16).frames
    # the pipeline's noise: one draw of [B, C, F_lat, h, w] after encoding (the mode draws nothing),
    # packed; its first frame is replaced by the image there and ignored by flowrl's velocity here
    noise = pipe._pack_latents(torch.randn(2, 8, *GRID, generator=torch.Generator().manual_seed(4)))
    ours = _ode_frames(m, rows, noise)
    assert ours.shape == (2, 9, 3, 32, 64)
    assert ((ref > 0) & (ref < 1)).float().mean() > 0.3, "the comparison needs unclamped pixels"
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_image_to_video_keeps_the_first_frame_clean(i2v):
    from flowrl.sampling.rollout import ode_sample

    rows, _ = _image_prompts(PROMPTS[:1])
    text = i2v.encode_prompts(rows)
    assert text["condition_latents"].shape == (1, 2 * 4, 8) and i2v.condition_tokens == 8
    seen = []
    hook = i2v.denoiser.register_forward_pre_hook(lambda m, a, kw: seen.append(kw), with_kwargs=True)
    try:
        x = torch.randn(1, *LATENT, generator=torch.Generator().manual_seed(6))
        out = ode_sample(lambda i, x, s: i2v.velocity(x, s, text), x, i2v.sigmas(3))
    finally:
        hook.remove()
    t = seen[0]["timestep"]  # CFG: [uncond; cond], 3 x 2 x 4 tokens, the first frame's 8 at 0
    assert t.shape == (2, 24) and (t[:, :8] == 0).all() and (t[:, 8:] == 1000.0).all()
    torch.testing.assert_close(seen[0]["hidden_states"][:, :8], text["condition_latents"].repeat(2, 1, 1))
    torch.testing.assert_close(out[:, :8], text["condition_latents"], atol=1e-6, rtol=0)


def test_image_to_video_condition_is_the_normalised_encoded_image(i2v):
    # Independent route: the VAE's mode of the resized image, (z - mean) / std per channel (the
    # pipeline's normalisation of the image, which leaves the VAE's scaling_factor out), tokens
    # frame-major with channels last
    from PIL import Image

    rows, paths = _image_prompts(PROMPTS[:1])
    vae = i2v.pipe.vae
    pixels = i2v.pipe.video_processor.preprocess(Image.open(paths[0]).convert("RGB"), height=32, width=64)
    with torch.no_grad():
        z = vae.encode(pixels.unsqueeze(2)).latent_dist.mode()  # [1, 8, 1, 2, 4]
    z = (z - vae.latents_mean.view(1, 8, 1, 1, 1)) / vae.latents_std.view(1, 8, 1, 1, 1)
    torch.testing.assert_close(i2v.encode_prompts(rows)["condition_latents"], z.flatten(2).transpose(1, 2))


def test_image_to_video_log_probs_ignore_the_first_frame(i2v):
    # That frame's velocity holds no parameters: a kernel's step from it is the same Gaussian under
    # any weights (the log-prob terms of its elements cancel in every ratio), and its gradient is 0
    import copy

    from flowrl.sampling.kernels import FlowKernel
    from flowrl.sampling.rollout import rollout

    rows, _ = _image_prompts(PROMPTS)
    text = i2v.encode_prompts(rows)
    kernel = FlowKernel(a=0.7)
    x = torch.randn(2, *LATENT, generator=torch.Generator().manual_seed(7))
    # SDE at every step; the clip is the last step's x0_hat (the recipe's image_from), which on that
    # frame is x - sigma (x - c) / sigma = c
    traj = rollout(lambda x, s: i2v.velocity(x, s, text), x, i2v.sigmas(3), kernel,
                   generators=torch.Generator().manual_seed(8), image_from="x0_hat")
    torch.testing.assert_close(traj.image_latents[:, :8], text["condition_latents"], atol=1e-6, rtol=0)
    other = copy.deepcopy(i2v.denoiser)
    with torch.no_grad():
        for q in other.parameters():
            q.add_(0.05 * torch.randn(q.shape, generator=torch.Generator().manual_seed(9)))
    xi, xn = traj.latents[:, 1], traj.latents[:, 2]
    sigma, sigma_next = traj.sigmas[1].repeat(2), traj.sigmas[2].repeat(2)
    params = [q for q in i2v.denoiser.parameters()]
    for q in params:
        q.requires_grad_(True)
    try:
        v = i2v.velocity(xi, sigma, text)
        a = kernel.step(v, xi, sigma, sigma_next, next_sample=xn)
        grads = torch.autograd.grad(a.mean[:, :8].sum(), params, allow_unused=True, retain_graph=True)
        assert all(g is None or not g.any() for g in grads), "the first frame's step depends on the weights"
        grads = torch.autograd.grad(a.log_prob.sum(), params)
        assert any(g.abs().max() > 0 for g in grads)
    finally:
        for q in params:
            q.requires_grad_(False)
    with torch.no_grad():
        b = kernel.step(i2v._velocity(other, xi, sigma, text), xi, sigma, sigma_next, next_sample=xn)
    assert torch.equal(a.mean[:, :8].detach(), b.mean[:, :8])
    assert (a.mean[:, 8:].detach() - b.mean[:, 8:]).abs().max() > 1e-4


def test_image_to_video_needs_a_condition_image(i2v):
    with pytest.raises(FlowrlError, match="condition image"):
        i2v.encode_prompts(["a red cat"])


def test_image_to_video_needs_frames_after_the_image():
    from flowrl.recipe import load_recipe
    from flowrl_plugins.diffusers_models.ltx import LTXConfig

    with pytest.raises(FlowrlError, match="image_to_video") as err:
        LTXConfig(image_to_video=True, num_frames=1)
    assert err.value.where.endswith(".image_to_video") and "num_frames" in err.value.hint
    with pytest.raises(FlowrlError, match="image_to_video"):
        load_recipe(RECIPE, ["model.image_to_video=true", "model.num_frames=1"])
    assert LTXConfig(image_to_video=True, num_frames=9).image_to_video


@pytest.fixture(scope="module")
def clip_conditions(tmp_path_factory):
    """Two smooth 32 x 64 condition images and a prompt table naming them."""
    import numpy as np
    from PIL import Image

    root = tmp_path_factory.mktemp("ltx_i2v")
    (root / "img").mkdir()
    yy, xx = np.mgrid[0:32, 0:64] / np.array([31.0, 63.0])[:, None, None]
    for i in range(2):
        rgb = np.stack([xx, yy, (xx + yy) / 2 if i else 1 - xx], -1)
        Image.fromarray((rgb * 255).astype(np.uint8)).save(root / "img" / f"{i}.png")
    rows = [{"text": p, "image": f"img/{i}.png"} for i, p in enumerate(PROMPTS)]
    (root / "clips.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return root


def test_image_to_video_trains_and_its_rollouts_start_on_the_image(module_cli, tiny_ltx, clip_conditions, tmp_path,
                                                                   request, monkeypatch):
    import diffusers.pipelines.ltx.pipeline_ltx_image2video as i2v_module
    from diffusers import LTXImageToVideoPipeline
    from PIL import Image
    from rich.console import Console
    from safetensors.torch import load_file

    from flowrl.commands.inference import load_policy, resolve_source
    from flowrl.prompts import PromptRow
    from flowrl.recipe import load_recipe
    from flowrl.train import train
    from flowrl_plugins.diffusers_models.ltx import LTXConfig, LTXModel

    monkeypatch.chdir(request.config.rootpath)
    decoded = []
    decode = LTXModel.decode
    monkeypatch.setattr(LTXModel, "decode", lambda self, z: decoded.append(z.detach().clone()) or decode(self, z))
    sets = [f"model.path={tiny_ltx}", *_SETS, "model.image_to_video=true", f'run.output_dir="{tmp_path / "run"}"',
            f'prompts.source="{clip_conditions / "clips.jsonl"}"', 'prompts.text_column="text"',
            'prompts.condition_column="image"', 'prompts.split_column=""', "prompts.num_eval=0"]
    run = train(load_recipe(RECIPE, sets), console=Console(quiet=True))
    records = read_metrics(run)
    assert [r["iteration"] for r in records] == [0, 1]
    assert all(r["on_policy/max_abs_log_ratio"] <= 1e-6 for r in records)
    state = load_file(str(run / "checkpoints" / "iter_000002" / "model.safetensors"))
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in state.items()), "LoRA B never moved"
    # every rollout's clip starts on its prompt's encoded image (the rollouts' image latents, as decoded)
    m = LTXModel(LTXConfig(path=str(tiny_ltx), **TINY, image_to_video=True))
    images = m.encode_conditions([PromptRow(p, str(clip_conditions / "img" / f"{i}.png"))
                                  for i, p in enumerate(PROMPTS)])
    clips = torch.cat(decoded)
    assert clips.shape[0] >= 4 and clips.shape[1:] == LATENT
    gaps = (clips[:, None, :8] - images[None]).abs().flatten(2).amax(-1)  # [clips, images]
    assert (gaps.amin(1) <= 1e-5).all(), gaps
    assert (clips[:, 8:] - clips[:1, 8:]).abs().max() > 1e-3  # the later frames are generated
    # the exported LoRA, loaded into LTXImageToVideoPipeline, gives the trained policy's clip
    monkeypatch.setattr(LTXModel, "decode", decode)
    code, text = module_cli.merged("export", run, "-o", tmp_path / "lora")
    assert code == 0, text
    monkeypatch.setattr(i2v_module, "retrieve_latents", lambda out, generator=None, sample_mode="sample":
                        out.latent_dist.mode())
    pipe = LTXImageToVideoPipeline.from_pretrained(tiny_ltx)
    image = Image.open(clip_conditions / "img" / "0.png").convert("RGB")

    def pipe_frames():
        return pipe(image=image, prompt=PROMPTS[0], negative_prompt="", height=32, width=64, num_frames=9,
                    frame_rate=25, num_inference_steps=4, guidance_scale=3.0, generator=torch.Generator().manual_seed(5),
                    output_type="pt", max_sequence_length=16).frames

    base = pipe_frames()
    pipe.load_lora_weights(tmp_path / "lora")
    tuned = pipe_frames()
    assert (tuned - base).abs().max() > 1e-3, "the exported LoRA does not change the pipeline's output"
    noise = pipe._pack_latents(torch.randn(1, 8, *GRID, generator=torch.Generator().manual_seed(5)))
    policy = load_policy(resolve_source(run, None, [], None), "cpu")
    ours = _ode_frames(policy, [PromptRow(PROMPTS[0], str(clip_conditions / "img" / "0.png"))], noise)
    torch.testing.assert_close(ours, tuned, atol=1e-5, rtol=0)


_SETS = ["model.height=32", "model.width=64", "model.num_frames=9", "model.max_sequence_length=16",
         "model.dtype=fp32", "model.vae_batch_size=8", "model.gradient_checkpointing=false",
         "train.iterations=2", "train.prompts_per_iteration=1", "train.group_size=2", "train.micro_batch_size=2",
         "train.optimizer_steps_per_update=1", "rewards.0.use=brightness", "log.progress=false",
         "log.image_every=1", "run.device=cpu",
         "train.lora_rank=4", "train.lora_alpha=8.0", "train.lr=0.05", "train.max_grad_norm=0"]


def test_lora_export_loads_into_ltx_pipeline_and_reproduces_the_policy(module_cli, tiny_ltx, tmp_path):
    from diffusers import LTXPipeline

    from flowrl.commands.inference import load_policy, resolve_source

    out = module_cli.train_two_iterations_and_export(RECIPE, [f"model.path={tiny_ltx}", *_SETS], tmp_path)
    run = tmp_path / "run"
    noise = torch.randn(1, *LATENT, generator=torch.Generator().manual_seed(5))
    pipe = LTXPipeline.from_pretrained(tiny_ltx)
    base = _pipe_frames(pipe, PROMPTS[:1], noise, 3.0)
    pipe.load_lora_weights(out)
    tuned = _pipe_frames(pipe, PROMPTS[:1], noise, 3.0)
    assert (tuned - base).abs().max() > 1e-3, "the exported LoRA does not change the pipeline's output"
    policy = load_policy(resolve_source(run, None, [], None), "cpu")
    torch.testing.assert_close(tuned, _ode_frames(policy, PROMPTS[:1], noise), atol=1e-5, rtol=0)
