"""V-GRPO: GRPO on an ELBO surrogate of the final sample's likelihood (Tang et al., "V-GRPO: Online
Reinforcement Learning for Denoising Generative Models Is Easier than You Think", arXiv 2604.23380).
docs/objectives.md, "V-GRPO".

The whole sampling run is one action; its log-likelihood is the flow-matching ELBO of the final
image (:mod:`flowrl.objectives.elbo` with ``units = "sample"``), so one ratio per sample::

    z = mean_k (l_k(theta) - sg(l_k(theta_old)))       rho = exp(z)
    A~ = c tanh(A / c)                                  (advantage soft-clipping; c = 0: none)
    L = max(-A~ rho, -A~ clip(rho, 1 - eps, 1 + eps))

with the paper's variance reductions in the estimator: the points ``(sigma_k, eps_k)`` shared by
the samples of a prompt group (``noise = "group"``), the sigmas stratified over the schedule
(``stratified = true``) and the adaptive loss weighting (``weighting = "adaptive"``).

Written from the paper's description: no public code was found. The soft clip's form (``c tanh(A /
c)``: the identity for small ``A``, bounded by ``c``) and the default clip range are this
module's choices, stated in docs/objectives.md.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from flowrl.objectives.losses import broadcast_advantages, clipped_surrogate

__all__ = ["soft_clip", "vgrpo_loss", "VGRPOObjective"]


def soft_clip(advantages: torch.Tensor, c: float) -> torch.Tensor:
    """``c tanh(A / c)`` (float32); ``c = 0`` returns ``A`` unchanged."""
    if not (isinstance(c, (int, float)) and math.isfinite(c) and c >= 0):
        raise ValueError(f"the soft clip c must be a finite number >= 0, got {c!r}")
    a = torch.as_tensor(advantages, dtype=torch.float32)
    return a if c == 0 else c * torch.tanh(a / c)


def vgrpo_loss(log_ratio: torch.Tensor, advantages: torch.Tensor, *, eps: float, adv_soft_clip: float) -> torch.Tensor:
    """Per unit: the clipped surrogate of ``rho = exp(z)`` with the soft-clipped advantage."""
    z = log_ratio.to(torch.float32)
    a = soft_clip(broadcast_advantages(advantages, z), adv_soft_clip)
    return clipped_surrogate(z, a, eps, eps)


@dataclasses.dataclass(frozen=True)
class VGRPOObjective:
    """:func:`vgrpo_loss` as a unit objective ``(z [B, K], A [B, K]) -> [B, K]``."""

    eps: float = 1e-3
    adv_soft_clip: float = 3.0

    def __call__(self, log_ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        return vgrpo_loss(log_ratio, advantages, eps=self.eps, adv_soft_clip=self.adv_soft_clip)
