"""``temporal_consistency``: how steady a clip is from frame to frame (any video model, no weights).

Two measures, each in [0, 1] and 1 for a clip whose frames agree:

- ``histogram`` (default): the mean, over consecutive frame pairs, of the intersection of the two
  frames' colour histograms (``bins`` per channel, each histogram summing to 1). It is blind to
  where things are, so an object that moves keeps a score of 1, while flicker, colour drift and
  objects that appear, vanish or change colour lower it: the consistency of *what* the clip shows.
- ``pixels``: 1 - the mean absolute difference of consecutive frames (pixel values in [0, 1]):
  any change lowers it, motion included (a still clip scores 1); the classic flicker measure for
  clips that should not move.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from flowrl.config import param


@dataclasses.dataclass(frozen=True)
class TemporalConsistencyConfig:
    measure: Literal["histogram", "pixels"] = param(
        "histogram", "'histogram': colour-histogram intersection of consecutive frames (blind to motion); "
        "'pixels': 1 - mean |frame t+1 - frame t| (motion lowers it too).")
    bins: int = param(4, "histogram: bins per colour channel (bins^3 colours).", min=2, max=32)


def histograms(frames: torch.Tensor, bins: int) -> torch.Tensor:
    """Colour histograms ``[N, bins^3]`` (each sums to 1) of frames ``[N, 3, H, W]`` in [0, 1];
    a value v falls in bin ``min(floor(v * bins), bins - 1)`` of its channel."""
    q = (frames.clamp(0, 1) * bins).floor().clamp_max(bins - 1).long()  # [N, 3, H, W]
    index = (q[:, 0] * bins + q[:, 1]) * bins + q[:, 2]  # [N, H, W]
    counts = torch.zeros(frames.shape[0], bins ** 3, dtype=torch.float32)
    counts.scatter_add_(1, index.flatten(1).cpu(), torch.ones(index.flatten(1).shape, dtype=torch.float32))
    return counts / counts.sum(1, keepdim=True)


class TemporalConsistency:
    """Frame-to-frame consistency of a clip in [0, 1] (colour histograms, or pixels)."""

    Config = TemporalConsistencyConfig
    scores_clips = True  # flowrl.interfaces.ScoresClips: it needs the whole clip

    def __init__(self, config: TemporalConsistencyConfig):
        self.config = config
        self.name = "temporal_consistency"

    @torch.no_grad()
    def __call__(self, images, prompts, metadata=None) -> torch.Tensor:
        if images.ndim != 5:
            raise ValueError(f"temporal_consistency scores clips [B, F, 3, H, W] of a video model, got shape "
                             f"{tuple(images.shape)}")
        clips = images.detach().float().cpu().clamp(0, 1)
        b, f = clips.shape[:2]
        if f < 2:
            return torch.ones(b)
        if self.config.measure == "pixels":
            return 1.0 - (clips[:, 1:] - clips[:, :-1]).abs().mean(dim=(1, 2, 3, 4))
        h = histograms(clips.flatten(0, 1), self.config.bins).view(b, f, -1)
        return torch.minimum(h[:, 1:], h[:, :-1]).sum(-1).mean(1)
