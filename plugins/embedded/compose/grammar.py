"""The compositional grammar: prompts in GenEval's six categories, each with GenEval-style metadata.

Four shapes (the classes) and six colours:

==============  ==========================================  ======================================
tag             prompt                                      metadata ``include`` (``exclude``)
==============  ==========================================  ======================================
single_object   ``a {shape}``                               the shape once
two_object      ``a {A} and a {B}`` (A != B)                A once, B once
counting        ``{one..four} {shape}(s)``                  the shape n times (not n + 1 times)
colors          ``a {colour} {shape}``                      the shape once, of that colour
position        ``a {A} {left of|right of|above|below} a    B once, then A once at that relation
                {B}`` (A != B)                              to group 0 (GenEval's order)
color_attr      ``a {c1} {A} and a {c2} {B}`` (A != B,      A of c1 once, B of c2 once
                c1 != c2)
==============  ==========================================  ======================================

464 prompts. The held-out split (``split(prompt) == "eval"``) is a fixed arithmetic rule over the
attribute indices, so it names combinations the model never trains on: 4 of 12 object pairs, 4 of
16 counts, 6 of 24 colour-shape pairs, 12 of 48 relations and 72 of 360 colour attributions. The
four single-object prompts are in both splits (there is no combination to hold out).
"""

from __future__ import annotations

import functools
import json

from ..dataset import COLOUR_NAMES

SHAPES: list[str] = ["circle", "square", "triangle", "cross"]
PLURALS: dict[str, str] = {"circle": "circles", "square": "squares", "triangle": "triangles", "cross": "crosses"}
NUMBERS: list[str] = ["one", "two", "three", "four"]
RELATIONS: list[str] = ["left of", "right of", "above", "below"]
TAGS: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
VOCAB: list[str] = (["<pad>", "<unk>", "a", "and", "of", "left", "right", "above", "below"] + NUMBERS + COLOUR_NAMES
                    + SHAPES + list(PLURALS.values()))
MAX_WORDS = 7  # "a red triangle and a blue square"


def _include(shape: str, count: int = 1, colour: str | None = None, position=None) -> dict:
    req: dict = {"class": shape, "count": count}
    if colour is not None:
        req["color"] = colour
    if position is not None:
        req["position"] = list(position)
    return req


def _entries() -> list[tuple[dict, str]]:
    """Every prompt's metadata (GenEval's format) with its split, in a fixed order."""
    out: list[tuple[dict, str]] = []
    n_s, n_c = len(SHAPES), len(COLOUR_NAMES)

    def add(tag, prompt, include, held_out, exclude=None):
        meta = {"tag": tag, "prompt": prompt, "include": include}
        if exclude:
            meta["exclude"] = exclude
        out.append((meta, "eval" if held_out else "train"))

    for a in SHAPES:
        add("single_object", f"a {a}", [_include(a)], held_out=False)
    for i, a in enumerate(SHAPES):
        for j, b in enumerate(SHAPES):
            if a != b:
                add("two_object", f"a {a} and a {b}", [_include(a), _include(b)], held_out=(n_s * i + j) % 3 == 0)
    for n, word in enumerate(NUMBERS, start=1):
        for i, a in enumerate(SHAPES):
            noun = a if n == 1 else PLURALS[a]
            add("counting", f"{word} {noun}", [_include(a, n)], held_out=(n + i) % 4 == 0,
                exclude=[{"class": a, "count": n + 1}])
    for c, colour in enumerate(COLOUR_NAMES):
        for i, a in enumerate(SHAPES):
            add("colors", f"a {colour} {a}", [_include(a, colour=colour)], held_out=(c + i) % 4 == 0)
    for i, a in enumerate(SHAPES):
        for j, b in enumerate(SHAPES):
            if a == b:
                continue
            for r, rel in enumerate(RELATIONS):
                add("position", f"a {a} {rel} a {b}", [_include(b), _include(a, position=(rel, 0))],
                    held_out=(i + j + r) % 4 == 0)
    for i, a in enumerate(SHAPES):
        for j, b in enumerate(SHAPES):
            if a == b:
                continue
            for c1 in range(n_c):
                for c2 in range(n_c):
                    if c1 != c2:
                        add("color_attr", f"a {COLOUR_NAMES[c1]} {a} and a {COLOUR_NAMES[c2]} {b}",
                            [_include(a, colour=COLOUR_NAMES[c1]), _include(b, colour=COLOUR_NAMES[c2])],
                            held_out=(c1 + c2 + i + j) % 5 == 0)
    return out


@functools.lru_cache(maxsize=None)
def _table() -> dict[str, tuple[str, str]]:
    return {meta["prompt"]: (json.dumps(meta), split) for meta, split in _entries()}


def all_prompts(split: str | None = None) -> list[str]:
    """Every prompt of the grammar (464), or those of one split (``"train"`` or ``"eval"``), in a fixed order.
    The single-object prompts belong to both splits."""
    if split not in (None, "train", "eval"):
        raise ValueError(f"unknown split {split!r}: use 'train' or 'eval'")
    return [m["prompt"] for m, s in _entries() if split is None or s == split or m["tag"] == "single_object"]


def metadata(prompt: str) -> dict:
    """The prompt's GenEval-style metadata (a fresh dict). Raises ValueError for a prompt outside the grammar."""
    key = " ".join(prompt.strip().lower().split())
    try:
        return json.loads(_table()[key][0])
    except KeyError:
        raise ValueError(f"not a prompt of the compositional grammar: {prompt!r}") from None


def split(prompt: str) -> str:
    """``"train"`` or ``"eval"`` (the held-out combinations; single-object prompts say ``"train"``)."""
    metadata(prompt)
    return _table()[" ".join(prompt.strip().lower().split())][1]


def accepts_prompt(prompt: str) -> None:
    """Raise ValueError unless the grammar can score ``prompt`` (flowrl.hookspecs: accepts_prompt)."""
    metadata(prompt)


def write_csv(path) -> None:
    """The prompt table recipes train and evaluate from: ``prompt,split,tag``, every prompt once
    under its split, except the four single-object prompts, which belong to both and so have a
    ``train`` row and a ``test`` row (GenEval's single-object category has no combination to hold out)."""
    import csv

    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["prompt", "split", "tag"])
        for meta, part in _entries():
            parts = ("train", "test") if meta["tag"] == "single_object" else ("train" if part == "train" else "test",)
            for name in parts:
                writer.writerow([meta["prompt"], name, meta["tag"]])


if __name__ == "__main__":
    import sys

    write_csv(sys.argv[1] if len(sys.argv) > 1 else "recipes/prompts/compose.csv")
