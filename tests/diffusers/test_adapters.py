"""The FLUX and SD3 adapters against diffusers' own pipelines and against independent maths."""

from __future__ import annotations

import copy

import pytest
import torch

from flowrl.errors import FlowrlError
from flowrl.sampling.rollout import rollout
from flowrl.sampling.kernels import ODEKernel

PROMPTS = ["a red cat", "the blue dog"]


def _ode_images(model, prompts, noise, steps):
    text = model.encode_prompts(prompts)
    traj = rollout(lambda x, s: model.velocity(x, s, text), noise, model.sigmas(steps), ODEKernel(), image_from="final")
    return model.decode(traj.image_latents)


def test_flux_sampling_equals_flux_pipeline(flux_model):
    # Timestep = sigma, guidance embedding, packing, ids, schedule with dynamic shift, VAE scaling
    # and shift: all at once, against FluxPipeline.__call__ from the same starting latents.
    noise = torch.randn(2, *flux_model.latent_shape, generator=torch.Generator().manual_seed(0))
    ours = _ode_images(flux_model, PROMPTS, noise, 5)
    ref = flux_model.pipe(PROMPTS, height=32, width=32, num_inference_steps=5, latents=noise, output_type="pt",
                          max_sequence_length=16, guidance_scale=3.5).images
    assert ours.shape == (2, 3, 32, 32) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_sd3_sampling_with_true_cfg_equals_sd3_pipeline(sd3_model):
    noise = torch.randn(2, *sd3_model.latent_shape, generator=torch.Generator().manual_seed(1))
    ours = _ode_images(sd3_model, PROMPTS, noise, 5)
    ref = sd3_model.pipe(PROMPTS, height=32, width=32, num_inference_steps=5, latents=noise, output_type="pt",
                         max_sequence_length=16, guidance_scale=4.5).images
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_sd3_cfg_is_the_combined_velocity(sd3_model, make_sd3):
    # v = v_u + w (v_c - v_u), with v_u and v_c from the same weights without CFG
    plain = make_sd3(cfg_scale=1.0)
    plain.denoiser.load_state_dict(sd3_model.denoiser.state_dict())
    text = sd3_model.encode_prompts(PROMPTS)
    x = torch.randn(2, *sd3_model.latent_shape, generator=torch.Generator().manual_seed(2))
    s = torch.tensor([0.7, 0.2])
    v = sd3_model.velocity(x, s, text)
    v_c = plain.velocity(x, s, {"prompt_embeds": text["prompt_embeds"], "pooled": text["pooled"]})
    v_u = plain.velocity(x, s, {"prompt_embeds": text["negative_prompt_embeds"], "pooled": text["negative_pooled"]})
    torch.testing.assert_close(v, v_u + 4.5 * (v_c - v_u), atol=1e-5, rtol=1e-5)
    assert set(plain.encode_prompts(PROMPTS)) == {"prompt_embeds", "pooled"}  # no CFG: no negatives


def test_flux_packing_and_ids_match_diffusers(flux_model):
    from diffusers import FluxPipeline

    z = torch.randn(2, 4, 16, 16)
    torch.testing.assert_close(flux_model.pack(z), FluxPipeline._pack_latents(z, 2, 4, 16, 16))
    torch.testing.assert_close(flux_model.unpack(flux_model.pack(z)), z)
    torch.testing.assert_close(flux_model.image_ids(), FluxPipeline._prepare_latent_image_ids(2, 8, 8, "cpu", torch.float32))
    assert flux_model.latent_shape == (64, 16) and flux_model.image_seq_len == 64


def test_flux_own_schedule_is_the_dynamic_shift(flux_model):
    from flowrl.sampling.schedules import flux_dynamic_sigmas

    for n in (4, 17):
        torch.testing.assert_close(flux_model.sigmas(n), flux_dynamic_sigmas(n, 64), atol=2e-6, rtol=0)


