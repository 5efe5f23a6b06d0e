"""The Z-Image adapter on a tiny offline ZImagePipeline: the conformance suite (with the reversed
time declared), the pipeline's own sampling with and without CFG, its conventions against
independent computations, the recipe trained for 2 iterations (LoRA and full fine-tuning), and
exports that a fresh pipeline loads."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from flowrl.errors import FlowrlError
from flowrl.runlog import read_metrics
from flowrl.testing.conformance import CHECK_NAMES, check_adapter, run_check

PROMPTS = ("a red cat", "the blue dog on the mat")  # different lengths: each caption is its own length
TINY = dict(dtype="fp32", height=32, width=32, max_sequence_length=64)
RECIPE = "recipes/zimage_lora.toml"


@pytest.fixture(scope="module")
def tiny_zimage(tiny_dir):
    from flowrl.testing.tiny_pipelines import build_tiny_zimage

    return build_tiny_zimage(tiny_dir / "zimage")


@pytest.fixture(scope="module")
def make(tiny_zimage):
    from flowrl_plugins.diffusers_models.zimage import ZImageConfig, ZImageModel

    return lambda **kw: ZImageModel(ZImageConfig(**{"path": str(tiny_zimage), **TINY, **kw}))


@pytest.fixture(scope="module")
def turbo(make):
    """No CFG (the default, Z-Image-Turbo-like). Do not modify it."""
    return make()


@pytest.fixture(scope="module")
def guided(make):
    """CFG 3 (Z-Image base-like). Do not modify it."""
    return make(cfg_scale=3.0)


def _ode_images(model, prompts, noise, steps):
    from flowrl.sampling.kernels import ODEKernel
    from flowrl.sampling.rollout import rollout

    text = model.encode_prompts(prompts)
    traj = rollout(lambda x, s: model.velocity(x, s, text), noise, model.sigmas(steps), ODEKernel(), image_from="final")
    return model.decode(traj.image_latents)


def _pipe_images(pipe, prompts, noise, cfg=0.0, **kw):
    # ZImagePipeline rewrites the prompt list it is given (chat template in place): pass a copy
    return pipe(prompt=list(prompts), height=32, width=32, num_inference_steps=5, latents=noise, guidance_scale=cfg,
                output_type="pt", max_sequence_length=64, **kw).images


# ---- conformance and the pipeline's own sampling --------------------------------------------


@pytest.mark.parametrize("which", ["turbo", "guided"])
def test_conforms(request, which):
    report = check_adapter(request.getfixturevalue(which))
    notes = {r.name: r.message for r in report.results}
    assert [r.name for r in report.results] == list(CHECK_NAMES)
    # the denoiser receives 1 - sigma: 0 at sigma 1 (noise), 0.75 at sigma 0.25
    assert "timestep = timestep_from_sigma(sigma): sigma 1 -> 0, 0.25 -> 0.75" in notes["sigma_direction"]
    # its blocks live in noise_refiner / context_refiner / layers, which the *blocks rule misses
    assert "from shardable_blocks()" in notes["shardable_blocks"]


@pytest.mark.parametrize("cfg, extra", [
    (0.0, {}),
    (3.0, {}),
    (3.0, {"cfg_normalization": 1.0, "cfg_truncation": 0.5}),
])
def test_sampling_equals_the_zimage_pipeline(turbo, guided, make, cfg, extra):
    # t = 1 - sigma, the negated output, per-prompt caption lengths, CFG in Z-Image's form (with
    # its norm cap and truncation), the static-shift schedule, the VAE scaling: all at once.
    m = turbo if cfg == 0 else (guided if not extra else make(cfg_scale=cfg, **extra))
    noise = torch.randn(2, *m.latent_shape, generator=torch.Generator().manual_seed(0))
    ours = _ode_images(m, PROMPTS, noise, 5)
    ref = _pipe_images(m.pipe, PROMPTS, noise, cfg, **extra)
    assert ours.shape == (2, 3, 32, 32) and ours.dtype == torch.float32
    assert ((ref > 0) & (ref < 1)).float().mean() > 0.3, "the comparison needs unclamped pixels"
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_time_is_reversed_and_the_output_negated(turbo):
    # Independent route: call the transformer by hand with t = 1 - sigma; flowrl's velocity is
    # minus its output.
    text = turbo.encode_prompts(PROMPTS[:1])
    x = torch.randn(1, *turbo.latent_shape, generator=torch.Generator().manual_seed(3))
    seen = []
    h = turbo.denoiser.register_forward_pre_hook(lambda m, a, kw: seen.append(a[1].clone()), with_kwargs=True)
    v = turbo.velocity(x, torch.tensor([0.25]), text)
    h.remove()
    assert seen[0].tolist() == [0.75]
    n = int(text["prompt_lengths"][0])
    with torch.no_grad():
        raw = turbo.denoiser([x[0].unsqueeze(1)], torch.tensor([0.75]), [text["prompt_embeds"][0, :n]],
                             return_dict=False)[0][0]
    torch.testing.assert_close(v[0], -raw.squeeze(1))


def test_cfg_is_zimages_combination(guided, turbo):
    # v = v_c + w (v_c - v_u): ordinary CFG with weight w + 1
    text = guided.encode_prompts(PROMPTS)
    x = torch.randn(2, *guided.latent_shape, generator=torch.Generator().manual_seed(2))
    s = torch.tensor([0.7, 0.2])
    v = guided.velocity(x, s, text)
    v_c = turbo.velocity(x, s, {"prompt_embeds": text["prompt_embeds"], "prompt_lengths": text["prompt_lengths"]})
    v_u = turbo.velocity(x, s, {"prompt_embeds": text["negative_prompt_embeds"],
                                "prompt_lengths": text["negative_prompt_lengths"]})
    torch.testing.assert_close(v, v_c + 3.0 * (v_c - v_u), atol=1e-5, rtol=1e-5)


def test_cfg_truncation_and_normalisation_per_sample(make, turbo):
    m = make(cfg_scale=3.0, cfg_truncation=0.5, cfg_normalization=1.0)
    text = m.encode_prompts(PROMPTS)
    x = torch.randn(2, *m.latent_shape, generator=torch.Generator().manual_seed(4))
    s = torch.tensor([0.7, 0.2])  # 1 - sigma = 0.3 (guided) and 0.8 > 0.5 (truncated: conditional only)
    v = m.velocity(x, s, text)
    plain = {"prompt_embeds": text["prompt_embeds"], "prompt_lengths": text["prompt_lengths"]}
    v_c = turbo.velocity(x, s, plain)
    torch.testing.assert_close(v[1], v_c[1])
    v_u = turbo.velocity(x, s, {"prompt_embeds": text["negative_prompt_embeds"],
                                "prompt_lengths": text["negative_prompt_lengths"]})
    g = (v_c[0] + 3.0 * (v_c[0] - v_u[0])).double()
    cap = v_c[0].double().norm()
    expected = g * min(1.0, float(cap / g.norm()))  # the norm is capped at 1 x the conditional one
    torch.testing.assert_close(v[0].double(), expected, atol=1e-5, rtol=1e-5)


def test_captions_keep_each_prompts_own_tokens(turbo):
    text = turbo.encode_prompts(PROMPTS)
    own = turbo.pipe.encode_prompt(list(PROMPTS), do_classifier_free_guidance=False, max_sequence_length=64)[0]
    lengths = text["prompt_lengths"].tolist()
    assert lengths == [len(r) for r in own] and lengths[0] < lengths[1]
    for i, r in enumerate(own):
        torch.testing.assert_close(text["prompt_embeds"][i, : len(r)], r)
        assert text["prompt_embeds"][i, len(r):].abs().max() == 0


def test_own_schedule_is_the_static_shift(turbo):
    # FlowMatchEuler with shift 3 on linspace(1, 1/N, N) (float64 by hand), then 0
    for n in (4, 6):
        s = torch.linspace(1.0, 1.0 / n, n, dtype=torch.float64)
        s = 3.0 * s / (1 + 2.0 * s)
        torch.testing.assert_close(turbo.sigmas(n), torch.cat([s, torch.zeros(1, dtype=torch.float64)]).float(),
                                   atol=2e-6, rtol=0)


def test_conformance_catches_an_undeclared_or_wrong_time_convention(turbo):
    # Feeding sigma where Z-Image wants 1 - sigma (declared): caught against the declaration.
    wrong = copy.copy(turbo)
    wrong.timestep_from_sigma = lambda s: s  # its velocity now feeds sigma
    with pytest.raises(AssertionError, match="not the adapter's timestep_from_sigma"):
        run_check(_Declares(wrong, lambda s: 1.0 - s), "sigma_direction")
    # Feeding 1 - sigma without declaring it: the plain check refuses it.
    with pytest.raises(AssertionError, match="does not grow with sigma"):
        run_check(_Declares(turbo, None), "sigma_direction")


class _Declares:
    """``inner`` with its ``timestep_from_sigma`` declaration replaced (None: not declared)."""

    def __init__(self, inner, declared):
        self.inner = inner
        self.denoiser = inner.denoiser
        self.latent_shape = inner.latent_shape
        if declared is not None:
            self.timestep_from_sigma = declared

    def __getattr__(self, name):
        if name == "timestep_from_sigma":
            raise AttributeError(name)
        return getattr(self.inner, name)


def test_lora_preset_names_zimage_modules(turbo):
    assert turbo.lora_targets == ["to_q", "to_k", "to_v", "to_out.0", "feed_forward.w1", "feed_forward.w2",
                                  "feed_forward.w3"]


def test_resolution_must_fit_the_vae_and_patches(make):
    with pytest.raises(FlowrlError, match="multiple of 4"):
        make(height=34)


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
def lora_run(cli, tiny_zimage, tmp_path_factory):
    return _train(cli, tiny_zimage, tmp_path_factory.mktemp("runs") / "zimage_lora", _LORA)


@pytest.fixture(scope="module")
def full_run(cli, tiny_zimage, tmp_path_factory):
    return _train(cli, tiny_zimage, tmp_path_factory.mktemp("runs") / "zimage_full", _FULL)


def test_recipe_validates_and_trains_two_iterations(cli, tiny_zimage, tmp_path):
    from safetensors.torch import load_file

    from flowrl.recipe import load_recipe

    recipe = load_recipe(RECIPE)
    assert recipe.components["model"].use == "zimage" and recipe.train.finetune == "lora"
    run = _train(cli, tiny_zimage, tmp_path / "run")  # the recipe's own settings, tiny geometry
    records = read_metrics(run)
    assert [r["iteration"] for r in records] == [0, 1]
    assert all(r["on_policy/max_abs_log_ratio"] <= 1e-6 for r in records)
    state = load_file(str(run / "checkpoints" / "iter_000002" / "model.safetensors"))
    assert state and all("lora_" in k for k in state) and any("feed_forward.w2" in k for k in state)
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in state.items()), "LoRA B never moved"


def _policy_images(run_dir, noise, prompt):
    from flowrl.commands.inference import load_policy, resolve_source
    from flowrl.sampling.rollout import ode_sample

    model = load_policy(resolve_source(run_dir, None, [], None), "cpu")
    text = model.encode_prompts([prompt])
    return model.decode(ode_sample(lambda i, x, s: model.velocity(x, s, text), noise, model.sigmas(5)))


def test_lora_export_loads_with_load_lora_weights(lora_run, tiny_zimage, cli, tmp_path):
    from diffusers import ZImagePipeline

    out = tmp_path / "lora"
    code, text = cli("export", lora_run, "-o", out)
    assert code == 0, text
    assert json.loads((out / "flowrl_export.json").read_text())["format"] == "diffusers_lora"
    noise = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(5))
    pipe = ZImagePipeline.from_pretrained(tiny_zimage)
    base = _pipe_images(pipe, PROMPTS[:1], noise)
    pipe.load_lora_weights(out)
    tuned = _pipe_images(pipe, PROMPTS[:1], noise)
    assert (tuned - base).abs().max() > 1e-3, "the exported LoRA does not change the pipeline's output"
    torch.testing.assert_close(tuned, _policy_images(lora_run, noise, PROMPTS[0]), atol=1e-5, rtol=0)


def test_full_finetune_exports_a_pipeline_that_loads(full_run, tiny_zimage, cli):
    from diffusers import ZImagePipeline

    code, text = cli("export", full_run)
    assert code == 0, text
    out = full_run / "export" / "iter_000002"
    assert json.loads((out / "flowrl_export.json").read_text())["format"] == "diffusers_pipeline"
    noise = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(6))
    exported = _pipe_images(ZImagePipeline.from_pretrained(out), PROMPTS[:1], noise)
    base = _pipe_images(ZImagePipeline.from_pretrained(tiny_zimage), PROMPTS[:1], noise)
    assert (exported - base).abs().max() > 1e-3
    torch.testing.assert_close(exported, _policy_images(full_run, noise, PROMPTS[0]), atol=1e-5, rtol=0)
