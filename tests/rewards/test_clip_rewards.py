"""pickscore and clip (transformers backend) on a tiny CLIPModel saved and reloaded offline."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from reward_helpers import PROMPTS, assert_invariant, fixed_images, to_pil

from flowrl.errors import FlowrlError
from flowrl.rewards import score
from flowrl.plugins import get_registry
from flowrl_plugins.rewards.clip import Clip, ClipConfig, PickScore, PickScoreConfig, apply_scale

LOGIT_SCALE = math.exp(3.0)  # the tiny model's exp(logit_scale)


def reference_cosine(model_dir, images, prompts):
    """CLIP similarity computed independently: the processor's PIL pipeline and the model's
    sub-modules (vision/text towers and projections), not get_*_features."""
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(model_dir).eval()
    proc = CLIPProcessor.from_pretrained(model_dir)
    pixels = proc.image_processor(images=to_pil(images), return_tensors="pt")["pixel_values"]
    tok = proc.tokenizer(prompts, padding=True, truncation=True, max_length=64, return_tensors="pt")
    with torch.no_grad():
        img = model.visual_projection(model.vision_model(pixel_values=pixels).pooler_output)
        txt = model.text_projection(model.text_model(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"]).pooler_output)
    return F.cosine_similarity(img, txt, dim=-1)


@pytest.fixture(scope="module")
def pickscore(tiny_clip_dir):
    # on the CPU in fp32, where the reference is computed ('auto' is CUDA and bf16 on a GPU machine)
    return PickScore(PickScoreConfig(model=str(tiny_clip_dir), processor=str(tiny_clip_dir), batch_size=4, device="cpu"))


def test_pickscore_matches_independent_computation(pickscore, tiny_clip_dir):
    images = fixed_images(6)
    out = score(pickscore, images, PROMPTS)
    cos = reference_cosine(tiny_clip_dir, images, PROMPTS)
    torch.testing.assert_close(out.extras["cosine"], cos, atol=2e-6, rtol=1e-5)
    # default scale: PickScore's published logit_scale * cos
    torch.testing.assert_close(out.scores, LOGIT_SCALE * cos, atol=2e-5, rtol=1e-5)
    assert out.scores.dtype == torch.float32 and out.scores.shape == (6,)


def test_pickscore_batch_size_and_order_invariant(pickscore):
    images = fixed_images(6, seed=3)
    assert_invariant(pickscore, images, PROMPTS)


def test_resize_and_crop_in_torch_follow_the_processor(pickscore, tiny_clip_dir):
    # 40x56 images: shorter side resized to 32 (bicubic), centre crop 32x32. The processor does
    # it on 8-bit PIL images, we do it on float tensors: same geometry, small interpolation error.
    images = fixed_images(4, size=(40, 56), seed=5)
    ours = pickscore(images, PROMPTS[:4]).extras["cosine"]
    ref = reference_cosine(tiny_clip_dir, images, PROMPTS[:4])
    assert (ours - ref).abs().max() < 5e-3, (ours, ref)  # measured: 6e-4


@pytest.mark.parametrize(
    "scale, expected",
    [
        ("cosine", lambda c: c),
        ("logit", lambda c: LOGIT_SCALE * c),
        ("logit/26", lambda c: LOGIT_SCALE * c / 26),
        ("(logit-18)/8", lambda c: (LOGIT_SCALE * c - 18) / 8),
        ("clipscore", lambda c: 2.5 * c.clamp(min=0)),
    ],
)
def test_scales(scale, expected):
    cos = torch.tensor([-0.5, 0.0, 0.21, 0.9])
    torch.testing.assert_close(apply_scale(cos, LOGIT_SCALE, scale), expected(cos))


def test_clip_transformers_backend_equals_pickscore_cosine(pickscore, tiny_clip_dir):
    clip = Clip(ClipConfig(backend="transformers", model=str(tiny_clip_dir)))
    images = fixed_images(3, seed=7)
    torch.testing.assert_close(clip(images, PROMPTS[:3]).scores, pickscore(images, PROMPTS[:3]).extras["cosine"])


def test_registered_and_built_from_recipe_params(tiny_clip_dir):
    from flowrl.config import from_dict

    comp = get_registry().get("reward", "pickscore")
    params = from_dict(comp.params, {"model": str(tiny_clip_dir), "processor": str(tiny_clip_dir), "scale": "logit/26",
                                     "device": "cpu", "dtype": "float32", "offload": True}, where="test")
    reward = comp.build(params)
    images = fixed_images(2)
    out = reward(images, PROMPTS[:2])
    torch.testing.assert_close(out.scores, LOGIT_SCALE * out.extras["cosine"] / 26)


def test_bfloat16_runs_and_stays_close(pickscore, tiny_clip_dir):
    low = PickScore(PickScoreConfig(model=str(tiny_clip_dir), processor=str(tiny_clip_dir), dtype="bfloat16", scale="cosine"))
    images = fixed_images(3, seed=9)
    assert (low(images, PROMPTS[:3]).scores - pickscore(images, PROMPTS[:3]).extras["cosine"]).abs().max() < 0.05


def test_clear_errors(tiny_clip_dir):
    with pytest.raises(FlowrlError, match="cannot load CLIP model"):
        PickScore(PickScoreConfig(model="/nonexistent/dir/pickscore", processor=str(tiny_clip_dir)))
    with pytest.raises(FlowrlError, match="CUDA is not available"):
        if torch.cuda.is_available():
            pytest.skip("a GPU is present")
        PickScore(PickScoreConfig(model=str(tiny_clip_dir), processor=str(tiny_clip_dir), device="cuda"))
    with pytest.raises(FlowrlError, match="only"):
        Clip(ClipConfig(backend="transformers", model=str(tiny_clip_dir), pretrained="laion2b"))
    reward = PickScore(PickScoreConfig(model=str(tiny_clip_dir), processor=str(tiny_clip_dir)))
    with pytest.raises(FlowrlError, match="2 images but 1 prompts"):
        reward(fixed_images(2), ["one"])


def test_features_accepts_both_transformers_conventions():
    from types import SimpleNamespace

    from flowrl_plugins.rewards.common import features

    t = torch.ones(2, 4)
    assert features(t) is t  # transformers 4.x: the projected tensor
    assert features(SimpleNamespace(pooler_output=t)) is t  # 5.x: an output object
    with pytest.raises(TypeError):
        features(SimpleNamespace(last_hidden_state=t))
