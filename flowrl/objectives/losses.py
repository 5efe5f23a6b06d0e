"""Ratios, the clipped objective and KL terms (docs/api.md §5, §8).

Units: a "unit" is a chunk of consecutive trainable transitions (``sizes`` from
:mod:`flowrl.chunking`); step-level GRPO is ``sizes = (1,) * T``, GSPO is ``sizes = (T,)``::

    step i:  log rho_i = l_i^theta - l_i^old
    unit u:  log rho_u = mean_{i in u} (l_i^theta - l_i^old)       (geometric mean of ratios)
    loss_u = max( -A rho_u, -A clip(rho_u, 1 - eps_low, 1 + eps_high) )

and the policy loss averages ``loss_u`` over the SELECTED units of each sample, sums over
samples and divides by ``normaliser`` (default ``B``, i.e. the mean over samples; pass the
total number of samples of a gradient-accumulation step to reproduce the anchors' division by
``grad_acc * units_per_sample``). ``l`` are per-element-mean log-probs (section 3), so ``rho``
is the true ratio to the power 1/D.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from flowrl.chunking import chunk_mean, validate_chunks
from flowrl.interfaces import ReportsClipping
from flowrl.sampling.kernels import std_like

__all__ = [
    "UnitObjective",
    "ClippedObjective",
    "unit_log_ratios",
    "clipped_surrogate",
    "clip_mask",
    "reduce_units",
    "unit_metrics",
    "objective_loss",
    "kl_gaussian_exact",
    "kl_flow_grpo",
    "kl_old_policy_k3",
    "K3_DIRECTIONS",
]

# A unit objective (a PolicyLoss's ``objective``, e.g. ClippedObjective): (log_ratio [B, K], advantages [B, K]) ->
# per-unit loss [B, K]. Not an "Objective" (flowrl.interfaces.Objective: what an update optimises, per micro-batch).
UnitObjective = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _check_eps(eps_low: float, eps_high: float) -> None:
    for name, e in (("eps_low", eps_low), ("eps_high", eps_high)):
        if not (isinstance(e, (int, float)) and math.isfinite(e) and e >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {e!r}")
    if eps_low >= 1:
        raise ValueError(f"eps_low must be < 1 (the lower clip bound is 1 - eps_low), got {eps_low!r}")


def _check_lp_pair(new_lp: torch.Tensor, old_lp: torch.Tensor) -> None:
    if new_lp.ndim != 2 or new_lp.shape != old_lp.shape:
        raise ValueError(
            f"new and old log-probs must both be [B, T], got {tuple(new_lp.shape)} and {tuple(old_lp.shape)}"
        )


def broadcast_advantages(advantages: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Advantages ``[B]`` (per sample) or of ``ref``'s shape -> broadcast to ``ref``."""
    a = torch.as_tensor(advantages, dtype=torch.float32, device=ref.device)
    if a.ndim < ref.ndim:
        if a.shape != ref.shape[: a.ndim]:
            raise ValueError(
                f"advantages of shape {tuple(a.shape)} do not match the leading dims of {tuple(ref.shape)}"
            )
        a = a.reshape(*a.shape, *([1] * (ref.ndim - a.ndim)))
    try:
        return a.expand_as(ref)
    except RuntimeError as exc:
        raise ValueError(f"advantages of shape {tuple(a.shape)} do not broadcast to {tuple(ref.shape)}") from exc


