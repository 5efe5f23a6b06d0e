"""Prompt sources and the order in which training visits them.

A prompt source is ``"model"`` (the model adapter's own prompts, e.g. the embedded model's
grammar) or a text file with one prompt per line. The prompts of iteration ``k`` depend only on
``(seed, k)`` (epoch-wise seeded shuffles), which makes resume exact; the evaluation prompts are
a seeded subset, the same for the whole run and for ``flowrl eval`` of any of its checkpoints.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import FlowrlError
from .seeding import generator


def read_prompts(source: str, model, where: str) -> list[str]:
    """The prompts of ``source``: ``"model"`` or a text file, one prompt a line."""
    if source == "model":
        prompts = model.prompt_source()
        if not prompts:
            raise FlowrlError("the model has no prompt source of its own", where=where, hint="give a prompt file path")
        return list(prompts)
    path = Path(source)
    if not path.is_file():
        raise FlowrlError(f"prompt file not found: {path}", where=where)
    prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise FlowrlError(f"prompt file {path} is empty", where=where)
    return prompts


def prompts_for_iteration(prompts: list[str], seed: int, iteration: int, count: int) -> list[str]:
    """The global prompts of one iteration: epoch-wise shuffles of the list, seeded.

    The data position is fully determined by (seed, iteration), which makes resume exact.
    """
    out = []
    start = iteration * count
    for k in range(start, start + count):
        epoch, pos = divmod(k, len(prompts))
        perm = torch.randperm(len(prompts), generator=generator(seed, "data", epoch))
        out.append(prompts[int(perm[pos])])
    return out


def evaluation_prompts(pool: list[str], seed: int, count: int) -> list[str]:
    """The run's fixed evaluation prompts: ``count`` of ``pool`` in a seeded order."""
    perm = torch.randperm(len(pool), generator=generator(seed, "eval-prompts"))
    return [pool[int(i)] for i in perm[:count]]
