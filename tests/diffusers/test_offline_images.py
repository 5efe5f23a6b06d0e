"""Offline data on the diffusers image models: each adapter turns images back into its clean
latents (``encode_images``, the VAE's mode then the inverse of the decoder's scaling and packing),
so that `flowrl train` runs offline SFT and Diffusion-DPO on FLUX, SD3, Qwen-Image, FLUX.2 [klein]
and Z-Image from a table of images, as it does on the embedded model.

The round trip is checked where it is exact: the latents decode() hands to the VAE's decoder
are the VAE encoder's own mode, whatever the (random) VAE loses in pixels.
"""

from __future__ import annotations

import json

import pytest
import torch

from flowrl.errors import FlowrlError
from flowrl.runlog import read_metrics
from flowrl.train.checkpoint import latest_checkpoint

from conftest import REPO, TINY_MODEL

TINY = dict(dtype="fp32", height=32, width=32, max_sequence_length=16)
ADAPTERS = {
    "flux": ("build_tiny_flux", "flux", "FluxConfig", "FluxModel"),
    "sd3": ("build_tiny_sd3", "sd3", "SD3Config", "SD3Model"),
    "qwen_image": ("build_tiny_qwen_image", "qwen_image", "QwenImageConfig", "QwenImageModel"),
    "flux2_klein": ("build_tiny_flux2_klein", "flux2", "Flux2KleinConfig", "Flux2KleinModel"),
    "zimage": ("build_tiny_zimage", "zimage", "ZImageConfig", "ZImageModel"),
}


@pytest.fixture(scope="module", params=list(ADAPTERS))
def adapter(request, tiny_dir):
    import importlib

    from flowrl.testing import tiny_pipelines

    builder, module, config, model = ADAPTERS[request.param]
    path = getattr(tiny_pipelines, builder)(tiny_dir / f"encode_{request.param}")
    mod = importlib.import_module(f"flowrl_plugins.diffusers_models.{module}")
    return getattr(mod, model)(getattr(mod, config)(path=str(path), **TINY))


