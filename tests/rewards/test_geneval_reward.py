"""The ``geneval`` reward on a tiny random OWLv2 and a tiny CLIP built offline.

Random weights detect nothing meaningful, so the scoring tests replace the detector's raw outputs
(``raw_detections``) with hand-chosen boxes and scores on hand-painted images, and CLIP's image
features with an oracle of the crop's mean colour: the reward must then equal
``flowrl.geneval.score_prompt`` on the same detections. The real loading and forward paths run
unpatched end to end, and match transformers' own preprocessing and post-processing.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from flowrl import geneval
from flowrl.errors import FlowrlError
from flowrl.plugins import get_registry
from flowrl.testing.components import check_component
from flowrl_plugins.rewards import geneval as reward_module
from flowrl_plugins.rewards.geneval import (
    GREY, SCORE_FLOOR, GenEval, GenEvalConfig, detections_from_outputs, grey_masked_crop, owl_pixels,
)

OWL_SIZE = 64  # the tiny detector's input side (4 x 4 patches of 16)
H, W = 48, 64  # the test images: not square, so boxes are scaled by the longer side

META = [
    {"tag": "color_attr", "prompt": "a photo of a red dog and a blue cat",
     "include": [{"class": "dog", "count": 1, "color": "red"}, {"class": "cat", "count": 1, "color": "blue"}]},
    {"tag": "counting", "prompt": "a photo of two dogs",
     "include": [{"class": "dog", "count": 2}], "exclude": [{"class": "dog", "count": 3}]},
    {"tag": "position", "prompt": "a photo of a dog right of a cat",
     "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["right of", 0]}]},
    {"tag": "single_object", "prompt": "a photo of a bench", "include": [{"class": "bench", "count": 1}]},
]
NO_COLOUR = [m for m in META if m["tag"] != "color_attr"]
RGB = {"red": (1, 0, 0), "orange": (1, .5, 0), "yellow": (1, 1, 0), "green": (0, 1, 0), "blue": (0, 0, 1),
       "purple": (.5, 0, .5), "pink": (1, .75, .8), "brown": (.6, .3, 0), "black": (0, 0, 0), "white": (1, 1, 1)}


def build_tiny_owlv2(directory):
    """A random OWLv2 (image 64, patch 16) with its processor, saved like a hub checkpoint."""
    from transformers import CLIPTokenizer, Owlv2Config, Owlv2ForObjectDetection, Owlv2ImageProcessor, Owlv2Processor

    from flowrl.testing.tiny_models import write_clip_tokenizer

    vocab = write_clip_tokenizer(directory / "tok")
    tok = CLIPTokenizer(str(directory / "tok" / "vocab.json"), str(directory / "tok" / "merges.txt"))
    tok.model_max_length = 64  # the tiny tokenizer spends one token per byte
    text = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                max_position_embeddings=64, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  image_size=OWL_SIZE, patch_size=16)
    torch.manual_seed(0)
    model = Owlv2ForObjectDetection(Owlv2Config(text_config=text, vision_config=vision, projection_dim=32)).eval()
    model.save_pretrained(directory)
    Owlv2Processor(image_processor=Owlv2ImageProcessor(size={"height": OWL_SIZE, "width": OWL_SIZE}),
                   tokenizer=tok).save_pretrained(directory)
    return directory


def write_metadata(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_clip_dir):
    root = tmp_path_factory.mktemp("geneval")
    return {"detector": str(build_tiny_owlv2(root / "owl")), "clip": str(tiny_clip_dir),
            "metadata": str(write_metadata(root / "meta.jsonl", META)),
            "no_colour": str(write_metadata(root / "no_colour.jsonl", NO_COLOUR))}


def make(files, **kw):
    # on the CPU in fp32, as the references here are computed ('auto' is CUDA and bf16 on a GPU machine)
    params = {"detector": files["detector"], "clip": files["clip"], "metadata": files["metadata"], "batch_size": 8,
              "device": "cpu"}
    return GenEval(GenEvalConfig(**{**params, **kw}))


@pytest.fixture(scope="module")
def reward(files):
    return make(files)


# ----------------------------------------------------------------------------- the real path, unpatched


def test_registered_reward_loads_the_local_models_and_scores(files):
    comp = get_registry().get("reward", "geneval")
    reward = comp.build(comp.params(detector=files["detector"], clip=files["clip"], metadata=files["metadata"]))
    prompts = [m["prompt"] for m in META] * 2
    images = torch.rand(len(prompts), 3, H, W, generator=torch.Generator().manual_seed(0))
    out = reward(images, prompts)
    assert out.scores.dtype == torch.float32 and out.scores.shape == (len(prompts),)
    assert bool(((out.scores >= 0) & (out.scores <= 1)).all())
    torch.testing.assert_close(out.scores, out.extras["soft"])
    assert set(out.extras["strict"].tolist()) <= {0.0, 1.0}
    # each image on its own, in another order: the same scores
    singles = torch.cat([reward(images[i : i + 1], prompts[i : i + 1]).scores for i in reversed(range(len(prompts)))])
    torch.testing.assert_close(singles.flip(0), out.scores)
    check_component("reward", reward, prompts=[m["prompt"] for m in META[:3]])


@pytest.mark.parametrize("side", [48, 64, 80])  # enlarged, as is, shrunk (Gaussian anti-aliasing)
def test_preprocessing_matches_the_owlv2_image_processor(files, side):
    from transformers import Owlv2ImageProcessor

    proc = Owlv2ImageProcessor.from_pretrained(files["detector"])
    images = torch.rand(2, 3, side, side, generator=torch.Generator().manual_seed(side))
    ref = proc(images=list(images), do_rescale=False, return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(owl_pixels(images, OWL_SIZE, proc.image_mean, proc.image_std), ref, atol=1e-5, rtol=0)


def test_detections_match_transformers_forward_and_post_processing(files, reward):
    from transformers import Owlv2ForObjectDetection, Owlv2Processor

    model = Owlv2ForObjectDetection.from_pretrained(files["detector"]).eval()
    proc = Owlv2Processor.from_pretrained(files["detector"])
    images = torch.rand(2, 3, OWL_SIZE, OWL_SIZE, generator=torch.Generator().manual_seed(3))
    # the processor pads the second image's queries with " "; we mask the padding instead
    inputs = proc(text=[["a photo of a dog", "a photo of a cat"], ["a photo of a cat", "a photo of a cat"]],
                  images=list(images), do_rescale=False, return_tensors="pt")
    with torch.no_grad():
        ref = proc.image_processor.post_process_object_detection(model(**inputs), threshold=SCORE_FLOOR,
                                                                 target_sizes=[(OWL_SIZE, OWL_SIZE)] * 2)
        reward.prepare(["a photo of a red dog and a blue cat"])
        ours = reward.detect(images, [["dog", "cat"], ["cat"]])
    for dets, r, names in zip(ours, ref, [["dog", "cat"], ["cat", "cat"]]):
        assert [d.score for d in dets] == pytest.approx(r["scores"].tolist(), abs=1e-5)
        assert [d.label for d in dets] == [names[i] for i in r["labels"].tolist()]
        torch.testing.assert_close(torch.tensor([d.box for d in dets]).reshape(-1, 4), r["boxes"], atol=1e-4, rtol=0)
    assert ours[0], "the random tiny detector should find something above the floor"


# ----------------------------------------------------------------------------- scoring, detector patched

#: Per image: (prompt, painted regions (box, colour), detections (class, box, score)); H x W pixels.
SCENES = [
    ("a photo of a red dog and a blue cat", [((4, 6, 24, 30), "red"), ((36, 10, 60, 40), "blue")],
     [("dog", (4, 6, 24, 30), 0.95), ("cat", (36, 10, 60, 40), 0.8), ("cat", (0, 0, 10, 10), 0.2),
      ("dog", (38, 12, 58, 38), 0.31)]),  # a weak second dog: GenEval looks at the best one only
    ("a photo of a red dog and a blue cat", [((4, 6, 24, 30), "blue"), ((36, 10, 60, 40), "blue")],
     [("dog", (4, 6, 24, 30), 0.9), ("cat", (36, 10, 60, 40), 0.7)]),  # the dog is blue: colour fails
    ("a photo of two dogs", [], [("dog", (0, 0, 20, 20), 0.95), ("dog", (30, 0, 50, 20), 0.92),
                                 ("dog", (30, 25, 50, 45), 0.6)]),  # the third is below counting's 0.9
    ("a photo of a dog right of a cat", [], [("dog", (2, 10, 20, 30), 0.8), ("cat", (40, 10, 60, 30), 0.9)]),
    ("a photo of a bench", [], [("bench", (5, 5, 40, 40), 0.29)]),  # not above 0.3: absent
]


def paint(scenes):
    images = torch.full((len(scenes), 3, H, W), 0.5)
    for i, (_, regions, _) in enumerate(scenes):
        for (x0, y0, x1, y1), colour in regions:
            images[i, :, y0:y1, x0:x1] = torch.tensor(RGB[colour], dtype=torch.float32).view(3, 1, 1)
    return images


def expected_detections(scenes):
    """The detections as GenEval would see them, colours from the paint (an unpainted box: None)."""
    return [[geneval.Detection(c, box, s, dict(regions).get(box)) for c, box, s in dets] for _, regions, dets in scenes]


def patch_detector(monkeypatch, reward, scenes, calls):
    """``raw_detections`` returns the scenes' boxes (centre/size on the padded W x W square) and
    logits (the sigmoid gives the score) for the image's queries; -20 elsewhere."""
    def raw_detections(pixels, queries, mask):
        calls.append((tuple(pixels.shape), mask.sum(1).tolist()))
        b, q = mask.shape
        n = max(len(s[2]) for s in scenes)
        logits, boxes = torch.full((b, n, q), -20.0), torch.full((b, n, 4), 0.5)
        for i, (prompt, _, dets) in enumerate(scenes):
            classes = reward.classes_for(reward.metadata_for(prompt))
            for j, (cls, (x0, y0, x1, y1), s) in enumerate(dets):
                logits[i, j, classes.index(cls)] = math.log(s / (1 - s))
                boxes[i, j] = torch.tensor([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0]) / W
        return logits, boxes
    monkeypatch.setattr(reward, "raw_detections", raw_detections)


