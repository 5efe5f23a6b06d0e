"""Train (or evaluate) the ``embedded_clip`` reward: a tiny CLIP trained contrastively on the
embedded model's shapes grammar ("a {colour} {shape} on a {colour} background", 32x32).

    python scripts/train_embedded_clip.py --steps 3000          # writes the shipped weights
    python scripts/train_embedded_clip.py --eval-only

The reward itself lives in the rewards plugin (``flowrl_plugins.rewards.embedded_clip``); this
script needs the embedded plugin's dataset and verifier as well, so it is a script of the
repository rather than part of either plugin.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from flowrl.compat import ensure_torchvision_importable
from flowrl_plugins.embedded import dataset as D
from flowrl_plugins.embedded.verifier import verify
from flowrl_plugins.rewards.clip import OPENAI_MEAN, OPENAI_STD
from flowrl_plugins.rewards.common import normalise
from flowrl_plugins.rewards.embedded_clip import WEIGHTS_DIR, EmbeddedClip, EmbeddedClipConfig
from flowrl.testing.tiny_models import write_clip_tokenizer


def build_model(seed: int):
    """A small CLIPModel for 32x32 images (patch 4: 64 patches) and byte-level prompts."""
    ensure_torchvision_importable()
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer

    tok_dir = Path(tempfile.mkdtemp(prefix="flowrl-clip-tok-"))
    vocab_size = write_clip_tokenizer(tok_dir)
    tokenizer = CLIPTokenizer(str(tok_dir / "vocab.json"), str(tok_dir / "merges.txt"))
    tokenizer.model_max_length = 48  # the longest grammar prompt is 42 tokens
    text = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64, projection_dim=32, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, image_size=32,
                  patch_size=4, projection_dim=32)
    torch.manual_seed(seed)
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=32)), tokenizer, tok_dir


def _features(out):
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def train(out_dir: Path, steps: int, batch: int, lr: float, seed: int, log_every: int = 100) -> dict:
    import shutil

    from transformers import CLIPImageProcessor, CLIPProcessor

    model, tokenizer, tok_dir = build_model(seed)
    prompts_all = D.all_prompts()
    tok = tokenizer(prompts_all, padding="max_length", max_length=48, truncation=True, return_tensors="pt")
    index = {p: i for i, p in enumerate(prompts_all)}
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    g = torch.Generator().manual_seed(seed)
    start = time.time()
    history = []
    model.train()
    for step in range(steps):
        images, prompts = D.sample_batch(batch, g)
        # Generated images are noisy and blurry: train on corrupted copies too.
        noise = torch.rand(batch, 1, 1, 1, generator=g) * 0.25
        images = (images + noise * torch.randn(images.shape, generator=g)).clamp(0, 1)
        ids = torch.tensor([index[p] for p in prompts])
        img = F.normalize(_features(model.get_image_features(pixel_values=normalise(images, OPENAI_MEAN, OPENAI_STD))), dim=-1)
        txt = F.normalize(_features(model.get_text_features(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"])), dim=-1)
        # Image -> all 90 prompts (no in-batch duplicates problem); prompt side: in-batch, with
        # every image of the same prompt a positive.
        logits = model.logit_scale.exp() * img @ txt.T  # [batch, 90]
        loss_i = F.cross_entropy(logits, ids)
        same = (ids[:, None] == ids[None, :]).float()
        logits_t = model.logit_scale.exp() * txt[ids] @ img.T  # [batch, batch]
        loss_t = -(same / same.sum(1, keepdim=True) * logits_t.log_softmax(1)).sum(1).mean()
        loss = 0.5 * (loss_i + loss_t)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        if step % log_every == 0 or step == steps - 1:
            acc = (logits.argmax(1) == ids).float().mean().item()
            history.append({"step": step, "loss": round(loss.item(), 4), "train_top1": round(acc, 3),
                            "seconds": round(time.time() - start, 1)})
            print(json.dumps(history[-1]), flush=True)
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(out_dir)
    model.save_pretrained(out_dir)
    shutil.rmtree(tok_dir, ignore_errors=True)
    return {"steps": steps, "batch": batch, "lr": lr, "seed": seed, "seconds": round(time.time() - start, 1),
            "history": history}


@torch.no_grad()
def evaluate(directory: Path, n: int = 1024, seed: int = 123) -> dict:
    """Retrieval accuracy over all 90 prompts on fresh ground-truth images (clean and noisy),
    and how the score ranks the right prompt against prompts differing in one attribute."""
    reward = EmbeddedClip(EmbeddedClipConfig(model=str(directory), device="cpu"))
    g = torch.Generator().manual_seed(seed)
    images, prompts = D.sample_batch(n, g)
    noisy = (images + 0.3 * torch.randn(images.shape, generator=g)).clamp(0, 1)
    prompts_all = D.all_prompts()
    reward.prepare(prompts_all)
    text = torch.stack([reward._text[p] for p in prompts_all])
    out = {}
    for name, imgs in (("clean", images), ("noise_0.3", noisy)):
        emb = F.normalize(reward._encode_images(reward.geometry(imgs)).float(), dim=-1)
        pred = (emb @ text.T).argmax(1)
        truth = torch.tensor([prompts_all.index(p) for p in prompts])
        chosen = [prompts_all[i] for i in pred]
        out[f"top1_{name}"] = round((pred == truth).float().mean().item(), 4)
        out[f"verifier_of_top1_{name}"] = round(verify(imgs, chosen).score.float().mean().item(), 4)
    # The right prompt against the same prompt with a wrong shape, and with a wrong foreground.
    right = reward(images, prompts).scores
    for attr in ("shape", "fg"):
        wrong = []
        for p in prompts:
            a = D.parse_prompt(p)
            if attr == "shape":
                wrong.append(D.make_prompt(a.fg, D.SHAPES[(a.shape_index + 1) % 3], a.bg))
            else:
                fg = next(c for c in D.COLOUR_NAMES[a.fg_index + 1:] + D.COLOUR_NAMES if c not in (a.fg, a.bg))
                wrong.append(D.make_prompt(fg, a.shape, a.bg))
        off = reward(images, wrong).scores
        out[f"matched_beats_wrong_{attr}"] = round((right > off).float().mean().item(), 4)
        out[f"mean_cos_wrong_{attr}"] = round(off.mean().item(), 4)
    out["mean_cos_matched"] = round(right.mean().item(), 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="Train the embedded CLIP reward on the shapes grammar.")
    parser.add_argument("--out", type=Path, default=WEIGHTS_DIR)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-only", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    report = {} if args.eval_only else train(args.out, args.steps, args.batch, args.lr, args.seed)
    report["eval"] = evaluate(args.out)
    print(json.dumps(report["eval"]), flush=True)
    (args.out / "training.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
