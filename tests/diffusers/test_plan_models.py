"""``flowrl plan`` for Qwen-Image, FLUX.2 [klein], Z-Image, the editing models, Wan 2.1 / 2.2 (the A14B's two
experts included) and LTX-Video: offline from the
built-in copies of the published configs, exact parameter counts against the loaded tiny
pipelines, and the update's activation estimate against what autograd really saves."""

from __future__ import annotations

import pytest
import torch

from flowrl_plugins.diffusers_models.memory.common import saved_elements


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("recipe, params", [
    ("qwen_image_lora", "20.430e9 params x 2 B"),          # Qwen-Image's 20B MMDiT
    ("qwen_image_edit_lora", "20.430e9 params x 2 B"),     # the same transformer
    ("flux2_klein_lora", "3.876e9 params x 2 B"),          # FLUX.2 [klein] 4B
    ("zimage_lora", "6.155e9 params x 2 B"),               # Z-Image-Turbo's 6B single-stream DiT
    ("kontext_edit_lora", "11.901e9 params x 2 B"),        # FLUX.1 Kontext [dev] = FLUX.1's 12B
    ("flux2_klein_nf4_24gb", "3.876e9 params, 0.591 B each on average (quantised)"),
    ("wan21_1p3b_lora", "1.419e9 params x 2 B"),           # Wan 2.1 T2V 1.3B
    ("wan21_14b_lora", "14.289e9 params x 2 B"),           # Wan 2.1 T2V 14B
    ("wan21_14b_nf4_32gb", "14.289e9 params, 0.541 B each on average (quantised)"),
    ("wan22_5b_lora", "5.000e9 params x 2 B"),             # Wan 2.2 TI2V-5B
    ("wan22_a14b_lora", "28.578e9 params x 2 B / 8 shards"),  # Wan 2.2 T2V A14B: both 14B experts
    ("ltx_lora", "1.923e9 params x 2 B"),                  # LTX-Video 2B
])
def test_plan_needs_no_weights(cli, recipe, params):
    code, out, err = cli("plan", f"recipes/{recipe}.toml", "--num-processes", "8")
    assert code == 0, err
    assert params in _flat(out) and "peak ~" in out, _flat(out)


def _tiny(name, tiny_dir):
    from flowrl.testing import tiny_pipelines

    return getattr(tiny_pipelines, f"build_tiny_{name}")(tiny_dir / f"plan_{name}")


CASES = {
    "qwen_image": ("recipes/qwen_image_lora.toml", ["model.max_sequence_length=64"]),
    "flux2_klein": ("recipes/flux2_klein_lora.toml", ["model.max_sequence_length=16"]),
    "zimage": ("recipes/zimage_lora.toml", ["model.max_sequence_length=16"]),
    # Wan declares separate LoRA constants (a frozen base saves less); this measurement makes every
    # weight trainable, so the plan is asked for full fine-tuning, like for like
    "wan": ("recipes/wan21_1p3b_lora.toml", ["model.max_sequence_length=16", "model.num_frames=5", "train.finetune=full"]),
    "wan22": ("recipes/wan22_5b_lora.toml", ["model.max_sequence_length=16", "model.num_frames=5",
                                             "train.finetune=full"]),
    # both experts held and counted; one runs per forward (both sigmas below the boundary)
    "wan22_a14b": ("recipes/wan22_a14b_lora.toml", ["model.max_sequence_length=16", "model.num_frames=5",
                                                    "train.finetune=full", "distributed.mixed_precision=no",
                                                    "distributed.strategy=auto", "distributed.num_processes=1"]),
    "ltx": ("recipes/ltx_lora.toml", ["model.max_sequence_length=16", "model.num_frames=9", "model.width=64"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_counts_and_update_activations_match_the_tiny_model(name, tiny_dir, monkeypatch, request):
    from flowrl.memory_plan import estimate
    from flowrl.plugins import get_registry
    from flowrl.recipe import load_recipe
    from flowrl.train.session import build_components

    monkeypatch.chdir(request.config.rootpath)
    recipe_path, extra = CASES[name]
    sets = [f"model.path={_tiny(name, tiny_dir)}", "model.height=32", "model.width=32", "model.dtype=fp32",
            "model.gradient_checkpointing=false", "rewards.0.use=brightness", "train.micro_batch_size=2",
            "train.group_size=2", "train.prompts_per_iteration=1", "train.optimizer_steps_per_update=1", *extra]
    recipe = load_recipe(recipe_path, sets)
    _, mm, lines = estimate(recipe, get_registry(), 1)
    model = build_components(recipe, get_registry(), rewards=False, trackers=False).model
    den = model.denoiser
    assert mm.denoiser_params == sum(p.numel() for p in den.parameters()) + sum(b.numel() for b in den.buffers())
    for part, (count, _) in mm.frozen.items():
        module = getattr(model.pipe, part)
        assert count == sum(p.numel() for p in module.parameters()) + sum(b.numel() for b in module.buffers()), part
    estimated = next(line for line in lines if line.phase == "update").bytes
    text = model.encode_prompts(["a red cat on the mat with a dog", "a dog"])
    x = torch.randn(2, *model.latent_shape)
    measured = 4 * saved_elements(den, lambda: model.velocity(x, torch.tensor([0.5, 0.4]), text))
    den.requires_grad_(False)
    print(f"{name}: update activations estimated {estimated} B, measured {measured} B")
    assert 0.7 < estimated / measured < 1.3, (estimated, measured)


def test_ltx_image_to_video_plans_a_timestep_per_token(request, monkeypatch):
    # the adapter passes one timestep per token (the condition's at 0): every block's modulation is
    # per token, which the replica measures with per-token timesteps too
    from flowrl.memory_plan import estimate
    from flowrl.plugins import get_registry
    from flowrl.recipe import load_recipe

    monkeypatch.chdir(request.config.rootpath)
    plans = {}
    for i2v in (False, True):
        _, mm, lines = estimate(load_recipe("recipes/ltx_lora.toml", [f"model.image_to_video={str(i2v).lower()}"]),
                                get_registry(), 1)
        plans[i2v] = (next(line for line in lines if line.phase == "update").bytes, " ".join(mm.notes))
    assert plans[True][0] > plans[False][0]
    assert "a timestep per token" in plans[True][1] and "a timestep per token" not in plans[False][1]
