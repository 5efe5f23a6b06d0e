"""The FLUX.2 [klein] adapter on tiny offline Flux2KleinPipelines (base-like with CFG, and
step-distilled): the conformance suite, the pipeline's own sampling, its conventions against
independent computations, the recipe trained for 2 iterations (LoRA and full fine-tuning), and
exports that a fresh pipeline loads."""

from __future__ import annotations

import json
import math

import pytest
import torch

from flowrl.errors import FlowrlError
from flowrl.runlog import read_metrics
from flowrl.testing.conformance import CHECK_NAMES, check_adapter

PROMPTS = ["a red cat", "the blue dog on the mat"]
TINY = dict(dtype="fp32", height=32, width=32, max_sequence_length=48)
RECIPE = "recipes/flux2_klein_lora.toml"


@pytest.fixture(scope="module")
def tiny_klein(tiny_dir):
    from flowrl.testing.tiny_pipelines import build_tiny_flux2_klein

    return build_tiny_flux2_klein(tiny_dir / "flux2_klein")


@pytest.fixture(scope="module")
def tiny_klein_distilled(tiny_dir):
    from flowrl.testing.tiny_pipelines import build_tiny_flux2_klein

    return build_tiny_flux2_klein(tiny_dir / "flux2_klein_distilled", distilled=True, seed=1)


@pytest.fixture(scope="module")
def make(tiny_klein):
    from flowrl_plugins.diffusers_models.flux2 import Flux2KleinConfig, Flux2KleinModel

    return lambda **kw: Flux2KleinModel(Flux2KleinConfig(**{"path": str(tiny_klein), **TINY, **kw}))


@pytest.fixture(scope="module")
def model(make):
    """True CFG 4.0 (the default, klein-base-like). Do not modify it."""
    return make()


@pytest.fixture(scope="module")
def distilled(tiny_klein_distilled):
    from flowrl_plugins.diffusers_models.flux2 import Flux2KleinConfig, Flux2KleinModel

    return Flux2KleinModel(Flux2KleinConfig(path=str(tiny_klein_distilled), cfg_scale=1.0, **TINY))


def _ode_images(model, prompts, noise, steps):
    from flowrl.sampling.kernels import ODEKernel
    from flowrl.sampling.rollout import rollout

    text = model.encode_prompts(prompts)
    traj = rollout(lambda x, s: model.velocity(x, s, text), noise, model.sigmas(steps), ODEKernel(), image_from="final")
    return model.decode(traj.image_latents)


def _pipe_images(pipe, model, prompts, noise, cfg=4.0):
    """The pipeline's own sampling from the same noise (it takes it as the patchified grid)."""
    return pipe(prompt=prompts, height=32, width=32, num_inference_steps=5, latents=model.tokens_to_grid(noise),
                guidance_scale=cfg, output_type="pt", max_sequence_length=48).images


# ---- conformance and the pipeline's own sampling --------------------------------------------


def test_base_with_cfg_conforms(model):
    report = check_adapter(model)
    notes = {r.name: r.message for r in report.results}
    assert [r.name for r in report.results] == list(CHECK_NAMES)
    assert "timestep = 1 * sigma" in notes["sigma_direction"]


def test_distilled_conforms(distilled):
    assert distilled.is_distilled and not distilled.uses_cfg
    check_adapter(distilled)


@pytest.mark.parametrize("kind", ["base_cfg", "distilled"])
def test_sampling_equals_the_flux2_klein_pipeline(model, distilled, kind):
    # Timestep = sigma, patchify + pack, 4-axis ids, CFG against "", the empirical-mu schedule,
    # the VAE's batch-norm de-normalisation: all at once, against Flux2KleinPipeline.__call__.
    m = model if kind == "base_cfg" else distilled
    noise = torch.randn(2, *m.latent_shape, generator=torch.Generator().manual_seed(0))
    ours = _ode_images(m, PROMPTS, noise, 5)
    ref = _pipe_images(m.pipe, m, PROMPTS, noise, 4.0 if kind == "base_cfg" else 1.0)
    assert ours.shape == (2, 3, 32, 32) and ours.dtype == torch.float32
    assert ((ref > 0) & (ref < 1)).float().mean() > 0.3, "the comparison needs unclamped pixels"
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_distilled_checkpoints_refuse_cfg(tiny_klein_distilled):
    from flowrl_plugins.diffusers_models.flux2 import Flux2KleinConfig, Flux2KleinModel

    with pytest.raises(FlowrlError, match="step-distilled") as err:
        Flux2KleinModel(Flux2KleinConfig(path=str(tiny_klein_distilled), **TINY))  # cfg_scale 4.0 by default
    assert "cfg_scale = 1" in err.value.hint and err.value.where.endswith(".cfg_scale")


