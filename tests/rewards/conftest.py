"""Fixtures of the reward tests: tiny models built offline once per session."""

from __future__ import annotations

import pytest

from flowrl.compat import ensure_torchvision_importable

# Where a CUDA torchvision sits beside CPU torch (an environment with flowrl-diffusion[clip]), importing
# transformers' vision models fails unless the shim runs first; a no-op everywhere else.
ensure_torchvision_importable()


@pytest.fixture(scope="session")
def tiny_clip_dir(tmp_path_factory):
    """A tiny CLIPModel + CLIPProcessor saved to disk (image size 32, logit scale exp(3))."""
    from flowrl.testing.tiny_models import build_tiny_clip

    return build_tiny_clip(tmp_path_factory.mktemp("tiny_clip"), image_size=32, seed=0, logit_scale=3.0)
