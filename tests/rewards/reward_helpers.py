"""Helpers shared by the reward tests (imported by name: pytest puts this directory on sys.path)."""

from __future__ import annotations

import torch

PROMPTS = [
    "a red circle on a white background", "a blue square", "a green triangle on a black background",
    "a red circle on a white background", "an empty canvas", "a blue square",
]


def fixed_images(n: int, size: tuple[int, int] = (32, 32), seed: int = 0) -> torch.Tensor:
    """Images in [0, 1] whose values are multiples of 1/255, so an 8-bit round trip is exact."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, *size), generator=g).float() / 255


def to_pil(images: torch.Tensor):
    """8-bit PIL images (exact for :func:`fixed_images`)."""
    from PIL import Image

    arr = (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return [Image.fromarray(a) for a in arr]


def assert_invariant(reward, images: torch.Tensor, prompts: list[str], atol: float = 1e-5) -> torch.Tensor:
    """Scores must not depend on how the batch is split or ordered; returns the full-batch scores."""
    full = reward(images, prompts).scores
    singles = torch.cat([reward(images[i : i + 1], prompts[i : i + 1]).scores for i in range(len(prompts))])
    torch.testing.assert_close(singles, full, atol=atol, rtol=1e-5)
    perm = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(1))
    permuted = reward(images[perm], [prompts[i] for i in perm]).scores
    torch.testing.assert_close(permuted, full[perm], atol=atol, rtol=1e-5)
    return full
