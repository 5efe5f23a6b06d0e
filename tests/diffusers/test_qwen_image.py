"""The Qwen-Image adapter on a tiny offline QwenImagePipeline: the conformance suite, the
pipeline's own sampling, its conventions against independent computations, the recipe trained
for 2 iterations (LoRA and full fine-tuning), and exports that a fresh pipeline loads."""

from __future__ import annotations

import json
import math

import pytest
import torch

from flowrl.errors import FlowrlError
from flowrl.runlog import read_metrics
from flowrl.testing.conformance import CHECK_NAMES, check_adapter

PROMPTS = ["a red cat", "the blue dog on the mat"]  # different lengths: the padding mask matters
TINY = dict(dtype="fp32", height=32, width=32, max_sequence_length=64)
RECIPE = "recipes/qwen_image_lora.toml"


@pytest.fixture(scope="module")
def tiny_qwen(tiny_dir):
    from flowrl.testing.tiny_pipelines import build_tiny_qwen_image

    return build_tiny_qwen_image(tiny_dir / "qwen_image")


@pytest.fixture(scope="module")
def make(tiny_qwen):
    from flowrl_plugins.diffusers_models.qwen_image import QwenImageConfig, QwenImageModel

    return lambda **kw: QwenImageModel(QwenImageConfig(**{"path": str(tiny_qwen), **TINY, **kw}))


@pytest.fixture(scope="module")
def model(make):
    """True CFG 4.0 (the default). Do not modify it."""
    return make()


def _ode_images(model, prompts, noise, steps):
    from flowrl.sampling.kernels import ODEKernel
    from flowrl.sampling.rollout import rollout

    text = model.encode_prompts(prompts)
    traj = rollout(lambda x, s: model.velocity(x, s, text), noise, model.sigmas(steps), ODEKernel(), image_from="final")
    return model.decode(traj.image_latents)


def _pipe_images(pipe, prompts, noise, cfg=4.0):
    kw = dict(negative_prompt=" ", true_cfg_scale=cfg) if cfg != 1.0 else {}
    return pipe(prompts, height=32, width=32, num_inference_steps=5, latents=noise, output_type="pt",
                max_sequence_length=64, **kw).images


# ---- conformance and the pipeline's own sampling --------------------------------------------


def test_conforms_with_true_cfg(model):
    report = check_adapter(model)
    notes = {r.name: r.message for r in report.results}
    assert [r.name for r in report.results] == list(CHECK_NAMES)
    assert "timestep = 1 * sigma" in notes["sigma_direction"]
    assert notes["reference_model"] == "reference = lora_disabled, frozen_copy"


def test_conforms_without_cfg(make):
    check_adapter(make(cfg_scale=1.0))


@pytest.mark.parametrize("cfg, trim", [(4.0, False), (1.0, False), (4.0, True)])
def test_sampling_equals_the_qwen_image_pipeline(model, make, cfg, trim):
    # Timestep = sigma, packing, img_shapes, the padded-and-masked text (trimmed or not), CFG with
    # its norm correction, the dynamic-shift schedule with its terminal stretch, the VAE's
    # per-channel de-normalisation: all at once, against QwenImagePipeline.__call__.
    m = model if (cfg, trim) == (4.0, False) else make(cfg_scale=cfg, trim_text_padding=trim)
    noise = torch.randn(2, *m.latent_shape, generator=torch.Generator().manual_seed(0))
    ours = _ode_images(m, PROMPTS, noise, 5)
    ref = _pipe_images(m.pipe, PROMPTS, noise, cfg)
    assert ours.shape == (2, 3, 32, 32) and ours.dtype == torch.float32
    assert ((ref > 0) & (ref < 1)).float().mean() > 0.5, "the comparison needs unclamped pixels"
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_untrimmed_text_keeps_bf16_rescoring_on_policy(make):
    # With every call at max_sequence_length text columns, re-scoring a rollout in other batch
    # compositions rounds the same way even in bf16 (the default 1e-6 tolerance).
    from flowrl.testing.conformance import run_check

    run_check(make(dtype="bf16"), "on_policy_ratio")