def patch_clip(monkeypatch, reward, crops):
    """CLIP's image features: the one-hot of the colour nearest the crop's mean (undoing CLIP's
    normalisation), against a classifier whose colour rows are the unit vectors; records crops."""
    clip = reward.module["clip"]
    dim = clip.config.projection_dim
    mean = torch.tensor(reward.clip_geometry.mean).view(1, 3, 1, 1)
    std = torch.tensor(reward.clip_geometry.std).view(1, 3, 1, 1)
    table = torch.tensor([RGB[c] for c in geneval.COLOURS], dtype=torch.float32)

    def get_image_features(pixel_values):
        rgb = (pixel_values.float() * std + mean).mean((2, 3))
        nearest = torch.cdist(rgb, table).argmin(1)
        return torch.nn.functional.one_hot(nearest, dim).float()

    real_crop = reward_module.grey_masked_crop

    def spy(image, box, mask=None):
        crops.append((image.clone(), tuple(box)))
        return real_crop(image, box, mask)

    monkeypatch.setattr(clip, "get_image_features", get_image_features)
    monkeypatch.setattr(reward, "_colour_classifier", lambda cls: torch.eye(len(geneval.COLOURS), dim))
    monkeypatch.setattr(reward_module, "grey_masked_crop", spy)


@pytest.mark.parametrize("mode", ["soft", "strict"])
def test_reward_equals_score_prompt_on_the_same_detections(files, monkeypatch, mode):
    reward = make(files, mode=mode)
    calls, crops = [], []
    patch_detector(monkeypatch, reward, SCENES, calls)
    patch_clip(monkeypatch, reward, crops)
    images = paint(SCENES)
    out = reward(images, [s[0] for s in SCENES])
    results = [geneval.score_prompt(d, geneval_meta(s[0])) for d, s in zip(expected_detections(SCENES), SCENES)]
    expected = [r.soft if mode == "soft" else float(r.strict) for r in results]
    assert out.scores.tolist() == pytest.approx(expected, abs=1e-6)
    assert [r.strict for r in results] == [True, False, True, False, False]  # the scenes test what they claim
    assert results[1].soft == pytest.approx(0.75)  # count 1, count 1, colour 0, colour 1
    assert out.extras["strict"].tolist() == [float(r.strict) for r in results]
    # one detector pass for the batch, on OWLv2's square input, each image with its own queries
    assert calls == [((len(SCENES), 3, OWL_SIZE, OWL_SIZE), [2, 2, 1, 2, 1])]
    # colour only where a requirement names one, for the best object of the class, cropped at its box
    assert [box for _, box in crops] == [pytest.approx(b, abs=1e-4) for b in
                                         [(4, 6, 24, 30), (36, 10, 60, 40), (4, 6, 24, 30), (36, 10, 60, 40)]]
    assert all(torch.equal(img, images[i]) for (img, _), i in zip(crops, [0, 0, 1, 1]))


