"""Deterministic ODE solvers for the steps outside an SDE window (docs/objectives.md, MixGRPO-Flash).

Flow matching's probability-flow ODE ``dx/dsigma = v`` with ``x_sigma = alpha x0 + sigma eps``,
``alpha = 1 - sigma``, is solved in DPM-Solver++'s data-prediction form. With
``lambda(sigma) = log(alpha / sigma)``, ``h_i = lambda(sigma_{i+1}) - lambda(sigma_i)``,
``D0 = x0_hat_i = x_i - sigma_i v_i``::

    first order (== Euler == DDIM):
        x_{i+1} = (sigma_{i+1} / sigma_i) x_i + alpha_{i+1} (1 - e^{-h_i}) D0
    second order multistep, 2M (midpoint form), with the previous step's x0_hat:
        r_i = h_{i-1} / h_i,   D1 = (x0_hat_i - x0_hat_{i-1}) / r_i
        x_{i+1} = (sigma_{i+1} / sigma_i) x_i + alpha_{i+1} (1 - e^{-h_i}) (D0 + D1 / 2)

First order is used when there is no previous prediction, when the previous step started at
``sigma = 1`` (``lambda = -inf``: ``r = inf``, ``D1 = 0`` in the limit, taken explicitly here)
and for the last step into ``sigma = 0`` (DPM-Solver++'s ``lower_order_final``; it returns
``x0_hat`` exactly). Everything is float32; sigmas are per-sample ``[B]`` or numbers.
"""

from __future__ import annotations

import math

import torch

__all__ = ["dpm_lambda", "dpm_first_order_step", "dpmpp_2m_step", "flash_schedule", "DPM2M", "OUTSIDE_SOLVERS"]

#: The name of the multistep solver in recipes (``outside = "dpm2m"``).
DPM2M = "dpm2m"
#: The solvers a rollout may use outside a sample's SDE window (Euler before it, one of these after).
OUTSIDE_SOLVERS = ("euler", DPM2M)


def _col(t, x: torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(t, dtype=torch.float32, device=x.device)
    if t.ndim == 0:
        t = t.expand(x.shape[0])
    return t.reshape(-1, *([1] * (x.ndim - 1)))


def dpm_lambda(sigma) -> torch.Tensor:
    """``lambda = log((1 - sigma) / sigma)`` (float32; ``-inf`` at sigma 1, ``+inf`` at 0)."""
    s = torch.as_tensor(sigma, dtype=torch.float32)
    return torch.log1p(-s) - torch.log(s)


def _decay(sigma, sigma_next, x) -> torch.Tensor:
    """``alpha_{i+1} (1 - e^{-h_i})`` written without infinities:
    ``alpha' - alpha sigma' / sigma``."""
    s, sn = _col(sigma, x), _col(sigma_next, x)
    return (1.0 - sn) - (1.0 - s) * sn / s


def dpm_first_order_step(x: torch.Tensor, x0_hat: torch.Tensor, sigma, sigma_next) -> torch.Tensor:
    """``x_{i+1} = (sigma'/sigma) x + alpha' (1 - e^{-h}) x0_hat`` (exactly Euler ``x + dt v``
    in exact arithmetic)."""
    x = x.to(torch.float32)
    return _col(sigma_next, x) / _col(sigma, x) * x + _decay(sigma, sigma_next, x) * x0_hat.to(torch.float32)


def dpmpp_2m_step(x: torch.Tensor, x0_hat: torch.Tensor, sigma: float, sigma_next: float,
                  prev_x0_hat: torch.Tensor | None = None, prev_sigma: float | None = None) -> torch.Tensor:
    """One DPM-Solver++(2M) step from ``sigma`` to ``sigma_next`` (numbers: the batch shares its
    schedule; module docstring); first order when ``prev_x0_hat`` is None, when ``prev_sigma``
    is 1, or into ``sigma_next = 0``. ``r = h_{i-1} / h_i`` is computed in float64."""
    s, sn = float(sigma), float(sigma_next)
    if not 0.0 <= sn < s <= 1.0:
        raise ValueError(f"need 0 <= sigma_next < sigma <= 1, got {sigma_next} and {sigma}")
    if prev_x0_hat is None or prev_sigma is None or float(prev_sigma) >= 1.0 or sn <= 0.0:
        return dpm_first_order_step(x, x0_hat, s, sn)
    sp = float(prev_sigma)
    if not s < sp:
        raise ValueError(f"the previous sigma must be above this one, got {sp} and {s}")

    def lam(v: float) -> float:
        return math.log((1.0 - v) / v)

    r = (lam(s) - lam(sp)) / (lam(sn) - lam(s))
    x0 = x0_hat.to(torch.float32)
    d1 = (x0 - prev_x0_hat.to(torch.float32)) / r
    return dpm_first_order_step(x, x0 + 0.5 * d1, s, sn)


def flash_schedule(sigmas: torch.Tensor, last: int, ratio: float, warp) -> torch.Tensor:
    """MixGRPO-Flash's schedule for a window ending at step ``last``: ``sigmas[0..last]`` (kept),
    then ``n_post = int(max((N - last) * ratio, 1))`` points ``warp(linspace(u, 0, n_post))``
    where ``u = 1 - (last + 1) / N`` is the uniform time of ``sigmas[last + 1]`` and ``warp`` maps
    uniform time to sigma (the run's schedule, e.g. the time shift). ``last + n_post`` steps
    in all. ``warp(u)`` must reproduce ``sigmas[last + 1]`` and ``n_post >= 2`` (one point would
    stop the trajectory before sigma 0, an anchor hazard); both are checked."""
    sig = torch.as_tensor(sigmas, dtype=torch.float32).flatten().cpu()
    n = sig.numel() - 1
    if not 0 <= last < n - 1:
        raise ValueError(f"the window must end before the last step: last = {last}, N = {n}")
    if not (isinstance(ratio, (int, float)) and 0 < ratio <= 1):
        raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
    n_post = int(max((n - last) * ratio, 1))
    if n_post < 2:
        raise ValueError(f"compression leaves {n_post} point after the window; raise the ratio so that "
                         f"int((N - last) * ratio) >= 2 (N = {n}, last = {last})")
    u = 1.0 - (last + 1) / n
    t = torch.linspace(u, 0.0, n_post, dtype=torch.float64)
    post = torch.as_tensor(warp(t), dtype=torch.float64).to(torch.float32)
    if not math.isclose(float(post[0]), float(sig[last + 1]), rel_tol=0, abs_tol=1e-5):
        raise ValueError(f"the time warp gives sigma {float(post[0]):.6f} at the window's end, but the schedule "
                         f"has {float(sig[last + 1]):.6f}: compression needs the run's own schedule")
    post[0] = sig[last + 1]
    post[-1] = 0.0
    return torch.cat([sig[: last + 1], post])
