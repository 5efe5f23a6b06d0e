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
import shutil
import tempfile
import time
from collections import Counter
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


def _merge(symbols: list[str], pair: tuple[str, str]) -> list[str]:
    out: list[str] = []
    for sym in symbols:
        if out and (out[-1], sym) == pair:
            out[-1] += sym
        else:
            out.append(sym)
    return out


def add_word_merges(tok_dir: Path, prompts: list[str]) -> int:
    """Learn byte-pair merges on the words of ``prompts`` (greedy, most frequent pair first, ties by
    the pair's text; CLIP's ``</w>`` end of word) until every word is one token, and add them to the
    byte-level tokenizer in ``tok_dir``; returns the new vocabulary size. BPE encodes a word it
    learnt from exactly as it learnt it, so each word of the grammar becomes one token."""
    segments = [list(w[:-1]) + [w[-1] + "</w>"] for w in sorted({w for p in prompts for w in p.split()})]
    vocab = json.loads((tok_dir / "vocab.json").read_text(encoding="utf-8"))
    merges = []
    while pairs := Counter(pair for seg in segments for pair in zip(seg, seg[1:])):
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(" ".join(best))
        vocab.setdefault("".join(best), len(vocab))
        segments = [_merge(seg, best) for seg in segments]
    (tok_dir / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (tok_dir / "merges.txt").write_text("\n".join(["#version: 0.2", *merges]) + "\n", encoding="utf-8")
    return len(vocab)


def build_model(seed: int, prompts: list[str], max_length: int = 48, whole_words: bool = False):
    """A small CLIPModel for 32x32 images (patch 4: 64 patches) and byte-level prompts (with
    ``whole_words``, every word of ``prompts`` one token: :func:`add_word_merges`), with its
    tokenizer cut at ``max_length`` tokens; every prompt of ``prompts`` must fit whole."""
    ensure_torchvision_importable()
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer

    tok_dir = Path(tempfile.mkdtemp(prefix="flowrl-clip-tok-"))
    vocab_size = write_clip_tokenizer(tok_dir)
    if whole_words:
        vocab_size = add_word_merges(tok_dir, prompts)
    tokenizer = CLIPTokenizer(str(tok_dir / "vocab.json"), str(tok_dir / "merges.txt"))
    tokenizer.model_max_length = max_length
    ids = tokenizer(prompts)["input_ids"]  # <|startoftext|> ... <|endoftext|>, which is also the unknown token
    longest = max(len(i) for i in ids)
    if longest > max_length or any(tokenizer.unk_token_id in i[1:-1] for i in ids):
        raise ValueError(f"prompts need {longest} tokens (max_length {max_length}) or hold unknown characters")
    if whole_words and any(len(i) != len(p.split()) + 2 for i, p in zip(ids, prompts)):
        raise ValueError("the word merges do not make every word one token")
    text = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64, projection_dim=32, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, image_size=32,
                  patch_size=4, projection_dim=32)
    torch.manual_seed(seed)
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=32)), tokenizer, tok_dir


def _features(out):
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def corrupt(images: torch.Tensor, g: torch.Generator, noise_max: float = 0.25, blur_max: float = 0.0) -> torch.Tensor:
    """Generated images are noisy and blurry: a Gaussian blur of random sd in [0, blur_max] pixels
    (none, and no random numbers drawn, when ``blur_max`` is 0), then pixel noise of random sd in
    [0, noise_max]; clamped to [0, 1]."""
    batch = images.shape[0]
    if blur_max > 0:
        sigma = (torch.rand(batch, 1, generator=g) * blur_max).clamp(min=1e-3)
        x = torch.arange(-2, 3, dtype=torch.float32).view(1, 5)
        k = torch.exp(-0.5 * (x / sigma) ** 2)
        k = (k / k.sum(1, keepdim=True)).repeat_interleave(images.shape[1], 0)  # [batch * C, 5]
        flat = images.reshape(1, -1, *images.shape[2:])
        flat = F.conv2d(F.pad(flat, (2, 2, 0, 0), mode="replicate"), k.view(-1, 1, 1, 5), groups=k.shape[0])
        flat = F.conv2d(F.pad(flat, (0, 0, 2, 2), mode="replicate"), k.view(-1, 1, 5, 1), groups=k.shape[0])
        images = flat.reshape(images.shape)
    noise = torch.rand(batch, 1, 1, 1, generator=g) * noise_max
    return (images + noise * torch.randn(images.shape, generator=g)).clamp(0, 1)


