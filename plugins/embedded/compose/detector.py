"""The embedded detector: GenEval-style detections (class, box, score, colour) of the compositional
world's images, the analogue of GenEval's Mask2Former with its CLIP colour classifier.

1. Every pixel takes the nearest of the six palette colours or the grey background.
2. Each colour's pixels split into 8-connected components (label propagation by max-pooling, on
   the whole batch at once); a component of fewer than ``MIN_PIXELS`` pixels is a speck, not an
   object.
3. A component's class is the shape whose template fits its mask best: templates of the
   component's area and centroid, over a small search of scale (x0.85 to x1.15) and offset
   (-1, 0, 1 px in x and y), compared by IoU (the embedded verifier's method, with the cross).
4. The score is that best IoU mapped linearly from ``IOU_NONE`` (score 0) to ``IOU_SURE`` (score 1),
   so GenEval's two thresholds keep their meaning: 0.3 (presence) needs an IoU above 0.531,
   counting's 0.9 one above 0.693 (clean rendered shapes fit with 0.83 to 1.0; MODEL_CARD.md).
5. The colour is the component's palette colour (GenEval's colour classifier answers for the
   object; here the object is one colour by construction).

Accuracy on rendered ground truth, per GenEval category, is in MODEL_CARD.md and checked by the
tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flowrl import geneval
from flowrl.geneval import Detection

from ..dataset import COLOUR_NAMES, PALETTE
from .grammar import SHAPES, all_prompts, metadata
from .scenes import BACKGROUND, CROSS_ARM, render_prompts, shape_masks

MIN_PIXELS = 8
IOU_NONE, IOU_SURE = 0.45, 0.72
_SCALES = (0.85, 1.0, 1.15)
_OFFSETS = (-1.0, 0.0, 1.0)
# template area in units of r^2, and its centroid below the box centre in units of r (y down)
_AREA = torch.tensor([torch.pi, 4.0, 2.0, 4.0 - 4.0 * (1.0 - CROSS_ARM) ** 2])
_CENTROID_DY = torch.tensor([0.0, 0.0, 1.0 / 3.0, 0.0])
_PIXEL_PALETTE = torch.cat([PALETTE, torch.tensor([BACKGROUND])])  # the background is class 6


def classify_pixels(images: torch.Tensor) -> torch.Tensor:
    """``[B, H, W]`` long: each pixel's nearest palette colour (0-5) or the background (6)."""
    pal = _PIXEL_PALETTE.to(images.dtype).view(1, -1, 3, 1, 1)
    return ((images.unsqueeze(1) - pal) ** 2).sum(2).argmin(1)


def components(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 8-connected components of each colour: ``(image index [M], colour index [M], masks [M, H, W])``."""
    b, h, w = labels.shape
    k = len(COLOUR_NAMES)
    masks = F.one_hot(labels, k + 1)[..., :k].permute(0, 3, 1, 2).float()  # [B, K, H, W]
    ids = torch.arange(1, h * w + 1, dtype=torch.float32).view(1, 1, h, w) * masks
    while True:  # every pixel takes the largest id in its component
        spread = F.max_pool2d(ids, 3, stride=1, padding=1) * masks
        if torch.equal(spread, ids):
            break
        ids = spread
    flat = ids.reshape(b * k, h * w).long()
    rows, pixels = flat.nonzero(as_tuple=True)
    keys, inverse = torch.unique(rows * (h * w + 1) + flat[rows, pixels], return_inverse=True)
    comp = torch.zeros(len(keys), h * w)
    comp[inverse, pixels] = 1.0
    owner = keys // (h * w + 1)
    return owner // k, owner % k, comp.view(-1, h, w)


def template_ious(masks: torch.Tensor) -> torch.Tensor:
    """Best IoU ``[M, 4]`` of each binary mask ``[M, H, W]`` with each shape's template."""
    m, h, w = masks.shape
    area = masks.sum((1, 2)).clamp_min(1.0)
    ys = torch.arange(h, dtype=torch.float32).view(1, h, 1)
    xs = torch.arange(w, dtype=torch.float32).view(1, 1, w)
    my = (masks * ys).sum((1, 2)) / area
    mx = (masks * xs).sum((1, 2)) / area
    out = torch.zeros(m, len(SHAPES))
    for s in range(len(SHAPES)):
        r0 = torch.sqrt(area / _AREA[s])
        for scale in _SCALES:
            r = r0 * scale
            cy = my - _CENTROID_DY[s] * r
            for oy in _OFFSETS:
                for ox in _OFFSETS:
                    t = shape_masks(torch.full((m,), s), mx + ox, cy + oy, r, size=h)
                    inter = (t * masks).sum((1, 2))
                    union = (t + masks).clamp_max(1.0).sum((1, 2)).clamp_min(1.0)
                    out[:, s] = torch.maximum(out[:, s], inter / union)
    return out


@torch.no_grad()
def detect(images: torch.Tensor) -> list[list[Detection]]:
    """Detections of each image ``[B, 3, H, W]`` in [0, 1] (empty lists for empty canvases)."""
    images = images.detach().float().cpu().clamp(0, 1)
    owner, colour, masks = components(classify_pixels(images))
    keep = masks.sum((1, 2)) >= MIN_PIXELS
    owner, colour, masks = owner[keep], colour[keep], masks[keep]
    out: list[list[Detection]] = [[] for _ in range(images.shape[0])]
    if len(masks) == 0:
        return out
    best, shape = template_ious(masks).max(1)
    score = ((best - IOU_NONE) / (IOU_SURE - IOU_NONE)).clamp(0, 1)
    rows, cols = masks.amax(2), masks.amax(1)  # [M, H], [M, W]: which rows and columns it touches
    span = torch.arange(masks.shape[1], dtype=torch.float32)
    y0, y1 = (span + 1e4 * (1 - rows)).amin(1), (span - 1e4 * (1 - rows)).amax(1) + 1
    x0, x1 = (span + 1e4 * (1 - cols)).amin(1), (span - 1e4 * (1 - cols)).amax(1) + 1
    for i in range(len(masks)):
        out[int(owner[i])].append(Detection(SHAPES[int(shape[i])], (float(x0[i]), float(y0[i]), float(x1[i]),
                                                                     float(y1[i])), float(score[i]),
                                            COLOUR_NAMES[int(colour[i])]))
    return out


def ground_truth_accuracy(scenes_per_prompt: int = 4, seed: int = 7) -> dict[str, tuple[float, int]]:
    """GenEval's verdict on rendered ground truth, per category: ``{tag: (accuracy, images)}``,
    every prompt of the grammar ``scenes_per_prompt`` times (MODEL_CARD.md's table)."""
    prompts = [p for p in all_prompts() for _ in range(scenes_per_prompt)]
    g = torch.Generator().manual_seed(seed)
    verdicts: dict[str, list[bool]] = {}
    for i in range(0, len(prompts), 256):
        batch = prompts[i:i + 256]
        for prompt, dets in zip(batch, detect(render_prompts(batch, g))):
            meta = metadata(prompt)
            verdicts.setdefault(meta["tag"], []).append(geneval.score_prompt(dets, meta).strict)
    return {tag: (sum(v) / len(v), len(v)) for tag, v in verdicts.items()}


if __name__ == "__main__":
    torch.set_num_threads(1)
    for tag, (accuracy, n) in ground_truth_accuracy().items():
        print(f"| {tag} | {n} | {accuracy:.4f} |")
