"""clip with the open_clip backend, on a tiny architecture registered locally.

open_clip is an optional extra (flowrl-diffusion[clip]) and is not installed in the default test
environment: these tests skip there. Run them in an environment with `pip install -c
constraints/cpu.txt -e ".[clip,dev]"` (see docs/rewards.md).
"""

from __future__ import annotations

import math

import pytest
import torch
from reward_helpers import PROMPTS, assert_invariant, fixed_images, to_pil

from importlib.util import find_spec

from flowrl.compat import ensure_torchvision_importable
from flowrl.rewards import score
from flowrl.testing.tiny_models import write_tiny_open_clip_config
from flowrl_plugins.rewards.clip import Clip, ClipConfig

# found, not imported: importing open_clip costs every collecting worker 1.4 s
pytestmark = pytest.mark.skipif(find_spec("open_clip") is None, reason="needs open_clip (the 'clip' extra)")


def _open_clip():
    ensure_torchvision_importable()  # a CUDA torchvision beside CPU torch breaks `import open_clip`
    import open_clip

    return open_clip

NAME = "flowrl-tiny-clip"


@pytest.fixture(scope="module")
def tiny_open_clip(tmp_path_factory):
    """(model name, weights file, the model itself) for a random tiny open_clip CLIP."""
    from safetensors.torch import save_file

    directory = tmp_path_factory.mktemp("open_clip")
    open_clip = _open_clip()
    open_clip.add_model_config(write_tiny_open_clip_config(directory, NAME, image_size=32))
    torch.manual_seed(0)
    model = open_clip.create_model(NAME).eval()
    with torch.no_grad():
        model.logit_scale.fill_(math.log(20.0))
    weights = directory / "tiny.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
    return NAME, str(weights), model


def reference(model, images, prompts):
    """open_clip's own pipeline: its torchvision preprocessing on PIL images and model(image, text)."""
    open_clip = _open_clip()
    preprocess = open_clip.image_transform(model.visual.image_size, is_train=False,
                                           mean=model.visual.image_mean, std=model.visual.image_std)
    pixels = torch.stack([preprocess(im) for im in to_pil(images)])
    text = open_clip.get_tokenizer(NAME)(prompts)
    with torch.no_grad():
        out = model(pixels, text)
    img, txt, logit_scale = (out["image_features"], out["text_features"], out["logit_scale"]) if isinstance(out, dict) else out[:3]
    return (img * txt).sum(-1), float(logit_scale)


def test_open_clip_matches_its_own_pipeline(tiny_open_clip):
    name, weights, model = tiny_open_clip
    reward = Clip(ClipConfig(model=name, pretrained=weights, scale="logit", batch_size=4))
    images = fixed_images(6)
    out = score(reward, images, PROMPTS)
    cos, logit_scale = reference(model, images, PROMPTS)
    assert abs(logit_scale - 20.0) < 1e-4
    torch.testing.assert_close(out.extras["cosine"], cos, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(out.scores, 20.0 * cos, atol=2e-5, rtol=1e-5)


def test_open_clip_invariant_to_batch_size_and_order(tiny_open_clip):
    name, weights, _ = tiny_open_clip
    reward = Clip(ClipConfig(model=name, pretrained=weights, batch_size=4))
    assert_invariant(reward, fixed_images(6, seed=2), PROMPTS)


def test_open_clip_weights_are_loaded_from_the_file(tiny_open_clip, tmp_path):
    from flowrl.errors import FlowrlError

    name, weights, _ = tiny_open_clip
    a = Clip(ClipConfig(model=name, pretrained=weights))
    b = Clip(ClipConfig(model=name, pretrained=weights))
    images = fixed_images(2, seed=4)
    torch.testing.assert_close(a(images, PROMPTS[:2]).scores, b(images, PROMPTS[:2]).scores)
    with pytest.raises(FlowrlError, match="cannot create open_clip model"):
        Clip(ClipConfig(model="no-such-architecture", pretrained=weights))
