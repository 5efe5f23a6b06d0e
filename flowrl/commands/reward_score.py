"""``flowrl reward score NAME``: score images already on disk with any registered reward.

::

    flowrl reward score ocr --images samples/ --prompt 'a shop sign that says "OPEN"'
    flowrl reward score clip --images a.png b.png --prompts prompts.txt --set scale=clipscore --json scores.json

- **Images**: the paths after ``--images`` (up to the next option; ``--images`` may also be
  repeated), in the order given: image files, or folders, each read in sorted file-name order
  (``.png``, ``.jpg``, ``.jpeg``, ``.webp``; other files in a folder are skipped). Each is read as
  RGB, ``[3, H, W]`` in [0, 1]; images of one size are scored together, ``--batch-size`` at a
  time, each batch read from disk when it is scored.
- **Prompts**: ``--prompts FILE``, one prompt a line in the images' order (blank lines skipped;
  a JSONL, CSV or Parquet table's ``prompt`` column, as ``[prompts].source`` reads it), or
  ``--prompt TEXT`` for every image. A prompt count other than the image count is an error.
- **The reward** is built as a recipe's ``[[rewards]]`` entry is: ``--set key=value`` are its
  parameters, validated as the recipe's keys before any file is read
  (:func:`flowrl.commands.reward_common.reward_choice`, shared with ``flowrl reward serve``).
  Scores come through :func:`flowrl.rewards.score`, which holds the reward to the contract, as
  training does.
- **Output**: a table (image, prompt, score) and the mean; ``--json OUT`` also writes a JSON list
  of ``{"image", "prompt", "score"}`` (a non-finite score is ``null``, left out of the mean).

Bad input (an unknown reward or parameter, a missing file, a folder without images, an unreadable
image, a count mismatch) is one message and exit status 2.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated

import typer

from ..errors import FlowrlError
from .base import FlowrlCommand, console, table_console
from .reward_common import build_chosen, reward_app, reward_choice

COMMAND = "flowrl reward score"
#: Image files read from a folder.
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


class ManyImagesCommand(FlowrlCommand):
    """A command whose ``--images`` takes every path that follows it: click gives an option one
    value, so ``--images a b c`` is read as ``--images a --images b --images c``."""

    def parse_args(self, ctx, args):
        return super().parse_args(ctx, spread_values(list(args), ("--images", "-i")))


def spread_values(args: list[str], names: tuple[str, ...]) -> list[str]:
    """``args`` with each value after the first that follows an option of ``names`` (up to the next
    argument starting with ``-``, or ``--``) given its own copy of the option, in place."""
    out: list[str] = []
    option, first = None, False
    for i, arg in enumerate(args):
        if arg == "--":
            return out + args[i:]
        if arg.startswith("-") and len(arg) > 1:
            option, first = (arg if arg in names else None), True
        else:
            if option is not None and not first:
                out.append(option)
            first = False
        out.append(arg)
    return out


@reward_app.command("score", cls=ManyImagesCommand)
def score(
    name: Annotated[str, typer.Argument(help="A registered reward (see `flowrl plugins`).")],
    images: Annotated[list[Path] | None, typer.Option(
        "--images", "-i", help="Image files or folders (a folder: its png, jpg and webp files in sorted order); "
                               "every path after it, up to the next option.")] = None,
    prompts: Annotated[Path | None, typer.Option("--prompts", help="A file, one prompt a line in the images' order.")] = None,
    prompt: Annotated[str | None, typer.Option("--prompt", "-p", help="One prompt for every image.")] = None,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", "-s", help="A reward parameter: key=value (TOML value). Repeatable.")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the scores to this JSON file.")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Images per reward call.")] = 16,
) -> None:
    """Score images on disk with reward NAME: a table of scores and their mean; --json writes them."""
    choice = reward_choice(name, list(set_ or []), COMMAND)  # the name and keys first: nothing is read yet
    if json_out is not None:  # an unwritable --json costs no scoring
        from ..files import ensure_writable

        ensure_writable(json_out, where=f"{COMMAND} --json", directory=False)
    paths = image_paths(list(images or []))
    texts = prompt_list(prompts, prompt, len(paths))
    sizes = image_sizes(paths)
    reward = build_chosen(choice, command=COMMAND, reads=f"`{COMMAND}` reads images")
    refuse_clip_rewards(reward, name)
    scores = score_files(reward, name, paths, sizes, texts, batch_size)
    rows = [{"image": str(p), "prompt": t, "score": s if math.isfinite(s) else None}
            for p, t, s in zip(paths, texts, scores)]
    print_table(name, rows)
    if json_out is not None:
        write_json(json_out, rows)


def image_paths(given: list[Path]) -> list[Path]:
    """The images named: files as given, folders expanded to their images in sorted order."""
    if not given:
        raise FlowrlError("no images given", where=COMMAND, hint="pass --images PATH... (image files or folders)")
    out: list[Path] = []
    for path in given:
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
            if not found:
                raise FlowrlError(f"no images in the folder {path}", where=f"{COMMAND} --images",
                                  hint=f"a folder is read for {', '.join(IMAGE_SUFFIXES)} files")
            out += found
        elif path.is_file():
            out.append(path)
        else:
            raise FlowrlError(f"image not found: {path}", where=f"{COMMAND} --images")
    return out


def prompt_list(prompts_file: Path | None, prompt: str | None, count: int) -> list[str]:
    """One prompt per image, from ``--prompts FILE`` or ``--prompt TEXT``."""
    if (prompts_file is None) == (prompt is None):
        raise FlowrlError("give the prompts with exactly one of --prompts FILE and --prompt TEXT", where=COMMAND,
                          hint="--prompts: one prompt a line, in the images' order; --prompt: one for every image")
    if prompt is not None:
        return [prompt] * count
    from ..prompts import read_prompts

    if not prompts_file.is_file():
        raise FlowrlError(f"prompt file not found: {prompts_file}", where=f"{COMMAND} --prompts")
    texts = [str(p) for p in read_prompts(str(prompts_file), None, f"{COMMAND} --prompts")]
    if len(texts) != count:
        raise FlowrlError(f"the number of prompts in {prompts_file} ({len(texts)}) is not the number of images ({count})",
                          where=f"{COMMAND} --prompts",
                          hint="one prompt a line, in the images' order (a folder's images are in sorted file-name "
                               "order); or --prompt TEXT for every image")
    return texts


def refuse_clip_rewards(reward, name: str) -> None:
    from ..interfaces import ScoresClips

    if isinstance(reward, ScoresClips) and reward.scores_clips:
        raise FlowrlError(f"reward '{name}' scores a video model's clips, and `{COMMAND}` reads images",
                          where=f"{COMMAND} NAME", hint="score the clips with `flowrl eval` of a video run")


def image_sizes(paths: list[Path]) -> list[tuple[int, int]]:
    """``(H, W)`` of each image, read from its header: an unreadable file is found before the
    reward is built, and no image is held in memory until its batch is scored."""
    from PIL import Image

    from ..files import image_read_errors

    sizes = []
    for path in paths:
        try:
            with Image.open(path) as image:
                sizes.append((image.height, image.width))
        except image_read_errors() as exc:
            raise FlowrlError(f"cannot read the image {path}: {exc}", where=f"{COMMAND} --images") from exc
    return sizes


def load_image(path: Path):
    """``[3, H, W]`` float32 in [0, 1] (RGB) of an image file."""
    import numpy as np
    import torch
    from PIL import Image

    from ..files import image_read_errors

    try:
        with Image.open(path) as image:
            array = np.asarray(image.convert("RGB"), dtype=np.uint8).copy()
    except image_read_errors() as exc:  # e.g. a file truncated after its header
        raise FlowrlError(f"cannot read the image {path}: {exc}", where=f"{COMMAND} --images") from exc
    return torch.from_numpy(array).permute(2, 0, 1).float() / 255


def score_files(reward, name: str, paths: list[Path], sizes: list[tuple[int, int]], prompts: list[str],
                batch_size: int) -> list[float]:
    """Scores of the images, in their order: images of one size scored together, ``batch_size``
    at a time (each batch read when it is scored), through :func:`flowrl.rewards.score` (the
    reward contract)."""
    import torch

    from ..rewards import score as call_reward

    by_size: dict[tuple[int, int], list[int]] = {}
    for i, size in enumerate(sizes):
        by_size.setdefault(size, []).append(i)
    scores = [math.nan] * len(paths)
    for indices in by_size.values():
        for start in range(0, len(indices), batch_size):
            chunk = indices[start : start + batch_size]
            batch = torch.stack([load_image(paths[i]) for i in chunk])
            try:
                out = call_reward(reward, batch, [prompts[i] for i in chunk], name=name)
            except FlowrlError:
                raise
            except ValueError as exc:  # a reward's refusal of its input (a prompt it cannot score)
                raise FlowrlError(f"reward '{name}' cannot score {paths[chunk[0]]}: {exc}", where=COMMAND) from exc
            for i, value in zip(chunk, out.scores.tolist()):
                scores[i] = float(value)
    return scores


def print_table(name: str, rows: list[dict]) -> None:
    from rich.table import Table
    from rich.text import Text

    table = Table(title=Text(f"reward '{name}'"), title_justify="left")
    table.add_column("image", overflow="fold")
    table.add_column("prompt", overflow="fold")
    table.add_column("score", justify="right")
    for row in rows:
        table.add_row(Text(row["image"]), Text(row["prompt"]), "nan" if row["score"] is None else f"{row['score']:.4f}")
    table_console().print(table)
    finite = [r["score"] for r in rows if r["score"] is not None]
    left_out = len(rows) - len(finite)
    mean = f"{sum(finite) / len(finite):.4f}" if finite else "nan"
    note = f", non-finite scores left out: {left_out}" if left_out else ""
    console.print(f"mean {mean} (n = {len(finite)}{note})", highlight=False)


def write_json(path: Path, rows: list[dict]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rows, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    except OSError as exc:
        raise FlowrlError(f"cannot write {path}: {exc.strerror or exc}", where=f"{COMMAND} --json") from exc
    console.print(f"wrote {path}", highlight=False)
