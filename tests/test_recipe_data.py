"""The [data] table of a recipe (offline SFT and DPO): `flowrl validate` refuses every combination
that cannot train, before any model loads, with one message naming the table and the fix (no
traceback): an online loss with [data], an offline loss without it, a missing table or image, a
table of the other kind, a stated kind that disagrees, group_size, and a table smaller than an
iteration. A resolved offline recipe round-trips."""

from __future__ import annotations

import json
import tomllib

import pytest

from flowrl import hookimpl
from flowrl.plugins import temporary_plugin
from flowrl.recipe import dump_toml, load_recipe, validate as validate_dict

from test_recipes import REPO

SFT, DPO = REPO / "recipes" / "offline_sft.toml", REPO / "recipes" / "offline_dpo.toml"


def png(path):
    from PIL import Image

    Image.new("RGB", (8, 8), (255, 0, 0)).save(path)
    return path.name


@pytest.fixture
def tables(tmp_path):
    """An image table and a pair table of 16 rows each (an iteration of the SFT recipe), beside their images."""
    a, b = png(tmp_path / "a.png"), png(tmp_path / "b.png")
    (tmp_path / "best.jsonl").write_text("".join(json.dumps({"prompt": f"p{i}", "image": a}) + "\n" for i in range(16)))
    (tmp_path / "pairs.jsonl").write_text(
        "".join(json.dumps({"prompt": f"p{i}", "chosen": a, "rejected": b}) + "\n" for i in range(16)))
    return tmp_path


def data(path) -> str:
    return f"data.path={str(path)!r}"


def test_the_offline_recipes_validate_with_their_tables(validate, tables):
    for recipe, table in ((SFT, "best.jsonl"), (DPO, "pairs.jsonl")):
        code, err = validate(recipe, data(tables / table))
        assert code == 0, err


@pytest.mark.parametrize("recipe, sets, where, says", [
    (REPO / "recipes" / "quickstart_dpo.toml", ["data.path=TABLE_pairs"], "[loss]",
     "[data] names an offline table, but loss 'dpo' trains on rollouts"),
    (SFT, ["data.path=''"], "[data].path", "loss 'sft' trains on an offline table of images, and the recipe names none"),
    (DPO, ["data.path=''"], "[data].path", "loss 'offline_dpo' trains on an offline table of pairs"),
    (SFT, ["data.path=TABLE_missing.jsonl"], "[data].path", "offline data not found"),
    (SFT, ["data.path=TABLE_pairs"], "[data].path", "is a table of pairs, but loss 'sft' trains on a table of images"),
    (DPO, ["data.path=TABLE_best"], "[data].path", "is a table of images, but loss 'offline_dpo' trains on a table of pairs"),
    (SFT, ["data.path=TABLE_best", "data.kind='pairs'"], "[data].kind", "kind = 'pairs', but loss 'sft' trains"),
    (SFT, ["data.path=TABLE_best", "train.group_size=4"], "[train].group_size", "group_size does not apply"),
    (SFT, ["data.path=TABLE_best", "train.prompts_per_iteration=32"], "[train].prompts_per_iteration",
     "holds 16 rows, fewer than an iteration trains"),
    (SFT, ["data.path=TABLE_noimage"], "[data].path", "row 1: image image not found"),
    (SFT, ["data.path=TABLE_best", "model.use='embedded_video'"], "[data]",
     "model 'embedded_video' cannot train on an offline table of images: its task is text-to-video"),
    (DPO, ["data.path=TABLE_pairs", "model.use='wan'"], "[data]",
     "model 'wan' cannot train on an offline table of images: its task is text-to-video"),
    (SFT, ["data.path=TABLE_best", "model.use='flux_kontext'"], "[data]",
     "model 'flux_kontext' cannot train on an offline table of images: its task is image-to-image"),
])
def test_a_combination_that_cannot_train_is_one_message_naming_the_table(validate, tables, recipe, sets, where, says):
    (tables / "noimage.jsonl").write_text(json.dumps({"prompt": "p", "image": "gone.png"}) + "\n")
    files = {"TABLE_pairs": tables / "pairs.jsonl", "TABLE_best": tables / "best.jsonl",
             "TABLE_missing.jsonl": tables / "missing.jsonl", "TABLE_noimage": tables / "noimage.jsonl"}
    sets = [s if not s.startswith("data.path=TABLE") else data(files[s.split("=", 1)[1]]) for s in sets]
    code, err = validate(recipe, *sets)
    assert code == 2, err
    assert says in err and f"{recipe.name}: {where}" in err and "hint:" in err, err
    assert "Traceback" not in err


def test_a_resolved_offline_recipe_round_trips_without_group_size(tables):
    recipe = load_recipe(SFT, [data(tables / "best.jsonl")])
    assert recipe.group_size == 1 and recipe.data.path == str(tables / "best.jsonl")
    text = dump_toml(recipe.to_toml_dict())
    assert "group_size" not in tomllib.loads(text)["train"]
    again = validate_dict(tomllib.loads(text), source=recipe.source)
    assert again.to_toml_dict() == recipe.to_toml_dict()


class ImageModelWithoutEncoder:
    """A third-party text-to-image adapter that cannot turn images into latents."""

    @hookimpl
    def register_models(self, register):
        from flowrl_plugins.embedded.plugin import EmbeddedModel

        class Model(EmbeddedModel):
            encode_images = None  # what a subclass without an encoder looks like to the registry

        register("no_encoder", Model)


class ImageModelWithoutSize:
    """A third-party adapter with encode_images but no image_size: EncodesImages needs both."""

    @hookimpl
    def register_models(self, register):
        from flowrl_plugins.embedded.plugin import EmbeddedConfig

        class Model:
            Config = EmbeddedConfig

            def __init__(self, config):
                self.config = config

            def encode_images(self, images):
                return images

        register("no_encoder", Model)


@pytest.mark.parametrize("plugin", [ImageModelWithoutEncoder, ImageModelWithoutSize])
def test_an_image_model_without_an_encoder_is_refused_naming_those_with_one(validate, tables, plugin):
    with temporary_plugin(plugin(), name="no-encoder"):
        code, err = validate(SFT, data(tables / "best.jsonl"), "model.use='no_encoder'")
    assert code == 2, err
    assert "model 'no_encoder' cannot train on an offline table of images: its adapter cannot turn images" in err
    assert "embedded, embedded_compose, flux, flux2_klein, qwen_image, sd3, zimage" in err, err
    assert "Traceback" not in err


def test_an_offline_runs_table_prompts_are_embedded_and_checked_against_a_store(validate, tables, flowrl_cli, tmp_path):
    """`flowrl embed` of an offline recipe embeds its [data] table's prompts; a store without them is refused."""
    sets = ["--set", data(tables / "best.jsonl")]
    (r,) = flowrl_cli.in_process([["embed", str(SFT), *sets, "-o", str(tmp_path / "store")]], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    code, err = validate(SFT, data(tables / "best.jsonl"), f"prompts.embeddings={str(tmp_path / 'store')!r}")
    assert code == 0, err
    other = tables / "other.jsonl"
    other.write_text("".join(json.dumps({"prompt": f"q{i}", "image": "a.png"}) + "\n" for i in range(16)))
    code, err = validate(SFT, data(other), f"prompts.embeddings={str(tmp_path / 'store')!r}")
    assert code == 2 and "16 prompt(s) the run uses are not in" in err and "'q0'" in err, err
