"""Throughput of the ``ocr`` reward on the CPU: images per second at 512x512.

    OMP_NUM_THREADS=1 python benchmarks/ocr_reward.py                      # 1 ONNX Runtime thread
    OMP_NUM_THREADS=1 python benchmarks/ocr_reward.py --threads 1 2 --images 16 --rounds 3 --json /tmp/ocr.json

Run from the repository root with the ``ocr`` extra installed. The images are what a text-rendering
run scores: 512x512, white, with black text rendered by PIL (one to three words on one or two
lines, two fonts, 28 to 80 px), a quarter of them blank (nothing to read, so detection alone runs).
Each configuration scores the whole batch once to warm up, then ``--rounds`` times; the figure
is images / median wall time of a round, timing the reward call as training makes it (tensor in,
scores out). ONNX Runtime ignores ``OMP_NUM_THREADS``: ``--threads`` sets the reward's ``threads``
(intra-op threads per session). The 1-minute load average is printed beside each figure: on a
shared machine the figure is only as good as the cores that were free.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from flowrl.plugins import get_registry

TEXTS = ["OPEN", "Garden party", "FLOW\nGRPO", "Night sale", "HELLO\nWORLD", "Bakery", ""]


def fonts() -> list:
    import matplotlib

    serif = f"{matplotlib.get_data_path()}/fonts/ttf/DejaVuSerif.ttf"
    return [ImageFont.load_default(size=80), ImageFont.truetype(serif, 28), ImageFont.load_default(size=40),
            ImageFont.truetype(serif, 56)]


def batch(n: int, size: int = 512) -> tuple[torch.Tensor, list[str]]:
    """``n`` images ``[n, 3, size, size]`` in [0, 1] and their prompts (every fourth blank)."""
    images, prompts, faces = [], [], fonts()
    for i in range(n):
        text = "" if i % 4 == 3 else TEXTS[i % len(TEXTS)] or "OPEN"
        image = Image.new("RGB", (size, size), "white")
        if text:
            draw = ImageDraw.Draw(image)
            font = faces[i % len(faces)]
            left, top, right, bottom = draw.multiline_textbbox((0, 0), text, font=font, align="center")
            draw.multiline_text(((size - right - left) / 2, (size - bottom - top) / 2), text, fill="black", font=font,
                                align="center")
        images.append(torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255)
        prompts.append(f'a poster that says "{(text or "OPEN").replace(chr(10), " ")}"')
    return torch.stack(images), prompts


def measure(threads: int, images: torch.Tensor, prompts: list[str], rounds: int) -> dict:
    comp = get_registry().get("reward", "ocr")
    reward = comp.build(comp.params(device="cpu", threads=threads))
    warm = reward(images, prompts).scores
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        reward(images, prompts)
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {"threads": threads, "images": len(prompts), "rounds": rounds, "seconds": times,
            "images_per_s": len(prompts) / median, "mean_score": float(warm.mean()),
            "load_1min": os.getloadavg()[0], "providers": reward.providers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1], help="ONNX Runtime intra-op threads to try")
    parser.add_argument("--images", type=int, default=16, help="images per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    images, prompts = batch(args.images)
    results = []
    for threads in args.threads:
        r = measure(threads, images, prompts, args.rounds)
        results.append(r)
        print(f"threads {threads}: {r['images_per_s']:.2f} images/s at 512x512 ({r['images']} images, median of "
              f"{r['rounds']} rounds; mean score {r['mean_score']:.3f}; load average {r['load_1min']:.2f}; "
              f"{', '.join(r['providers'])}; {os.cpu_count()} CPUs)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
