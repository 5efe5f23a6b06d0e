"""Offline training data: a table of prompts with images, or with preference pairs of images.

One schema, two kinds (decided by the columns present):

- ``images``: columns ``prompt`` and ``image`` (a path) -- supervised fine-tuning data;
- ``pairs``: columns ``prompt``, ``chosen`` and ``rejected`` (two image paths of one prompt,
  the first preferred) -- preference (DPO) data.

Other columns (e.g. ``score``, ``chosen_score``) are kept but not used. The table is JSONL,
CSV or Parquet; relative image paths are read against the table's folder. Images of another size
than the model's are resized (shorter side, bicubic) and centre-cropped to it, as diffusers'
training scripts prepare theirs; then the model adapter encodes them into clean latents
(:class:`flowrl.interfaces.EncodesImages`), so an offline run needs no rollout and no reward model.

Which rows an iteration trains is drawn from a generator seeded by (seed, "offline", iteration):
the same on a resume.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from collections import OrderedDict
from pathlib import Path

import torch

from .errors import FlowrlError
from .files import image_read_errors
from .interfaces import EncodesImages
from .seeding import generator

__all__ = ["KINDS", "CACHED_LATENTS", "LatentCache", "OfflineRows", "OfflineBatch", "read_offline_rows", "load_image",
           "iteration_rows", "encode_rows",
           "offline_batch", "best_worst_rows", "best_rows"]

#: the dataset kinds and the image columns each needs
KINDS = {"images": ("image",), "pairs": ("chosen", "rejected")}


@dataclasses.dataclass
class OfflineRows:
    """The rows of an offline table: ``kind`` (``images`` or ``pairs``), the prompts and, per image
    column of the kind, the resolved image paths."""

    kind: str
    prompts: list[str]
    images: dict[str, list[Path]]

    def __len__(self) -> int:
        return len(self.prompts)


@dataclasses.dataclass
class OfflineBatch:
    """One iteration's rows: their indices in the table, prompts, per image column the clean
    latents ``[B, *L]``, and the sigmas the objectives draw their points from (the training
    sampler's schedule; None where the caller passes them itself)."""

    rows: list[int]
    prompts: list[str]
    latents: dict[str, torch.Tensor]
    sigmas: torch.Tensor | None = None


def read_table(path: Path, where: str) -> list[dict]:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
        try:
            return [json.loads(ln) for ln in lines]
        except json.JSONDecodeError as exc:
            raise FlowrlError(f"{path}: not JSON Lines ({exc})", where=where) from exc
    if suffix in (".csv", ".tsv"):
        with path.open(newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f, delimiter="\t" if suffix == ".tsv" else ","))
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise FlowrlError("reading Parquet needs pyarrow", where=where, hint="pip install pyarrow") from exc
        return pq.read_table(path).to_pylist()
    raise FlowrlError(f"{path}: offline data must be .jsonl, .csv, .tsv or .parquet", where=where)


def read_offline_rows(source: str | Path, where: str = "offline data") -> OfflineRows:
    """Read and check an offline table (module docstring). One clear error for a missing file,
    an empty table, a table with neither ``image`` nor ``chosen``/``rejected`` (or both), or a row
    with an empty prompt or path."""
    path = Path(source)
    if not path.is_file():
        raise FlowrlError(f"offline data not found: {path}", where=where)
    rows = read_table(path, where)
    if not rows:
        raise FlowrlError(f"{path} holds no rows", where=where)
    columns = set(rows[0])
    kinds = [k for k, need in KINDS.items() if any(c in columns for c in need)]
    if len(kinds) != 1 or "prompt" not in columns or not set(KINDS[kinds[0]]) <= columns:
        raise FlowrlError(
            f"{path}: columns {sorted(columns)} are neither an image table nor a preference table",
            where=where, hint="give `prompt` and `image` (SFT), or `prompt`, `chosen` and `rejected` (DPO)")
    kind = kinds[0]
    prompts, images = [], {c: [] for c in KINDS[kind]}
    for i, row in enumerate(rows):
        values = [row.get("prompt")] + [row.get(c) for c in KINDS[kind]]
        if any(not isinstance(v, str) or not v.strip() for v in values):
            raise FlowrlError(f"{path}: row {i + 1} has an empty or missing prompt or image path", where=where)
        prompts.append(row["prompt"])
        for c in KINDS[kind]:
            p = Path(row[c])
            images[c].append(p if p.is_absolute() else path.parent / p)
    return OfflineRows(kind, prompts, images)


def load_image(path: Path, size: tuple[int, int] | None = None) -> torch.Tensor:
    """An image file as float32 ``[3, H, W]`` in [0, 1], upright (a camera's EXIF orientation
    applied); with ``size = (H, W)`` first resized so that it covers ``size`` (bicubic, aspect ratio
    kept) and centre-cropped to it. An image already of that size is read as it is."""
    from PIL import Image, ImageOps

    try:
        with Image.open(path) as im:
            im = ImageOps.exif_transpose(im).convert("RGB")
            if size is not None and (im.height, im.width) != tuple(size):
                im = _cover_and_crop(im, size)
            data = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
            w, h = im.size
    except image_read_errors() as exc:
        raise FlowrlError(f"cannot read the image {path}: {exc}", where="[data].path",
                          hint="replace or remove the table's row that names it") from exc
    return data.reshape(h, w, 3).permute(2, 0, 1).to(torch.float32) / 255.0