def _images(n=2, seed=0):
    return torch.rand(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def test_decode_hands_the_vae_decoder_the_encoders_own_latents(adapter, monkeypatch):
    images = _images()
    z = adapter.encode_images(images)
    assert z.dtype == torch.float32 and tuple(z.shape) == (2, *adapter.latent_shape)
    vae = adapter.pipe.vae
    pixels = images * 2 - 1
    if type(adapter).__name__ == "QwenImageModel":  # a one-frame video for the 3-D VAE
        pixels = pixels.unsqueeze(2)
    want = vae.encode(pixels, return_dict=False)[0].mode()
    seen = []
    decode = vae.decode
    monkeypatch.setattr(vae, "decode", lambda latents, **kw: (seen.append(latents), decode(latents, **kw))[1])
    adapter.decode(z)
    assert len(seen) == 1 and seen[0].shape == want.shape
    torch.testing.assert_close(seen[0], want, rtol=1e-5, atol=1e-5)


def test_the_encoding_is_deterministic_and_per_image(adapter):
    images = _images(3, seed=1)
    whole = adapter.encode_images(images)
    torch.testing.assert_close(adapter.encode_images(images[1:2]), whole[1:2], rtol=1e-5, atol=1e-6)
    assert torch.equal(adapter.encode_images(images), whole)


def test_images_of_another_size_are_refused_by_the_adapter(adapter):
    with pytest.raises(FlowrlError, match=r"images of \(16, 32\) pixels, the model encodes \(32, 32\)"):
        adapter.encode_images(torch.rand(1, 3, 16, 32))


# ---- the recipe, end to end ----------------------------------------------------------------------


def _png(path, colour, size):
    from PIL import Image

    Image.new("RGB", size, colour).save(path)
    return path.name


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """A pairs table of 4 prompts whose images are of other sizes than the model's (resized and cropped)."""
    root = tmp_path_factory.mktemp("sd3_pairs")
    bright, dark = _png(root / "bright.png", (230, 220, 200), (48, 40)), _png(root / "dark.png", (20, 30, 40), (24, 64))
    rows = [{"prompt": p, "chosen": bright, "rejected": dark} for p in ("a cat", "a dog", "a house", "a tree")]
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / "pairs.jsonl"


def test_the_sd3_offline_dpo_recipe_trains_from_a_table(pairs, tiny_sd3, cli, tmp_path):
    run = tmp_path / "run"
    sets = [f"model.path={tiny_sd3}", *TINY_MODEL, f"data.path={str(pairs)!r}", "train.iterations=2",
            "train.prompts_per_iteration=2", "train.micro_batch_size=1", "sampler.steps=4", "prompts.num_eval=2",
            "log.eval_every=1", "log.image_every=1", "checkpoint.every=1", "log.progress=false", "run.device=cpu",
            "rewards.0.use=brightness", "model.gradient_checkpointing=false"]
    code, out, err = cli("train", "recipes/offline_dpo_sd3.toml", *[a for s in sets for a in ("--set", s)], "-o", run)
    assert code == 0, out + err
    rows = read_metrics(run)
    trained = [r for r in rows if not r.get("final")]
    assert [r["iteration"] for r in trained] == [0, 1]
    assert not any(k.startswith(("reward/", "time/rollout")) for r in trained for k in r)
    # the first step is at the reference (the LoRA starts at zero): margin 0, loss softplus(0)
    assert abs(trained[0]["dpo/margin"]) < 1e-6 and abs(trained[0]["dpo/loss"] - 0.6931472) < 1e-5
    assert trained[1]["dpo/margin"] != 0.0  # the LoRA moved
    # the conditional velocity (CFG 4.5 off in training, as Diffusion-DPO trains): one network row
    # per point, 2 rows x 2 sides x 1 point, for the policy and for the reference (8 each with CFG)
    assert trained[0]["compute/update/forward"] == 4 and trained[0]["compute/reference/forward"] == 4
    assert "eval/brightness/mean" in trained[0]
    assert latest_checkpoint(run).name == "iter_000002"


def test_the_recipe_says_how_to_build_its_table_from_prompts_its_evaluation_never_sees():
    from flowrl.prompts import read_prompts
    from flowrl.recipe import load_recipe
    from flowrl.train.evaluate import evaluation_set

    recipe = load_recipe(REPO / "recipes" / "offline_dpo_sd3.toml")
    p = recipe.prompts
    training = set(read_prompts(p.source, None, "source", p, role="train"))
    held_out = evaluation_set(recipe, None)
    assert len(training) == 48 and len(held_out) == 16 and not training & set(held_out)
    text = (REPO / "recipes" / "offline_dpo_sd3.toml").read_text()
    assert "flowrl sample recipes/offline_dpo_sd3.toml" in text and "--tables" in text and "eval_split=train" in text


def test_the_recipes_table_command_builds_a_pairs_table_it_accepts(tiny_sd3, cli, tmp_path):
    """The header's `flowrl sample ... --tables` on the tiny SD3 (brightness for PickScore), then the table validates."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\na dog\n")
    sets = [f"model.path={tiny_sd3}", *TINY_MODEL, "rewards.0.use=brightness", "run.device=cpu"]
    flags = [a for s in sets for a in ("--set", s)]
    code, out, err = cli("sample", "recipes/offline_dpo_sd3.toml", "--prompts", prompts, "--seeds", "3", "--steps", "2",
                         "--no-grid", "--tables", "-o", tmp_path / "sampled", *flags)
    assert code == 0, out + err
    rows = [json.loads(line) for line in (tmp_path / "sampled" / "pairs.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["a cat", "a dog"] and all(r["chosen"] != r["rejected"] for r in rows)
    code, out, err = cli("validate", "recipes/offline_dpo_sd3.toml", *flags, "--set",
                         f"data.path={str(tmp_path / 'sampled' / 'pairs.jsonl')!r}", "--set", "train.prompts_per_iteration=2")
    assert code == 0, out + err
