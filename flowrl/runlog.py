"""What a run writes for people: metrics.jsonl, annotated image grids, trackers."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from .files import write_text_atomic
from .prompts import condition_images, condition_of


class MetricsLog:
    """``metrics.jsonl``: one JSON object per iteration, each line on disk (fsynced) when
    :meth:`write` returns.

    On resume, lines for iterations at or after the resumed iteration are dropped first (the file
    is replaced atomically), so the file reads as one uninterrupted run.
    """

    def __init__(self, path: Path, resume_from: int | None = None):
        self.path = path
        if resume_from is not None and path.is_file():
            kept = [l for l in path.read_text().splitlines() if l.strip() and json.loads(l).get("iteration", -1) < resume_from]
            write_text_atomic(path, "".join(k + "\n" for k in kept))
        self._f = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, default=_jsonable) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def rewrite_last(self, record: dict[str, Any]) -> None:
        """Replace the last line by ``record``, atomically: a reader sees the old line or the
        new one, never neither."""
        self._f.close()
        lines = self.path.read_text(encoding="utf-8").splitlines()
        lines[-1] = json.dumps(record, default=_jsonable)
        write_text_atomic(self.path, "\n".join(lines) + "\n")
        self._f = open(self.path, "a", encoding="utf-8")

    def close(self) -> None:
        self._f.close()


def _jsonable(value):
    if torch.is_tensor(value):
        return value.tolist()
    raise TypeError(type(value).__name__)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def image_grid(images: torch.Tensor, captions: Sequence[str], columns: int | None = None, scale: int = 4):
    """A PIL image: ``images [B, 3, H, W]`` in [0, 1] tiled with a caption under each."""
    from PIL import Image, ImageDraw

    b, _, h, w = images.shape
    columns = columns or min(b, 8)
    rows = math.ceil(b / columns)
    cell_w, cell_h, text_h = w * scale, h * scale, 26
    grid = Image.new("RGB", (columns * cell_w, rows * (cell_h + text_h)), "white")
    draw = ImageDraw.Draw(grid)
    arr = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    for i in range(b):
        r, c = divmod(i, columns)
        tile = Image.fromarray(arr[i]).resize((cell_w, cell_h), Image.NEAREST)
        grid.paste(tile, (c * cell_w, r * (cell_h + text_h)))
        for j, line in enumerate(captions[i].split("\n")[:2]):
            draw.text((c * cell_w + 2, r * (cell_h + text_h) + cell_h + 1 + 12 * j), line, fill="black")
    return grid


def with_condition(images: torch.Tensor, captions: Sequence[str], prompt: str) -> tuple[torch.Tensor, list[str]]:
    """``images`` of one prompt with its condition image (image editing) put first, captioned
    ``condition``; unchanged when the prompt carries none."""
    if condition_of(prompt) is None:
        return images, list(captions)
    cond = condition_images([prompt], images.shape[-2], images.shape[-1]).to(images)
    return torch.cat([cond, images]), ["condition", *captions]