def test_prompts_are_padded_with_a_mask_to_a_fixed_length(model):
    text = model.encode_prompts(PROMPTS)
    assert text["prompt_embeds"].shape == (2, 64, 32) and text["prompt_mask"].dtype == torch.bool
    lengths = text["prompt_mask"].sum(1)
    # the pipeline's own encoding of each prompt alone: its length and values, then zeros
    for i, p in enumerate(PROMPTS):
        own, mask = model.pipe.encode_prompt(p, max_sequence_length=64)
        assert mask is None and own.shape[1] == lengths[i]
        torch.testing.assert_close(text["prompt_embeds"][i, : own.shape[1]], own[0])
        assert text["prompt_embeds"][i, own.shape[1]:].abs().max() == 0
    assert lengths[0] < lengths[1]
    # the negative prompt " " is encoded once for every row
    assert torch.equal(text["negative_prompt_embeds"][0], text["negative_prompt_embeds"][1])


def test_cfg_is_the_norm_corrected_combination(model, make):
    # Independent route: conditional and unconditional velocities from a CFG-free adapter on
    # the same weights, combined and renormalised per token in float64.
    plain = make(cfg_scale=1.0)
    plain.denoiser.load_state_dict(model.denoiser.state_dict())
    text = model.encode_prompts(PROMPTS)
    x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(2))
    s = torch.tensor([0.7, 0.2])
    v = model.velocity(x, s, text)
    v_c = plain.velocity(x, s, {"prompt_embeds": text["prompt_embeds"], "prompt_mask": text["prompt_mask"]}).double()
    v_u = plain.velocity(x, s, {"prompt_embeds": text["negative_prompt_embeds"],
                                "prompt_mask": text["negative_prompt_mask"]}).double()
    combined = v_u + 4.0 * (v_c - v_u)
    expected = combined * v_c.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(v.double(), expected, atol=2e-5, rtol=1e-5)
    assert set(plain.encode_prompts(PROMPTS)) == {"prompt_embeds", "prompt_mask"}  # no CFG: no negatives


def test_timestep_is_sigma(model):
    seen = []
    h = model.denoiser.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["timestep"].clone()), with_kwargs=True)
    model.velocity(torch.zeros(1, *model.latent_shape), torch.tensor([0.25]), model.encode_prompts(PROMPTS[:1]))
    h.remove()
    assert seen[0].tolist() == [0.25, 0.25]  # [uncond; cond] in one batch


def test_packing_matches_diffusers(model):
    from diffusers import QwenImagePipeline

    z = torch.randn(2, 4, 1, 16, 16)
    packed = QwenImagePipeline._pack_latents(z[:, :, 0], 2, 4, 16, 16)
    torch.testing.assert_close(model.pack(z), packed)
    torch.testing.assert_close(model.unpack(packed), QwenImagePipeline._unpack_latents(packed, 32, 32, 2))
    assert model.latent_shape == (64, 16) and model.image_seq_len == 64


def test_own_schedule_is_the_dynamic_shift_with_terminal_stretch(model):
    # Independent float64 computation from the tiny scheduler's config: linspace(1, 1/N, N),
    # mu linear in the token count between (256, 0.5) and (8192, 0.9), exponential time shift
    # e^mu / (e^mu + 1/s - 1), then the stretch that puts the last non-zero sigma at 0.02.
    for n in (4, 10):
        s = torch.linspace(1.0, 1.0 / n, n, dtype=torch.float64)
        mu = 0.5 + (0.9 - 0.5) * (64 - 256) / (8192 - 256)
        s = math.exp(mu) / (math.exp(mu) + (1 / s - 1))
        one_minus = 1 - s
        s = 1 - one_minus / (one_minus[-1] / (1 - 0.02))
        expected = torch.cat([s, torch.zeros(1, dtype=torch.float64)]).float()
        torch.testing.assert_close(model.sigmas(n), expected, atol=2e-6, rtol=0)


def test_resolution_must_fit_the_vae_and_packing(make):
    with pytest.raises(FlowrlError, match="multiple of 4") as err:
        make(height=30)
    assert err.value.where.endswith(".height")


# ---- training the recipe, and exports ------------------------------------------------------

_TINY_SETS = ["model.height=32", "model.width=32", "model.max_sequence_length=64", "model.dtype=fp32",
              "model.vae_batch_size=8"]
