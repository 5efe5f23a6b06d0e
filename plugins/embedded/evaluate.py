"""Fixed evaluation of the embedded model.

Eval set: every prompt of the grammar (90) x seeds (0, 1) = 180 images. Initial noise for seed s
is ``torch.randn(90, 64, 48, generator=Generator().manual_seed(s))`` in ``all_prompts()`` order.
Sampling: deterministic Euler ODE, 16 steps, sigmas = shift-3 of ``linspace(1, 0, 17)``
(sigma' = 3 sigma / (1 + 2 sigma)), ``x <- x + (sigma_{i+1} - sigma_i) * v``; the image is decoded
from the final x (sigma = 0). Scored by ``verifier.verify``.

Run: ``python -m flowrl_plugins.embedded.evaluate [--weights PATH] [--seeds 0 1]``.

Sampling is flowrl's own ODE sampler (:func:`flowrl.sampling.rollout.ode_sample`), the one training
evaluates with.
"""

from __future__ import annotations

import argparse
import time

import torch

from flowrl.sampling.rollout import ode_sample

from .dataset import all_prompts
from .network import load_pretrained
from .verifier import verify

EVAL_SEEDS = (0, 1)
EVAL_STEPS = 16
EVAL_SHIFT = 3.0


def shifted_sigmas(steps: int = EVAL_STEPS, shift: float = EVAL_SHIFT) -> torch.Tensor:
    s = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    return (shift * s / (1.0 + (shift - 1.0) * s)).float()


@torch.no_grad()
def euler_sample(
    model, prompts: list[str], noise: torch.Tensor, steps: int = EVAL_STEPS, shift: float = EVAL_SHIFT
) -> torch.Tensor:
    """Deterministic Euler ODE from sigma=1 to 0. ``noise`` is packed [B,64,48]. Returns images [B,3,32,32]."""
    emb, pooled = model.encode_prompts(prompts)
    x = ode_sample(lambda i, x, s: model.velocity(x, s, emb, pooled), noise, shifted_sigmas(steps, shift))
    return model.decode(x)


def eval_noise(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, 64, 48, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def evaluate(
    model,
    prompts: list[str] | None = None,
    seeds=EVAL_SEEDS,
    steps: int = EVAL_STEPS,
    shift: float = EVAL_SHIFT,
    batch_size: int = 90,
) -> dict:
    """Return accuracies (fractions) over prompts x seeds, plus per-shape all-correct."""
    prompts = list(prompts or all_prompts())
    model.eval()
    res = {k: [] for k in ("bg", "fg", "shape", "all", "score")}
    all_prompts_list = []
    for seed in seeds:
        noise = eval_noise(seed, len(prompts))
        for i in range(0, len(prompts), batch_size):
            p = prompts[i : i + batch_size]
            imgs = euler_sample(model, p, noise[i : i + batch_size], steps, shift)
            r = verify(imgs, p)
            res["bg"].append(r.bg_correct)
            res["fg"].append(r.fg_correct)
            res["shape"].append(r.shape_correct)
            res["all"].append(r.all_correct)
            res["score"].append(r.score)
            all_prompts_list += p
    out = {k: torch.cat(v).float().mean().item() for k, v in res.items()}
    allc = torch.cat(res["all"]).float()
    for s in ("circle", "square", "triangle"):
        m = torch.tensor([s in p for p in all_prompts_list])
        out[f"all_{s}"] = allc[m].mean().item() if m.any() else float("nan")
    out["n"] = len(all_prompts_list)
    return out


def format_table(r: dict) -> str:
    rows = [
        ("background colour", r["bg"]),
        ("foreground colour", r["fg"]),
        ("shape", r["shape"]),
        ("all correct", r["all"]),
        ("  circle prompts, all correct", r["all_circle"]),
        ("  square prompts, all correct", r["all_square"]),
        ("  triangle prompts, all correct", r["all_triangle"]),
        ("mean verifier score", r["score"]),
    ]
    lines = [f"| metric (n = {r['n']}) | value |", "|---|---|"]
    lines += [f"| {name} | {100 * v:.1f}% |" if "score" not in name else f"| {name} | {v:.3f} |" for name, v in rows]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights", default=None, help="safetensors file or folder (default: shipped weights)")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(EVAL_SEEDS))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_pretrained(args.weights)
    t = time.time()
    r = evaluate(model, seeds=tuple(args.seeds))
    print(format_table(r))
    print(f"(16-step Euler ODE, shift 3, {r['n']} images, {time.time() - t:.1f} s)")


if __name__ == "__main__":
    main()
