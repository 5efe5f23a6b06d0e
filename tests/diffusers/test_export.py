"""``flowrl export``: trained weights load back into fresh diffusers pipelines and reproduce the policy."""

from __future__ import annotations

import json

import torch

PROMPT = "a red cat"
STEPS = 5


def _pipeline_images(pipe, model_like_shape, seed=0):
    """The pipeline's own sampling at the recipes' guidance (FLUX embedded 3.5, SD3 true CFG 4.5)."""
    noise = torch.randn(1, *model_like_shape, generator=torch.Generator().manual_seed(seed))
    guidance = 3.5 if type(pipe).__name__ == "FluxPipeline" else 4.5
    kw = dict(height=32, width=32, num_inference_steps=STEPS, latents=noise, output_type="pt", max_sequence_length=16,
              guidance_scale=guidance)
    return pipe(PROMPT, **kw).images, noise


def _policy_images(run_dir, noise):
    """What flowrl's own sampler makes with the run's latest checkpoint (ODE, model's schedule)."""
    from flowrl.commands.inference import load_policy, resolve_source
    from flowrl.sampling.rollout import ode_sample

    model = load_policy(resolve_source(run_dir, None, [], None), "cpu")
    text = model.encode_prompts([PROMPT])
    x = ode_sample(lambda i, x, s: model.velocity(x, s, text), noise, model.sigmas(STEPS))
    return model.decode(x)


def test_flux_lora_loads_with_load_lora_weights_and_changes_the_output(flux_lora_run, tiny_flux, cli, tmp_path):
    from diffusers import FluxPipeline

    out = tmp_path / "lora"
    code, stdout, err = cli("export", flux_lora_run, "-o", out)
    assert code == 0, err
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    info = json.loads((out / "flowrl_export.json").read_text())
    assert info["format"] == "diffusers_lora" and info["iteration"] == 2 and info["lora"]["rank"] == 4

    pipe = FluxPipeline.from_pretrained(tiny_flux)
    base, noise = _pipeline_images(pipe, (64, 16))
    pipe.load_lora_weights(out)
    tuned, _ = _pipeline_images(pipe, (64, 16))
    assert (tuned - base).abs().max() > 1e-3, "the exported LoRA does not change the pipeline's output"
    # ...and it changes it into exactly what the trained policy samples (rank, alpha, targets kept)
    torch.testing.assert_close(tuned, _policy_images(flux_lora_run, noise), atol=1e-5, rtol=0)


def test_flux_lora_merge_exports_a_full_pipeline(flux_lora_run, tiny_flux, cli, tmp_path):
    from diffusers import FluxPipeline

    out = tmp_path / "merged"
    code, _, err = cli("export", flux_lora_run, "--merge", "-o", out)
    assert code == 0, err
    assert json.loads((out / "flowrl_export.json").read_text())["format"] == "diffusers_pipeline"
    merged, noise = _pipeline_images(FluxPipeline.from_pretrained(out), (64, 16))
    torch.testing.assert_close(merged, _policy_images(flux_lora_run, noise), atol=1e-5, rtol=0)


def test_flux_full_finetune_exports_save_pretrained(flux_full_run, tiny_flux, cli):
    from diffusers import FluxPipeline

    code, stdout, err = cli("export", flux_full_run)
    assert code == 0, err
    out = flux_full_run / "export" / "iter_000002"
    assert json.loads((out / "flowrl_export.json").read_text())["format"] == "diffusers_pipeline"
    exported, noise = _pipeline_images(FluxPipeline.from_pretrained(out), (64, 16))
    base, _ = _pipeline_images(FluxPipeline.from_pretrained(tiny_flux), (64, 16))
    assert (exported - base).abs().max() > 1e-3
    torch.testing.assert_close(exported, _policy_images(flux_full_run, noise), atol=1e-5, rtol=0)


def test_sd3_lora_loads_into_a_fresh_sd3_pipeline(sd3_lora_run, tiny_sd3, cli, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    out = tmp_path / "sd3_lora"
    code, _, err = cli("export", sd3_lora_run, "-o", out)
    assert code == 0, err
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3)
    base, noise = _pipeline_images(pipe, (4, 16, 16))
    pipe.load_lora_weights(out)
    tuned, _ = _pipeline_images(pipe, (4, 16, 16))
    assert (tuned - base).abs().max() > 1e-3
    torch.testing.assert_close(tuned, _policy_images(sd3_lora_run, noise), atol=1e-5, rtol=0)


def test_export_needs_a_checkpoint(cli, tmp_path):
    from pathlib import Path

    code, out, err = cli("export", tmp_path / "nothing_here")
    assert code == 2 and "not found" in err and "Traceback" not in err
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.toml").write_text(Path("recipes/chunk_grpo_flux.toml").read_text())
    code, out, err = cli("export", run)
    assert code == 2 and "no checkpoint yet" in err and "Traceback" not in err