def test_sd3_own_schedule_is_the_shifted_linspace(sd3_model):
    # diffusers' FlowMatchEuler (shift 3): linspace from sigma_max = 1 to sigma_min = shift(1/1000),
    # shifted again, then a terminal 0 (an independent float64 computation)
    from flowrl.sampling.schedules import time_shift

    n = 6
    lo = float(time_shift(torch.tensor(1e-3, dtype=torch.float64), 3.0))
    expected = torch.cat([time_shift(torch.linspace(1.0, lo, n, dtype=torch.float64), 3.0), torch.zeros(1)])
    torch.testing.assert_close(sd3_model.sigmas(n), expected.float(), atol=2e-6, rtol=0)


def test_timestep_conventions(flux_model, sd3_model):
    seen = {}
    for name, model in (("flux", flux_model), ("sd3", sd3_model)):
        h = model.denoiser.register_forward_pre_hook(
            lambda m, a, kw, name=name: seen.__setitem__(name, kw["timestep"].clone()), with_kwargs=True)
        text = model.encode_prompts(PROMPTS[:1])
        model.velocity(torch.zeros(1, *model.latent_shape), torch.tensor([0.25]), text)
        h.remove()
    assert seen["flux"].tolist() == [0.25]
    assert seen["sd3"].tolist() == [250.0, 250.0]  # [uncond; cond] in one batch


def test_flux_guidance_is_an_explicit_field(make_flux, tiny_flux_schnell, flux_model):
    from flowrl_plugins.diffusers_models.flux import FluxConfig, FluxModel

    text = flux_model.encode_prompts(PROMPTS[:1])
    x = torch.randn(1, *flux_model.latent_shape, generator=torch.Generator().manual_seed(3))
    low = make_flux(guidance=1.0)
    assert (flux_model.velocity(x, torch.tensor([0.5]), text) - low.velocity(x, torch.tensor([0.5]), text)).abs().max() > 1e-4
    with pytest.raises(FlowrlError, match="no guidance embedding") as err:
        FluxModel(FluxConfig(path=str(tiny_flux_schnell), dtype="fp32", height=32, width=32))
    assert "guidance = 0" in err.value.hint
    schnell = FluxModel(FluxConfig(path=str(tiny_flux_schnell), dtype="fp32", height=32, width=32, guidance=0.0))
    assert not schnell.uses_guidance


def test_resolution_must_fit_the_vae_and_packing(make_flux, make_sd3):
    with pytest.raises(FlowrlError, match="multiple of 4") as err:
        make_flux(height=30)
    assert err.value.where.endswith(".height")
    with pytest.raises(FlowrlError, match="multiple of 4"):
        make_sd3(width=34)


def test_missing_weights_are_one_clear_error(make_flux, tmp_path, monkeypatch):
    with pytest.raises(FlowrlError, match="model path not found"):
        make_flux(path=str(tmp_path / "nowhere"))
    with pytest.raises(FlowrlError, match="no model_index.json"):
        make_flux(path=str(tmp_path))
    # a hub id, offline, empty cache: says it is not cached and how to get it
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    with pytest.raises(FlowrlError) as err:
        make_flux(path="black-forest-labs/FLUX.1-dev")
    text = err.value.format()
    assert "not available" in text and "huggingface-cli login" in text and "local directory" in text


def test_gated_repository_error_names_the_licence(make_flux, monkeypatch):
    from diffusers import FluxPipeline
    from huggingface_hub.errors import GatedRepoError

    def gated(*args, **kwargs):
        # The hub's constructor wants an HTTP response object; the message is what matters here.
        exc = GatedRepoError.__new__(GatedRepoError)
        Exception.__init__(exc, "401 Client Error. Cannot access gated repo for url https://huggingface.co/...")
        raise exc

    monkeypatch.setattr(FluxPipeline, "from_pretrained", gated)
    with pytest.raises(FlowrlError, match="gated") as err:
        make_flux(path="black-forest-labs/FLUX.1-dev")
    assert "accept the licence on https://huggingface.co/black-forest-labs/FLUX.1-dev" in err.value.hint
    assert "huggingface-cli login" in err.value.hint


