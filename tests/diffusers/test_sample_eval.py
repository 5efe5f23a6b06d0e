"""``flowrl sample`` and ``flowrl eval``: seeds, sharding, hybrid inference, JSON beside the checkpoint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flowrl.distributed import DistContext


def _pngs(out):
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    return records, {(r["prompt"], r["seed_index"]): np.asarray(Image.open(out / r["file"])).astype(int) for r in records}


def test_sample_the_embedded_model_without_a_recipe(cli, tmp_path):
    out = tmp_path / "s"
    code, stdout, err = cli("sample", "--model", "embedded", "--set", "model.random_init=true", "--prompt",
                            "a red circle on a blue background", "--prompt", "a green square on a white background",
                            "--seeds", "2", "--steps", "4", "-o", out)
    assert code == 0, err
    records, images = _pngs(out)
    assert len(records) == 4 and len(images) == 4 and (out / "grid.png").is_file()
    assert {r["seed_index"] for r in records} == {0, 1}
    settings = json.loads((out / "settings.json").read_text())
    assert settings["steps"] == 4 and settings["num_images"] == 4


def test_sample_images_do_not_depend_on_batch_size_or_prompt_order(cli, tmp_path, flux_lora_run):
    a, b = tmp_path / "a", tmp_path / "b"
    assert cli("sample", flux_lora_run, "-p", "a red cat", "-p", "the blue dog", "--seeds", "2", "--steps", "4",
               "--batch-size", "4", "-o", a)[0] == 0
    assert cli("sample", flux_lora_run, "-p", "the blue dog", "-p", "a red cat", "--seeds", "2", "--steps", "4",
               "--batch-size", "1", "-o", b)[0] == 0
    _, ia = _pngs(a)
    _, ib = _pngs(b)
    assert ia.keys() == ib.keys()
    for key in ia:
        assert np.abs(ia[key] - ib[key]).max() <= 1, key  # same noise, same image (PNG rounding)
    assert np.abs(ia[("a red cat", 0)] - ia[("a red cat", 1)]).max() > 0  # seeds differ


def test_shard_covers_every_item_once_in_the_batches_of_one_process():
    from flowrl.commands.inference import shard

    items = list(range(11))
    parts = [shard(items, r, 3) for r in range(3)]
    assert sorted(sum(parts, [])) == items and sum(len(p) for p in parts) == 11
    # batches of 4: [0-3] [4-7] [8-10], one a process, so each batch is the one process's
    assert [shard(items, r, 3, 4) for r in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
    assert sum((shard(items, r, 2, 4) for r in range(2)), []) == items  # in item order


def test_sharded_sampling_writes_each_image_once(cli, tmp_path, flux_lora_run, monkeypatch):
    import flowrl.commands.inference as inference
    import flowrl.commands.sample as sample_mod

    single, sharded = tmp_path / "single", tmp_path / "sharded"
    args = ["-p", "a red cat", "-p", "the blue dog", "-p", "a dog on the red mat", "--seeds", "2", "--steps", "3"]
    assert cli("sample", flux_lora_run, *args, "-o", single)[0] == 0
    monkeypatch.setattr(sample_mod, "barrier", lambda ctx: None)
    for rank in (2, 1, 0):  # rank 0 last: it merges the other ranks' manifests after the barrier
        monkeypatch.setattr(inference, "dist_context", lambda dev, rank=rank: DistContext(rank=rank, world_size=3))
        code, _, err = cli("sample", flux_lora_run, *args, "-o", sharded)
        assert code == 0, err
    records, images = _pngs(sharded)
    assert [r["index"] for r in records] == list(range(6))
    assert not list(sharded.glob("samples.rank*.jsonl")) and (sharded / "grid.png").is_file()
    _, reference = _pngs(single)
    assert images.keys() == reference.keys()
    assert all(np.abs(images[k] - reference[k]).max() <= 1 for k in images)


def _images(model, prompts, noise, sigmas, velocity_for_step):
    from flowrl.sampling.rollout import ode_sample

    return model.decode(ode_sample(lambda i, x, s: velocity_for_step(i)(x, s), noise, sigmas))


@pytest.mark.parametrize("run_fixture", ["flux_lora_run", "flux_full_run"])
def test_hybrid_inference_switches_to_the_base_model(request, run_fixture, make_flux):
    from flowrl.commands.inference import Item, base_model_for_hybrid, generate, load_policy, noise_for, resolve_source

    run = request.getfixturevalue(run_fixture)
    src = resolve_source(run, None, [], None)
    trained = load_policy(src, "cpu")
    base = base_model_for_hybrid(src, trained, "cpu")
    assert (base is None) == (run_fixture == "flux_lora_run")  # LoRA: the adapter disabled, no copy
    fresh = make_flux()  # the untrained base, built independently
    sigmas = trained.sigmas(4)
    items = [Item(0, 0, "a red cat", 0)]
    noise = noise_for(trained, src.recipe.run.seed, "a red cat", 0)[None]
    text = trained.encode_prompts(["a red cat"])

    def manual(k):
        return _images(trained, None, noise, sigmas, lambda i: (
            (lambda x, s: trained.velocity(x, s, text)) if i < k else (lambda x, s: fresh.velocity(x, s, text))))

    for k in (1, 3):
        [(_, got)] = list(generate(trained, items, sigmas, seed=src.recipe.run.seed, batch_size=1, hybrid_steps=k, base=base))
        torch.testing.assert_close(got, manual(k), atol=1e-5, rtol=0)
    assert (manual(1) - manual(4)).abs().max() > 1e-4  # the switch matters


class _RedPlugin:
    """A second offline reward, registered for one test like any third-party plugin."""

    from flowrl import hookimpl

    @hookimpl
    def register_rewards(self, register):
        register("redness", lambda images, prompts: images[:, 0].mean(dim=(1, 2)))


def test_eval_writes_json_beside_the_checkpoint(cli, flux_lora_run):
    from flowrl.plugins import temporary_plugin

    with temporary_plugin(_RedPlugin(), "red"):
        code, out, err = cli("eval", flux_lora_run, "-p", "a red cat", "-p", "the blue dog", "--seeds", "2",
                             "--steps", "3", "--reward", "brightness", "--reward", "redness", "--batch-size", "3")
    assert code == 0, err
    # prompts, seeds and rewards of its own: an ad-hoc evaluation, beside the checkpoint but never in
    # place of the run's own iter_000002.eval.json
    path = Path(re.search(r"wrote (\S+\.json)", out).group(1))
    assert path.parent == flux_lora_run / "checkpoints" and re.fullmatch(r"iter_000002\.adhoc-\d+\.json", path.name)
    result = json.loads(path.read_text())
    assert result["iteration"] == 2 and set(result["rewards"]) == {"brightness", "redness"}
    per = result["per_image"]
    assert len(per) == 4 and len({(p["prompt"], p["seed_index"]) for p in per}) == 4
    for label, stats in result["rewards"].items():
        values = [p["scores"][label] for p in per]
        assert stats["n"] == 4 and stats["mean"] == pytest.approx(sum(values) / 4)
    # the images scored are the ones `flowrl sample` writes for the same prompts and seeds
    samples = flux_lora_run / "samples_for_eval"
    assert cli("sample", flux_lora_run, "-p", "a red cat", "-p", "the blue dog", "--seeds", "2", "--steps", "3",
               "-o", samples)[0] == 0
    _, images = _pngs(samples)
    for p in per:
        png = images[(p["prompt"], p["seed_index"])] / 255.0
        assert abs(png.mean() - p["scores"]["brightness"]) < 2 / 255
    assert result["settings"]["steps"] == 3 and len(result["settings"]["sigmas"]) == 4


def test_eval_of_a_base_model_from_a_recipe_with_its_rewards(cli, tmp_path, tiny_flux, tiny_overrides):
    sets = []
    for s in [f"model.path={tiny_flux}", *tiny_overrides, "rewards.0.use=brightness"]:
        sets += ["--set", s]
    out = tmp_path / "base.json"
    code, _, err = cli("eval", "recipes/chunk_grpo_flux.toml", *sets, "-p", "a cat", "--steps", "2", "-o", out,
                       "--device", "cpu")
    assert code == 0, err
    result = json.loads(out.read_text())
    assert result["checkpoint"] is None and list(result["rewards"]) == ["brightness"]
    code, _, err = cli("eval", "recipes/chunk_grpo_flux.toml", *sets, "-p", "a cat", "--steps", "2", "--device", "cpu")
    assert code == 2 and "pass -o" in err
