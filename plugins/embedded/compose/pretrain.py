"""Fixed-seed pretraining of the compositional model (rectified flow), stopped early on purpose.

The recipe is the embedded model's (``flowrl_plugins.embedded.pretrain``: logit-normal sigma with
shift 3, AdamW, warm-up then cosine, EMA 0.999, batch 64, 1 thread), on ground-truth scenes of the
training split's prompts (``scenes.sample_batch``). ``--stop-at S`` ends the run at step S of a
schedule planned for ``--steps`` and writes the EMA weights of that step: the base model is meant to
sit well below the ceiling (MODEL_CARD.md says how S was chosen), and the same command reproduces
the shipped file bit for bit on the same torch build.

Run: ``OMP_NUM_THREADS=1 python -m flowrl_plugins.embedded.compose.pretrain --out plugins/embedded/weights``
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch

from ..network import num_parameters
from ..pretrain import flow_matching_step, pretrain_parser
from .evaluate import eval_items, evaluate
from .grammar import all_prompts
from .network import COMPOSE_TEXT_CONFIG, COMPOSE_TRANSFORMER_CONFIG, ComposeT2I, save_compose_weights
from .scenes import sample_batch

DEFAULTS = dict(steps=4000, stop_at=1750, batch=32, lr=1e-3, warmup=200, weight_decay=0.01, ema=0.999, t_mean=0.0,
                t_std=1.0, train_shift=3.0, seed=0, double_blocks=2, single_blocks=2, text_layers=0)


def build_model(args) -> ComposeT2I:
    """The shipped architecture, or the variant the depth options name (MODEL_CARD.md, "Random
    layouts: binding at chance": a third double-stream block, self-attention over the prompt's words)."""
    transformer = dict(COMPOSE_TRANSFORMER_CONFIG, num_layers=args.double_blocks, num_single_layers=args.single_blocks)
    text = dict(COMPOSE_TEXT_CONFIG, layers=args.text_layers) if args.text_layers else None
    return ComposeT2I(transformer, text)


def train(args) -> ComposeT2I:
    torch.manual_seed(args.seed)
    model = build_model(args)
    ema = copy.deepcopy(model).eval()
    ema.requires_grad_(False)
    params, ema_params = list(model.parameters()), list(ema.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=args.weight_decay)
    g = torch.Generator().manual_seed(args.seed)
    prompts = all_prompts("train")
    stop = args.stop_at or args.steps
    print(f"parameters: {num_parameters(model)}; {len(prompts)} training prompts; stopping at step {stop}", flush=True)
    start, run_loss, history = time.time(), None, []
    for step in range(stop):
        images, batch_prompts = sample_batch(prompts, args.batch, g)
        loss = flow_matching_step(model, opt, params, ema_params, model.pack(model.encode_images(images)),
                                  batch_prompts, g, args, step)
        run_loss = loss.item() if run_loss is None else 0.98 * run_loss + 0.02 * loss.item()
        if (step + 1) % 100 == 0:
            print(f"step {step + 1} loss {run_loss:.4f} lr {opt.param_groups[0]['lr']:.2e} "
                  f"t {time.time() - start:.0f}s", flush=True)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            table = evaluate(ema, eval_items("eval", 24))
            history.append({"step": step + 1, "overall": table["overall"]["mean"], "soft": table["soft"],
                            **{tag: row["mean"] for tag, row in table["categories"].items()}})
            print("  eval@" + json.dumps(history[-1]), flush=True)
            # a snapshot of every evaluated step, from which the stopping step is chosen; the run
            # with --stop-at that step writes the same weights
            save_compose_weights(ema, Path(args.out) / "snapshots" / f"step_{step + 1}")
    wall = time.time() - start
    print(f"training wall time {wall:.0f}s", flush=True)
    settings = {k: getattr(args, k) for k in DEFAULTS} | {"threads": args.threads, "wall_time_s": round(wall, 1),
                                                         "final_loss_ema": run_loss}
    save_compose_weights(ema, args.out, extra={"training": settings})
    if history:
        (Path(args.out) / "compose_eval_history.json").write_text(json.dumps(history, indent=1))
    return ema


def main(argv=None):
    args = pretrain_parser("Pretrain the compositional embedded model.", DEFAULTS).parse_args(argv)
    torch.set_num_threads(args.threads)
    train(args)


if __name__ == "__main__":
    main()
