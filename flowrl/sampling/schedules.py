"""Noise schedules for flow-matching sampling (docs/api.md §1).

Conventions (docs/api.md §1): the noise level ``sigma`` runs from 1 (pure noise) to
0 (data), ``x_sigma = (1 - sigma) * x0 + sigma * eps``. A schedule of ``N`` sampling steps is a
strictly decreasing float32 tensor ``sigmas [N + 1]`` with ``sigmas[0] <= 1`` and
``sigmas[N] == 0`` exactly; step ``i`` goes from ``sigmas[i]`` to ``sigmas[i + 1]`` and
``dt_i = sigmas[i + 1] - sigmas[i] < 0``.

Every function here is pure: it computes in float64 and returns float32 so that the same
schedule is produced at rollout and at training (docs/api.md §3: sigma rounding that
differs between rollout and training breaks the on-policy ratio).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from flowrl.checks import positive_int

__all__ = [
    "time_shift",
    "conditioning_timestep",
    "TIMESTEP_CONDITIONINGS",
    "shifted_sigmas",
    "flux_mu",
    "exponential_time_shift",
    "flux_dynamic_sigmas",
    "validate_sigmas",
]


def time_shift(sigmas: torch.Tensor | Sequence[float] | float, shift: float) -> torch.Tensor:
    """SD3-style fixed time shift (docs/api.md §1).

    ``sigma' = s * sigma / (1 + (s - 1) * sigma)``. Maps 0 -> 0 and 1 -> 1; ``s > 1`` spends more
    steps at high noise. Returns a float32 tensor of the input's shape.
    """
    if not (isinstance(shift, (int, float)) and math.isfinite(shift) and shift > 0):
        raise ValueError(f"shift must be a finite number > 0, got {shift!r}")
    t = torch.as_tensor(sigmas, dtype=torch.float64)
    return (shift * t / (1.0 + (shift - 1.0) * t)).to(torch.float32)


def shifted_sigmas(num_steps: int, shift: float = 3.0) -> torch.Tensor:
    """``linspace(1, 0, N + 1)`` with the fixed time shift: float32 ``[N + 1]``, last exactly 0.

    docs/api.md §1 reference (N = 16, s = 3): [1.0, .97826, .95455, ..., .16667, 0].
    """
    n = positive_int(num_steps, "num_steps")
    sig = time_shift(torch.linspace(1.0, 0.0, n + 1, dtype=torch.float64), shift)
    sig[-1] = 0.0
    return sig


def flux_mu(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """FLUX's resolution-dependent shift parameter (docs/api.md §1).

    Linear interpolation through ``(base_seq_len, base_shift)`` and ``(max_seq_len, max_shift)``:
    ``mu = base_shift + (image_seq_len - base_seq_len) * (max_shift - base_shift) /
    (max_seq_len - base_seq_len)`` (extrapolates outside the interval, as FLUX does).
    ``image_seq_len`` is the number of packed latent tokens, e.g. ``(H / 16) * (W / 16)``.
    """
    if max_seq_len == base_seq_len:
        raise ValueError(
            f"max_seq_len and base_seq_len must differ, both are {max_seq_len}"
        )
    if image_seq_len <= 0:
        raise ValueError(f"image_seq_len must be > 0, got {image_seq_len!r}")
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return float(base_shift + m * (image_seq_len - base_seq_len))


def exponential_time_shift(sigmas: torch.Tensor | Sequence[float], mu: float) -> torch.Tensor:
    """FLUX's exponential time shift ``exp(mu) / (exp(mu) + (1 / sigma - 1))``; maps 0 -> 0.

    Equivalent to the fixed shift with ``s = exp(mu)``. Returns float32.
    """
    t = torch.as_tensor(sigmas, dtype=torch.float64)
    e = math.exp(mu)
    safe = torch.where(t > 0, t, torch.ones_like(t))
    out = torch.where(t > 0, e / (e + (1.0 / safe - 1.0)), torch.zeros_like(t))
    return out.to(torch.float32)


def flux_dynamic_sigmas(
    num_steps: int,
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> torch.Tensor:
    """FLUX's dynamic schedule: ``linspace(1, 0, N + 1)`` with the exponential shift at
    ``mu = flux_mu(image_seq_len, ...)``; float32 ``[N + 1]``, terminal exactly 0.

    Matches diffusers' ``FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)`` given
    ``sigmas = linspace(1, 1/N, N)`` and that ``mu`` (docs/api.md §1).
    """
    n = positive_int(num_steps, "num_steps")
    mu = flux_mu(image_seq_len, base_seq_len, max_seq_len, base_shift, max_shift)
    sig = exponential_time_shift(torch.linspace(1.0, 0.0, n + 1, dtype=torch.float64), mu)
    sig[-1] = 0.0
    return sig


def validate_sigmas(sigmas: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """Check a schedule and return it as a float32 CPU-or-same-device tensor ``[N + 1]``.

    Requirements (docs/api.md §1): 1-D with at least 2 entries, finite, strictly
    decreasing, ``0 < sigmas[0] <= 1`` and ``sigmas[-1] == 0`` exactly.
    """
    t = torch.as_tensor(sigmas)
    if t.is_floating_point() or t.dtype in (torch.int32, torch.int64):
        t = t.to(torch.float32)
    else:
        raise ValueError(f"sigmas must be real numbers, got dtype {t.dtype}")
    if t.ndim != 1 or t.numel() < 2:
        raise ValueError(
            f"sigmas must be a 1-D schedule of N + 1 >= 2 values, got shape {tuple(t.shape)}"
        )
    if not torch.isfinite(t).all():
        raise ValueError("sigmas must be finite, got NaN or inf")
    if not bool((t[1:] < t[:-1]).all()):
        bad = int(torch.nonzero(t[1:] >= t[:-1])[0])
        raise ValueError(
            "sigmas must be strictly decreasing (noise 1 -> data 0), but "
            f"sigmas[{bad}] = {float(t[bad])} <= sigmas[{bad + 1}] = {float(t[bad + 1])}"
        )
    if float(t[0]) > 1.0:
        raise ValueError(f"sigmas must start at a value <= 1, got sigmas[0] = {float(t[0])}")
    if float(t[-1]) != 0.0:
        raise ValueError(f"sigmas must end exactly at 0, got sigmas[-1] = {float(t[-1])}")
    return t


#: How a model adapter feeds sigma to its network (``timestep_conditioning``).
TIMESTEP_CONDITIONINGS = ("exact", "truncated_1000")


def conditioning_timestep(sigma: torch.Tensor, mode: str = "exact") -> torch.Tensor:
    """The sigma a network is conditioned on: ``"exact"`` (diffusers' pipelines, flowrl's
    default) returns ``sigma`` unchanged; ``"truncated_1000"`` returns
    ``floor(float32(sigma) * 1000) / 1000`` in float32, the ``int(sigma * 1000) / 1000`` that
    GCPO, DanceGRPO and MixGRPO feed their FLUX transformer (the kernel maths keeps the exact
    sigma). Applied identically at rollout and training, it is part of the policy."""
    if mode not in TIMESTEP_CONDITIONINGS:
        raise ValueError(f"timestep conditioning must be one of {TIMESTEP_CONDITIONINGS}, got {mode!r}")
    if mode == "exact":
        return sigma
    s = torch.as_tensor(sigma)
    return (torch.floor(s.to(torch.float32) * 1000.0) / 1000.0).to(s.dtype)