def unit_log_ratios(new_lp: torch.Tensor, old_lp: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """``[B, T]`` step log-probs -> ``[B, K]`` unit log-ratios ``mean_{i in u}(new_i - old_i)``
    (``old`` is detached; section 5)."""
    _check_lp_pair(new_lp, old_lp)
    s = validate_chunks(sizes, new_lp.shape[1])
    return chunk_mean(new_lp.to(torch.float32) - old_lp.detach().to(torch.float32), s)


def clipped_surrogate(
    log_ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> torch.Tensor:
    """Per-unit PPO loss ``max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))``,
    ``rho = exp(log_ratio)``. ``advantages`` is ``[B]`` or ``log_ratio``'s shape."""
    _check_eps(eps_low, eps_high)
    a = broadcast_advantages(advantages, log_ratio)
    rho = torch.exp(log_ratio.to(torch.float32))
    return torch.maximum(-a * rho, -a * rho.clamp(1.0 - eps_low, 1.0 + eps_high))


def clip_mask(
    log_ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> torch.Tensor:
    """Bool: the clipped branch is active (zero gradient), i.e. ``A > 0`` and
    ``rho > 1 + eps_high``, or ``A < 0`` and ``rho < 1 - eps_low``."""
    a = broadcast_advantages(advantages, log_ratio)
    rho = torch.exp(log_ratio.detach().to(torch.float32))
    return ((a > 0) & (rho > 1.0 + eps_high)) | ((a < 0) & (rho < 1.0 - eps_low))


@dataclass(frozen=True)
class ClippedObjective:
    """The clipped surrogate of section 5 as an objective for :func:`objective_loss` and
    :mod:`flowrl.objectives.chunk_gradient`. Compose extra per-unit terms by wrapping it, e.g.
    ``lambda z, a: ClippedObjective(e, e)(z, a) + beta * kl_old_policy_k3(z)``."""

    eps_low: float = 5e-5
    eps_high: float = 5e-5

    def __post_init__(self):
        _check_eps(self.eps_low, self.eps_high)

    def __call__(self, log_ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        return clipped_surrogate(log_ratio, advantages, self.eps_low, self.eps_high)

    def clip_mask(self, log_ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        return clip_mask(log_ratio, advantages, self.eps_low, self.eps_high)


def check_unit_mask(unit_mask: torch.Tensor, B: int, K: int, device) -> torch.Tensor:
    m = torch.as_tensor(unit_mask)
    if m.dtype != torch.bool or tuple(m.shape) != (B, K):
        raise ValueError(f"unit_mask must be a bool tensor [B, K] = {(B, K)}, got {m.dtype} {tuple(m.shape)}")
    m = m.to(device)
    empty = ~m.any(dim=1)
    if bool(empty.any()):
        raise ValueError(
            f"every sample needs at least one selected unit; samples {torch.nonzero(empty).flatten().tolist()} "
            "have none (drop them from the batch instead)"
        )
    return m


def reduce_units(per_unit: torch.Tensor, unit_mask: torch.Tensor, normaliser: float | None = None) -> torch.Tensor:
    """``(1 / normaliser) * sum_b [ mean over selected u of per_unit[b, u] ]`` (default
    normaliser ``B``). ``per_unit`` and ``unit_mask`` are ``[B, K]``."""
    if per_unit.ndim != 2:
        raise ValueError(f"per-unit values must be [B, K], got shape {tuple(per_unit.shape)}")
    B, K = per_unit.shape
    m = check_unit_mask(unit_mask, B, K, per_unit.device)
    if normaliser is None:
        normaliser = B
    if not (isinstance(normaliser, (int, float)) and normaliser > 0):
        raise ValueError(f"normaliser must be a number > 0, got {normaliser!r}")
    masked = torch.where(m, per_unit, torch.zeros_like(per_unit))
    per_sample = masked.sum(dim=1) / m.sum(dim=1).to(per_unit.dtype)
    return per_sample.sum() / normaliser


def unit_metrics(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    unit_mask: torch.Tensor,
    objective: UnitObjective | None = None,
) -> dict[str, float]:
    """Diagnostics over the selected units: ``ratio_mean/min/max``, ``clip_fraction`` (share of
    units where the clipped branch is active; 0 when the objective has no ``clip_mask``),
    ``approx_kl_old`` (mean k3 estimate of KL(pi_old || pi_theta) per unit, from
    :func:`kl_old_policy_k3`; per-element scale because log-probs are per-element means) and
    ``num_units``."""
    z = log_ratio.detach().to(torch.float32)
    m = torch.as_tensor(unit_mask, device=z.device)
    sel = z[m]
    rho = torch.exp(sel)
    if isinstance(objective, ReportsClipping):
        clipped = objective.clip_mask(z, broadcast_advantages(advantages, z))[m]
        clip_frac = float(clipped.float().mean()) if sel.numel() else 0.0
    else:
        clip_frac = 0.0
    if sel.numel() == 0:
        return {"ratio_mean": 1.0, "ratio_min": 1.0, "ratio_max": 1.0, "clip_fraction": 0.0,
                "approx_kl_old": 0.0, "num_units": 0}
    return {
        "ratio_mean": float(rho.mean()),
        "ratio_min": float(rho.min()),
        "ratio_max": float(rho.max()),
        "clip_fraction": clip_frac,
        "approx_kl_old": float(kl_old_policy_k3(sel).mean()),
        "num_units": int(sel.numel()),
    }


def objective_loss(
    new_lp: torch.Tensor,
    old_lp: torch.Tensor,
    advantages: torch.Tensor,
    sizes: Sequence[int],
    unit_mask: torch.Tensor,
    objective: UnitObjective,
    normaliser: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Generic unit loss: ``reduce_units(objective(z, A), unit_mask, normaliser)`` with
    ``z = unit_log_ratios(new_lp, old_lp, sizes)`` (unselected units are zeroed before the
    objective, so garbage there cannot leak NaN into the gradient). Returns (loss, metrics)."""
    z = unit_log_ratios(new_lp, old_lp, sizes)
    B, K = z.shape
    m = check_unit_mask(unit_mask, B, K, z.device)
    z = torch.where(m, z, torch.zeros_like(z))
    a = broadcast_advantages(advantages, z)
    loss = reduce_units(objective(z, a), m, normaliser)
    return loss, unit_metrics(z, a, m, objective)


# ------------------------------------------------------------------------------------ KL terms


def kl_gaussian_exact(mean: torch.Tensor, ref_mean: torch.Tensor, std) -> torch.Tensor:
    """Exact KL between the two step Gaussians ``N(mean, s^2 I)`` and ``N(ref_mean, s^2 I)``
    per element, averaged over elements: ``mean((mu - mu_ref)^2 / (2 s^2))`` -> ``[B]``
    (section 8; ``s = g sqrt(h)``). ``std`` follows :func:`flowrl.sampling.kernels.gaussian_log_prob`'s
    rule (per-sample ``[B]`` allowed). Keeps the gradient of both means."""
    d = mean.to(torch.float32) - ref_mean.to(torch.float32)
    s = std_like(std, d)
    if not bool((s > 0).all()):
        raise ValueError("std must be > 0 for the Gaussian KL")
    return ((d**2) / (2.0 * s**2)).expand_as(d).reshape(d.shape[0], -1).mean(dim=1)


def kl_flow_grpo(mean: torch.Tensor, ref_mean: torch.Tensor, g) -> torch.Tensor:
    """Flow-GRPO's KL to the reference model: ``mean((mu - mu_ref)^2) / (2 g^2)`` -> ``[B]``
    with ``g`` the diffusion coefficient (NOT the step std: it lacks the ``1/h`` of the exact
    KL, section 8). ``g`` per-sample ``[B]`` allowed. Keeps the gradient."""
    d = mean.to(torch.float32) - ref_mean.to(torch.float32)
    gg = std_like(g, d)
    if not bool((gg > 0).all()):
        raise ValueError("g must be > 0 for the Flow-GRPO KL")
    return ((d**2) / (2.0 * gg**2)).expand_as(d).reshape(d.shape[0], -1).mean(dim=1)


#: Directions of :func:`kl_old_policy_k3`.
K3_DIRECTIONS = ("old_theta", "theta_old")


def kl_old_policy_k3(log_ratio: torch.Tensor, direction: str = "old_theta") -> torch.Tensor:
    """k3 estimator of a KL to the OLD (rollout) policy (section 8), elementwise, >= 0, with
    gradient; ``z = log_ratio`` (theta over old):

    - ``"old_theta"`` (default): ``(rho - 1) - log rho = e^z - 1 - z``, KL(pi_old || pi_theta)
      estimated from pi_old's samples;
    - ``"theta_old"``: ``1/rho - 1 + log rho = e^-z - 1 + z``, the k3 form of KL(pi_theta || pi_old)
      that GCPO (and DeepSeekMath's GRPO) write.

    Both are ``z^2 / 2 + O(z^3)``; they differ by ``z^3 / 3``. This is a KL to the old policy,
    not to a reference model."""
    if direction not in K3_DIRECTIONS:
        raise ValueError(f"direction must be one of {K3_DIRECTIONS}, got {direction!r}")
    z = log_ratio.to(torch.float32)
    return torch.expm1(z) - z if direction == "old_theta" else torch.expm1(-z) + z