def test_cfg_is_the_combined_velocity(model, make):
    plain = make(cfg_scale=1.0)
    plain.denoiser.load_state_dict(model.denoiser.state_dict())
    text = model.encode_prompts(PROMPTS)
    x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(2))
    s = torch.tensor([0.7, 0.2])
    v = model.velocity(x, s, text)
    v_c = plain.velocity(x, s, {"prompt_embeds": text["prompt_embeds"]})
    v_u = plain.velocity(x, s, {"prompt_embeds": text["negative_prompt_embeds"]})
    torch.testing.assert_close(v, v_u + 4.0 * (v_c - v_u), atol=1e-5, rtol=1e-5)
    # the negative is the empty prompt through the same chat template, padded to the same length
    empty, _ = model.pipe.encode_prompt("", max_sequence_length=48)
    torch.testing.assert_close(text["negative_prompt_embeds"][:1], empty)
    assert text["prompt_embeds"].shape == (2, 48, 48)  # 3 Qwen3 layers x width 16


def test_timestep_is_sigma(model):
    seen = []
    h = model.denoiser.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["timestep"].clone()), with_kwargs=True)
    model.velocity(torch.zeros(1, *model.latent_shape), torch.tensor([0.25]), model.encode_prompts(PROMPTS[:1]))
    h.remove()
    assert seen[0].tolist() == [0.25, 0.25]  # [uncond; cond] in one batch


def test_packing_and_ids_match_diffusers(model):
    from diffusers import Flux2KleinPipeline as P

    z = torch.randn(2, 4, 16, 16)
    grid = P._patchify_latents(z)
    torch.testing.assert_close(model.pack(z), P._pack_latents(grid))
    torch.testing.assert_close(model.tokens_to_grid(model.pack(z)), grid)
    torch.testing.assert_close(model.unpack(model.pack(z)), P._unpatchify_latents(grid))
    torch.testing.assert_close(model.image_ids(), P._prepare_latent_ids(grid)[0])
    torch.testing.assert_close(model.text_ids(5, "cpu"), P._prepare_text_ids(torch.zeros(1, 5, 3))[0])
    assert model.latent_shape == (64, 16) and model.image_seq_len == 64


def test_empirical_mu_and_own_schedule(model):
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

    from flowrl_plugins.diffusers_models.flux2 import flux2_empirical_mu

    for seq in (64, 1024, 4096, 4301, 8192):
        for n in (4, 8, 28, 50):
            assert flux2_empirical_mu(seq, n) == pytest.approx(compute_empirical_mu(seq, n), abs=1e-9)
    # by hand at 1024 tokens (512x512) and 28 steps: the 10- and 200-step fits, interpolated
    fit10, fit200 = 8.73809524e-05 * 1024 + 1.89833333, 0.00016927 * 1024 + 0.45666666
    assert flux2_empirical_mu(1024, 28) == pytest.approx(fit10 + (fit200 - fit10) * 18 / 190, abs=1e-12)
    # the schedule: linspace(1, 1/N, N) through the exponential time shift with that mu, then 0
    for n in (4, 8):
        mu = flux2_empirical_mu(64, n)
        s = torch.linspace(1.0, 1.0 / n, n, dtype=torch.float64)
        s = math.exp(mu) / (math.exp(mu) + (1 / s - 1))
        torch.testing.assert_close(model.sigmas(n), torch.cat([s, torch.zeros(1, dtype=torch.float64)]).float(),
                                   atol=2e-6, rtol=0)


def test_lora_preset_reaches_both_block_kinds(model):
    targets = model.lora_targets
    assert "to_qkv_mlp_proj" in targets and "single_transformer_blocks.0.attn.to_out" in targets
    assert "ff.linear_in" in targets  # attention_ff is the default preset
    names = dict(model.denoiser.named_modules())
    assert isinstance(names["single_transformer_blocks.0.attn.to_out"], torch.nn.Linear)


def test_resolution_must_fit_the_vae_and_patches(make):
    with pytest.raises(FlowrlError, match="multiple of 4"):
        make(width=30)


# ---- training the recipe, and exports ------------------------------------------------------

_TINY_SETS = ["model.height=32", "model.width=32", "model.max_sequence_length=48", "model.dtype=fp32",
              "model.vae_batch_size=8"]