def contrastive_train(model, tokenizer, prompts_all: list[str], sample, out_dir: Path, steps: int, batch: int,
                      lr: float, seed: int, max_length: int = 48, blur_max: float = 0.0, log_every: int = 100) -> dict:
    """Train ``model`` on ``sample(batch, generator) -> (images, prompts)`` (prompts from
    ``prompts_all``), corrupted by :func:`corrupt`, and save it with its processor to ``out_dir``."""
    from transformers import CLIPImageProcessor, CLIPProcessor

    tok = tokenizer(prompts_all, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt")
    index = {p: i for i, p in enumerate(prompts_all)}
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    g = torch.Generator().manual_seed(seed)
    start = time.time()
    history = []
    model.train()
    for step in range(steps):
        images, prompts = sample(batch, g)
        images = corrupt(images, g, blur_max=blur_max)
        ids = torch.tensor([index[p] for p in prompts])
        img = F.normalize(_features(model.get_image_features(pixel_values=normalise(images, OPENAI_MEAN, OPENAI_STD))), dim=-1)
        txt = F.normalize(_features(model.get_text_features(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"])), dim=-1)
        # Image -> every prompt (no in-batch duplicates problem); prompt side: in-batch, with
        # every image of the same prompt a positive.
        logits = model.logit_scale.exp() * img @ txt.T  # [batch, len(prompts_all)]
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
    return {"steps": steps, "batch": batch, "lr": lr, "seed": seed, "seconds": round(time.time() - start, 1),
            "history": history}


def train(out_dir: Path, steps: int, batch: int, lr: float, seed: int, log_every: int = 100) -> dict:
    prompts_all = D.all_prompts()
    model, tokenizer, tok_dir = build_model(seed, prompts_all)
    report = contrastive_train(model, tokenizer, prompts_all, D.sample_batch, out_dir, steps, batch, lr, seed,
                               log_every=log_every)
    shutil.rmtree(tok_dir, ignore_errors=True)
    return report


@torch.no_grad()
def retrieve(reward, images: torch.Tensor, prompts_all: list[str]) -> torch.Tensor:
    """The index in ``prompts_all`` of the prompt each image scores highest with, ``[B]``."""
    reward.prepare(prompts_all)
    text = torch.stack([reward._text[p] for p in prompts_all])
    emb = F.normalize(reward._encode_images(reward.geometry(images)).float(), dim=-1)
    return (emb @ text.T).argmax(1)


@torch.no_grad()
def evaluate(directory: Path, n: int = 1024, seed: int = 123) -> dict:
    """Retrieval accuracy over all 90 prompts on fresh ground-truth images (clean and noisy),
    and how the score ranks the right prompt against prompts differing in one attribute."""
    reward = EmbeddedClip(EmbeddedClipConfig(model=str(directory), device="cpu"))
    g = torch.Generator().manual_seed(seed)
    images, prompts = D.sample_batch(n, g)
    noisy = (images + 0.3 * torch.randn(images.shape, generator=g)).clamp(0, 1)
    prompts_all = D.all_prompts()
    out = {}
    for name, imgs in (("clean", images), ("noise_0.3", noisy)):
        pred = retrieve(reward, imgs, prompts_all)
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


def run(description: str, weights_dir: Path, train_fn, evaluate_fn, steps: int, batch: int, argv=None) -> dict:
    """The command line of a CLIP-judge script: train ``train_fn(out, steps, batch, lr, seed)`` on
    one thread (unless --eval-only), evaluate ``evaluate_fn(out)`` and write both to
    ``out/training.json`` (--eval-only keeps the history already there); returns the report."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=weights_dir)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-only", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    path = args.out / "training.json"
    if args.eval_only:
        report = json.loads(path.read_text()) if path.is_file() else {}
    else:
        report = train_fn(args.out, args.steps, args.batch, args.lr, args.seed)
    report["eval"] = evaluate_fn(args.out)
    print(json.dumps(report["eval"]), flush=True)
    path.write_text(json.dumps(report, indent=1))
    return report


def main(argv=None) -> None:
    run("Train the embedded CLIP reward on the shapes grammar.", WEIGHTS_DIR, train, evaluate, 3000, 128, argv)


if __name__ == "__main__":
    main()
