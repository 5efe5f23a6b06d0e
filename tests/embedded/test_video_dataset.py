"""The video grammar and its clips: 360 prompts, and shapes that move SPEED px per frame."""

import pytest
import torch

from flowrl_plugins.embedded.video_dataset import (
    FRAMES, SPEED, all_prompts, parse_prompt, render_prompts, sample_batch,
)


def test_grammar():
    prompts = all_prompts()
    assert len(prompts) == 360 == len(set(prompts))
    a = parse_prompt("a red circle moving left on a blue background")
    assert (a.fg, a.shape, a.direction, a.bg) == ("red", "circle", "left", "blue")
    for bad in ("a red circle on a blue background", "a red circle moving sideways on a blue background"):
        with pytest.raises(ValueError, match="video grammar"):
            parse_prompt(bad)


@pytest.mark.parametrize("direction, dx, dy", [("left", -1, 0), ("right", 1, 0), ("up", 0, -1), ("down", 0, 1)])
def test_the_shape_moves_the_prompts_way(direction, dx, dy):
    clip = render_prompts([f"a white square moving {direction} on a black background"], torch.Generator().manual_seed(3))[0]
    assert clip.shape == (FRAMES, 3, 16, 16)
    mask = clip[:, 0]  # white on black: any channel
    ys, xs = torch.arange(16.0).view(16, 1), torch.arange(16.0).view(1, 16)
    cx = (mask * xs).sum((1, 2)) / mask.sum((1, 2))
    cy = (mask * ys).sum((1, 2)) / mask.sum((1, 2))
    # an unclipped square's centroid is its centre: it moves exactly SPEED per frame
    assert torch.allclose(cx[1:] - cx[:-1], torch.full((FRAMES - 1,), SPEED * dx), atol=1e-4)
    assert torch.allclose(cy[1:] - cy[:-1], torch.full((FRAMES - 1,), SPEED * dy), atol=1e-4)
    assert torch.equal(mask.sum((1, 2)), mask[0].sum().expand(FRAMES))  # same size in every frame


def test_batches_are_deterministic():
    a, pa = sample_batch(5, torch.Generator().manual_seed(0))
    b, pb = sample_batch(5, torch.Generator().manual_seed(0))
    assert pa == pb and torch.equal(a, b) and a.shape == (5, FRAMES, 3, 16, 16)
