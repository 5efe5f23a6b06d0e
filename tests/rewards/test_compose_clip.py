"""compose_clip: the shipped tiny CLIP of the compositional world loads offline and scores ground-truth
scenes higher for their own prompt than for a prompt with a wrong colour or a wrong shape; the
training script's minimally wrong prompts are false of the scenes they are compared on."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch
from reward_helpers import assert_invariant

from flowrl import geneval
from flowrl.plugins import get_registry
from flowrl_plugins.embedded.compose import grammar as G
from flowrl_plugins.embedded.compose import scenes as S
from flowrl_plugins.embedded.compose.detector import detect

# The training and evaluation script is part of the repository, not of a plugin.
REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("train_compose_clip", REPO / "scripts" / "train_compose_clip.py")
_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_script)

#: (prompt, the same with a wrong colour, the same with a wrong shape). The wrong shapes swap a triangle
#: and a square, which the judge separates almost always; circle against cross it often does not (see
#: the model card), so no case here asks for that.
CASES = [
    ("a red triangle", "a blue triangle", "a red square"),
    ("a green square", "a white square", "a green triangle"),
    ("a red circle and a blue square", "a red circle and a yellow square", "a red circle and a blue triangle"),
    ("a yellow triangle and a black cross", "a green triangle and a black cross", "a yellow square and a black cross"),
]


@pytest.fixture(scope="module")
def reward():
    with pytest.MonkeyPatch.context() as mp:  # nothing may come from the Hub
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        comp = get_registry().get("reward", "compose_clip")
        return comp.build(comp.params(device="cpu"))


@pytest.fixture(scope="module")
def scenes():
    prompts = [right for right, _, _ in CASES for _ in range(3)]  # three layouts each
    return S.render_prompts(prompts, torch.Generator().manual_seed(11)), prompts


def test_own_prompt_beats_wrong_colour_and_wrong_shape(reward, scenes):
    images, prompts = scenes
    by_prompt = {right: (colour, shape) for right, colour, shape in CASES}
    right = reward(images, prompts).scores
    assert right.shape == (len(prompts),) and right.dtype == torch.float32
    wrong_colour = reward(images, [by_prompt[p][0] for p in prompts]).scores
    wrong_shape = reward(images, [by_prompt[p][1] for p in prompts]).scores
    assert (right > wrong_colour).all(), (right, wrong_colour)
    # shapes are harder (the card: about 81% overall, 95% square against triangle): every case on average
    # over its layouts, and all but one scene alone
    assert (right - wrong_shape).view(len(CASES), 3).mean(1).gt(0).all(), (right, wrong_shape)
    assert (right > wrong_shape).sum() >= len(prompts) - 1, (right, wrong_shape)


def test_registered_reward_is_invariant_and_cosine(reward, scenes):
    images, prompts = scenes
    scores = assert_invariant(reward, images[:6], prompts[:6])
    assert ((scores >= -1) & (scores <= 1)).all()


def test_minimal_wrongs_are_false_of_the_scene():
    """The evaluation's premise: each minimally wrong prompt is in the grammar, in the prompt's own
    category, and GenEval's rules (embedded detector) reject it on a scene that the right prompt passes."""
    prompts = G.all_prompts()[::4]
    images = S.render_prompts(prompts, torch.Generator().manual_seed(3))
    rng = random.Random(0)
    kinds = set()
    for p, detections in zip(prompts, detect(images)):
        assert geneval.score_prompt(detections, G.metadata(p)).strict, p
        for kind, wrong in _script.minimal_wrongs(p, rng).items():
            kinds.add(kind)
            assert wrong != p and G.metadata(wrong)["tag"] == G.metadata(p)["tag"], (p, kind, wrong)
            assert not geneval.score_prompt(detections, G.metadata(wrong)).strict, (p, kind, wrong)
    assert kinds == set(_script.KINDS)


def test_training_counterparts_are_ground_truth():
    """The script's mirrored and recoloured scenes are scenes of the prompts it gives them."""
    prompts = G.all_prompts()[1::6]
    g = torch.Generator().manual_seed(4)
    images = S.render_prompts(prompts, g)
    made = [_script.counterpart(x, p, g) for x, p in zip(images, prompts)]
    made += [_script.transform(x, p, hflip=True, vflip="triangle" not in p, colours={"red": "blue", "blue": "red"})
             for x, p in zip(images, prompts)]
    assert sum(p not in prompts for _, p in made) > len(prompts) // 2  # most counterparts name another prompt
    for (_, prompt), detections in zip(made, detect(torch.stack([x for x, _ in made]))):
        assert geneval.score_prompt(detections, G.metadata(prompt)).strict, prompt
