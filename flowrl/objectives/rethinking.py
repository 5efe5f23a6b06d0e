"""EPG, PEPG and PAR: the policy-gradient losses of "Rethinking the Design Space of Reinforcement
Learning for Diffusion Models" (Choi et al., ICML 2026; jaemoo-choi/rethinking-diffusion-rl,
``compute_policy_loss`` in ``src/utils/base.py``). docs/objectives.md, "EPG, PEPG and PAR".

Per unit, with ``z = l - sg(l_old)`` the log-ratio (``l`` the unit's log-likelihood: its ELBO
under ``[likelihood] use = "elbo"``, the paper's choice, or its trajectory log-prob), ``rho =
exp(z)`` and ``A`` the advantage, ``sg`` the stop-gradient::

    EPG   (policy gradient):            L = -sg(rho) A z
    PEPG  (proximal policy gradient):   L = -sg(rho) (A - sg(z)) z
    PAR   (proximal advantage regression): L = 1/2 sg(rho) (A - z)^2

and with ``ratio = false`` (the authors' ``*_noratio`` variants) ``sg(rho)`` is replaced by 1. The
gradients, which is what training sees::

    dL/dz:  EPG  -rho A        PEPG  -rho (A - z)        PAR  -rho (A - z)

PEPG and PAR share their gradient; they differ in value (PAR's is a regression residual, >= 0).
PEPG's ``-z`` term pulls a unit back once its likelihood has moved past what its advantage asks
(a proximal term without clipping).

The authors write EPG and PEPG on the ELBO itself, ``-sg(rho) A l``, whose value differs from the
one here by ``-sg(rho) A sg(l_old)``, a constant in the parameters: the gradients are equal, and
on-policy (``z = 0``) the values here are 0 (EPG, PEPG) and ``A^2 / 2`` (PAR).
"""

from __future__ import annotations

import dataclasses

import torch

from flowrl.objectives.losses import broadcast_advantages

__all__ = ["epg_loss", "pepg_loss", "par_loss", "EPGObjective", "PEPGObjective", "PARObjective"]


def _weight(z: torch.Tensor, ratio: bool) -> torch.Tensor:
    return torch.exp(z.detach()) if ratio else torch.ones_like(z)


def epg_loss(log_ratio: torch.Tensor, advantages: torch.Tensor, *, ratio: bool = True) -> torch.Tensor:
    """EPG per unit: ``-sg(rho) A z`` (module docstring); ``advantages`` is ``[B]`` or ``log_ratio``'s shape."""
    z = log_ratio.to(torch.float32)
    a = broadcast_advantages(advantages, z)
    return -_weight(z, ratio) * a * z


def pepg_loss(log_ratio: torch.Tensor, advantages: torch.Tensor, *, ratio: bool = True) -> torch.Tensor:
    """PEPG per unit: ``-sg(rho) (A - sg(z)) z``."""
    z = log_ratio.to(torch.float32)
    a = broadcast_advantages(advantages, z)
    return -_weight(z, ratio) * (a - z.detach()) * z


def par_loss(log_ratio: torch.Tensor, advantages: torch.Tensor, *, ratio: bool = True) -> torch.Tensor:
    """PAR per unit: ``1/2 sg(rho) (A - z)^2``."""
    z = log_ratio.to(torch.float32)
    a = broadcast_advantages(advantages, z)
    return 0.5 * _weight(z, ratio) * (a - z) ** 2


@dataclasses.dataclass(frozen=True)
class EPGObjective:
    """:func:`epg_loss` as a unit objective ``(z [B, K], A [B, K]) -> [B, K]``."""

    ratio: bool = True

    def __call__(self, log_ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        return epg_loss(log_ratio, advantages, ratio=self.ratio)


@dataclasses.dataclass(frozen=True)
class PEPGObjective:
    """:func:`pepg_loss` as a unit objective."""

    ratio: bool = True

    def __call__(self, log_ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        return pepg_loss(log_ratio, advantages, ratio=self.ratio)


@dataclasses.dataclass(frozen=True)
class PARObjective:
    """:func:`par_loss` as a unit objective."""

    ratio: bool = True

    def __call__(self, log_ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        return par_loss(log_ratio, advantages, ratio=self.ratio)
