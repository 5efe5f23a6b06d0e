"""Train the latent verifier head offline (:mod:`.latent_verifier`) and write its weights.

Data, all from the shipped embedded model and the procedural dataset (nothing downloaded):

- the model's own samples: Euler ODE from fresh noise for every grammar prompt, at 8 to 32
  steps (other step counts than training uses, so the head sees the model's range of quality);
- rendered dataset images encoded to latents (clean, correct pictures);
- blends of two samples' latents (pictures between two prompts' answers);

each paired with its own prompt half of the time and with a random grammar prompt otherwise,
and labelled with the verifier's soft score of the decoded image against that prompt. The
held-out split is made of samples from noise seeds the training split never uses; the script
reports the head's mean absolute error and Pearson correlation against the verifier there and
writes them, with its settings, to ``latent_verifier.json``.

Run: ``python -m flowrl_plugins.embedded.train_latent_verifier [--out DIR] [--seed 0]``
(about two minutes on one CPU core).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from flowrl.sampling.rollout import ode_sample

from .dataset import all_prompts, render_prompts
from .evaluate import shifted_sigmas
from .latent_verifier import LATENT_VERIFIER_PATH, LatentVerifierNet, prompt_features
from .network import decode, encode_images, load_pretrained, pack, unpack
from .verifier import verify


@torch.no_grad()
def model_samples(model, prompts: list[str], seed: int, steps: int) -> torch.Tensor:
    """Packed latents ``[B, 64, 48]`` of the model's ODE samples (noise from ``seed``)."""
    noise = torch.randn(len(prompts), 64, 48, generator=torch.Generator().manual_seed(seed))
    emb, pooled = model.encode_prompts(prompts)
    return ode_sample(lambda i, x, s: model.velocity(x, s, emb, pooled), noise, shifted_sigmas(steps))


@torch.no_grad()
def labelled(latents: torch.Tensor, own: list[str], rng: random.Random, grammar: list[str]):
    """``(grid [N, 12, 16, 16], prompt features [N, 15], verifier score [N])``: half with their own
    prompt, half with a random one."""
    prompts = [p if rng.random() < 0.5 else rng.choice(grammar) for p in own]
    grid = unpack(latents.float())
    return grid, prompt_features(prompts), verify(decode(grid), prompts).score.float()


def build(model, seeds, rng, grammar, with_renders: bool):
    parts = []
    for k, seed in enumerate(seeds):
        steps = (8, 12, 16, 24, 32)[k % 5]
        z = model_samples(model, grammar, seed, steps)
        parts.append(labelled(z, grammar, rng, grammar))
        if k % 2 == 1:  # blends of this sample set with the previous one
            a = torch.rand(len(grammar), 1, 1)
            parts.append(labelled(a * z + (1 - a) * previous, grammar, rng, grammar))
        previous = z
        if with_renders:
            g = torch.Generator().manual_seed(10_000 + seed)
            parts.append(labelled(pack(encode_images(render_prompts(grammar, g))), grammar, rng, grammar))
    return tuple(torch.cat(t) for t in zip(*parts))


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=LATENT_VERIFIER_PATH.parent)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-seeds", type=int, default=30)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--width", type=int, default=32)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    rng, grammar = random.Random(args.seed), all_prompts()
    model = load_pretrained()
    t0 = time.time()
    train = build(model, range(100, 100 + args.train_seeds), rng, grammar, with_renders=True)
    held = build(model, range(5000, 5006), rng, grammar, with_renders=False)
    print(f"data: {len(train[0])} train, {len(held[0])} held-out ({time.time() - t0:.0f} s)")

    net = LatentVerifierNet(width=args.width)
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=1e-4)
    n, batch = len(train[0]), 128
    total = args.epochs * ((n + batch - 1) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=total)
    for epoch in range(args.epochs):
        net.train()
        order = torch.randperm(n)
        for i in range(0, n, batch):
            j = order[i:i + batch]
            loss = F.mse_loss(net(train[0][j], train[1][j]), train[2][j])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        if epoch % 10 == 9 or epoch == args.epochs - 1:
            net.eval()
            with torch.no_grad():
                pred = net(held[0], held[1])
            print(f"epoch {epoch + 1}: held-out MAE {float((pred - held[2]).abs().mean()):.4f}, "
                  f"Pearson {pearson(pred, held[2]):.4f}")
    net.eval()
    with torch.no_grad():
        pred = net(held[0], held[1])
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / LATENT_VERIFIER_PATH.name
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path))
    settings = {"width": args.width, "seed": args.seed, "train_seeds": args.train_seeds, "epochs": args.epochs,
                "train_examples": len(train[0]), "held_out_examples": len(held[0]),
                "held_out_mae": round(float((pred - held[2]).abs().mean()), 4),
                "held_out_pearson": round(pearson(pred, held[2]), 4)}
    path.with_suffix(".json").write_text(json.dumps(settings, indent=2) + "\n")
    print(f"wrote {path} ({time.time() - t0:.0f} s): {settings}")


if __name__ == "__main__":
    main()
