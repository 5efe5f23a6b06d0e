"""Fixed-seed pretraining of the embedded video model (rectified flow on synthetic clips).

The recipe of :mod:`.pretrain` (logit-normal sigma with the fixed shift 3, MSE on ``v = eps -
x0``, AdamW with warm-up and cosine decay, grad clip 1.0, EMA weights shipped), on
:func:`.video_dataset.sample_batch` clips. The transformer starts from the shipped image model's
transformer (same configuration; its RoPE's first axis, always 0 for images, now counts frames),
which already draws palette colours and shapes from 4x4-pixel patches, so the video model mostly
has to learn the new prompt words, the smaller frames and the motion; the text encoder starts
from scratch (``--from-scratch`` starts the transformer from scratch too).

Run (from the repository root; the numbers it printed are in MODEL_CARD.md):
``OMP_NUM_THREADS=1 python -m flowrl_plugins.embedded.video_pretrain --out plugins/embedded/weights``
"""

from __future__ import annotations

import copy
import time

import torch

from .network import load_pretrained
from .pretrain import flow_matching_step, pretrain_parser
from .video_dataset import all_prompts, sample_batch
from .video_network import EmbeddedT2V, save_video_weights
from .video_verifier import verify_clips

DEFAULTS = dict(steps=1200, batch=48, lr=1e-3, warmup=100, weight_decay=0.01, ema=0.995, t_mean=0.0, t_std=1.0,
                train_shift=3.0, seed=0)


@torch.no_grad()
def evaluate_clips(model: EmbeddedT2V, seeds=(0,), steps: int = 16, shift: float = 3.0, prompts=None) -> dict:
    """``prompts`` (default every prompt of the grammar) x ``seeds``, Euler ODE from fixed noise,
    scored by the verifier: accuracies."""
    prompts = list(prompts) if prompts is not None else all_prompts()
    t = torch.linspace(1, 0, steps + 1)
    sig = shift * t / (1 + (shift - 1) * t)
    rows = []
    for seed in seeds:
        g = torch.Generator().manual_seed(1000 + seed)
        for i in range(0, len(prompts), 60):
            part = prompts[i: i + 60]
            x = torch.randn(len(part), *model.latent_shape, generator=g)
            emb, pooled = model.encode_prompts(part)
            for k in range(steps):
                x = x + (sig[k + 1] - sig[k]) * model.velocity(x, sig[k], emb, pooled)
            rows.append(verify_clips(model.decode_clips(x), part))
    cat = lambda name: torch.cat([getattr(r, name) for r in rows]).float().mean().item()  # noqa: E731
    return {k: cat(v) for k, v in dict(bg="bg_correct", fg="fg_correct", shape="shape_correct",
                                       motion="motion_correct", all="all_correct", score="score").items()}


def train(args) -> EmbeddedT2V:
    torch.manual_seed(args.seed)
    model = EmbeddedT2V()
    if not args.from_scratch:
        model.transformer.load_state_dict(load_pretrained().transformer.state_dict())
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    params, ema_params = list(model.parameters()), list(ema.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=args.weight_decay)
    g = torch.Generator().manual_seed(args.seed)
    t0, run_loss = time.time(), None
    for step in range(args.steps):
        clips, prompts = sample_batch(args.batch, g)
        loss = flow_matching_step(model, opt, params, ema_params, model.encode_clips(clips), prompts, g, args, step)
        run_loss = loss.item() if run_loss is None else 0.98 * run_loss + 0.02 * loss.item()
        if (step + 1) % 50 == 0:
            print(f"step {step + 1} loss {run_loss:.4f} t {time.time() - t0:.0f}s", flush=True)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            print(f"  eval@{step + 1}: {evaluate_clips(ema)}", flush=True)
            save_video_weights(ema, args.out, extra={"training": {"partial_step": step + 1}})
    wall = time.time() - t0
    result = evaluate_clips(ema)
    print(f"training wall time {wall:.0f}s; final eval (seed 0, 360 prompts): {result}", flush=True)
    cfg = {k: getattr(args, k) for k in DEFAULTS} | {"threads": args.threads, "from_scratch": args.from_scratch,
                                                   "wall_time_s": round(wall, 1), "final_loss_ema": run_loss,
                                                   "eval_seed0": result}
    save_video_weights(ema, args.out, extra={"training": cfg})
    return ema


def main(argv=None):
    ap = pretrain_parser("Pretrain the embedded video model.", DEFAULTS)
    ap.add_argument("--from-scratch", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    train(args)


if __name__ == "__main__":
    main()
