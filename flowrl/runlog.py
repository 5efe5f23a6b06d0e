"""What a run writes for people: metrics.jsonl, annotated image grids, trackers."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from .files import read_jsonl, write_text_atomic
from .prompts import condition_images, condition_of


class MetricsLog:
    """``metrics.jsonl``: one JSON object per iteration, each line on disk (fsynced) when
    :meth:`write` returns. While a run trains the file is only appended to (never rewritten:
    a long run's file would be copied once per row).

    On resume, lines for iterations at or after the resumed iteration are dropped first (the file
    is replaced atomically), so the file reads as one uninterrupted run.
    """

    def __init__(self, path: Path, resume_from: int | None = None):
        self.path = path
        if resume_from is not None and path.is_file():
            # damage inside the file is one message; a record cut by the stop (no newline) is dropped
            records = read_jsonl(path)
            lines = [line for line in path.read_text(encoding="utf-8").splitlines(keepends=True)
                     if line.strip() and line.endswith("\n")]
            kept = [line for line, record in zip(lines, records) if record.get("iteration", -1) < resume_from]
            write_text_atomic(path, "".join(kept))
        self._f = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, default=_jsonable) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


def _jsonable(value):
    if torch.is_tensor(value):
        return value.tolist()
    raise TypeError(type(value).__name__)


def is_phase_seconds(key: str) -> bool:
    """Whether a metrics key is a phase's seconds, ``time/<phase>``: the phases of a row add up to
    its iteration's time. A breakdown inside a phase (``time/update/<part>``) is not one."""
    return key.startswith("time/") and key.count("/") == 1


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of a run's ``metrics.jsonl``, in order (:func:`flowrl.files.read_jsonl`)."""
    return read_jsonl(Path(run_dir) / "metrics.jsonl")


#: Caption font size in pixels (a FreeType font when Pillow has one, else Pillow's bitmap font).
FONT_SIZE = 13


def caption_font(size: int = FONT_SIZE):
    """Pillow's default font at ``size`` pixels (its small bitmap font without FreeType)."""
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except (TypeError, ImportError, OSError):  # Pillow < 10.1 or no FreeType
        return ImageFont.load_default()


def wrap_text(text: str, width: float, font) -> list[str]:
    """``text`` broken into lines no wider than ``width`` pixels, at spaces (a word longer than a
    line is cut, never dropped); explicit newlines are kept."""
    lines: list[str] = []
    for paragraph in text.split("\n"):
        line = ""
        for word in paragraph.split(" "):
            candidate = f"{line} {word}" if line else word
            if font.getlength(candidate) <= width or not line:
                line = candidate
            else:
                lines.append(line)
                line = word
            while font.getlength(line) > width and len(line) > 1:  # one word wider than the cell
                cut = next(k for k in range(len(line), 0, -1) if font.getlength(line[:k]) <= width or k == 1)
                lines.append(line[:cut])
                line = line[cut:]
        lines.append(line)
    return lines


def cell_size(h: int, w: int, scale: int, min_cell: int, max_cell: int) -> tuple[int, int]:
    """The size ``(width, height)`` an ``h x w`` image is drawn at in a grid: enlarged by an integer
    factor (at least ``scale`` and enough to reach ``min_cell`` pixels, at most ``max_cell``), or
    shrunk to ``max_cell`` pixels when it is larger."""
    side = max(h, w)
    if side > max_cell:
        return max(1, round(w * max_cell / side)), max(1, round(h * max_cell / side))
    s = max(1, min(max(scale, math.ceil(min_cell / side)), max_cell // side))
    return w * s, h * s


def image_grid(images: torch.Tensor, captions: Sequence[str], columns: int | None = None, scale: int = 4,
               title: str = "", row_labels: Sequence[str] = (), min_cell: int = 128, max_cell: int = 256):
    """A PIL image: ``images [B, 3, H, W]`` in [0, 1] tiled (``columns`` per row) with a caption
    under each, wrapped at spaces to the cell width, every line shown.

    Small images are enlarged by an integer factor (nearest neighbour: pixels stay sharp) to a
    cell of at least ``min_cell`` pixels, so that captions of 32x32 images stay readable; large
    ones are shrunk to ``max_cell`` pixels. ``title`` (wrapped to the grid's width) is drawn
    above the grid; ``row_labels`` (one per row, wrapped) to the left of each row.
    """
    from PIL import Image, ImageDraw

    b, _, h, w = images.shape
    columns = columns or min(b, 8)
    rows = math.ceil(b / columns)
    cell_w, cell_h = cell_size(h, w, scale, min_cell, max_cell)
    resample = Image.NEAREST if cell_w >= w else Image.LANCZOS
    font, pad, line_h = caption_font(), 4, FONT_SIZE + 3
    wrapped = [wrap_text(c, cell_w, font) if c else [] for c in captions]
    text_h = max((len(x) for x in wrapped), default=0) * line_h + pad
    label_lines = [wrap_text(lab, 2 * cell_w, font) for lab in row_labels]
    label_w = (max((font.getlength(x) for lines in label_lines for x in lines), default=0) + 2 * pad) if row_labels else 0
    label_w = int(math.ceil(label_w))
    body_w = label_w + columns * (cell_w + pad) + pad
    title_lines = wrap_text(title, body_w - 2 * pad, font) if title else []
    title_h = len(title_lines) * line_h + (pad if title else 0)
    grid = Image.new("RGB", (body_w, title_h + rows * (cell_h + text_h + pad) + pad), "white")
    draw = ImageDraw.Draw(grid)
    for j, line in enumerate(title_lines):
        draw.text((pad, pad + j * line_h), line, fill="black", font=font)
    arr = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    for i in range(b):
        r, c = divmod(i, columns)
        x, y = label_w + pad + c * (cell_w + pad), title_h + pad + r * (cell_h + text_h + pad)
        grid.paste(Image.fromarray(arr[i]).resize((cell_w, cell_h), resample), (x, y))
        draw.rectangle((x - 1, y - 1, x + cell_w, y + cell_h), outline=(190, 190, 190))  # white images stay framed
        for j, line in enumerate(wrapped[i] if i < len(wrapped) else []):
            draw.text((x, y + cell_h + 2 + j * line_h), line, fill="black", font=font)
    for r, lines in enumerate(label_lines[:rows]):
        y = title_h + pad + r * (cell_h + text_h + pad) + max(0, (cell_h - len(lines) * line_h) // 2)
        for j, line in enumerate(lines):
            draw.text((pad, y + j * line_h), line, fill="black", font=font)
    return grid


def with_condition(images: torch.Tensor, captions: Sequence[str], prompt: str) -> tuple[torch.Tensor, list[str]]:
    """``images`` of one prompt with its condition image (image editing) put first, captioned
    ``condition``; unchanged when the prompt carries none."""
    if condition_of(prompt) is None:
        return images, list(captions)
    cond = condition_images([prompt], images.shape[-2], images.shape[-1]).to(images)
    return torch.cat([cond, images]), ["condition", *captions]
