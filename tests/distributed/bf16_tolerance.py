"""The bf16 on-policy tolerance derivation of docs/distributed.md, as the distributed tests use it.

How far one bfloat16 rounding of the velocity can move a trainable transition's log-prob: the
tests check that a bf16 run's first step stays within this bound, and docs/distributed.md
derives from it the ``[train].on_policy_tolerance`` to set for bf16 runs.
"""

from __future__ import annotations

import torch


def log_prob_sensitivity(kernel, sigma: float, sigma_next: float) -> tuple[float, float]:
    """``(c, s)`` of one step: the kernel's mean moves by ``c * delta`` when the velocity moves by
    ``delta`` (every kernel's mean is affine in the velocity), and ``s`` is its std."""
    x = torch.zeros(1, 1)
    at0 = kernel.step(torch.zeros(1, 1), x, sigma, sigma_next, next_sample=x)
    at1 = kernel.step(torch.ones(1, 1), x, sigma, sigma_next, next_sample=x)
    return float(at1.mean - at0.mean), float(at0.std)


def bf16_on_policy_tolerance(kernels, sigmas: torch.Tensor, trainable: torch.Tensor, *, velocity_rms: float,
                             latent_numel: int, reduction: str = "mean", rho: float = 2.0**-8,
                             noise_rms: float = 1.0) -> float:
    """The largest ``|log pi_new - log pi_old|`` of one trainable transition when the velocity of
    re-scoring differs from the rollout's by ``delta`` with ``rms(delta) <= rho * velocity_rms``
    (``rho = 2**-8``: one bfloat16 rounding of the output).

    With the Gaussian step ``N(mu, s^2)``, ``mu' = mu + c delta`` and the stored sample
    ``x' = mu + s eps``, the per-element log-density changes exactly by
    ``(c / s) eps delta - (c / s)^2 delta^2 / 2``; averaged over the latent (``"mean"``) and
    bounded by Cauchy-Schwarz: ``(|c| / s) rms(eps) rms(delta) + (c / s)^2 rms(delta)^2 / 2``
    (times ``latent_numel`` for ``"sum"``). ``rms(eps)`` is about 1 (``noise_rms``)."""
    worst = 0.0
    for i, kernel in enumerate(kernels):
        if not bool(trainable[i]):
            continue
        c, s = log_prob_sensitivity(kernel, float(sigmas[i]), float(sigmas[i + 1]))
        k, d = abs(c) / s, rho * velocity_rms
        worst = max(worst, k * noise_rms * d + 0.5 * (k * d) ** 2)
    return worst * (latent_numel if reduction == "sum" else 1)
