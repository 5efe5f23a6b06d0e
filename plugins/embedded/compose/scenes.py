"""Scenes of the compositional world: several coloured shapes on a grey canvas, drawn from a
prompt's metadata.

- Canvas ``IMAGE_SIZE`` = 32 x 32 RGB in [0, 1], background mid-grey (``BACKGROUND``), the six
  palette colours of the embedded model for objects.
- An object is ``(shape, colour, cx, cy, r)`` with half-size ``R`` = 5 (10 px across), centred in
  one cell of a 2 x 2 grid on the model's token grid (a token is ``TOKEN`` = 4 x 4 pixels): the
  cells are the 12 x 12 pixel blocks of tokens ``CELLS`` = 1-3 and 4-6 on each axis, the object
  1 px inside its cell. So an object always covers the same 3 x 3 tokens in the same way, and the
  layout has four places: a tiny model learns nine token patterns per shape and commits to a cell
  from the noise, instead of averaging over every position into a faint ghost (what 10-14 px
  objects at free positions gave: empty canvases after 1,250 steps). Objects in neighbouring
  cells are 2 px apart (``GAP``) and 5 px from the border, so they never touch (two objects of
  one colour stay two).
- Shapes: circle (disc of radius r), square (side 2r), triangle (upright, base 2r, height 2r), cross
  (a plus sign in the 2r box, arms ``2 * CROSS_ARM * r`` wide).
- A scene holds exactly what the prompt names (counting: n objects), colours drawn where the prompt
  names none.
- Two named objects are laid out by the prompt, never by a joint draw: two objects and colour
  attribution in reading order (the first named in the left column, the second in the right); a
  position prompt's subject on the named side of its reference ("a circle left of a square": the
  circle in the left column, the square in the right; "above": the top row). The other axis is
  drawn for each object on its own, so GenEval's rule (``flowrl.geneval.relative_position``) finds
  the named relation, with a second one when the two sit diagonally, which GenEval accepts. Placed
  at random, which cell draws which object is a choice two cells must make together; this model
  learns no such joint choice (it drew the named pairs at chance and RL did not move them:
  MODEL_CARD.md), while an object that follows from the prompt and its cell's column or row is a
  binding it learns in part and RL sharpens.

Deterministic for a ``torch.Generator``'s state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..dataset import COLOUR_NAMES, PALETTE
from .grammar import SHAPES, metadata

IMAGE_SIZE = 32
BACKGROUND = (0.5, 0.5, 0.5)
R = 5.0
TOKEN = 4
CELLS = (1, 4)
GAP = 2.0
CROSS_ARM = 0.4


@dataclass(frozen=True)
class SceneObject:
    shape: str
    colour: str
    cx: float
    cy: float
    r: float

    @property
    def box(self) -> tuple[float, float, float, float]:
        return (self.cx - self.r, self.cy - self.r, self.cx + self.r, self.cy + self.r)


def shape_masks(shape_idx: torch.Tensor, cx: torch.Tensor, cy: torch.Tensor, r: torch.Tensor,
                size: int = IMAGE_SIZE) -> torch.Tensor:
    """Binary masks ``[N, size, size]`` (float) of N shapes (indices into ``SHAPES``) with per-shape
    centres and half-sizes; pixel (row y, column x) is inside when its centre is."""
    ys = torch.arange(size, dtype=torch.float32).view(1, size, 1)
    xs = torch.arange(size, dtype=torch.float32).view(1, 1, size)
    cx, cy, r = (torch.as_tensor(t, dtype=torch.float32).view(-1, 1, 1) for t in (cx, cy, r))
    dx, dy = xs - cx, ys - cy
    inside_box = (dx.abs() <= r) & (dy.abs() <= r)
    masks = torch.stack([
        dx * dx + dy * dy <= r * r,                                              # circle
        inside_box,                                                              # square
        (dy >= -r) & (dy <= r) & (2 * dx.abs() <= dy + r),                       # triangle, apex up
        inside_box & ((dx.abs() <= CROSS_ARM * r) | (dy.abs() <= CROSS_ARM * r)),  # cross
    ])  # [4, N, size, size]
    sel = torch.as_tensor(shape_idx).view(1, -1, 1, 1).expand(1, -1, size, size)
    return masks.gather(0, sel)[0].float()


def _place(g: torch.Generator, n: int) -> list[tuple[float, float]]:
    """Centres of ``n`` objects in distinct cells (the grammar counts to four, the cells)."""
    cells = [(i, j) for i in CELLS for j in CELLS]
    if n > len(cells):
        raise ValueError(f"{n} objects do not fit in {len(cells)} cells")
    order = torch.randperm(len(cells), generator=g)[:n].tolist()
    return [_centre(cells[k][1], cells[k][0]) for k in order]


def _centre(col: int, row: int) -> tuple[float, float]:
    """The centre ``(x, y)`` of the cell whose first token is at ``(row, col)`` of the token grid."""
    return (TOKEN * col + 1.5 * TOKEN - 0.5, TOKEN * row + 1.5 * TOKEN - 0.5)


def _place_by_prompt(g: torch.Generator, relation: str | None) -> list[tuple[float, float]]:
    """Centres of two named objects, in the order of ``wanted`` (module docstring): reading order
    (``relation`` None: the first on the left), or a position's reference then its subject, the
    subject on the ``relation``'s side; the other axis drawn for each object."""
    free = [CELLS[k] for k in torch.randint(0, len(CELLS), (2,), generator=g).tolist()]
    near, far = CELLS
    if relation is None:
        return [_centre(near, free[0]), _centre(far, free[1])]
    reference, subject = {"left of": (far, near), "right of": (near, far), "above": (far, near),
                          "below": (near, far)}[relation]
    if relation in ("left of", "right of"):
        return [_centre(reference, free[0]), _centre(subject, free[1])]
    return [_centre(free[0], reference), _centre(free[1], subject)]


