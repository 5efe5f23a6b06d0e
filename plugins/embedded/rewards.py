"""Offline rewards for the embedded model: plain functions, no registration.

Each is ``fn(images: Tensor[B, 3, H, W] in [0, 1], prompts: list[str]) -> Tensor[B] float32``.

- ``verifier_score``: the verifier's soft prompt-correctness in [0, 1].
- ``foreground_area``: fraction of pixels whose nearest palette colour is NOT the prompt's
  background colour, in [0, 1]. The pretrained model draws shapes of the training size range
  (about 10-47% of the canvas), so RL can raise it; pushed far, it fights correctness (a
  canvas-filling blob has no background and no recognisable shape).
- ``brightness``: mean pixel value in [0, 1]. Trades off against correctness for prompts with
  black or dark colours (the model can gain by whitening the background or the object).
"""

from __future__ import annotations

import torch

from .dataset import parse_prompt
from .verifier import classify_pixels, verify


@torch.no_grad()
def verifier_score(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    return verify(images, prompts).score.float()


@torch.no_grad()
def foreground_area(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    images = images.detach().float().cpu().clamp(0, 1)
    bg = torch.tensor([parse_prompt(p).bg_index for p in prompts])
    labels = classify_pixels(images)
    return (labels != bg.view(-1, 1, 1)).float().mean((1, 2))


@torch.no_grad()
def brightness(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    return images.detach().float().cpu().clamp(0, 1).mean((1, 2, 3))


REWARDS = {"verifier_score": verifier_score, "foreground_area": foreground_area, "brightness": brightness}

# Both read the prompt's attributes, so a prompt outside the grammar cannot be scored; saying so
# (flowrl.hookspecs: accepts_prompt) lets `flowrl validate` check a recipe's prompt files before a
# model loads, instead of training failing at its first reward call.
verifier_score.accepts_prompt = parse_prompt
foreground_area.accepts_prompt = parse_prompt
