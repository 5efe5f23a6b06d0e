"""``flowrl plan`` counts a reward's model from what the reward's params declare
(:class:`flowrl.interfaces.PlansRewardMemory`), never from a table of reward names in the core."""

from __future__ import annotations

import dataclasses

from pathlib import Path

import pytest

from flowrl.interfaces import PlansRewardMemory
from flowrl.memory_plan import estimate
from flowrl.plugins import get_registry
from flowrl.recipe import load_recipe
from flowrl_plugins.rewards.clip import ClipConfig, PickScoreConfig
from flowrl_plugins.rewards.hpsv3 import HPSv3Config
from flowrl_plugins.rewards.video_align import VideoAlignConfig

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("config, parameters", [
    (HPSv3Config(), 8.29e9), (VideoAlignConfig(), 2.21e9), (PickScoreConfig(), 986.1e6),
    (ClipConfig(), 986.1e6),  # open_clip's default ViT-H-14
    (ClipConfig(backend="transformers"), 427.6e6),  # openai/clip-vit-large-patch14
    (ClipConfig(backend="transformers", model="laion/CLIP-ViT-bigG-14-laion2B-39B-b160k"), 2.540e9),
])
def test_a_model_reward_declares_its_weights_in_its_dtype(config, parameters):
    assert isinstance(config, PlansRewardMemory)
    assert config.memory_bytes() == int(parameters * 2)  # 'auto' is bfloat16 on an accelerator
    assert dataclasses.replace(config, dtype="float32").memory_bytes() == int(parameters * 4)
    assert f"{parameters / 1e9:.2f}e9 params" in config.memory_note


def test_a_clip_from_a_local_directory_is_not_guessed():
    config = ClipConfig(backend="transformers", model="/weights/my_clip")
    assert config.memory_bytes() is None and "0." not in config.memory_note


def test_the_plan_lists_the_declared_bytes_and_an_undeclared_reward_uncounted():
    registry = get_registry()
    recipe = load_recipe(REPO / "recipes" / "chunk_grpo_flux.toml", registry=registry)
    lines = {line.item: line for line in estimate(recipe, registry, 8)[2]}
    hps = lines["reward 'hpsv3'"]
    assert hps.bytes == HPSv3Config().memory_bytes() and hps.note.startswith("Qwen2-VL-7B, 8.29e9 params")
    recipe = load_recipe(REPO / "recipes" / "quickstart.toml", registry=registry)
    lines = [line for line in estimate(recipe, registry, 1)[2] if line.item.startswith("reward '")]
    assert lines and all(line.bytes == 0 and line.note == "size unknown (not counted)" for line in lines)
