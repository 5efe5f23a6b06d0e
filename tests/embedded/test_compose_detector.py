"""The embedded detector measures the generator, not its own errors: on rendered ground truth of
every category GenEval's rules pass at >= 0.97, and wrong prompts fail."""

from __future__ import annotations

import pytest

import collections

import torch

from flowrl import geneval
from flowrl_plugins.embedded.compose import detector, grammar, scenes


def _accuracy_by_category(prompts, images):
    verdicts = collections.defaultdict(list)
    for prompt, dets in zip(prompts, detector.detect(images)):
        meta = grammar.metadata(prompt)
        verdicts[meta["tag"]].append(geneval.score_prompt(dets, meta).strict)
    return {tag: sum(v) / len(v) for tag, v in verdicts.items()}


@pytest.mark.slow
def test_ground_truth_of_every_category_scores_at_least_097():
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(123)
    prompts = grammar.all_prompts()
    prompts = [p for p in prompts for _ in range(2 if grammar.metadata(p)["tag"] != "color_attr" else 1)]
    accuracy = _accuracy_by_category(prompts, scenes.render_prompts(prompts, g))
    assert set(accuracy) == set(geneval.TAGS)
    assert min(accuracy.values()) >= 0.97, accuracy


def test_wrong_prompts_fail_on_ground_truth():
    g = torch.Generator().manual_seed(5)
    pairs = [("a red circle", "a blue circle"), ("a red circle", "a red square"), ("two squares", "three squares"),
             ("three squares", "two squares"), ("a circle left of a square", "a circle right of a square"),
             ("a circle above a square", "a square above a circle"), ("a red circle and a blue square",
                                                                      "a blue circle and a red square")]
    images = scenes.render_prompts([truth for truth, _ in pairs], g)
    for (truth, wrong), dets in zip(pairs, detector.detect(images)):
        assert geneval.score_prompt(dets, grammar.metadata(truth)).strict, truth
        assert not geneval.score_prompt(dets, grammar.metadata(wrong)).strict, (truth, wrong)


def test_detections_of_a_hand_placed_scene():
    objects = [scenes.SceneObject("circle", "red", 8.0, 8.0, 5.0), scenes.SceneObject("cross", "blue", 24.0, 20.0, 5.0),
               scenes.SceneObject("triangle", "red", 8.0, 24.0, 5.0)]
    dets = sorted(detector.detect(scenes.render([objects]))[0], key=lambda d: d.box)
    assert [(d.label, d.colour) for d in dets] == [("circle", "red"), ("triangle", "red"), ("cross", "blue")]
    # boxes in pixel-edge coordinates: the pixels whose centres lie within r of the centre
    assert dets[0].box == (3.0, 3.0, 14.0, 14.0) and dets[2].box == (19.0, 15.0, 30.0, 26.0)
    assert all(d.score == 1.0 for d in dets)


def test_specks_and_empty_canvases_give_no_detection():
    images = scenes.render([[], []])
    images[1, :, 5:7, 5:7] = torch.tensor([1.0, 0.0, 0.0]).view(3, 1, 1)  # 4 red pixels
    assert detector.detect(images) == [[], []]


def test_a_shapeless_blob_scores_below_the_counting_threshold():
    blob = scenes.render([[]])
    blob[0, :, 4:28, 6:9] = torch.tensor([0.0, 1.0, 0.0]).view(3, 1, 1)  # a long thin bar is no shape here
    (det,) = detector.detect(blob)[0]
    assert det.score < geneval.COUNTING_THRESHOLD
