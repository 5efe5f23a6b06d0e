"""Procedural "moving coloured shape" clips for the embedded video model.

Grammar: ``"a {fg} {shape} moving {direction} on a {bg} background"`` with the image grammar's 6
colours (``fg != bg``), its 3 shapes and 4 directions: 6 * 5 * 3 * 4 = 360 prompts.

A clip is ``FRAMES`` = 4 frames of 16x16 RGB in [0, 1], ``[F, 3, H, W]``; a batch is
``[B, F, 3, H, W]``. The shape keeps its colour, size and kind, and its centre moves ``SPEED`` = 2
pixels per frame in the prompt's direction (6 pixels from the first frame to the last), so the
direction is visible in every pair of frames. The path is centred on the frame centre with an
integer jitter in [-JITTER, JITTER] on each axis; the half-size ``r`` is uniform in
[R_MIN, R_MAX]. Shapes are those of :mod:`.dataset` (disc, square of side 2r, upright triangle),
rendered with its ``shape_masks``; a shape near the edge is clipped by the frame.

Everything is deterministic for a given ``torch.Generator`` seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .dataset import COLOUR_NAMES, COLOURS, PALETTE, SHAPES, ColourShapeIndices, shape_masks

FRAME_SIZE = 16
FRAMES = 4
SPEED = 2.0
R_MIN, R_MAX = 3.0, 4.0
JITTER = 1
CENTRE = (FRAME_SIZE - 1) / 2.0

#: direction -> unit displacement (dx, dy) per frame, image axes (y down).
DIRECTIONS: dict[str, tuple[float, float]] = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0)}
DIRECTION_NAMES: list[str] = list(DIRECTIONS)
DIRECTION_VECTORS = torch.tensor([DIRECTIONS[d] for d in DIRECTION_NAMES], dtype=torch.float32)  # [4, 2]

TEMPLATE = "a {fg} {shape} moving {direction} on a {bg} background"


@dataclass(frozen=True)
class ClipAttributes(ColourShapeIndices):
    fg: str
    shape: str
    direction: str
    bg: str

    @property
    def direction_index(self) -> int:
        return DIRECTION_NAMES.index(self.direction)


def make_prompt(fg: str, shape: str, direction: str, bg: str) -> str:
    return TEMPLATE.format(fg=fg, shape=shape, direction=direction, bg=bg)


def all_prompts() -> list[str]:
    """Every prompt of the grammar (360), in a fixed order: fg, bg, shape, direction."""
    return [make_prompt(fg, shape, d, bg) for fg in COLOUR_NAMES for bg in COLOUR_NAMES if fg != bg
            for shape in SHAPES for d in DIRECTION_NAMES]


def parse_prompt(prompt: str) -> ClipAttributes:
    """Parse a grammar prompt back into its attributes. Raises ValueError otherwise."""
    w = prompt.strip().lower().split()
    if (len(w) != 9 or w[0] != "a" or w[3] != "moving" or w[5] != "on" or w[6] != "a" or w[8] != "background"
            or w[1] not in COLOURS or w[7] not in COLOURS or w[2] not in SHAPES or w[4] not in DIRECTIONS):
        raise ValueError(f"not a prompt of the video grammar: {prompt!r}")
    return ClipAttributes(fg=w[1], shape=w[2], direction=w[4], bg=w[7])


def render_clips(fg_idx, shape_idx, bg_idx, dir_idx, cx, cy, r) -> torch.Tensor:
    """Render clips ``[B, F, 3, H, W]``; ``cx, cy`` are the path's mid-point, per sample ``[B]``."""
    b = len(fg_idx)
    vec = DIRECTION_VECTORS[torch.as_tensor(dir_idx)]  # [B, 2]
    frames = []
    fg = PALETTE[torch.as_tensor(fg_idx)].view(b, 3, 1, 1)
    bg = PALETTE[torch.as_tensor(bg_idx)].view(b, 3, 1, 1)
    for f in range(FRAMES):
        step = (f - (FRAMES - 1) / 2.0) * SPEED
        mask = shape_masks(shape_idx, cx + step * vec[:, 0], cy + step * vec[:, 1], r, FRAME_SIZE).unsqueeze(1)
        frames.append(mask * fg + (1 - mask) * bg)
    return torch.stack(frames, dim=1)


def render_prompts(prompts: list[str], generator: torch.Generator | None = None) -> torch.Tensor:
    """Ground-truth clips ``[B, F, 3, H, W]``, random jitter and size from ``generator``."""
    attrs = [parse_prompt(p) for p in prompts]
    n = len(attrs)
    jit = torch.randint(-JITTER, JITTER + 1, (2, n), generator=generator).float()
    r = R_MIN + (R_MAX - R_MIN) * torch.rand(n, generator=generator)
    return render_clips(torch.tensor([a.fg_index for a in attrs]), torch.tensor([a.shape_index for a in attrs]),
                        torch.tensor([a.bg_index for a in attrs]), torch.tensor([a.direction_index for a in attrs]),
                        CENTRE + jit[0], CENTRE + jit[1], r)


def sample_batch(batch_size: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, list[str]]:
    """A random batch ``(clips [B, F, 3, H, W] in [0, 1], prompts)``, uniform over the 360 prompts."""
    prompts_all = all_prompts()
    idx = torch.randint(0, len(prompts_all), (batch_size,), generator=generator)
    prompts = [prompts_all[i] for i in idx.tolist()]
    return render_prompts(prompts, generator), prompts
