"""Train (or evaluate) the ``compose_clip`` reward: a tiny CLIP trained contrastively on the
compositional embedded world (``flowrl_plugins.embedded.compose``: 464 prompts in GenEval's six
categories, 32x32 ground-truth scenes on a grey background).

    python scripts/train_compose_clip.py                # writes the shipped weights
    python scripts/train_compose_clip.py --eval-only

The judge trains on ground-truth scenes of *all* 464 prompts, the held-out split included: the
generator never sees those prompts, but a judge that RL runs log must be able to score them. The
model, the loss, the corruption and the command line are those of ``train_embedded_clip.py``
(imported from it; here with one token a word, and a mild blur). This script adds the data and an
evaluation by kind of error. A training batch (:func:`sample_paired`) is a quarter fresh scenes, a
category drawn uniformly and then a prompt, and their exact mirrored / recoloured variants, each
beside its closest wrong counterpart (the opposite relation, the colours of an attribution swapped).
Defaults: 2000 steps of batch 64, about 13.5 minutes on one busy core (MODEL_CARD.md).

Evaluation (``evaluate``; 1024 fresh scenes, the categories in turn, seed 123, clean and with pixel
noise of sd 0.3):

- ``top1_exact``: the image's own prompt scores highest among all 464;
- ``top1_true``: the highest-scoring prompt is *true* of the scene by GenEval's rules (the embedded
  detector on the clean scene). Many prompts are true of one scene ("a circle", "one circle" and
  "a red circle" of a red circle), so exact top-1 has a ceiling well below 1 and this is the fairer
  retrieval measure;
- the right prompt against a minimally wrong prompt of the same category (the share of images whose
  right prompt scores higher), by kind of error: ``colour`` (one object's colour changed to an unused
  one), ``shape`` (one shape changed to an unused one), ``count`` (one more or one fewer), ``relation``
  (the opposite relation: "right of" for "left of"), ``order`` (the two objects of a relation swapped:
  "a square left of a circle" for "a circle left of a square"), ``attribution`` (the two colours
  swapped: "a blue circle and a red square" for "a red circle and a blue square").
  ``KIND@image`` is the other direction: for the prompt, its own scene against a scene of the wrong one.
"""

from __future__ import annotations

import functools
import random
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_embedded_clip import build_model, contrastive_train, retrieve, run  # noqa: E402

from flowrl_plugins.embedded.compose import grammar as G  # noqa: E402
from flowrl_plugins.embedded.compose import scenes as S  # noqa: E402
from flowrl_plugins.embedded.compose.evaluate import score_images  # noqa: E402
from flowrl_plugins.embedded.dataset import PALETTE  # noqa: E402
from flowrl_plugins.rewards.compose_clip import WEIGHTS_DIR, ComposeClip, ComposeClipConfig  # noqa: E402

MAX_LENGTH = 12  # one token a word: the longest prompt is 7 words, 9 tokens (build_model checks)
BLUR_MAX = 0.8  # sd in pixels of the mild training blur
KINDS = ("colour", "shape", "count", "relation", "order", "attribution")
OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


@functools.lru_cache(maxsize=None)
def _groups() -> tuple[tuple[str, ...], ...]:
    """The grammar's prompts, category by category (``G.TAGS``' order)."""
    return tuple(tuple(p for p in G.all_prompts() if G.metadata(p)["tag"] == tag) for tag in G.TAGS)


def sample_balanced(n: int, g: torch.Generator, cycle: bool = False) -> tuple[torch.Tensor, list[str]]:
    """``n`` ground-truth scenes with their prompts, the category drawn uniformly (``cycle``: the
    categories in turn) and then the prompt within it: uniform prompts would give colour attribution
    (360 of 464 prompts) 78% of the images and a single object (4) under 1%."""
    groups = _groups()
    tags = [k % len(groups) for k in range(n)] if cycle else torch.randint(0, len(groups), (n,), generator=g).tolist()
    prompts = [groups[t][torch.randint(0, len(groups[t]), (1,), generator=g).item()] for t in tags]
    return S.render_prompts(prompts, g), prompts


def _phrase(shape: str, colour: str | None = None) -> str:
    return f"a {colour} {shape}" if colour else f"a {shape}"


def _prompt(tag: str, objects: list[tuple[str, str | None]], count: int = 1, relation: str | None = None) -> str:
    """The grammar's prompt of ``tag`` for ``objects`` ``(shape, colour)`` in the prompt's order."""
    if tag == "counting":
        shape = objects[0][0]
        return f"{G.NUMBERS[count - 1]} {shape if count == 1 else G.PLURALS[shape]}"
    if tag == "position":
        return f"{_phrase(*objects[0])} {relation} {_phrase(*objects[1])}"
    return " and ".join(_phrase(*o) for o in objects)


def _parts(prompt: str) -> tuple[str, list[tuple[str, str | None]], int, str | None]:
    """``(tag, objects (shape, colour) in the prompt's order, count, relation)`` of a prompt."""
    meta = G.metadata(prompt)
    include = meta["include"][::-1] if meta["tag"] == "position" else meta["include"]  # the subject comes first
    relation = next((req["position"][0] for req in include if "position" in req), None)
    return meta["tag"], [(req["class"], req.get("color")) for req in include], include[0]["count"], relation


