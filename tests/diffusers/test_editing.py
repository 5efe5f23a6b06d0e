"""Image editing: FLUX.1 Kontext and Qwen-Image-Edit on tiny offline pipelines. The conformance
suite (with condition images), sampling equal to each pipeline's own ``__call__`` for the same
noise and condition, the recipes trained for 2 iterations from a prompt table with condition
images (the condition beside the result in the grid, the condition in the rewards' metadata),
and the LoRA export loaded by a fresh pipeline."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from flowrl.errors import FlowrlError
from flowrl.prompts import PromptRow
from flowrl.runlog import read_metrics
from flowrl.testing.conformance import CHECK_NAMES, check_adapter

PROMPTS = ["make the cat red", "the blue dog on the mat"]


@pytest.fixture(scope="module")
def tiny_kontext(tiny_dir):
    from flowrl.testing.tiny_pipelines import build_tiny_flux_kontext

    return build_tiny_flux_kontext(tiny_dir / "kontext")


@pytest.fixture(scope="module")
def tiny_qwen_edit(tiny_dir):
    from flowrl.testing.tiny_pipelines import build_tiny_qwen_image_edit

    return build_tiny_qwen_image_edit(tiny_dir / "qwen_image_edit")


@pytest.fixture(scope="module")
def conditions(tmp_path_factory):
    """Two 32 x 32 condition images (smooth, so that the tiny VAE sees structure) and a prompt table."""
    from PIL import Image

    root = tmp_path_factory.mktemp("edits")
    (root / "img").mkdir()
    yy, xx = np.mgrid[0:32, 0:32] / 31.0
    for i in range(2):
        rgb = np.stack([xx, yy, (xx + yy) / 2 if i else 1 - xx], -1)
        Image.fromarray((rgb * 255).astype(np.uint8)).save(root / "img" / f"{i}.png")
    rows = [{"instruction": p, "source": f"img/{i}.png"} for i, p in enumerate(PROMPTS)]
    (root / "edits.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return root


def _rows(conditions):
    return [PromptRow(p, str(conditions / "img" / f"{i}.png")) for i, p in enumerate(PROMPTS)]


def _pictures(conditions):
    from PIL import Image

    return [Image.open(conditions / "img" / f"{i}.png").convert("RGB") for i in range(2)]


@pytest.fixture(scope="module")
def make_kontext(tiny_kontext):
    from flowrl_plugins.diffusers_models.editing import FluxKontextConfig, FluxKontextModel

    base = dict(path=str(tiny_kontext), dtype="fp32", height=32, width=32, max_sequence_length=16)
    return lambda **kw: FluxKontextModel(FluxKontextConfig(**{**base, **kw}))


@pytest.fixture(scope="module")
def make_qwen_edit(tiny_qwen_edit):
    from flowrl_plugins.diffusers_models.editing import QwenImageEditConfig, QwenImageEditModel

    base = dict(path=str(tiny_qwen_edit), dtype="fp32", height=32, width=32, max_sequence_length=64)
    return lambda **kw: QwenImageEditModel(QwenImageEditConfig(**{**base, **kw}))


def _ode_images(model, prompts, noise, steps):
    from flowrl.sampling.kernels import ODEKernel
    from flowrl.sampling.rollout import rollout

    text = model.encode_prompts(prompts)
    traj = rollout(lambda x, s: model.velocity(x, s, text), noise, model.sigmas(steps), ODEKernel(), image_from="final")
    return model.decode(traj.image_latents)


# ---- conformance -----------------------------------------------------------------------------


def test_kontext_conforms(make_kontext):
    report = check_adapter(make_kontext())
    notes = {r.name: r.message for r in report.results}
    assert [r.name for r in report.results] == list(CHECK_NAMES)
    assert notes["condition"].startswith("condition (32, 32)") and "timestep = 1 * sigma" in notes["sigma_direction"]


@pytest.mark.parametrize("cfg", [4.0, 1.0])
def test_qwen_image_edit_conforms(make_qwen_edit, cfg):
    report = check_adapter(make_qwen_edit(cfg_scale=cfg))
    assert {r.name: r.message for r in report.results}["condition"].startswith("condition (32, 32)")


def test_the_condition_suite_catches_an_adapter_that_ignores_the_condition(make_kontext):
    model = make_kontext()
    model._image_inputs = lambda latents, text: (latents, model.image_ids())  # drops the condition tokens
    report = check_adapter(model, checks=["condition"], raise_on_failure=False)
    assert not report.passed and "does not depend on the condition image" in report.results[0].message


# ---- the pipelines' own sampling -------------------------------------------------------------


def test_kontext_sampling_equals_the_pipeline(make_kontext, conditions):
    # FLUX.1 conventions plus the condition: VAE mode, (z - shift) * scale, packing, ids (1, r, c),
    # the concatenation and the slice of the output, against FluxKontextPipeline.__call__.
    model = make_kontext()
    noise = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    ours = _ode_images(model, _rows(conditions), noise, 5)
    ref = model.pipe(image=_pictures(conditions), prompt=PROMPTS, height=32, width=32, num_inference_steps=5,
                     guidance_scale=2.5, latents=noise, max_sequence_length=16, max_area=32 * 32,
                     _auto_resize=False, output_type="pt").images
    assert ((ref > 0) & (ref < 1)).float().mean() > 0.5, "the comparison needs unclamped pixels"
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    # and the condition matters: another image, another result
    swapped = _ode_images(model, [PromptRow(PROMPTS[0], _rows(conditions)[1].condition)], noise[:1], 5)
    assert (swapped - ours[:1]).abs().max() > 1e-3


@pytest.mark.parametrize("cfg", [4.0, 1.0])
def test_qwen_image_edit_sampling_equals_the_pipeline(make_qwen_edit, conditions, monkeypatch, cfg):
    # The pipeline sizes the condition at about 1024 x 1024 pixels (calculate_dimensions); the test
    # makes that rule give the adapter's 32 x 32, nothing else of the pipeline is touched.
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as edit

    real = edit.calculate_dimensions
    monkeypatch.setattr(edit, "calculate_dimensions", lambda area, ratio: real(32 * 32, ratio))
    model = make_qwen_edit(cfg_scale=cfg)
    noise = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(1))
    ours = _ode_images(model, _rows(conditions), noise, 5)
    kw = dict(negative_prompt=[" ", " "], true_cfg_scale=cfg) if cfg != 1.0 else {}  # one per image
    ref = model.pipe(image=_pictures(conditions), prompt=PROMPTS, height=32, width=32, num_inference_steps=5,
                     latents=noise, output_type="pt", **kw).images
    assert ((ref > 0) & (ref < 1)).float().mean() > 0.5
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_qwen_image_edit_text_holds_the_image_tokens(make_qwen_edit, conditions):
    model = make_qwen_edit()
    text = model.encode_prompts(_rows(conditions))
    assert model.vision_tokens == 16 and text["prompt_embeds"].shape == (2, 16 + 64, 32)
    assert text["condition_latents"].shape == (2, 64, 16)
    # the negative prompt is encoded with each row's own image
    assert not torch.equal(text["negative_prompt_embeds"][0], text["negative_prompt_embeds"][1])


def test_a_prompt_without_a_condition_is_refused(make_kontext):
    with pytest.raises(FlowrlError, match="needs a condition image for every prompt") as err:
        make_kontext().encode_prompts(["a cat"])
    assert "condition_column" in err.value.hint


def test_condition_size_must_fit_the_packing(make_kontext):
    with pytest.raises(FlowrlError, match="condition_height = 30 is not a multiple of 4"):
        make_kontext(condition_height=30)
    model = make_kontext(condition_height=16, condition_width=48)
    assert model.condition_size == (16, 48) and model.condition_grid == (4, 12)


# ---- recipes: 2 iterations from a prompt table, grids, metadata, export ---------------------

_GEOMETRY = ["train.iterations=2", "train.prompts_per_iteration=1", "train.group_size=2", "train.micro_batch_size=2",
             "train.optimizer_steps_per_update=1", "log.progress=false", "log.image_every=1", "run.device=cpu",
             "model.height=32", "model.width=32", "model.dtype=fp32", "model.vae_batch_size=8",
             "model.gradient_checkpointing=false", "train.lora_rank=4", "train.lora_alpha=8.0", "train.lr=0.05",
             "train.max_grad_norm=0", "rewards.0.use=brightness", "prompts.split_column=\"\"", "prompts.num_eval=0"]


def _train(recipe, model_path, conditions, out, extra=()):
    from rich.console import Console

    from flowrl.recipe import load_recipe
    from flowrl.train import train

    sets = [f"model.path={model_path}", *_GEOMETRY, f'prompts.source="{conditions / "edits.jsonl"}"',
            'prompts.text_column="instruction"', 'prompts.condition_column="source"', *extra,
            f'run.output_dir="{out}"']
    return train(load_recipe(f"recipes/{recipe}", sets), console=Console(quiet=True))


@pytest.mark.parametrize("recipe, fixture, extra", [
    ("kontext_edit_lora.toml", "tiny_kontext", ["model.max_sequence_length=16"]),
    ("qwen_image_edit_lora.toml", "tiny_qwen_edit", ["model.max_sequence_length=64"]),
])
def test_edit_recipe_trains_two_iterations(recipe, fixture, extra, conditions, tmp_path, request, monkeypatch):
    from PIL import Image
    from safetensors.torch import load_file

    from flowrl.recipe import load_recipe

    monkeypatch.chdir(request.config.rootpath)
    assert load_recipe(f"recipes/{recipe}").prompts.condition_column  # the recipe reads a condition column
    run = _train(recipe, request.getfixturevalue(fixture), conditions, tmp_path / "run", extra)
    records = read_metrics(run)
    assert [r["iteration"] for r in records] == [0, 1]
    assert all(r["on_policy/max_abs_log_ratio"] <= 1e-6 for r in records)
    # the recipe's condition-fidelity reward read the condition images from its metadata
    assert all(0.0 < r["reward/fidelity/mean"] <= 1.0 for r in records)
    state = load_file(str(run / "checkpoints" / "iter_000002" / "model.safetensors"))
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in state.items()), "LoRA B never moved"
    # the training grid shows the condition beside the group: one more tile than the group
    grid = Image.open(run / "images" / "iter_000000.png")
    assert grid.width == 3 * (32 * 4 + 4) + 4  # three 128 px cells (32 px scaled 4x) and 4 px gaps


def test_kontext_lora_export_loads_with_load_lora_weights(make_kontext, tiny_kontext, conditions, tmp_path, request,
                                                          monkeypatch):
    from diffusers import FluxKontextPipeline

    from flowrl.commands.inference import load_policy, resolve_source
    from flowrl.sampling.rollout import ode_sample

    monkeypatch.chdir(request.config.rootpath)
    run = _train("kontext_edit_lora.toml", tiny_kontext, conditions, tmp_path / "run", ["model.max_sequence_length=16"])
    from flowrl import cli

    try:
        cli.main(["export", str(run), "-o", str(tmp_path / "lora")])
    except SystemExit as done:
        assert done.code in (0, None)
    noise = torch.randn(1, 64, 16, generator=torch.Generator().manual_seed(5))
    pipe = FluxKontextPipeline.from_pretrained(tiny_kontext)
    pipe.load_lora_weights(tmp_path / "lora")
    tuned = pipe(image=_pictures(conditions)[:1], prompt=PROMPTS[:1], height=32, width=32, num_inference_steps=5,
                 guidance_scale=2.5, latents=noise, max_sequence_length=16, max_area=32 * 32, _auto_resize=False,
                 output_type="pt").images
    model = load_policy(resolve_source(run, None, [], None), "cpu")
    text = model.encode_prompts(_rows(conditions)[:1])
    ours = model.decode(ode_sample(lambda i, x, s: model.velocity(x, s, text), noise, model.sigmas(5)))
    torch.testing.assert_close(tuned, ours, atol=1e-5, rtol=0)


def test_sample_grid_puts_each_condition_before_its_row(tiny_kontext, conditions, tmp_path, request, monkeypatch):
    from PIL import Image

    from flowrl import cli

    monkeypatch.chdir(request.config.rootpath)
    run = _train("kontext_edit_lora.toml", tiny_kontext, conditions, tmp_path / "run", ["model.max_sequence_length=16"])
    out = tmp_path / "samples"
    try:
        cli.main(["sample", str(run), "--prompts", str(conditions / "edits.jsonl"), "--seeds", "2", "-o", str(out)])
    except SystemExit as done:
        assert done.code in (0, None)
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 4 and records[0]["condition"] == str(conditions / "img" / "0.png")
    grid = Image.open(out / "grid.png")
    assert grid.width == 3 * (32 * 4 + 4) + 4  # condition + 2 seeds per row: 128 px cells, 4 px gaps
