"""GenEval on the compositional world: sample held-out prompts from fixed noise, detect, score by
GenEval's rules (``flowrl.geneval``), and tabulate per category and overall with standard errors.

Items: every prompt of the chosen split, each with ``ceil(images_per_category / n)`` noises when its
category has ``n`` prompts (at least one each), so every category is measured on about the same
number of images (48 by default; colour attribution, with 72 held-out prompts, on 72). The noise of
``(prompt, k)`` is drawn from ``Generator().manual_seed(100_003 * k + index)``, ``index`` the
prompt's place in the whole grammar, so an item's image does not depend on what else is evaluated.
Sampling: deterministic Euler ODE, 16 steps, shift 3 (the embedded model's evaluation).

Run: ``python -m flowrl_plugins.embedded.compose.evaluate [--weights PATH] [--split eval]``.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from flowrl import geneval

from ..evaluate import EVAL_SHIFT, EVAL_STEPS, euler_sample
from .detector import detect
from .grammar import TAGS, all_prompts, metadata
from .network import load_compose_pretrained

IMAGES_PER_CATEGORY = 48


def eval_items(split: str = "eval", images_per_category: int = IMAGES_PER_CATEGORY) -> list[tuple[str, int]]:
    """``(prompt, k)`` pairs: the ``k``-th noise of each prompt, category by category."""
    items = []
    prompts = all_prompts(split)
    for tag in TAGS:
        group = [p for p in prompts if metadata(p)["tag"] == tag]
        for k in range(max(1, math.ceil(images_per_category / len(group)))):
            items += [(p, k) for p in group]
    return items


def item_noise(items: list[tuple[str, int]]) -> torch.Tensor:
    """The fixed starting noise ``[N, 64, 48]`` of each item."""
    index = {p: i for i, p in enumerate(all_prompts())}
    return torch.stack([torch.randn(64, 48, generator=torch.Generator().manual_seed(100_003 * k + index[p]))
                        for p, k in items])


def score_images(images: torch.Tensor, prompts: list[str]) -> list[geneval.PromptScore]:
    """GenEval's verdict and soft score of each image for its prompt, from the embedded detector."""
    return [geneval.score_prompt(d, metadata(p)) for d, p in zip(detect(images), prompts)]


@torch.no_grad()
def evaluate(model, items: list[tuple[str, int]] | None = None, steps: int = EVAL_STEPS, shift: float = EVAL_SHIFT,
             batch_size: int = 128) -> dict:
    """GenEval's table for ``model`` (``flowrl.geneval.summarise``) plus ``soft`` (the mean soft score)."""
    items = list(items if items is not None else eval_items())
    noise = item_noise(items)
    prompts = [p for p, _ in items]
    scores = []
    for i in range(0, len(items), batch_size):
        images = euler_sample(model, prompts[i:i + batch_size], noise[i:i + batch_size], steps, shift)
        scores += score_images(images, prompts[i:i + batch_size])
    table = geneval.summarise([metadata(p)["tag"] for p in prompts], [s.strict for s in scores])
    table["soft"] = sum(s.soft for s in scores) / len(scores)
    return table


def format_table(table: dict) -> str:
    lines = ["| category | n | score |", "|---|---|---|"]
    for tag, row in table["categories"].items():
        lines.append(f"| {tag} | {row['n']} | {row['mean']:.3f} ± {row['sem']:.3f} |")
    lines.append(f"| **overall** | | **{table['overall']['mean']:.3f} ± {table['overall']['sem']:.3f}** |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights", default=None, help="safetensors file or folder (default: the shipped weights)")
    ap.add_argument("--split", default="eval", choices=("eval", "train"))
    ap.add_argument("--images-per-category", type=int, default=IMAGES_PER_CATEGORY)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the table as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_compose_pretrained(args.weights)
    start = time.time()
    table = evaluate(model, eval_items(args.split, args.images_per_category))
    print(format_table(table))
    print(f"(16-step Euler ODE, shift 3, {sum(r['n'] for r in table['categories'].values())} images, "
          f"{time.time() - start:.1f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
