"""Procedural "coloured shape" dataset for the embedded default model.

Grammar: ``"a {fg} {shape} on a {bg} background"`` with 6 colours, 3 shapes and
``fg != bg``: 6 * 5 * 3 = 90 prompts.

Images are 32x32 RGB, float in [0, 1], rendered on the fly (vectorised, no files).

Simplification with respect to the feasibility prototype (see MODEL_CARD.md): shapes are
*near-centred and large*. A shape is described by a centre ``(cx, cy)`` and a half-size ``r``:

- ``r`` is uniform in [R_MIN, R_MAX] = [7, 11] pixels (shape spans 14-22 of 32 pixels);
- the centre is ``(15.5 + dx, 15.5 + dy)`` with integer jitter ``dx, dy`` in [-JITTER, JITTER] = [-3, 3].

Shapes (all with a 2r x 2r bounding box):

- circle: disc of radius r;
- square: axis-aligned, side 2r;
- triangle: upright isosceles, base 2r at the bottom, apex at the top centre, height 2r.

Everything is deterministic for a given ``torch.Generator`` seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IMAGE_SIZE = 32
COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 1.0, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0),
    "white": (1.0, 1.0, 1.0),
    "black": (0.0, 0.0, 0.0),
}
COLOUR_NAMES: list[str] = list(COLOURS)
SHAPES: list[str] = ["circle", "square", "triangle"]
PALETTE = torch.tensor([COLOURS[c] for c in COLOUR_NAMES], dtype=torch.float32)  # [6, 3]

R_MIN, R_MAX = 7.0, 11.0
JITTER = 3
CENTRE = (IMAGE_SIZE - 1) / 2.0

TEMPLATE = "a {fg} {shape} on a {bg} background"


class ColourShapeIndices:
    """The palette and shape indices of a parsed prompt's ``fg``, ``bg`` and ``shape`` (the image
    and the clip grammars share them)."""

    fg: str
    shape: str
    bg: str

    @property
    def fg_index(self) -> int:
        return COLOUR_NAMES.index(self.fg)

    @property
    def bg_index(self) -> int:
        return COLOUR_NAMES.index(self.bg)

    @property
    def shape_index(self) -> int:
        return SHAPES.index(self.shape)


@dataclass(frozen=True)
class Attributes(ColourShapeIndices):
    fg: str
    shape: str
    bg: str


def make_prompt(fg: str, shape: str, bg: str) -> str:
    return TEMPLATE.format(fg=fg, shape=shape, bg=bg)


def all_prompts() -> list[str]:
    """Every prompt of the grammar (90), in a fixed order: fg, then bg, then shape."""
    out = []
    for fg in COLOUR_NAMES:
        for bg in COLOUR_NAMES:
            if fg == bg:
                continue
            for shape in SHAPES:
                out.append(make_prompt(fg, shape, bg))
    return out


def parse_prompt(prompt: str) -> Attributes:
    """Parse a grammar prompt back into its attributes. Raises ValueError otherwise."""
    words = prompt.strip().lower().split()
    if (
        len(words) != 7
        or words[0] != "a"
        or words[3] != "on"
        or words[4] != "a"
        or words[6] != "background"
        or words[1] not in COLOURS
        or words[5] not in COLOURS
        or words[2] not in SHAPES
    ):
        raise ValueError(f"not a prompt of the grammar: {prompt!r}")
    return Attributes(fg=words[1], shape=words[2], bg=words[5])


def shape_masks(
    shape_idx: torch.Tensor, cx: torch.Tensor, cy: torch.Tensor, r: torch.Tensor, size: int = IMAGE_SIZE
) -> torch.Tensor:
    """Binary masks [B, size, size] (float) of shapes given per-sample parameters.

    Pixel (row y, column x) is inside when its centre satisfies the shape's inequality.
    ``cx, cy, r`` may be float tensors of shape [B] (any broadcastable shape works too).
    """
    ys = torch.arange(size, dtype=torch.float32).view(1, size, 1)
    xs = torch.arange(size, dtype=torch.float32).view(1, 1, size)
    cx = cx.float().view(-1, 1, 1)
    cy = cy.float().view(-1, 1, 1)
    r = r.float().view(-1, 1, 1)
    dx = xs - cx
    dy = ys - cy

    def one(s: int) -> torch.Tensor:
        if s == 0:  # disc of radius r
            return dx * dx + dy * dy <= r * r
        if s == 1:  # square of side 2r
            return (dx.abs() <= r) & (dy.abs() <= r)
        # upright triangle: apex (cx, cy - r), base corners (cx +- r, cy + r)
        return (dy >= -r) & (dy <= r) & (2 * dx.abs() <= dy + r)

    sel = torch.as_tensor(shape_idx).view(-1)
    if sel.numel() > 0 and bool((sel == sel[0]).all()):  # one shape for the whole batch
        return one(int(sel[0])).float()
    sel = sel.view(-1, 1, 1)
    mask = torch.where(sel == 0, one(0), torch.where(sel == 1, one(1), one(2)))
    return mask.float()


def render(
    fg_idx: torch.Tensor,
    shape_idx: torch.Tensor,
    bg_idx: torch.Tensor,
    cx: torch.Tensor,
    cy: torch.Tensor,
    r: torch.Tensor,
    size: int = IMAGE_SIZE,
) -> torch.Tensor:
    """Render a batch: returns [B, 3, size, size] float in [0, 1]."""
    mask = shape_masks(shape_idx, cx, cy, r, size).unsqueeze(1)  # [B,1,H,W]
    fg = PALETTE[fg_idx].view(-1, 3, 1, 1)
    bg = PALETTE[bg_idx].view(-1, 3, 1, 1)
    return mask * fg + (1 - mask) * bg


def sample_geometry(n: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random centres and half-sizes: (cx [n], cy [n], r [n])."""
    jit = torch.randint(-JITTER, JITTER + 1, (2, n), generator=generator).float()
    r = R_MIN + (R_MAX - R_MIN) * torch.rand(n, generator=generator)
    return CENTRE + jit[0], CENTRE + jit[1], r


def render_prompts(prompts: list[str], generator: torch.Generator | None = None) -> torch.Tensor:
    """Ground-truth images [B, 3, H, W] for the given prompts, random position/size from ``generator``."""
    attrs = [parse_prompt(p) for p in prompts]
    fg = torch.tensor([a.fg_index for a in attrs])
    sh = torch.tensor([a.shape_index for a in attrs])
    bg = torch.tensor([a.bg_index for a in attrs])
    cx, cy, r = sample_geometry(len(prompts), generator)
    return render(fg, sh, bg, cx, cy, r)


def render_prompt(prompt: str, generator: torch.Generator | None = None) -> torch.Tensor:
    """Ground-truth image [3, H, W] for one prompt."""
    return render_prompts([prompt], generator)[0]


def sample_batch(batch_size: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, list[str]]:
    """A random batch ``(images [B,3,H,W] in [0,1], prompts)``, uniform over the 90 prompts."""
    prompts_all = all_prompts()
    idx = torch.randint(0, len(prompts_all), (batch_size,), generator=generator)
    prompts = [prompts_all[i] for i in idx.tolist()]
    return render_prompts(prompts, generator), prompts


class ShapesDataset(torch.utils.data.IterableDataset):
    """Infinite iterable of batches; deterministic for ``seed``."""

    def __init__(self, batch_size: int = 64, seed: int = 0):
        super().__init__()
        self.batch_size = batch_size
        self.seed = seed

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed)
        while True:
            yield sample_batch(self.batch_size, g)
