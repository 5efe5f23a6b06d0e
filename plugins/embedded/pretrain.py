"""Fixed-seed pretraining of the embedded model (rectified flow / flow matching).

Recipe (defaults = the shipped weights):

- data: ``dataset.sample_batch`` (uniform over the 90 prompts, random size / jitter), generator
  seeded with ``--seed``; model initialised with ``torch.manual_seed(--seed)``;
- noising: ``x_sigma = (1 - sigma) x0 + sigma eps``, target ``v = eps - x0``, MSE loss;
- sigma: logit-normal, ``sigma = sigmoid(N(t_mean, t_std))``, then the fixed time shift
  ``--train-shift`` (``s sigma / (1 + (s-1) sigma)``), which puts more training at high noise,
  matching the shift-3 sampler where the layout (shape) is decided;
- AdamW (betas 0.9/0.99, weight decay 0.01), linear warm-up then cosine decay to 0,
  grad-norm clip 1.0, EMA of the weights (decay ``--ema`` with the usual (1+n)/(10+n) warm-up);
- the EMA weights are written as ``embedded.safetensors`` + ``embedded.json`` in ``--out``.

Run: ``python -m flowrl_plugins.embedded.pretrain --out plugins/embedded/weights``
(``--threads 1`` by default: bitwise reproducible on the same torch build; ``--threads 2`` runs the same
recipe but float reductions may differ in the last bits. See MODEL_CARD.md for the wall time).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import torch

from .dataset import sample_batch
from .evaluate import evaluate
from .network import DEFAULT_TRANSFORMER_CONFIG, EmbeddedT2I, num_parameters, save_weights

DEFAULTS = dict(
    steps=2500,
    batch=64,
    lr=1e-3,
    warmup=200,
    weight_decay=0.01,
    ema=0.999,
    t_mean=0.0,
    t_std=1.0,
    train_shift=3.0,
    seed=0,
    num_layers=1,
    num_single_layers=2,
)


def sample_sigma(n: int, g: torch.Generator, t_mean: float, t_std: float, shift: float) -> torch.Tensor:
    s = torch.sigmoid(t_mean + t_std * torch.randn(n, generator=g))
    return shift * s / (1.0 + (shift - 1.0) * s)


def lr_at(step: int, total: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    prog = (step - warmup) / max(1, total - warmup)
    return lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, prog)))


def flow_matching_step(model, opt, params, ema_params, x0: torch.Tensor, prompts, g: torch.Generator, args,
                       step: int) -> torch.Tensor:
    """One pretraining step of ``model`` (the image or the video one) on clean latents ``x0`` and
    their prompts: the learning rate of ``step``, the flow-matching loss at a sampled sigma, clipped
    AdamW, then the EMA weights. Returns the loss."""
    for group in opt.param_groups:
        group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
    eps = torch.randn(x0.shape, generator=g)
    sigma = sample_sigma(args.batch, g, args.t_mean, args.t_std, args.train_shift)
    s = sigma.view(-1, *[1] * (x0.ndim - 1))
    emb, pooled = model.encode_prompts(prompts)
    loss = torch.nn.functional.mse_loss(model.velocity((1 - s) * x0 + s * eps, sigma, emb, pooled), eps - x0)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    with torch.no_grad():
        torch._foreach_lerp_(ema_params, params, 1.0 - min(args.ema, (1 + step) / (10 + step)))
    return loss


def pretrain_parser(description: str, defaults: dict) -> argparse.ArgumentParser:
    """``--out``, one option per key of ``defaults`` (its type and default), ``--threads``, ``--eval-every``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", required=True)
    for k, v in defaults.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-every", type=int, default=0)
    return ap


def train(args) -> EmbeddedT2I:
    torch.manual_seed(args.seed)
    tcfg = dict(DEFAULT_TRANSFORMER_CONFIG, num_layers=args.num_layers, num_single_layers=args.num_single_layers)
    model = EmbeddedT2I(tcfg)
    ema = copy.deepcopy(model).eval()
    for p in ema.parameters():
        p.requires_grad_(False)
    params = [p for p in model.parameters()]
    ema_params = [p for p in ema.parameters()]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=args.weight_decay)
    g = torch.Generator().manual_seed(args.seed)
    print(f"parameters: {num_parameters(model)}", flush=True)
    t0 = time.time()
    run_loss = None
    history = []
    for step in range(args.steps):
        images, prompts = sample_batch(args.batch, g)
        x0 = model.pack(model.encode_images(images))
        loss = flow_matching_step(model, opt, params, ema_params, x0, prompts, g, args, step)
        run_loss = loss.item() if run_loss is None else 0.98 * run_loss + 0.02 * loss.item()
        if (step + 1) % 100 == 0:
            print(f"step {step + 1} loss {run_loss:.4f} lr {opt.param_groups[0]['lr']:.2e} t {time.time() - t0:.0f}s", flush=True)
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            r = evaluate(ema, seeds=(0,))
            history.append({"step": step + 1, **r})
            print(f"  eval@{step + 1}: bg {r['bg']:.3f} fg {r['fg']:.3f} shape {r['shape']:.3f} all {r['all']:.3f} "
                  f"(c {r['all_circle']:.2f} s {r['all_square']:.2f} t {r['all_triangle']:.2f})", flush=True)
    wall = time.time() - t0
    print(f"training wall time {wall:.0f}s", flush=True)
    train_cfg = {k: getattr(args, k) for k in DEFAULTS} | {"threads": args.threads, "wall_time_s": round(wall, 1),
                                                        "final_loss_ema": run_loss}
    save_weights(ema, args.out, extra={"training": train_cfg})
    if history:
        (Path(args.out) / "eval_history.json").write_text(json.dumps(history, indent=1))
    return ema


def main(argv=None):
    args = pretrain_parser("Pretrain the embedded flowrl model.", DEFAULTS).parse_args(argv)
    torch.set_num_threads(args.threads)
    train(args)


if __name__ == "__main__":
    main()