def geneval_meta(prompt):
    return next(m for m in META if m["prompt"] == prompt)


def test_vocabulary_metadata_queries_every_class(files, monkeypatch):
    reward = make(files, vocabulary="metadata")
    calls = []
    patch_detector(monkeypatch, reward, SCENES[2:], calls)
    out = reward(paint(SCENES[2:]), [s[0] for s in SCENES[2:]])
    assert calls == [((3, 3, OWL_SIZE, OWL_SIZE), [3, 3, 3])]  # dog, cat, bench for every image
    assert out.extras["strict"].tolist() == [1.0, 0.0, 0.0]


def test_nms_threshold_reaches_select_objects(files, monkeypatch):
    scene = [("a photo of two dogs", [], [("dog", (0, 0, 20, 20), 0.95), ("dog", (1, 0, 21, 20), 0.93)])]
    for nms, strict in ((1.0, 1.0), (0.5, 0.0)):  # GenEval's default keeps both overlapping boxes
        reward = make(files, nms_threshold=nms)
        patch_detector(monkeypatch, reward, scene, [])
        assert reward(paint(scene), [scene[0][0]]).extras["strict"].tolist() == [strict]


def test_grey_masked_crop_on_a_hand_made_image():
    image = torch.arange(3 * 6 * 8, dtype=torch.float32).view(3, 6, 8) / 200
    torch.testing.assert_close(grey_masked_crop(image, (2, 1, 5, 4)), image[:, 1:4, 2:5])
    # GenEval: outside the object's mask, grey #999, then the crop to the box
    mask = torch.zeros(6, 8, dtype=torch.bool)
    mask[2, 3] = mask[3, 4] = True
    crop = grey_masked_crop(image, (2, 1, 5, 4), mask)
    keep = mask[1:4, 2:5]
    torch.testing.assert_close(crop[:, keep], image[:, 1:4, 2:5][:, keep])
    assert bool((crop[:, ~keep] == GREY).all()) and GREY == pytest.approx(153 / 255)
    # a box reaching beyond the image: grey there (PIL's crop would be black)
    crop = grey_masked_crop(image, (-2, -1, 3, 2))
    assert crop.shape == (3, 3, 5)
    torch.testing.assert_close(crop[:, 1:, 2:], image[:, 0:2, 0:3])
    assert bool((crop[:, 0] == GREY).all()) and bool((crop[:, :, :2] == GREY).all())
    # fractional boxes round as PIL's crop does (half to even); a degenerate box keeps one pixel
    torch.testing.assert_close(grey_masked_crop(image, (1.4, 0.6, 3.5, 2.5)), image[:, 1:2, 1:4])
    assert grey_masked_crop(image, (3, 3, 3, 3)).shape == (3, 1, 1)


