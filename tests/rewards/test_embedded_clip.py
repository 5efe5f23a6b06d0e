"""embedded_clip: the shipped tiny CLIP scores the embedded grammar meaningfully, through
PickScore's code path, offline."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from reward_helpers import assert_invariant

from flowrl.plugins import get_registry
from flowrl_plugins.embedded import dataset as D
from flowrl_plugins.rewards.embedded_clip import WEIGHTS_DIR

# The training and evaluation script is part of the repository, not of a plugin.
REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("train_embedded_clip", REPO / "scripts" / "train_embedded_clip.py")
_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_script)
evaluate = _script.evaluate


@pytest.fixture(scope="module")
def reward():
    comp = get_registry().get("reward", "embedded_clip")
    return comp.build(comp.params(device="cpu"))


def test_scores_mean_something():
    # Fresh images (another seed than the model card's); thresholds sit below the card's values.
    result = evaluate(WEIGHTS_DIR, n=256, seed=7)
    assert result["top1_clean"] >= 0.9, result  # the right prompt among all 90
    assert result["top1_noise_0.3"] >= 0.8, result
    assert result["matched_beats_wrong_fg"] >= 0.95, result
    assert result["matched_beats_wrong_shape"] >= 0.9, result


def test_registered_reward_scores_and_is_invariant(reward):
    images, prompts = D.sample_batch(6, torch.Generator().manual_seed(13))
    scores = assert_invariant(reward, images, prompts)
    assert scores.shape == (6,) and ((scores >= -1) & (scores <= 1)).all()  # cosine scale
