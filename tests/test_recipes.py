"""Every shipped recipe validates, and a resolved recipe written back to TOML round-trips."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from flowrl.config import fields_of
from flowrl.plugins import get_registry
from flowrl.recipe import SECTIONS, dump_toml, load_recipe, validate

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").rglob("*.toml"))


def _ids(paths):
    return [str(p.relative_to(REPO)) for p in paths]


def test_recipes_exist():
    assert RECIPES, f"no *.toml recipe found under {REPO / 'recipes'}"


def _round_trip(recipe):
    text = dump_toml(recipe.to_toml_dict())
    again = validate(tomllib.loads(text), source=recipe.source)
    assert again == recipe, text
    # and the text is stable: writing the re-read recipe gives the same file
    assert dump_toml(again.to_toml_dict()) == text


@pytest.mark.parametrize("path", RECIPES, ids=_ids(RECIPES))
def test_recipe_validates_and_round_trips(path, monkeypatch):
    # recipes name files (prompts, profiles) relative to where flowrl runs: the repository root
    monkeypatch.chdir(REPO)
    recipe = load_recipe(path)
    assert recipe.rewards, path
    _round_trip(recipe)


def test_round_trip_of_every_kind_of_value():
    data = {
        "run": {"name": 'quote " and \\ backslash', "seed": 7},
        "train": {"lr": 1e-5, "adam_betas": [0.5, 0.75], "lora_targets": ["to_q", "to_k"],
                  "same_noise_in_group": True, "finetune": "lora"},
        "sampler": {"steps": 12, "sde_window": [2, 9]},
        "chunker": {"use": "fixed", "size": 3, "remainder": "merge"},
        "rewards": [{"use": "brightness", "weight": 0.25, "name": "bright"},
                    {"use": "brightness", "weight": -1}],
        "trackers": [{"use": name} for name in get_registry().names("tracker")[:1]],
    }
    recipe = validate(data, source="<test>")
    assert recipe.rewards[0].label == "bright" and recipe.rewards[1].label == "brightness"
    assert recipe.num_trainable == 7
    _round_trip(recipe)


def test_every_recipe_key_is_documented():
    """`flowrl validate --explain` is only as good as the help strings: none may be empty."""
    undocumented = []
    for name, cls in SECTIONS.items():
        undocumented += [f"[{name}].{f.name}" for f, _ in fields_of(cls) if not f.metadata.get("help")]
    registry = get_registry()
    for kind, table in registry.components.items():
        for comp in table.values():
            if comp.params is None:
                continue
            assert dataclasses.is_dataclass(comp.params)
            undocumented += [
                f"{kind} '{comp.name}' ({comp.plugin}).{f.name}"
                for f, _ in fields_of(comp.params)
                if not f.metadata.get("help")
            ]
    assert not undocumented, "declare these with flowrl.config.param(default, help): " + ", ".join(undocumented)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["kernel.use='ode'"], "no trainable transition"),
        (["kernel.a=0.0"], "no trainable transition"),
        (["train.adam_betas=[0.9, 1.0]"], "adam_betas must be two numbers in [0, 1)"),
        (["train.adam_betas=[0.9]"], "adam_betas must be two numbers in [0, 1)"),
        (["log.eval_steps=1"], "[log].eval_steps: eval_steps = 1: a sampling schedule needs at least 2 steps"),
    ],
)
def test_settings_the_engine_cannot_train_fail_validation(overrides, message):
    from flowrl.errors import RecipeError
    from flowrl.recipe import load_recipe

    with pytest.raises(RecipeError) as err:
        load_recipe(REPO / "recipes" / "quickstart_hacking.toml", overrides)
    assert message in err.value.format()


def test_trainable_transitions_follow_the_kernel():
    from flowrl.recipe import load_recipe

    qs = REPO / "recipes" / "quickstart_hacking.toml"
    assert load_recipe(qs).num_trainable == 16  # 17 steps, image from the last x0_hat
    assert load_recipe(qs, ["sampler.image_from='final'", "chunker.sizes=[2,3,4,8]"]).num_trainable == 17
    # CPS into sigma = 0 is deterministic: the last step cannot be trained even with image_from = final
    assert load_recipe(qs, ["kernel.use='cps'", "sampler.image_from='final'"]).num_trainable == 16