def test_colour_classifier_is_the_mean_of_genevals_templates(files, reward):
    from transformers import CLIPModel, CLIPProcessor

    model, proc = CLIPModel.from_pretrained(files["clip"]).eval(), CLIPProcessor.from_pretrained(files["clip"])
    rows = []
    for colour in geneval.COLOURS:
        texts = [f"a photo of a {colour} dog", f"a photo of a {colour}-colored dog", f"a photo of a {colour} object"]
        tok = proc.tokenizer(texts, padding="max_length", max_length=64, return_tensors="pt")
        with torch.no_grad():
            emb = model.text_projection(model.text_model(**tok).pooler_output)
        emb = torch.nn.functional.normalize(emb, dim=-1).mean(0)
        rows.append(emb / emb.norm())
    with torch.no_grad():
        torch.testing.assert_close(reward._colour_classifier("dog"), torch.stack(rows), atol=1e-5, rtol=1e-5)


def test_detections_from_outputs_scales_boxes_and_drops_weak_ones():
    logits = torch.tensor([[[2.0, -1.0, 9.0], [-3.0, 0.5, 9.0]]])  # the third query is padding
    boxes = torch.tensor([[[0.5, 0.25, 0.5, 0.5], [0.1, 0.1, 0.1, 0.1]]])
    (dets,) = detections_from_outputs(logits, boxes, [["dog", "cat"]], [64])
    assert [d.label for d in dets] == ["dog", "cat"]
    assert dets[0].box == (16.0, 0.0, 48.0, 32.0) and dets[1].box == pytest.approx((3.2, 3.2, 9.6, 9.6))
    assert dets[0].score == pytest.approx(1 / (1 + math.exp(-2.0)))
    logits[0, 1, 1] = -1.0  # sigmoid(-1) = 0.27: at or below the floor, never selectable
    assert len(detections_from_outputs(logits, boxes, [["dog", "cat"]], [64])[0]) == 1


