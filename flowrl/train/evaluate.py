"""The one ODE sampler, and the run's evaluation on a fixed prompt set.

:func:`ode_sample` is deterministic Euler sampling (the policy's mean path, no SDE noise). It is
what training evaluates with, what ``flowrl sample`` and ``flowrl eval`` draw images with
(including hybrid inference: a different velocity for the late steps), and what the embedded
model's own evaluation uses.

:func:`evaluate` scores the fixed evaluation set of a run: prompt ``p`` with seed index ``s``
is item ``j`` of ``[(p, s) for s in seeds for p in prompts]`` and starts from noise drawn by a
generator seeded with ``(seed, "eval", j)``, so the numbers do not depend on the batch size and
``flowrl eval RUN_DIR`` reproduces them at any checkpoint.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch

from ..interfaces import score
from ..prompts import reward_metadata
from ..sde import ode_step
from ..seeding import generator

#: ``velocity_at(step, x [B, *L], sigma [B]) -> v [B, *L]``
StepVelocity = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


@torch.no_grad()
def ode_sample(velocity_at: StepVelocity, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """Euler ODE sampling from ``noise [B, *L]`` along ``sigmas [N + 1]``; returns ``x_N``
    (float32). ``velocity_at(i, x, sigma)`` gives step ``i``'s velocity, so a caller can switch
    models part-way (hybrid inference)."""
    x = noise.to(torch.float32)
    b = x.shape[0]
    for i in range(len(sigmas) - 1):
        s, s_next = sigmas[i].repeat(b), sigmas[i + 1].repeat(b)
        x = ode_step(velocity_at(i, x, s), x, s, s_next).next_sample
    return x


def evaluation_items(prompts: Sequence[str], seeds: int) -> list[tuple[str, int]]:
    """``(prompt, seed index)`` of every evaluation image, in the order that keys their noise."""
    return [(p, s) for s in range(seeds) for p in prompts]


def evaluation_noise(latent_shape, seed: int, indices: Sequence[int]) -> torch.Tensor:
    """Starting noise ``[len(indices), *L]`` of the evaluation items with these indices."""
    return torch.stack([torch.randn(tuple(latent_shape), generator=generator(seed, "eval", j)) for j in indices])


@torch.no_grad()
def evaluate(model, sigmas: torch.Tensor, rewards, prompts: list[str], seeds: int, seed: int, cache, batch: int):
    """Scores ``{label: [len(prompts) * seeds]}`` of every reward on the fixed evaluation set
    (ODE sampling along ``sigmas``, the run's schedule)."""
    scores: dict[str, list[torch.Tensor]] = defaultdict(list)
    items = evaluation_items(prompts, seeds)
    for start in range(0, len(items), batch):
        part = items[start : start + batch]
        ps = [p for p, _ in part]
        text = cache.get(ps, sigmas.device)
        noise = evaluation_noise(model.latent_shape, seed, range(start, start + len(part))).to(sigmas.device)
        images = model.decode(ode_sample(lambda i, x, s: model.velocity(x, s, text), noise, sigmas))
        metadata = reward_metadata(ps, images)
        for label, _, reward in rewards:
            scores[label].append(score(reward, images, ps, metadata).scores)
    return {label: torch.cat(v) for label, v in scores.items()}


def eval_metrics(scores: dict[str, torch.Tensor]) -> dict[str, float]:
    """Mean and standard error of the mean of each reward over the evaluation set."""
    out = {}
    for label, v in scores.items():
        out[f"eval/{label}/mean"] = v.mean().item()
        out[f"eval/{label}/sem"] = (v.std() / math.sqrt(v.numel())).item()
    return out