def transform(image: torch.Tensor, prompt: str, hflip: bool = False, vflip: bool = False,
              colours: dict[str, str] | None = None) -> tuple[torch.Tensor, str]:
    """Another exact ground-truth scene made from a scene ``image`` [3, H, W] of ``prompt``, with its
    prompt: mirrored left to right (every shape is mirror-symmetric and so are the layout rules: left
    and right swap), top to bottom (only without a triangle, whose apex points up: above and below
    swap), and with the palette colours renamed by ``colours`` (a permutation; scenes are painted in
    exact palette colours on grey with objects apart, so the pixels of each colour are exact masks)."""
    tag, objects, count, relation = _parts(prompt)
    if hflip:
        image = image.flip(-1)
        relation = {"left of": "right of", "right of": "left of"}.get(relation, relation)
    if vflip:
        if "triangle" in {shape for shape, _ in objects}:
            raise ValueError(f"the vertical mirror of a triangle is not a scene ({prompt!r})")
        image = image.flip(-2)
        relation = {"above": "below", "below": "above"}.get(relation, relation)
    if colours:
        masks = {c: (image == PALETTE[i].view(3, 1, 1)).all(0) for i, c in enumerate(G.COLOUR_NAMES)}
        image = image.clone()
        for src, dst in colours.items():
            image[:, masks[src]] = PALETTE[G.COLOUR_NAMES.index(dst)].view(3, 1)
        objects = [(shape, colours.get(c, c) if c else None) for shape, c in objects]
    return image, _prompt(tag, objects, count, relation)


def counterpart(image: torch.Tensor, prompt: str, g: torch.Generator) -> tuple[torch.Tensor, str]:
    """The :func:`transform` of a scene whose prompt is the closest wrong one: the opposite relation
    (a mirror; above/below with a triangle: none, the left-right mirror of the same prompt), the two
    colours of an attribution swapped, another colour; otherwise the left-right mirror, same prompt."""
    tag, objects, _, relation = _parts(prompt)
    if tag == "position":
        vertical = relation in ("above", "below") and "triangle" not in {shape for shape, _ in objects}
        return transform(image, prompt, hflip=not vertical, vflip=vertical)
    if tag == "color_attr":
        (_, c1), (_, c2) = objects
        return transform(image, prompt, colours={c1: c2, c2: c1})
    if tag == "colors":
        colour = objects[0][1]
        others = [c for c in G.COLOUR_NAMES if c != colour]
        new = others[torch.randint(0, len(others), (1,), generator=g).item()]
        return transform(image, prompt, colours={colour: new, new: colour})
    return transform(image, prompt, hflip=True)


