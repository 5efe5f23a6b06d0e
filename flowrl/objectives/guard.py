"""GRPO-Guard's ratio normalisation and per-step gradient reweighting (docs/objectives.md).

For a Gaussian step ``x' = mu_old + s eps`` (the rollout's proposal mean ``mu_old``, step std
``s``) re-scored with the current policy's mean ``mu`` (``d = mu - mu_old``), the per-element
mean log-ratio is::

    r  = l_theta - l_old = mean(eps d) / s - mean(d^2) / (2 s^2)

Its mean over the noise is ``-mean(d^2) / (2 s^2) < 0`` (a "left shift", largest at low noise
where ``s`` is small) and its spread ``sqrt(mean(d^2) / D) / s`` grows as ``s`` shrinks, so one
clip range cannot suit every step. GRPO-Guard (arXiv 2510.22319, as implemented in flow_grpo)
removes the bias and rescales by ``s``::

    zh = s (r + mean(d^2) / (2 s^2)) = mean(eps d)       (mean 0, spread sqrt(mean(d^2) / D))

and multiplies each step's gradient by ``w = 1 / h`` (``h = sigma - sigma_next``). flowrl uses
``zh`` in place of ``r`` wherever a step log-ratio enters a unit's ratio, so at chunk level the
chunk's normalised log-ratio is ``mean_{i in chunk} zh_i`` and each step's gradient inside the
chunk is weighted by its ``w_i`` (:func:`reweighted`: the value is unchanged).

The bias here is per sample (``mean`` over one sample's elements), as in Flow-Factory and
verl-omni; flow_grpo's script averages it over the micro-batch (a ``mean(dim=())`` side effect),
which couples samples: see docs/objectives.md, "what differs".

:func:`guard_step_ratio` is the step transform the ``guard`` loss hands the policy gradient:
the re-scored step as a "log-prob" relative to the rollout's, with the ``1 / h`` reweighting.
"""

from __future__ import annotations

import torch

__all__ = ["guard_log_ratio", "gaussian_log_ratio", "guard_bias", "reweighted", "inverse_step_weight",
           "guard_step_ratio"]


def _reduce(elem: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    flat = elem.reshape(elem.shape[0], -1)
    return flat.mean(dim=1) if reduction == "mean" else flat.sum(dim=1)


def _per_sample_std(std, x: torch.Tensor) -> torch.Tensor:
    s = torch.as_tensor(std, dtype=torch.float32, device=x.device)
    if s.ndim == 0:
        s = s.expand(x.shape[0])
    if s.shape != (x.shape[0],):
        raise ValueError(f"std must be a number or [B] with B = {x.shape[0]}, got shape {tuple(s.shape)}")
    if not bool((s > 0).all()):
        raise ValueError("GRPO-Guard needs a stochastic step: std must be > 0 for every sample")
    return s.reshape(-1, *([1] * (x.ndim - 1)))


def guard_log_ratio(next_sample: torch.Tensor, mean: torch.Tensor, old_mean: torch.Tensor, std,
                    reduction: str = "mean") -> torch.Tensor:
    """The normalised step log-ratio ``zh = reduce(eps * d)`` ``[B]`` (float32), with
    ``eps = (x' - mu_old) / s`` (the rollout's noise) and ``d = mu - mu_old``; the gradient flows
    through ``mean`` (``mu``) only. Equals ``s (r + reduce(d^2) / (2 s^2))`` for the Gaussian
    log-ratio ``r`` of the same reduction (:func:`gaussian_log_ratio`)."""
    x = next_sample.detach().to(torch.float32)
    old = old_mean.detach().to(torch.float32)
    mu = mean.to(torch.float32)
    if not (x.shape == old.shape == mu.shape) or x.ndim < 2:
        raise ValueError(f"next_sample, mean and old_mean must be [B, ...] of one shape, got "
                         f"{tuple(x.shape)}, {tuple(mu.shape)}, {tuple(old.shape)}")
    s = _per_sample_std(std, x)
    eps = (x - old) / s
    return _reduce(eps * (mu - old), reduction)


def gaussian_log_ratio(next_sample: torch.Tensor, mean: torch.Tensor, old_mean: torch.Tensor, std,
                       reduction: str = "mean") -> torch.Tensor:
    """The raw step log-ratio ``r = l(x' | mu, s) - l(x' | mu_old, s)`` ``[B]`` written out:
    ``reduce(eps d) / s - reduce(d^2) / (2 s^2)`` (for diagnostics and tests)."""
    x = next_sample.detach().to(torch.float32)
    old = old_mean.detach().to(torch.float32)
    mu = mean.to(torch.float32)
    s = _per_sample_std(std, x)
    d = mu - old
    eps = (x - old) / s
    return _reduce(eps * d / s - d**2 / (2 * s**2), reduction)


def guard_bias(mean: torch.Tensor, old_mean: torch.Tensor, std, reduction: str = "mean") -> torch.Tensor:
    """``reduce(d^2) / (2 s^2)`` ``[B]``: minus the expected raw log-ratio over the rollout noise."""
    d = mean.to(torch.float32) - old_mean.detach().to(torch.float32)
    s = _per_sample_std(std, d)
    return _reduce(d**2 / (2 * s**2), reduction)


def reweighted(value: torch.Tensor, weight) -> torch.Tensor:
    """``value`` with its gradient multiplied by ``weight`` and its value unchanged:
    ``sg(v) + w (v - sg(v))``. ``weight`` is a number or broadcastable to ``value``."""
    w = torch.as_tensor(weight, dtype=value.dtype, device=value.device)
    detached = value.detach()
    return detached + w * (value - detached)


def inverse_step_weight(sigma, sigma_next) -> torch.Tensor:
    """GRPO-Guard's per-step gradient weight ``1 / h = 1 / (sigma - sigma_next)`` (float32)."""
    h = torch.as_tensor(sigma, dtype=torch.float32) - torch.as_tensor(sigma_next, dtype=torch.float32)
    if not bool((h > 0).all()):
        raise ValueError("sigma_next must be < sigma")
    return 1.0 / h


def guard_step_ratio(out, old, reduction: str | None = None, reweight: bool = True) -> torch.Tensor:
    """GRPO-Guard's re-scored step as a "log-prob" relative to the rollout's: ``l_old + zh`` with
    ``zh = reduce(eps * (mu - mu_old))`` (:func:`guard_log_ratio`) and its gradient
    scaled by ``1 / h`` (``reweight``). ``out``: the kernel's StepOutput with gradient, ``old``:
    the :class:`flowrl.sampling.trajectory.Position` (its ``mean`` kept at rollout).
    ``reduction`` defaults to the one ``old.log_prob`` was taken with (``[sampler]
    logprob_reduction``): ``zh`` is added to it, so both must reduce a sample's elements alike."""
    if old.mean is None:
        raise ValueError("GRPO-Guard needs the rollout's proposal means (keep_means)")
    zh = guard_log_ratio(old.next_sample, out.mean, old.mean, out.std, reduction or old.reduction)
    if reweight:
        zh = reweighted(zh, inverse_step_weight(old.sigma, old.sigma_next).to(zh.device))
    return old.log_prob.to(zh.device) + zh
