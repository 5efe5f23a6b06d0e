"""Why an RL-trained embedded model draws triangles with a flared foot: does the verifier pay
for it? (docs/study_shapes.md, "The triangles' foot")

    OMP_NUM_THREADS=1 python benchmarks/triangle_foot.py [--checkpoint RUN/checkpoints/iter_N] [--noises 4]

For every triangle prompt of the grammar (30) x 4 noises, the base model's ODE sample (and the
rendered ground truth) is scored by the verifier as drawn and with a foot added: the bottom
``rows`` rows of the foreground mask widened by ``extra`` pixels on each side, in the
foreground colour. Prints the mean score change, the share of images whose score rises, and
the verifier's shape term and triangle IoU before and after.
"""

from __future__ import annotations

import argparse

import torch

from flowrl_plugins.embedded.dataset import COLOURS, PALETTE, all_prompts, parse_prompt, render_prompts
from flowrl_plugins.embedded.evaluate import euler_sample, eval_noise
from flowrl_plugins.embedded.network import load_pretrained
from flowrl_plugins.embedded.verifier import classify_pixels, verify


def add_foot(images: torch.Tensor, prompts: list[str], rows: int, extra: int) -> torch.Tensor:
    """The images with the lowest ``rows`` rows of the prompt-coloured mask widened by ``extra``
    pixels each side."""
    out = images.clone()
    labels = classify_pixels(images.clamp(0, 1))
    for b, p in enumerate(prompts):
        fg = parse_prompt(p).fg_index
        mask = labels[b] == fg
        ys = torch.nonzero(mask.any(1)).flatten()
        if len(ys) == 0:
            continue
        for y in ys[-rows:].tolist():
            xs = torch.nonzero(mask[y]).flatten()
            lo, hi = max(0, int(xs.min()) - extra), min(images.shape[-1] - 1, int(xs.max()) + extra)
            out[b, :, y, lo : hi + 1] = PALETTE[fg].view(3, 1)
    return out


def report(name: str, images: torch.Tensor, prompts: list[str]) -> None:
    before = verify(images, prompts)
    print(f"{name}: {len(prompts)} triangle images, verifier {before.score.mean():.4f}, "
          f"triangle IoU {before.shape_iou[:, 2].mean():.3f}")
    for rows, extra in [(1, 2), (2, 2), (3, 2), (1, 4), (2, 4)]:
        after = verify(add_foot(images, prompts, rows, extra), prompts)
        d = after.score - before.score
        print(f"  foot {rows} row(s) +{extra} px: score change {d.mean():+.4f} (rises on {(d > 0).float().mean():.0%}); "
              f"triangle IoU {before.shape_iou[:, 2].mean():.3f} -> {after.shape_iou[:, 2].mean():.3f}; "
              f"square IoU {before.shape_iou[:, 1].mean():.3f} -> {after.shape_iou[:, 1].mean():.3f}; "
              f"circle IoU {before.shape_iou[:, 0].mean():.3f} -> {after.shape_iou[:, 0].mean():.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default="", help="a run's checkpoint directory (model.safetensors) to compare")
    ap.add_argument("--noises", type=int, default=4, help="starting noises per triangle prompt (default 4)")
    args = ap.parse_args()
    prompts = [p for p in all_prompts() if parse_prompt(p).shape == "triangle"] * args.noises
    noise = torch.cat([eval_noise(s, 30) for s in range(args.noises)])
    torch.manual_seed(0)
    report("ground truth", render_prompts(prompts, torch.Generator().manual_seed(0)), prompts)
    model = load_pretrained()
    report("base model", euler_sample(model, prompts, noise).clamp(0, 1), prompts)
    if args.checkpoint:
        from safetensors.torch import load_file

        model.transformer.load_state_dict(load_file(f"{args.checkpoint}/model.safetensors"))
        report(f"trained ({args.checkpoint})", euler_sample(model, prompts, noise).clamp(0, 1), prompts)


if __name__ == "__main__":
    main()