def _cover_and_crop(im, size: tuple[int, int]):
    """``im`` scaled by the smallest factor that covers ``size = (H, W)``, then its centre ``H x W``."""
    from PIL import Image

    height, width = size
    scale = max(height / im.height, width / im.width)
    w, h = max(width, round(im.width * scale)), max(height, round(im.height * scale))
    im = im.resize((w, h), Image.Resampling.BICUBIC)
    left, top = (w - width) // 2, (h - height) // 2
    return im.crop((left, top, left + width, top + height))


def iteration_rows(num_rows: int, *, seed: int, iteration: int, count: int) -> list[int]:
    """The table rows of an iteration: ``count`` drawn without replacement (all of them when the
    table is smaller), from the generator seeded by (seed, "offline", iteration)."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    g = generator(seed, "offline", iteration)
    return torch.randperm(num_rows, generator=g)[: min(count, num_rows)].tolist()


#: table images whose latents a run keeps in CPU memory (least recently used dropped): 2048 of
#: SD3's at 512 x 512 (16 x 64 x 64 float32) are 0.5 GB
CACHED_LATENTS = 2048


class LatentCache:
    """Clean latents of a table's images, each encoded once and kept on the CPU, at most
    ``max_items`` (the least recently used dropped; a dropped one is encoded again to the same
    bits). Every image is encoded alone, a batch of one, so that its latent does not depend on
    which rows shared an iteration: the same on a resume and on any number of processes."""

    def __init__(self, max_items: int = CACHED_LATENTS):
        self.max_items = max_items
        self.items: OrderedDict[tuple[int, str], torch.Tensor] = OrderedDict()

    def get(self, data: OfflineRows, model, row: int, column: str, device: torch.device | str = "cpu") -> torch.Tensor:
        """The latent ``[*L]`` (float32, on the CPU) of the table's ``column`` image in ``row``."""
        key = (row, column)
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key]
        image = load_image(data.images[column][row], model.image_size)[None].to(device)
        with torch.no_grad():
            latent = model.encode_images(image).to(torch.float32)[0].cpu()
        self.items[key] = latent
        if len(self.items) > self.max_items:
            self.items.popitem(last=False)
        return latent


def encode_rows(data: OfflineRows, model, rows: list[int], device: torch.device | str = "cpu",
                cache: LatentCache | None = None) -> OfflineBatch:
    """These rows of the table, their images loaded at the model's ``image_size`` and encoded by
    ``model`` (:class:`EncodesImages`), one image at a time, through ``cache`` when given."""
    if not isinstance(model, EncodesImages):
        raise FlowrlError(f"{type(model).__name__} cannot encode images, so it cannot train on offline data",
                          hint="the adapter needs encode_images (flowrl.interfaces.EncodesImages)")
    cache = cache if cache is not None else LatentCache(max_items=0)
    latents = {column: torch.stack([cache.get(data, model, r, column, device) for r in rows]).to(device)
               for column in data.images}
    return OfflineBatch(list(rows), [data.prompts[r] for r in rows], latents)


def offline_batch(data: OfflineRows, model, *, seed: int, iteration: int, count: int,
                  device: torch.device | str = "cpu") -> OfflineBatch:
    """The iteration's ``count`` rows (:func:`iteration_rows`), encoded (:func:`encode_rows`)."""
    rows = iteration_rows(len(data), seed=seed, iteration=iteration, count=count)
    return encode_rows(data, model, rows, device)


def best_worst_rows(records: list[dict], scores) -> list[dict]:
    """Preference rows from scored samples (e.g. ``flowrl sample``'s ``samples.jsonl`` records,
    each with ``prompt`` and ``file``, and one score each): per prompt the best image is
    ``chosen`` and the worst ``rejected`` (the first of equal scores); a prompt whose images all
    score the same teaches nothing and gives no row."""
    if len(records) != len(scores):
        raise ValueError(f"one score per record: {len(records)} records, {len(scores)} scores")
    by_prompt: dict[str, list[tuple[float, dict]]] = {}
    for rec, sc in zip(records, scores):
        by_prompt.setdefault(rec["prompt"], []).append((float(sc), rec))
    rows = []
    for prompt, items in by_prompt.items():
        best = max(items, key=lambda t: t[0])
        worst = min(items, key=lambda t: t[0])
        if best[0] > worst[0]:
            rows.append({"prompt": prompt, "chosen": best[1]["file"], "rejected": worst[1]["file"],
                         "chosen_score": best[0], "rejected_score": worst[0]})
    return rows


def best_rows(records: list[dict], scores) -> list[dict]:
    """Supervised rows from scored samples (as :func:`best_worst_rows`): per prompt its best image
    (rejection sampling: SFT on the best of N), with its ``score``."""
    if len(records) != len(scores):
        raise ValueError(f"one score per record: {len(records)} records, {len(scores)} scores")
    best: dict[str, tuple[float, dict]] = {}
    for rec, sc in zip(records, scores):
        if rec["prompt"] not in best or float(sc) > best[rec["prompt"]][0]:
            best[rec["prompt"]] = (float(sc), rec)
    return [{"prompt": p, "image": rec["file"], "score": sc} for p, (sc, rec) in best.items()]
