"""DiffusionNFT's likelihood-free objective on the forward process (docs/objectives.md).

DiffusionNFT (NVlabs) trains on the CLEAN samples of a rollout and their rewards only: no
trajectory, no log-probs, so any sampler (an ODE solver) may produce them. With the advantage
mapped to an "optimality probability" ``r`` in [0, 1]::

    r = clip(clip(A, -C, C) / (2 C) + 1/2, 0, 1)

and, per sample and trained noise level ``sigma`` (fresh noise ``eps``,
``x = (1 - sigma) x0 + sigma eps``), the current velocity ``v = v_theta(x, sigma)`` and the
old policy's ``v_old`` (no gradient), two implicit policies::

    v+ = beta v + (1 - beta) v_old          (positive)
    v- = (1 + beta) v_old - beta v          (negative)
    x0+- = x - sigma v+-
    L+- = mean((x0+- - x0)^2) / sg(max(mean|x0+- - x0|, w_min))      (adaptive weight)
    loss = C (r L+ + (1 - r) L-) / beta

At ``theta = theta_old`` the gradient is ``C (2r - 1) dL/dv`` whatever ``beta``: descent moves
``v`` towards the data's velocity when ``A > 0`` and away when ``A < 0``. The old parameters
follow the trained ones softly after every iteration, ``theta_old <- d theta_old + (1 - d) theta``
with ``d`` from :func:`old_policy_decay`.
"""

from __future__ import annotations

import math

import torch

__all__ = ["optimality_probability", "nft_loss", "velocity_kl", "old_policy_decay", "DECAY_PRESETS"]

#: NFT's decay types: (flat, uprate, uphold) of :func:`old_policy_decay`.
DECAY_PRESETS: dict[int, tuple[int, float, float]] = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}


def optimality_probability(advantages: torch.Tensor, clip: float = 5.0) -> torch.Tensor:
    """``r = clip(clip(A, -C, C) / (2 C) + 1/2, 0, 1)`` (float32, ``A``'s shape)."""
    if not (isinstance(clip, (int, float)) and math.isfinite(clip) and clip > 0):
        raise ValueError(f"clip C must be a number > 0, got {clip!r}")
    a = torch.as_tensor(advantages, dtype=torch.float32).clamp(-clip, clip)
    return (a / (2.0 * clip) + 0.5).clamp(0.0, 1.0)


def _col(t, x):
    t = torch.as_tensor(t, dtype=torch.float32, device=x.device)
    if t.ndim == 0:
        t = t.expand(x.shape[0])
    return t.reshape(-1, *([1] * (x.ndim - 1)))


def nft_loss(v: torch.Tensor, v_old: torch.Tensor, x: torch.Tensor, x0: torch.Tensor, sigma, r: torch.Tensor, *,
             beta: float, clip: float = 5.0, weight_min: float = 1e-5) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-sample NFT loss ``[B]`` (module docstring) and its parts ``{"positive", "negative"}``
    (``L+``, ``L-``, detached). ``v`` carries the gradient; ``v_old``, ``x``, ``x0`` are used
    detached; ``sigma`` is a number or ``[B]``; ``r [B]`` the optimality probabilities. The
    adaptive weights are computed in float64 and detached."""
    if not (isinstance(beta, (int, float)) and beta > 0):
        raise ValueError(f"beta must be a number > 0, got {beta!r}")
    vv = v.to(torch.float32)
    vo = v_old.detach().to(torch.float32)
    xx, x0d = x.detach().to(torch.float32), x0.detach().to(torch.float32)
    if not (vv.shape == vo.shape == xx.shape == x0d.shape) or vv.ndim < 2:
        raise ValueError(f"v, v_old, x and x0 must be [B, ...] of one shape, got {tuple(vv.shape)}, "
                         f"{tuple(vo.shape)}, {tuple(xx.shape)}, {tuple(x0d.shape)}")
    s = _col(sigma, xx)
    rr = torch.as_tensor(r, dtype=torch.float32, device=xx.device).reshape(-1)
    parts = {}
    losses = []
    for name, vel in (("positive", beta * vv + (1.0 - beta) * vo), ("negative", (1.0 + beta) * vo - beta * vv)):
        err = (xx - s * vel) - x0d
        flat = err.reshape(err.shape[0], -1)
        w = flat.detach().to(torch.float64).abs().mean(dim=1).clamp(min=weight_min)
        loss = (flat**2).mean(dim=1) / w.to(torch.float32)
        parts[name] = loss.detach()
        losses.append(loss)
    total = clip * (rr * losses[0] + (1.0 - rr) * losses[1]) / beta
    return total, parts


def velocity_kl(v: torch.Tensor, v_ref: torch.Tensor) -> torch.Tensor:
    """NFT's KL surrogate to the reference: ``mean((v - v_ref)^2)`` per sample ``[B]``."""
    d = v.to(torch.float32) - v_ref.detach().to(torch.float32)
    return (d**2).reshape(d.shape[0], -1).mean(dim=1)


def old_policy_decay(step: int, flat: int, uprate: float, uphold: float) -> float:
    """The old policy's decay after ``step`` optimizer steps: ``0`` before ``flat``, then
    ``min((step - flat) * uprate, uphold)`` (NFT's schedule; :data:`DECAY_PRESETS`)."""
    if step < flat:
        return 0.0
    return min((step - flat) * uprate, uphold)
