"""temporal_consistency: colour-histogram intersection of consecutive frames, or 1 - mean |frame
difference|, checked on clips whose values are known by hand."""

import pytest
import torch

from flowrl.rewards import score
from flowrl_plugins.rewards.temporal import TemporalConsistency, TemporalConsistencyConfig, histograms


def square_clip(positions, size=8, fg=(1.0, 0.0, 0.0), bg=(0.0, 0.0, 1.0)):
    """A 2x2 square of colour fg at each (row, col) of ``positions`` on a bg frame: [F, 3, H, W]."""
    frames = []
    for r, c in positions:
        f = torch.tensor(bg).view(3, 1, 1).repeat(1, size, size)
        f[:, r:r + 2, c:c + 2] = torch.tensor(fg).view(3, 1, 1)
        frames.append(f)
    return torch.stack(frames)


def test_histograms_bin_by_hand():
    frame = torch.zeros(1, 3, 1, 4)
    frame[0, :, 0, 1] = torch.tensor([1.0, 0.0, 0.0])  # red: bin (3, 0, 0) with 4 bins
    frame[0, :, 0, 2] = torch.tensor([0.3, 0.6, 0.99])  # bins (1, 2, 3)
    h = histograms(frame, 4)[0]
    assert h.sum() == 1 and h[0] == 0.5 and h[(3 * 4 + 0) * 4 + 0] == 0.25 and h[(1 * 4 + 2) * 4 + 3] == 0.25


def test_motion_keeps_the_histogram_score_and_flicker_lowers_it():
    reward = TemporalConsistency(TemporalConsistencyConfig())
    moving = square_clip([(1, 1), (1, 3), (1, 5)])
    recoloured = torch.stack([moving[0], square_clip([(1, 3)], fg=(1.0, 1.0, 0.0))[0], moving[2]])
    out = score(reward, torch.stack([moving, recoloured]), ["a", "b"]).scores
    # recoloured: frames 0->1 share the 60 blue pixels of 64 (red 4 vs yellow 4), as do 1->2: 60/64
    assert torch.allclose(out, torch.tensor([1.0, 60 / 64]))


def test_pixel_measure_by_hand():
    reward = TemporalConsistency(TemporalConsistencyConfig(measure="pixels"))
    still = square_clip([(1, 1), (1, 1)])
    moved = square_clip([(1, 1), (1, 3)])
    # moving the 2x2 square by 2 px changes 8 pixels in 2 channels (red on, blue off) of 3 x 64 values
    out = score(reward, torch.stack([still, moved]), ["a", "b"]).scores
    assert torch.allclose(out, torch.tensor([1.0, 1.0 - 16 / 192]))


def test_images_are_refused():
    with pytest.raises(ValueError, match="scores clips"):
        TemporalConsistency(TemporalConsistencyConfig())(torch.rand(2, 3, 4, 4), ["a", "b"])