#: the categories whose two named objects are laid out by the prompt
LAID_OUT_BY_PROMPT = ("two_object", "color_attr", "position")


def scene(prompt: str, g: torch.Generator) -> list[SceneObject]:
    """The objects of one ground-truth scene for ``prompt``."""
    meta = metadata(prompt)
    wanted = [(req["class"], req.get("color")) for req in meta["include"] for _ in range(req["count"])]
    relation = next((req["position"][0] for req in meta["include"] if "position" in req), None)
    colours = torch.randint(0, len(COLOUR_NAMES), (len(wanted),), generator=g).tolist()
    centres = _place_by_prompt(g, relation) if meta["tag"] in LAID_OUT_BY_PROMPT else _place(g, len(wanted))
    return [SceneObject(shape, colour or COLOUR_NAMES[c], cx, cy, R)
            for (shape, colour), c, (cx, cy) in zip(wanted, colours, centres)]


def render(scenes: list[list[SceneObject]], size: int = IMAGE_SIZE) -> torch.Tensor:
    """Images ``[B, 3, size, size]`` in [0, 1] of the scenes."""
    objects = [(b, o) for b, objs in enumerate(scenes) for o in objs]
    images = torch.tensor(BACKGROUND).view(1, 3, 1, 1).repeat(len(scenes), 1, size, size)
    if not objects:
        return images
    idx = torch.tensor([b for b, _ in objects])
    masks = shape_masks(torch.tensor([SHAPES.index(o.shape) for _, o in objects]),
                        torch.tensor([o.cx for _, o in objects]), torch.tensor([o.cy for _, o in objects]),
                        torch.tensor([o.r for _, o in objects]), size)
    paint = PALETTE[[COLOUR_NAMES.index(o.colour) for _, o in objects]] - torch.tensor(BACKGROUND)
    images.index_add_(0, idx, masks.unsqueeze(1) * paint.view(-1, 3, 1, 1))
    return images


def render_prompts(prompts: list[str], g: torch.Generator) -> torch.Tensor:
    """Ground-truth images ``[B, 3, 32, 32]`` for ``prompts`` (random layout from ``g``)."""
    return render([scene(p, g) for p in prompts])


def sample_batch(prompts: list[str], batch_size: int, g: torch.Generator) -> tuple[torch.Tensor, list[str]]:
    """A random batch ``(images, prompts)``: a category drawn uniformly, then one of ``prompts`` in it.

    Drawing by category, not by prompt, matters: colour attribution holds 288 of the 366 training
    prompts and single objects 4, so a uniform draw over prompts would show the model one single
    object in a hundred scenes."""
    groups: dict[str, list[str]] = {}
    for p in prompts:
        groups.setdefault(metadata(p)["tag"], []).append(p)
    tags = list(groups)
    chosen = []
    for t in torch.randint(0, len(tags), (batch_size,), generator=g).tolist():
        group = groups[tags[t]]
        chosen.append(group[int(torch.randint(0, len(group), (1,), generator=g))])
    return render_prompts(chosen, g), chosen