_GEOMETRY = ["train.iterations=2", "train.prompts_per_iteration=1", "train.group_size=2", "train.micro_batch_size=2",
             "train.optimizer_steps_per_update=1", "rewards.0.use=brightness", "log.progress=false",
             "log.image_every=1", "run.device=cpu"]
# Large steps, so that two updates visibly move the policy (these runs test plumbing, not learning).
_LORA = ["train.lora_rank=4", "train.lora_alpha=8.0", "train.lr=0.05", "train.max_grad_norm=0"]
_FULL = ["train.finetune=full", "train.lr=0.002", "train.max_grad_norm=0", "model.gradient_checkpointing=false"]


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
def lora_run(cli, tiny_qwen, tmp_path_factory):
    return _train(cli, tiny_qwen, tmp_path_factory.mktemp("runs") / "qwen_lora", _LORA)


@pytest.fixture(scope="module")
def full_run(cli, tiny_qwen, tmp_path_factory):
    return _train(cli, tiny_qwen, tmp_path_factory.mktemp("runs") / "qwen_full", _FULL)


def test_recipe_validates_and_trains_two_iterations(cli, tiny_qwen, tmp_path):
    from safetensors.torch import load_file

    from flowrl.recipe import load_recipe

    recipe = load_recipe(RECIPE)
    assert recipe.components["model"].use == "qwen_image" and recipe.train.finetune == "lora"
    run = _train(cli, tiny_qwen, tmp_path / "run")  # the recipe's own settings, tiny geometry
    records = read_metrics(run)
    assert [r["iteration"] for r in records] == [0, 1]
    assert all(r["on_policy/max_abs_log_ratio"] <= 1e-6 for r in records)
    state = load_file(str(run / "checkpoints" / "iter_000002" / "model.safetensors"))
    assert state and all("lora_" in k for k in state)
    assert any("img_mlp" in k for k in state) and any("add_q_proj" in k for k in state)  # attention_ff preset
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in state.items()), "LoRA B never moved"


def _policy_images(run_dir, noise, prompt):
    from flowrl.commands.inference import load_policy, resolve_source
    from flowrl.sampling.rollout import ode_sample

    model = load_policy(resolve_source(run_dir, None, [], None), "cpu")
    text = model.encode_prompts([prompt])
    return model.decode(ode_sample(lambda i, x, s: model.velocity(x, s, text), noise, model.sigmas(5)))


def test_lora_export_loads_with_load_lora_weights(lora_run, tiny_qwen, cli, tmp_path):
    from diffusers import QwenImagePipeline

    out = tmp_path / "lora"
    code, text = cli("export", lora_run, "-o", out)
    assert code == 0, text
    info = json.loads((out / "flowrl_export.json").read_text())
    assert info["format"] == "diffusers_lora" and info["lora"]["rank"] == 4
    noise = torch.randn(1, 64, 16, generator=torch.Generator().manual_seed(5))
    pipe = QwenImagePipeline.from_pretrained(tiny_qwen)
    base = _pipe_images(pipe, PROMPTS[:1], noise)
    pipe.load_lora_weights(out)
    tuned = _pipe_images(pipe, PROMPTS[:1], noise)
    assert (tuned - base).abs().max() > 1e-3, "the exported LoRA does not change the pipeline's output"
    torch.testing.assert_close(tuned, _policy_images(lora_run, noise, PROMPTS[0]), atol=1e-5, rtol=0)


def test_full_finetune_exports_a_pipeline_that_loads(full_run, tiny_qwen, cli):
    from diffusers import QwenImagePipeline

    code, text = cli("export", full_run)
    assert code == 0, text
    out = full_run / "export" / "iter_000002"
    assert json.loads((out / "flowrl_export.json").read_text())["format"] == "diffusers_pipeline"
    noise = torch.randn(1, 64, 16, generator=torch.Generator().manual_seed(6))
    exported = _pipe_images(QwenImagePipeline.from_pretrained(out), PROMPTS[:1], noise)
    base = _pipe_images(QwenImagePipeline.from_pretrained(tiny_qwen), PROMPTS[:1], noise)
    assert (exported - base).abs().max() > 1e-3
    torch.testing.assert_close(exported, _policy_images(full_run, noise, PROMPTS[0]), atol=1e-5, rtol=0)