# ----------------------------------------------------------------------------- errors


def test_missing_files_are_clean_errors(files, tmp_path):
    with pytest.raises(FlowrlError) as e:
        GenEval(GenEvalConfig())
    text = str(e.value)
    assert "key 'detector'" in text and "google/owlv2-base-patch16-ensemble" in text and "key 'metadata'" in text
    assert "hf download" in text
    with pytest.raises(FlowrlError, match="detector directory not found"):
        make(files, detector=str(tmp_path / "nowhere"))
    with pytest.raises(FlowrlError, match="holds a 'clip' model, not OWLv2"):
        make(files, detector=files["clip"])
    with pytest.raises(FlowrlError, match="metadata file not found"):
        make(files, metadata=str(tmp_path / "none.jsonl"))
    with pytest.raises(FlowrlError, match="key 'clip' is empty.*name a colour") as e:
        make(files, clip="")
    assert "openai/clip-vit-large-patch14" in str(e.value)
    bad = write_metadata(tmp_path / "bad.jsonl", [META[0], {"tag": "counting", "prompt": "x", "include": []}])
    with pytest.raises(FlowrlError, match=r"bad.jsonl:2"):
        make(files, metadata=str(bad))
    twice = write_metadata(tmp_path / "twice.jsonl", [META[3], {**META[3], "prompt": "a photo of  a bench ",
                                                                 "include": [{"class": "bench", "count": 2}]}])
    with pytest.raises(FlowrlError, match="appears twice"):
        make(files, metadata=str(twice))


def test_colour_free_metadata_needs_no_clip(files):
    reward = make(files, clip="", metadata=files["no_colour"])
    assert "clip" not in reward.module
    out = reward(torch.rand(2, 3, H, W), ["a photo of two dogs", "a photo of a bench"])
    assert out.scores.shape == (2,)


def test_a_prompt_missing_from_the_metadata_is_a_value_error_before_any_model_runs(reward, monkeypatch):
    def fail(*args):
        raise AssertionError("the detector ran")
    monkeypatch.setattr(reward, "raw_detections", fail)
    with pytest.raises(ValueError, match=r"'a photo of a unicorn' is not in the GenEval metadata .*meta.jsonl"):
        reward(torch.rand(2, 3, H, W), ["a photo of   two dogs", "a photo of a unicorn"])
