"""Sample grid for the docs: ``python -m flowrl_plugins.embedded.samples --out docs/images/embedded_samples.png``.

One row per (foreground, background) colour pair (30 rows); columns: for each shape, the ground
truth and two samples (eval seeds 0 and 1, 16-step Euler, shift 3). Samples the verifier marks
all-correct get a green frame, the others a magenta one; ground truth has a grey frame.
"""

from __future__ import annotations

import argparse

import torch

from .dataset import SHAPES, all_prompts, render_prompts
from .evaluate import EVAL_SEEDS, euler_sample, eval_noise
from .network import load_pretrained
from .verifier import verify


def _frame(img: torch.Tensor, colour, pad: int = 1) -> torch.Tensor:
    c, h, w = img.shape
    out = torch.tensor(colour, dtype=img.dtype).view(3, 1, 1).expand(3, h + 2 * pad, w + 2 * pad).clone()
    out[:, pad : pad + h, pad : pad + w] = img
    return out


def make_grid(model, scale: int = 3) -> torch.Tensor:
    prompts = all_prompts()
    samples = []
    oks = []
    for seed in EVAL_SEEDS:
        imgs = euler_sample(model, prompts, eval_noise(seed, len(prompts)))
        samples.append(imgs)
        oks.append(verify(imgs, prompts).all_correct)
    gt = render_prompts(prompts, torch.Generator().manual_seed(0))
    rows = []
    n_sh = len(SHAPES)
    for row in range(len(prompts) // n_sh):
        cells = []
        for s in range(n_sh):
            i = row * n_sh + s
            cells.append(_frame(_frame(gt[i], (0.5, 0.5, 0.5)), (0.5, 0.5, 0.5)))
            for k in range(len(EVAL_SEEDS)):
                ok = bool(oks[k][i])
                cells.append(_frame(_frame(samples[k][i], (0.0, 0.6, 0.0) if ok else (1.0, 0.0, 1.0)), (0.5, 0.5, 0.5)))
            if s < n_sh - 1:
                cells.append(torch.full((3, cells[-1].shape[1], 4), 0.5))
        rows.append(torch.cat(cells, 2))
    grid = torch.cat(rows, 1)
    return torch.nn.functional.interpolate(grid[None], scale_factor=scale, mode="nearest")[0]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", default=None)
    ap.add_argument("--out", default="docs/images/embedded_samples.png")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from PIL import Image

    grid = make_grid(load_pretrained(args.weights))
    arr = (grid.permute(1, 2, 0).clamp(0, 1) * 255).round().byte().numpy()
    Image.fromarray(arr).save(args.out)
    print(f"wrote {args.out} {arr.shape}")


if __name__ == "__main__":
    main()