def sample_paired(n: int, g: torch.Generator) -> tuple[torch.Tensor, list[str]]:
    """A training batch of ``n`` (a multiple of 4) from ``n / 4`` scenes of :func:`sample_balanced`:
    each scene, a random :func:`transform` of it (mirrors, colours permuted) and the
    :func:`counterpart` of both, so hard negatives stand side by side and a scene costs a quarter
    (drawing four counted objects apart takes tens of milliseconds)."""
    if n % 4:
        raise ValueError(f"the batch must be a multiple of 4, not {n}")
    images, prompts = sample_balanced(n // 4, g)
    out = []
    for image, prompt in zip(images, prompts):
        triangle = "triangle" in prompt
        flips = torch.rand(2, generator=g) < 0.5
        perm = torch.randperm(len(G.COLOUR_NAMES), generator=g).tolist()
        variant = transform(image, prompt, bool(flips[0]), bool(flips[1]) and not triangle,
                            {c: G.COLOUR_NAMES[k] for c, k in zip(G.COLOUR_NAMES, perm)})
        out += [(image, prompt), counterpart(image, prompt, g), variant, counterpart(*variant, g)]
    return torch.stack([x for x, _ in out]), [p for _, p in out]


def train(out_dir: Path, steps: int, batch: int, lr: float, seed: int, log_every: int = 100) -> dict:
    prompts_all = G.all_prompts()
    model, tokenizer, tok_dir = build_model(seed, prompts_all, max_length=MAX_LENGTH, whole_words=True)
    report = contrastive_train(model, tokenizer, prompts_all, sample_paired, out_dir, steps, batch, lr, seed,
                               max_length=MAX_LENGTH, blur_max=BLUR_MAX, log_every=log_every)
    shutil.rmtree(tok_dir, ignore_errors=True)
    return {**report, "prompts": len(prompts_all),
            "sampling": "a quarter drawn (category, then prompt uniform); the rest mirrored/recoloured (sample_paired)",
            "noise_sd_max": 0.25, "blur_sd_max": BLUR_MAX, "command": " ".join(["python", *sys.argv])}


def minimal_wrongs(prompt: str, rng: random.Random) -> dict[str, str]:
    """For each kind of error that applies to ``prompt``'s category, a prompt of the same category
    that differs from it by that one error (false of every scene of ``prompt``)."""
    tag, objects, count, relation = _parts(prompt)
    out = {}
    i = rng.randrange(len(objects))
    shapes = [s for s in G.SHAPES if s not in {o[0] for o in objects}]
    out["shape"] = _prompt(tag, [(rng.choice(shapes), o[1]) if k == i else o for k, o in enumerate(objects)],
                           count, relation)
    if tag in ("colors", "color_attr"):
        colours = [c for c in G.COLOUR_NAMES if c not in {o[1] for o in objects}]
        out["colour"] = _prompt(tag, [(o[0], rng.choice(colours)) if k == i else o for k, o in enumerate(objects)])
    if tag == "counting":
        out["count"] = _prompt(tag, objects, rng.choice([c for c in (count - 1, count + 1) if 1 <= c <= 4]))
    if tag == "position":
        out["relation"] = _prompt(tag, objects, relation=OPPOSITE[relation])
        out["order"] = _prompt(tag, objects[::-1], relation=relation)
    if tag == "color_attr":
        (a, c1), (b, c2) = objects
        out["attribution"] = _prompt(tag, [(a, c2), (b, c1)])
    for wrong in out.values():
        G.metadata(wrong)  # inside the grammar, or ValueError
    return out


def _rate(hits: list[bool]) -> float | None:
    return round(sum(hits) / len(hits), 4) if hits else None


@torch.no_grad()
def evaluate(directory: Path, n: int = 1024, seed: int = 123) -> dict:
    """Retrieval among all 464 prompts and the right prompt against minimally wrong ones, on ``n``
    fresh ground-truth scenes (the categories in turn; clean and with pixel noise of sd 0.3), overall
    and per category. ``KIND@image`` is the other direction, the one a GRPO group compares: for the
    prompt, its own scene against a scene of the wrong prompt (drawn with seed + 1)."""
    reward = ComposeClip(ComposeClipConfig(model=str(directory), device="cpu"))
    prompts_all = G.all_prompts()
    g, g_wrong = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    images, prompts = sample_balanced(n, g, cycle=True)
    rng = random.Random(seed)
    wrongs = [minimal_wrongs(p, rng) for p in prompts]
    idx = {kind: [k for k, w in enumerate(wrongs) if kind in w] for kind in KINDS}
    wrong_images = {kind: S.render_prompts([wrongs[k][kind] for k in idx[kind]], g_wrong) for kind in KINDS}

    def noisy(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        return (x + 0.3 * torch.randn(x.shape, generator=gen)).clamp(0, 1)

    conditions = {"clean": (images, wrong_images),
                  "noise_0.3": (noisy(images, g), {kind: noisy(x, g_wrong) for kind, x in wrong_images.items()})}
    tags = [G.metadata(p)["tag"] for p in prompts]
    out: dict = {"images": n, "seed": seed, "sampling": "categories in turn, then prompt uniform"}
    for name, (imgs, wimgs) in conditions.items():
        chosen = [prompts_all[i] for i in retrieve(reward, imgs, prompts_all)]
        true = [s.strict for s in score_images(images, chosen)]  # GenEval's verdict on the clean scene
        right = reward(imgs, prompts).scores
        beats = {}
        for kind, members in idx.items():
            if members:
                off = reward(imgs[members], [wrongs[k][kind] for k in members]).scores
                beats[kind] = dict(zip(members, (right[members] > off).tolist()))
                off = reward(wimgs[kind], [prompts[k] for k in members]).scores
                beats[f"{kind}@image"] = dict(zip(members, (right[members] > off).tolist()))
        table = {}
        for group in ("all", *G.TAGS):
            members = [k for k in range(n) if group in ("all", tags[k])]
            row = {"n": len(members), "top1_exact": _rate([chosen[k] == prompts[k] for k in members]),
                   "top1_true": _rate([true[k] for k in members])}
            row.update({kind: _rate([hits[k] for k in members if k in hits]) for kind, hits in beats.items()})
            table[group] = {k: v for k, v in row.items() if v is not None}
        table["all"]["mean_cos_right"] = round(right.mean().item(), 4)
        out[name] = table
    return out


def format_table(result: dict, image_side: bool = False) -> str:
    """A markdown table of :func:`evaluate`'s result, clean / noisy in each cell: retrieval and the
    prompt side, or (``image_side``) the image side."""
    cols = [f"{k}@image" for k in KINDS] if image_side else ["top1_exact", "top1_true", *KINDS]
    header = " | ".join(c.replace("@image", "") for c in cols)
    lines = [f"| category | n | {header} |", "|---" * (len(cols) + 2) + "|"]
    for group, row in result["clean"].items():
        cells = [f"{100 * row[c]:.1f} / {100 * result['noise_0.3'][group][c]:.1f}" if c in row else "-" for c in cols]
        lines.append(f"| {group} | {row['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    report = run("Train the compose_clip reward on the compositional grammar.", WEIGHTS_DIR, train, evaluate,
                 2000, 64, argv)
    print(format_table(report["eval"]), format_table(report["eval"], image_side=True), sep="\n\n", flush=True)


if __name__ == "__main__":
    main()
