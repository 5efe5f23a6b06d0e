"""Offline verifier for the video grammar: does a clip show the prompt's colours, shape and motion?

Computed, not learned, from clips ``[B, F, 3, H, W]`` in [0, 1] (16x16 frames):

- every pixel is classified to the nearest palette colour (:func:`.verifier.classify_pixels`);
- background: the most frequent class over the whole clip (a moving shape can touch any border,
  so the image verifier's border ring does not apply; the shape covers at most about a quarter
  of a frame);
- foreground: the most frequent non-background class of the clip; a frame shows the object
  when it has at least ``MIN_FG_PIXELS`` non-background pixels;
- shape: per frame, the foreground mask against circle, square and triangle templates of the
  mask's area and centroid (small search over scale and offset, best IoU), averaged over frames;
- motion: the least-squares slope of the foreground centroid over frames, times ``F - 1``: the
  displacement from the first frame to the last (6 px on the training clips); its projection on
  each of the 4 directions decides the direction.

Soft score in [0, 1] = mean of four soft terms:
  bg_soft     = share of the clip's pixels of the prompt's background, over the share of the
                most frequent class (1 when the prompt's background is the most frequent);
  fg_soft     = share of non-background pixels of the prompt's foreground colour, times presence;
  shape_soft  = softmax(TEMP * mean IoU)[prompt's shape], times presence;
  motion_soft = softmax(projections in pixels)[prompt's direction], times presence;
presence = the mean over frames of min(1, non-background pixels / MIN_FG_PIXELS).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .dataset import PALETTE
from .verifier import classify_pixels, template_ious
from .video_dataset import DIRECTION_VECTORS, parse_prompt

MIN_FG_PIXELS = 8
TEMP = 20.0
#: the shape templates' pixel offsets (the image verifier's templates; finer steps on 16x16 frames)
_OFFSETS = (-0.5, 0.0, 0.5)


@dataclass
class ClipVerdict:
    score: torch.Tensor  # [B] soft score in [0, 1]
    bg_correct: torch.Tensor  # [B] bool
    fg_correct: torch.Tensor
    shape_correct: torch.Tensor
    motion_correct: torch.Tensor
    all_correct: torch.Tensor
    motion_soft: torch.Tensor  # [B] the motion term of the score
    displacement: torch.Tensor  # [B, 2] (dx, dy) pixels, first frame to last


@torch.no_grad()
def verify_clips(clips: torch.Tensor, prompts: list[str]) -> ClipVerdict:
    """Score clips ``[B, F, 3, H, W]`` in [0, 1] against their prompts."""
    clips = clips.detach().float().cpu().clamp(0, 1)
    b, f, _, h, w = clips.shape
    if len(prompts) != b:
        raise ValueError(f"one prompt per clip: {len(prompts)} prompts for {b} clips")
    attrs = [parse_prompt(p) for p in prompts]
    tgt_fg = torch.tensor([a.fg_index for a in attrs])
    tgt_bg = torch.tensor([a.bg_index for a in attrs])
    tgt_sh = torch.tensor([a.shape_index for a in attrs])
    tgt_dir = torch.tensor([a.direction_index for a in attrs])
    k = PALETTE.shape[0]

    labels = classify_pixels(clips.flatten(0, 1)).view(b, f, h, w)
    counts = torch.nn.functional.one_hot(labels, k).float().sum((1, 2, 3))  # [B, K] over the clip
    bg_pred = counts.argmax(1)
    bg_soft = counts.gather(1, tgt_bg.view(-1, 1)).squeeze(1) / counts.max(1).values

    nonbg = labels != bg_pred.view(-1, 1, 1, 1)  # [B, F, H, W]
    n_frame = nonbg.float().sum((2, 3))  # [B, F]
    presence = (n_frame / MIN_FG_PIXELS).clamp_max(1.0).mean(1)
    present = (n_frame >= MIN_FG_PIXELS).all(1)
    counts_fg = counts.scatter(1, bg_pred.view(-1, 1), 0.0)
    fg_pred = torch.where(present, counts_fg.argmax(1), torch.full_like(bg_pred, -1))
    fg_soft = counts_fg.gather(1, tgt_fg.view(-1, 1)).squeeze(1) / counts_fg.sum(1).clamp_min(1.0) * presence

    fg_mask = (labels == counts_fg.argmax(1).view(-1, 1, 1, 1)) & nonbg  # [B, F, H, W]
    ious = template_ious(fg_mask.flatten(0, 1).float(), offsets=_OFFSETS).view(b, f, -1).mean(1)  # [B, 3]
    shape_pred = torch.where(present, ious.argmax(1), torch.full_like(bg_pred, -1))
    shape_soft = torch.softmax(TEMP * ious, 1).gather(1, tgt_sh.view(-1, 1)).squeeze(1) * presence

    m = fg_mask.float()
    area = m.sum((2, 3)).clamp_min(1.0)
    cy = (m * torch.arange(h, dtype=torch.float32).view(1, 1, h, 1)).sum((2, 3)) / area  # [B, F]
    cx = (m * torch.arange(w, dtype=torch.float32).view(1, 1, 1, w)).sum((2, 3)) / area
    t = torch.arange(f, dtype=torch.float32) - (f - 1) / 2.0
    slope = lambda c: (c * t).sum(1) / (t * t).sum()  # noqa: E731 - least-squares slope per frame
    disp = torch.stack([slope(cx), slope(cy)], dim=1) * (f - 1)  # [B, 2]
    proj = disp @ DIRECTION_VECTORS.T  # [B, 4]
    motion_pred = torch.where(present, proj.argmax(1), torch.full_like(bg_pred, -1))
    motion_soft = torch.softmax(proj, 1).gather(1, tgt_dir.view(-1, 1)).squeeze(1) * presence

    ok = [bg_pred == tgt_bg, fg_pred == tgt_fg, shape_pred == tgt_sh, motion_pred == tgt_dir]
    score = ((bg_soft + fg_soft + shape_soft + motion_soft) / 4.0).float().clamp(0, 1)
    return ClipVerdict(score=score, bg_correct=ok[0], fg_correct=ok[1], shape_correct=ok[2], motion_correct=ok[3],
                       all_correct=ok[0] & ok[1] & ok[2] & ok[3], motion_soft=motion_soft.float(),
                       displacement=disp)
