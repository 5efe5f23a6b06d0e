"""Offline rewards for the embedded video model: plain functions ``fn(clips [B, F, 3, H, W],
prompts) -> Tensor[B]`` that score whole clips (``scores_clips = True``, flowrl.interfaces.ScoresClips).

- ``video_verifier``: the video verifier's soft correctness (colours, shape and motion
  direction) in [0, 1] (:mod:`.video_verifier`).
- ``video_motion``: its motion term alone: how much the clip moves the prompt's way.
"""

from __future__ import annotations

import torch

from .video_dataset import parse_prompt
from .video_verifier import verify_clips


@torch.no_grad()
def video_verifier(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    return verify_clips(_clips(images, "video_verifier"), prompts).score.float()


@torch.no_grad()
def video_motion(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    return verify_clips(_clips(images, "video_motion"), prompts).motion_soft.float()


def _clips(images: torch.Tensor, name: str) -> torch.Tensor:
    if images.ndim != 5:
        raise ValueError(f"reward '{name}' scores clips [B, F, 3, H, W] of a video model (model 'embedded_video'), "
                         f"got shape {tuple(images.shape)}")
    return images


for _fn in (video_verifier, video_motion):
    _fn.scores_clips = True  # whole clips: motion cannot be seen in one frame
    _fn.accepts_prompt = parse_prompt  # the video grammar only (checked by `flowrl validate`)
