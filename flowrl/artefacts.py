"""Image artefact measures that a run's evaluation logs beside its rewards.

A reward curve can rise while the images rot: a policy that learns a checkerboard or a fine
grid texture raises an area reward, and a soft prompt-correctness score mixes "wrong shape"
with "noisy pixels". :func:`high_frequency_share` makes that texture a number in
``metrics.jsonl`` (``eval/hf_share/mean``), so a user sees it without opening the grids.

The measure is model-agnostic (no palette, no detector): the share of an image's spectral
energy, mean removed per channel, at spatial frequencies above ``cutoff`` cycles per pixel
(the Nyquist limit is 0.5). Flat regions bounded by sharp edges put little energy there (an
edge's spectrum falls as 1/f); a pixel-scale texture puts most of its energy there (a
one-pixel checkerboard has all of it at 0.707). It is compared with the base model's own
images from the same starting noise: the run's first evaluation (before any update) is that
baseline, so ``flowrl plot`` and ``flowrl compare`` show the drift directly.
"""

from __future__ import annotations

import torch

#: Radial spatial frequency (cycles per pixel) above which energy counts as high-frequency.
HF_CUTOFF = 0.25


def high_frequency_share(images: torch.Tensor, cutoff: float = HF_CUTOFF) -> torch.Tensor:
    """``[B]`` share in [0, 1] of each image's non-constant spectral energy above ``cutoff``
    cycles per pixel (radially), summed over channels; 0 for a constant image.

    ``images [B, C, H, W]`` (any range; the measure is scale-free), or clips ``[B, F, C, H, W]``
    (the mean of the frames' shares). Computed in float32."""
    if images.ndim == 5:
        b, f = images.shape[:2]
        return high_frequency_share(images.flatten(0, 1), cutoff).view(b, f).mean(dim=1)
    if images.ndim != 4:
        raise ValueError(f"images must be [B, C, H, W] or clips [B, F, C, H, W], got shape {tuple(images.shape)}")
    x = images.detach().to(torch.float32)
    x = x - x.mean(dim=(-2, -1), keepdim=True)
    power = torch.fft.fft2(x).abs().square()  # [B, C, H, W]
    h, w = x.shape[-2:]
    fy = torch.fft.fftfreq(h, device=x.device).view(h, 1)
    fx = torch.fft.fftfreq(w, device=x.device).view(1, w)
    high = (fy.square() + fx.square()).sqrt() > cutoff  # [H, W]
    total = power.sum(dim=(1, 2, 3))
    above = (power * high).sum(dim=(1, 2, 3))
    return torch.where(total > 0, above / total.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(total))


#: label -> measure: what :func:`flowrl.train.evaluate.evaluate` adds to every evaluation's scores.
ARTEFACT_MEASURES = {"hf_share": high_frequency_share}