def test_cli_reports_missing_weights_without_traceback(cli, tmp_path):
    code, out, err = cli("train", "recipes/chunk_grpo_flux.toml", "--set", f"model.path={tmp_path}/missing",
                         "-o", tmp_path / "run", "--set", "run.device=cpu", "--set", "rewards.0.use=brightness")
    assert code == 2
    assert "model path not found" in err and "Traceback" not in err + out


def test_bf16_lora_trains_in_fp32_and_stays_on_policy(make_flux):
    from flowrl.recipe import TrainConfig
    from flowrl.testing.conformance import run_check
    from flowrl.train.finetune import prepare_trainable

    model = make_flux(dtype="bf16")
    assert model.denoiser.dtype == torch.bfloat16
    params = prepare_trainable(model, TrainConfig(finetune="lora", lora_rank=4, lora_alpha=8.0))
    assert params and all(p.dtype == torch.float32 for p in params)
    assert all(p.dtype == torch.bfloat16 for n, p in model.denoiser.named_parameters() if "lora_" not in n)
    assert model.denoiser.transformer_blocks[0].attn.to_q.base_layer.weight.dtype == torch.bfloat16
    run_check(model, "on_policy_ratio", ratio_tol=1e-6)


def test_full_finetuning_keeps_fp32_master_weights_and_bf16_compute(make_flux):
    model = make_flux(dtype="bf16", denoiser_dtype="fp32")
    assert all(p.dtype == torch.float32 for p in model.denoiser.parameters())
    seen = []
    h = model.denoiser.transformer_blocks[0].attn.to_q.register_forward_hook(lambda m, a, o: seen.append(o.dtype))
    model.denoiser.requires_grad_(True)
    text = model.encode_prompts(PROMPTS[:1])
    v = model.velocity(torch.randn(1, *model.latent_shape), torch.tensor([0.5]), text)
    v.square().mean().backward()
    h.remove()
    assert v.dtype == torch.float32 and seen == [torch.bfloat16]
    grads = [p.grad for p in model.denoiser.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


def test_gradient_checkpointing_gives_the_same_gradients(flux_model, make_flux):
    ckpt = make_flux(gradient_checkpointing=True)
    assert ckpt.denoiser.gradient_checkpointing
    plain = copy.deepcopy(flux_model)
    text = flux_model.encode_prompts(PROMPTS)
    x = torch.randn(2, *flux_model.latent_shape, generator=torch.Generator().manual_seed(4))
    grads = []
    for model in (plain, ckpt):
        model.denoiser.requires_grad_(True)
        model.velocity(x, torch.tensor([0.6, 0.3]), text).square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.denoiser.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)


def test_reference_model_needs_a_snapshot_for_full_finetuning(make_flux):
    model = make_flux()
    model.denoiser.requires_grad_(True)
    with pytest.raises(FlowrlError, match="snapshot_reference"):
        model.reference_velocity(torch.zeros(1, *model.latent_shape), torch.tensor([0.5]), model.encode_prompts(["a"]))
    assert model.snapshot_reference() == "frozen_copy"


def test_encoders_stay_put_on_cpu_and_offload_is_a_field(flux_model):
    # On the CPU there is nothing to offload; the bookkeeping must not move anything.
    assert flux_model.config.offload_encoders and not flux_model._offloading
    with flux_model._visiting(flux_model.pipe.text_encoder):
        pass
    assert next(flux_model.pipe.text_encoder.parameters()).device.type == "cpu"


def test_sd3_without_t5_uses_zeros_in_its_place(make_sd3):
    model = make_sd3(use_t5=False, cfg_scale=1.0)
    assert model.pipe.text_encoder_3 is None
    text = model.encode_prompts(PROMPTS)
    t5_part = text["prompt_embeds"][:, 77:]
    assert t5_part.shape[1] > 0 and t5_part.abs().max() == 0
    v = model.velocity(torch.randn(2, *model.latent_shape), torch.tensor([0.5, 0.5]), text)
    assert torch.isfinite(v).all()