_GEOMETRY = ["train.iterations=2", "train.prompts_per_iteration=1", "train.group_size=2", "train.micro_batch_size=2",
             "train.optimizer_steps_per_update=1", "rewards.0.use=brightness", "log.progress=false",
             "log.image_every=1", "run.device=cpu"]
# Large steps, so that two updates visibly move the policy (these runs test plumbing, not learning).
_LORA = ["train.lora_rank=4", "train.lora_alpha=8.0", "train.lr=0.05", "train.max_grad_norm=0"]
_FULL = ["train.finetune=full", "train.lr=0.002", "train.max_grad_norm=0"]


@pytest.fixture(scope="module")
def cli(module_cli):
    """``cli(*argv)`` -> (code, stdout + stderr), module-scoped: the module's run fixtures use it."""
    return module_cli.merged


def _train(cli, path, out, extra=()):
    sets = []
    for item in [f"model.path={path}", *_TINY_SETS, *_GEOMETRY, *extra]:
        sets += ["--set", item]
    code, text = cli("train", RECIPE, *sets, "-o", out)
    assert code == 0, text
    return out


@pytest.fixture(scope="module")
def lora_run(cli, tiny_klein, tmp_path_factory):
    return _train(cli, tiny_klein, tmp_path_factory.mktemp("runs") / "klein_lora", _LORA)


@pytest.fixture(scope="module")
def full_run(cli, tiny_klein, tmp_path_factory):
    return _train(cli, tiny_klein, tmp_path_factory.mktemp("runs") / "klein_full", _FULL)


def test_recipe_validates_and_trains_two_iterations(cli, tiny_klein, tmp_path):
    from safetensors.torch import load_file

    from flowrl.recipe import load_recipe

    recipe = load_recipe(RECIPE)
    assert recipe.components["model"].use == "flux2_klein" and recipe.train.finetune == "lora"
    run = _train(cli, tiny_klein, tmp_path / "run")  # the recipe's own settings, tiny geometry
    records = read_metrics(run)
    assert [r["iteration"] for r in records] == [0, 1]
    assert all(r["on_policy/max_abs_log_ratio"] <= 1e-6 for r in records)
    state = load_file(str(run / "checkpoints" / "iter_000002" / "model.safetensors"))
    assert state and all("lora_" in k for k in state)
    assert any("single_transformer_blocks.0.attn.to_out.lora_A" in k for k in state)
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in state.items()), "LoRA B never moved"


def _policy_images(run_dir, noise, prompt):
    from flowrl.commands.inference import load_policy, resolve_source
    from flowrl.sampling.rollout import ode_sample

    model = load_policy(resolve_source(run_dir, None, [], None), "cpu")
    text = model.encode_prompts([prompt])
    return model.decode(ode_sample(lambda i, x, s: model.velocity(x, s, text), noise, model.sigmas(5)))


def test_lora_export_loads_with_load_lora_weights(lora_run, tiny_klein, model, cli, tmp_path):
    from diffusers import Flux2KleinPipeline

    out = tmp_path / "lora"
    code, text = cli("export", lora_run, "-o", out)
    assert code == 0, text
    assert json.loads((out / "flowrl_export.json").read_text())["format"] == "diffusers_lora"
    noise = torch.randn(1, 64, 16, generator=torch.Generator().manual_seed(5))
    pipe = Flux2KleinPipeline.from_pretrained(tiny_klein)
    base = _pipe_images(pipe, model, PROMPTS[:1], noise)
    pipe.load_lora_weights(out)
    tuned = _pipe_images(pipe, model, PROMPTS[:1], noise)
    assert (tuned - base).abs().max() > 1e-3, "the exported LoRA does not change the pipeline's output"
    torch.testing.assert_close(tuned, _policy_images(lora_run, noise, PROMPTS[0]), atol=1e-5, rtol=0)


def test_full_finetune_exports_a_pipeline_that_loads(full_run, tiny_klein, model, cli):
    from diffusers import Flux2KleinPipeline

    code, text = cli("export", full_run)
    assert code == 0, text
    out = full_run / "export" / "iter_000002"
    assert json.loads((out / "flowrl_export.json").read_text())["format"] == "diffusers_pipeline"
    noise = torch.randn(1, 64, 16, generator=torch.Generator().manual_seed(6))
    exported = _pipe_images(Flux2KleinPipeline.from_pretrained(out), model, PROMPTS[:1], noise)
    base = _pipe_images(Flux2KleinPipeline.from_pretrained(tiny_klein), model, PROMPTS[:1], noise)
    assert (exported - base).abs().max() > 1e-3
    torch.testing.assert_close(exported, _policy_images(full_run, noise, PROMPTS[0]), atol=1e-5, rtol=0)
