"""GenEval-style verifier for the coloured-shape grammar.

Given images [B, 3, H, W] in [0, 1] and their prompts it decides, per image:

- background colour: each pixel is classified to the nearest palette colour; the background is the
  most frequent class on the 2-pixel border ring;
- foreground colour: the most frequent class among non-background pixels (at least
  ``MIN_FG_PIXELS`` of them, otherwise "no object" and fg/shape are wrong);
- shape: the mask of foreground-colour pixels is compared (IoU) with circle, square and triangle
  templates placed by the mask's moments: the template has the mask's area and centroid, and a
  small search over scale (x0.9, 1, 1.1) and offset (-1, 0, 1 px in x and y) takes the best IoU.
  Area-matched templates tolerate the rounded corners of generated squares, where fill-ratio
  rules fail.

Soft score (in [0, 1]) = mean of three soft terms:
  bg_soft    = fraction of border pixels of the prompt's background colour;
  fg_soft    = fraction of non-background pixels of the prompt's foreground colour, times
               min(1, n_non_background / MIN_FG_PIXELS);
  shape_soft = softmax(TEMP * best_IoU)[prompt shape] times the same presence factor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .dataset import PALETTE, SHAPES, parse_prompt, shape_masks

MIN_FG_PIXELS = 12
BORDER = 2
TEMP = 20.0
_SCALES = (0.9, 1.0, 1.1)
_OFFSETS = (-1.0, 0.0, 1.0)
# area of each template as a multiple of r^2: circle pi, square 4, triangle 2
_AREA_COEF = torch.tensor([torch.pi, 4.0, 2.0])
# centroid of each template relative to the bbox centre, in units of r (y down): triangle's centroid
# lies 2r/3 above its base, i.e. at +r/3 below the centre.
_CENTROID_DY = torch.tensor([0.0, 0.0, 1.0 / 3.0])


@dataclass
class VerifierResult:
    score: torch.Tensor  # [B] float32 soft score in [0, 1]
    bg_correct: torch.Tensor  # [B] bool
    fg_correct: torch.Tensor  # [B] bool
    shape_correct: torch.Tensor  # [B] bool
    all_correct: torch.Tensor  # [B] bool
    bg_pred: torch.Tensor  # [B] long palette index
    fg_pred: torch.Tensor  # [B] long palette index (-1 when no object)
    shape_pred: torch.Tensor  # [B] long shape index (-1 when no object)
    shape_iou: torch.Tensor  # [B, 3] best IoU per template


def classify_pixels(images: torch.Tensor) -> torch.Tensor:
    """Nearest palette colour per pixel: [B, H, W] long."""
    pal = PALETTE.to(images.device, images.dtype).view(1, -1, 3, 1, 1)
    d = ((images.unsqueeze(1) - pal) ** 2).sum(2)  # [B, K, H, W]
    return d.argmin(1)


def border_mask(h: int, w: int, width: int = BORDER) -> torch.Tensor:
    m = torch.zeros(h, w, dtype=torch.bool)
    m[:width] = True
    m[-width:] = True
    m[:, :width] = True
    m[:, -width:] = True
    return m


def template_ious(mask: torch.Tensor, offsets=_OFFSETS) -> torch.Tensor:
    """Best IoU [B, 3] of a binary mask [B, H, W] with each shape template (area- and
    centroid-matched, over the scales and the pixel ``offsets`` in x and y)."""
    b, h, w = mask.shape
    area = mask.sum((1, 2)).clamp_min(1.0)
    ys = torch.arange(h, dtype=torch.float32).view(1, h, 1)
    xs = torch.arange(w, dtype=torch.float32).view(1, 1, w)
    my = (mask * ys).sum((1, 2)) / area
    mx = (mask * xs).sum((1, 2)) / area
    out = torch.zeros(b, len(SHAPES))
    for s in range(len(SHAPES)):
        r0 = torch.sqrt(area / _AREA_COEF[s])
        best = torch.zeros(b)
        for sc in _SCALES:
            r = r0 * sc
            cy0 = my - _CENTROID_DY[s] * r
            for oy in offsets:
                for ox in offsets:
                    t = shape_masks(torch.full((b,), s), mx + ox, cy0 + oy, r, size=h)
                    inter = (t * mask).sum((1, 2))
                    union = (t + mask).clamp_max(1.0).sum((1, 2)).clamp_min(1.0)
                    best = torch.maximum(best, inter / union)
        out[:, s] = best
    return out


@torch.no_grad()
def verify(images: torch.Tensor, prompts: list[str]) -> VerifierResult:
    """Score a batch of images [B, 3, H, W] in [0, 1] against their prompts."""
    images = images.detach().float().cpu().clamp(0, 1)
    b, _, h, w = images.shape
    assert len(prompts) == b, "one prompt per image"
    attrs = [parse_prompt(p) for p in prompts]
    tgt_fg = torch.tensor([a.fg_index for a in attrs])
    tgt_bg = torch.tensor([a.bg_index for a in attrs])
    tgt_sh = torch.tensor([a.shape_index for a in attrs])
    k = PALETTE.shape[0]

    labels = classify_pixels(images)  # [B,H,W]
    onehot = torch.nn.functional.one_hot(labels, k).float()  # [B,H,W,K]
    bmask = border_mask(h, w)
    border_counts = onehot[:, bmask].sum(1)  # [B,K]
    bg_pred = border_counts.argmax(1)
    bg_soft = border_counts.gather(1, tgt_bg.view(-1, 1)).squeeze(1) / bmask.sum()

    nonbg = labels != bg_pred.view(-1, 1, 1)
    counts = onehot.sum((1, 2))  # [B,K]
    counts_fg = counts.scatter(1, bg_pred.view(-1, 1), 0.0)
    n_nonbg = counts_fg.sum(1)
    present = n_nonbg >= MIN_FG_PIXELS
    presence = (n_nonbg / MIN_FG_PIXELS).clamp_max(1.0)
    fg_pred = torch.where(present, counts_fg.argmax(1), torch.full_like(bg_pred, -1))
    fg_soft = counts_fg.gather(1, tgt_fg.view(-1, 1)).squeeze(1) / n_nonbg.clamp_min(1.0) * presence

    fg_mask = (labels == fg_pred.clamp_min(0).view(-1, 1, 1)) & nonbg & present.view(-1, 1, 1)
    ious = template_ious(fg_mask.float())
    shape_pred = torch.where(present, ious.argmax(1), torch.full_like(bg_pred, -1))
    shape_soft = torch.softmax(TEMP * ious, 1).gather(1, tgt_sh.view(-1, 1)).squeeze(1) * presence

    bg_ok = bg_pred == tgt_bg
    fg_ok = fg_pred == tgt_fg
    sh_ok = shape_pred == tgt_sh
    score = ((bg_soft + fg_soft + shape_soft) / 3.0).float().clamp(0, 1)
    return VerifierResult(
        score=score,
        bg_correct=bg_ok,
        fg_correct=fg_ok,
        shape_correct=sh_ok,
        all_correct=bg_ok & fg_ok & sh_ok,
        bg_pred=bg_pred,
        fg_pred=fg_pred,
        shape_pred=shape_pred,
        shape_iou=ious,
    )
