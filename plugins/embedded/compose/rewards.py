"""Rewards of the compositional world: GenEval's rules (``flowrl.geneval``) over the embedded
detector's detections, the prompt's metadata read from the grammar.

- ``compose_geneval``: the soft per-prompt score (Flow-GRPO's partial credit, 1 exactly when
  GenEval's verdict is correct), for training;
- ``compose_geneval_exact``: Flow-GRPO's exact-count score (an extra object costs as much as a
  missing one), the training reward of the compose recipes: ``compose_geneval`` inherits GenEval's
  "at least" and rewards drawing more objects than asked (``flowrl.geneval``, "Exact-count score");
- ``compose_geneval_strict``: GenEval's verdict (1 correct, 0 not), for evaluation.
"""

from __future__ import annotations

import torch

from .evaluate import score_images
from .grammar import accepts_prompt


@torch.no_grad()
def geneval_soft(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    return torch.tensor([s.soft for s in score_images(images, list(prompts))], dtype=torch.float32)


@torch.no_grad()
def geneval_exact(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    return torch.tensor([s.exact for s in score_images(images, list(prompts))], dtype=torch.float32)


@torch.no_grad()
def geneval_strict(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    return torch.tensor([float(s.strict) for s in score_images(images, list(prompts))], dtype=torch.float32)


geneval_soft.accepts_prompt = accepts_prompt
geneval_exact.accepts_prompt = accepts_prompt
geneval_strict.accepts_prompt = accepts_prompt
