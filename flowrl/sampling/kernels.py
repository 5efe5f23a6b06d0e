"""Stochastic step kernels and transition log-probabilities (docs/api.md §2, §3).

Every stochastic kernel is a Gaussian ``p(x_{i+1} | x_i) = N(mu_i, s_i^2 I)``. With
``dt = sigma_next - sigma < 0``, ``x0_hat = x - sigma * v`` and ``x1_hat = x + (1 - sigma) * v``
(docs/api.md §1), the SDE kernels share (section 2)::

    mu = x + dt * [ v + (g^2 / (2 sigma)) * x1_hat ]
    s  = g * sqrt(sigma - sigma_next)

and differ in the diffusion coefficient ``g``:

- ``flow`` (Flow-GRPO 'sde', MixGRPO, GCPO): ``g = a * sqrt(sigma / (1 - sigma))``; at
  ``sigma = 1`` the denominator uses ``1 - sigma_next`` so the first step's std is exactly ``a``.
- ``dance`` (DanceGRPO): ``g = eta``, constant.
- ``ode``: ``g = 0``, plain Euler ``x + dt * v``; std 0, log-prob 0, never trainable.
- ``cps`` (Coefficients-Preserving Sampling) is a different Gaussian:
  ``s = sigma_next * sin(a pi / 2)``,
  ``mu = (1 - sigma_next) * x0_hat + sqrt(sigma_next^2 - s^2) * x1_hat``; ``a = 0`` is Euler.

Every step function computes in float32 (inputs are upcast), and either SAMPLES (``next_sample
is None``: ``x' = mu + s * noise`` with noise from ``generator``) or SCORES a given
``next_sample`` (detached; ``mu`` carries the gradient). ``sigma`` / ``sigma_next`` may be python
floats, 0-d tensors or per-sample tensors ``[B]``. ``generator`` may be one ``torch.Generator``
(noise for the whole batch from one stream) or a list of ``B`` generators (sample ``b`` draws
from ``generator[b]``, so its noise does not depend on the batch composition).

A step whose std is 0 (noise parameter 0, or ``cps`` stepping to ``sigma_next = 0``) is
deterministic and reports log-prob 0 for that sample.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import ClassVar, Literal, Union

import torch

from flowrl.config import param

__all__ = [
    "StepOutput",
    "GeneratorArg",
    "gaussian_log_prob",
    "draw_noise",
    "flow_diffusion",
    "flow_step",
    "dance_step",
    "ode_step",
    "cps_step",
    "kernel_std",
    "FlowKernel",
    "DanceKernel",
    "ODEKernel",
    "CPSKernel",
]

GeneratorArg = Union[torch.Generator, Sequence[torch.Generator], None]

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)
_REDUCTIONS = ("mean", "sum")


@dataclass(frozen=True)
class StepOutput:
    """Result of one kernel step.

    Attributes:
        next_sample: ``[B, ...]`` float32, the sampled (or the given, detached) ``x_{i+1}``.
        log_prob: ``[B]`` float32, ``l_i`` of section 3 (0 for deterministic samples).
        mean: ``[B, ...]`` float32, ``mu_i``; carries the gradient of the velocity.
        std: ``[B]`` float32, ``s_i`` per sample (no gradient: it depends on sigmas only).
    """

    next_sample: torch.Tensor
    log_prob: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor


# --------------------------------------------------------------------------------------------
# helpers


def kernel_std(kernel, sigma, sigma_next) -> torch.Tensor:
    """float32 ``[n]``: the std of ``kernel``'s Gaussian step from ``sigma`` to ``sigma_next``
    (``[n]`` each). The std depends on the sigmas only (:class:`StepOutput`), so it is read off a
    step on a one-element zero state, with no model call."""
    sig = torch.as_tensor(sigma, dtype=torch.float32).reshape(-1).cpu()
    zero = torch.zeros(sig.numel(), 1)
    out = kernel.step(zero, zero, sig, torch.as_tensor(sigma_next, dtype=torch.float32).reshape(-1).cpu(),
                      next_sample=zero)
    return torch.as_tensor(out.std, dtype=torch.float32).reshape(-1)


def _check_reduction(reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")


def _per_sample(value, batch: int, device, name: str) -> torch.Tensor:
    """A python float, 0-d tensor or ``[B]`` tensor -> float32 ``[B]`` on ``device``."""
    t = torch.as_tensor(value, dtype=torch.float32, device=device)
    if t.ndim == 0:
        return t.expand(batch).clone()
    t = t.reshape(-1) if t.ndim > 1 and t.numel() == batch else t
    if t.ndim != 1 or t.shape[0] != batch:
        raise ValueError(
            f"{name} must be a float, a 0-d tensor or a tensor [B] with B = {batch}, "
            f"got shape {tuple(t.shape)}"
        )
    return t


def _bcast(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """``[B]`` -> ``[B, 1, ..., 1]`` with ``ndim`` dims."""
    return t.reshape(t.shape[0], *([1] * (ndim - 1)))


def std_like(std, x: torch.Tensor) -> torch.Tensor:
    """std rule of :func:`gaussian_log_prob`: a 1-D std is per-sample, else broadcastable."""
    s = torch.as_tensor(std, dtype=torch.float32, device=x.device)
    if s.ndim == 1 and x.ndim > 1:
        if s.shape[0] != x.shape[0]:
            raise ValueError(
                f"a 1-D std is per-sample and must have B = {x.shape[0]} entries, "
                f"got {s.shape[0]}"
            )
        s = _bcast(s, x.ndim)
    try:
        torch.broadcast_shapes(s.shape, x.shape)
    except RuntimeError as exc:
        raise ValueError(
            f"std of shape {tuple(s.shape)} does not broadcast to x of shape {tuple(x.shape)}"
        ) from exc
    return s


def _reduce(elem: torch.Tensor, reduction: str) -> torch.Tensor:
    flat = elem.reshape(elem.shape[0], -1)
    return flat.mean(dim=1) if reduction == "mean" else flat.sum(dim=1)


def gaussian_log_prob(
    x: torch.Tensor, mean: torch.Tensor, std, reduction: str = "mean"
) -> torch.Tensor:
    """Per-sample Gaussian log-density of ``x`` under ``N(mean, std^2 I)`` (docs/api.md §3).

    ``l = reduce over the D non-batch elements of [ -(x - mean)^2 / (2 std^2) - log std
    - 0.5 log(2 pi) ]`` where ``reduce`` is ``mean`` (default; every anchor's choice, so the
    ratio is the true ratio to the power 1/D) or ``sum`` (the true log-density).

    Args:
        x: ``[B, ...]`` the point to score. Used as given (detach it yourself if needed).
        mean: ``[B, ...]`` (or broadcastable); carries the gradient.
        std: float, 0-d tensor, per-sample ``[B]`` tensor, or a tensor broadcastable to ``x``
            with ``x.ndim`` dims. Must be > 0.
        reduction: ``"mean"`` or ``"sum"``.

    Returns:
        float32 ``[B]``.
    """
    _check_reduction(reduction)
    if x.ndim < 1:
        raise ValueError("x must have a batch dimension, got a 0-d tensor")
    x = x.to(torch.float32)
    mean = mean.to(torch.float32)
    s = std_like(std, x)
    if not bool((s > 0).all()):
        raise ValueError("std must be > 0 everywhere for a Gaussian log-prob")
    elem = -((x - mean) ** 2) / (2.0 * s**2) - torch.log(s) - _HALF_LOG_2PI
    elem = elem.expand(torch.broadcast_shapes(elem.shape, x.shape))
    return _reduce(elem, reduction)


def draw_noise(
    shape: Sequence[int], generator: GeneratorArg, device, dtype=torch.float32
) -> torch.Tensor:
    """Standard normal noise ``[B, ...]``.

    ``generator`` is None (global RNG), one ``torch.Generator`` (one stream for the whole
    batch), or a sequence of ``B`` generators (sample ``b`` draws ``shape[1:]`` from
    ``generator[b]``, independent of the batch composition). Noise is drawn on the generator's
    device and moved to ``device``.
    """
    shape = tuple(int(d) for d in shape)
    if generator is None or isinstance(generator, torch.Generator):
        gen_device = generator.device if generator is not None else device
        return torch.randn(shape, generator=generator, device=gen_device, dtype=dtype).to(device)
    gens = list(generator)
    if len(gens) != shape[0]:
        raise ValueError(
            f"a list of generators needs one per sample: got {len(gens)} for batch {shape[0]}"
        )
    return torch.stack(
        [torch.randn(shape[1:], generator=g, device=g.device, dtype=dtype).to(device) for g in gens]
    )


def _finish(
    mean: torch.Tensor,
    std: torch.Tensor,
    next_sample: torch.Tensor | None,
    generator: GeneratorArg,
    reduction: str,
    log_prob_fn=None,
) -> StepOutput:
    """Sample or score ``N(mean, std^2)``; std is ``[B]``; std 0 -> deterministic, log-prob 0."""
    b = mean.shape[0]
    s = _bcast(std, mean.ndim)
    if next_sample is None:
        noise = draw_noise(mean.shape, generator, mean.device)
        nxt = (mean + s * noise).detach()
    else:
        if next_sample.shape != mean.shape:
            raise ValueError(
                f"next_sample has shape {tuple(next_sample.shape)}, expected {tuple(mean.shape)}"
            )
        nxt = next_sample.detach().to(torch.float32)
    positive = std > 0
    if bool(positive.all()):
        lp = (log_prob_fn or gaussian_log_prob)(nxt, mean, std, reduction)
    elif not bool(positive.any()):
        lp = torch.zeros(b, dtype=torch.float32, device=mean.device)
    else:
        safe = torch.where(positive, std, torch.ones_like(std))
        lp = (log_prob_fn or gaussian_log_prob)(nxt, mean, safe, reduction)
        lp = torch.where(positive, lp, torch.zeros_like(lp))
    return StepOutput(next_sample=nxt, log_prob=lp, mean=mean, std=std.detach())


def _prepare(velocity, sample, sigma, sigma_next):
    if velocity.shape != sample.shape:
        raise ValueError(
            f"velocity has shape {tuple(velocity.shape)}, expected the sample's "
            f"{tuple(sample.shape)}"
        )
    if sample.ndim < 2:
        raise ValueError(f"sample must be [B, ...] with at least 2 dims, got {tuple(sample.shape)}")
    v = velocity.to(torch.float32)
    x = sample.to(torch.float32)
    b = x.shape[0]
    sig = _per_sample(sigma, b, x.device, "sigma")
    sig_n = _per_sample(sigma_next, b, x.device, "sigma_next")
    if not bool((sig_n < sig).all()):
        raise ValueError("sigma_next must be < sigma (sigmas decrease from noise 1 to data 0)")
    if not bool((sig <= 1).all()) or not bool((sig_n >= 0).all()):
        raise ValueError("sigmas must lie in [0, 1]")
    return v, x, sig, sig_n


def _sde_mean_std(v, x, sig, sig_n, g):
    """Shared SDE Gaussian of section 2 for a per-sample diffusion coefficient g [B]."""
    nd = x.ndim
    dt = _bcast(sig_n - sig, nd)
    s_ = _bcast(sig, nd)
    x1_hat = x + (1.0 - s_) * v
    mean = x + dt * (v + (_bcast(g, nd) ** 2 / (2.0 * s_)) * x1_hat)
    std = g * torch.sqrt(sig - sig_n)
    return mean, std


def _sde_step(velocity, sample, sigma, sigma_next, diffusion, next_sample, generator, reduction) -> StepOutput:
    """The SDE step of section 2 for the diffusion coefficient ``g = diffusion(sigma, sigma_next)``
    (per-sample float32 ``[B]`` sigmas in, ``g [B]`` out)."""
    _check_reduction(reduction)
    v, x, sig, sig_n = _prepare(velocity, sample, sigma, sigma_next)
    mean, std = _sde_mean_std(v, x, sig, sig_n, diffusion(sig, sig_n))
    return _finish(mean, std, next_sample, generator, reduction)


def _check_noise(value: float, name: str) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


# --------------------------------------------------------------------------------------------
# step functions


def flow_diffusion(sigma: torch.Tensor, sigma_next: torch.Tensor, a: float) -> torch.Tensor:
    """``g = a * sqrt(sigma / (1 - sigma))``, with ``1 - sigma_next`` when ``sigma >= 1``."""
    denom = 1.0 - torch.where(sigma >= 1.0, sigma_next, sigma)
    return a * torch.sqrt(sigma / denom)


def flow_step(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma,
    sigma_next,
    *,
    a: float,
    next_sample: torch.Tensor | None = None,
    generator: GeneratorArg = None,
    reduction: str = "mean",
) -> StepOutput:
    """Flow-GRPO 'sde' kernel (also MixGRPO / GCPO "eta"): section 2 with
    ``g = a * sqrt(sigma / (1 - sigma))`` (``1 - sigma_next`` in the denominator at
    ``sigma = 1``, so the first step's std is exactly ``a``). See the module docstring for
    sampling vs scoring, shapes and generators."""
    _check_noise(a, "a")
    return _sde_step(velocity, sample, sigma, sigma_next, lambda sig, sig_n: flow_diffusion(sig, sig_n, a),
                     next_sample, generator, reduction)


def dance_step(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma,
    sigma_next,
    *,
    eta: float,
    next_sample: torch.Tensor | None = None,
    generator: GeneratorArg = None,
    reduction: str = "mean",
) -> StepOutput:
    """DanceGRPO kernel: section 2 with constant ``g = eta``; std ``eta * sqrt(sigma -
    sigma_next)``."""
    _check_noise(eta, "eta")
    return _sde_step(velocity, sample, sigma, sigma_next, lambda sig, sig_n: torch.full_like(sig, float(eta)),
                     next_sample, generator, reduction)


def ode_step(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma,
    sigma_next,
    *,
    next_sample: torch.Tensor | None = None,
    generator: GeneratorArg = None,
    reduction: str = "mean",
) -> StepOutput:
    """Deterministic Euler step ``x + dt * v`` (section 2, ``g = 0``): std 0, log-prob zeros.

    Not trainable. With ``next_sample`` given it is returned (detached) unchanged;
    ``generator`` is accepted for a uniform signature and never used.
    """
    _check_reduction(reduction)
    v, x, sig, sig_n = _prepare(velocity, sample, sigma, sigma_next)
    mean = x + _bcast(sig_n - sig, x.ndim) * v
    std = torch.zeros_like(sig)
    if next_sample is None:
        nxt = mean.detach()
    else:
        if next_sample.shape != mean.shape:
            raise ValueError(
                f"next_sample has shape {tuple(next_sample.shape)}, expected {tuple(mean.shape)}"
            )
        nxt = next_sample.detach().to(torch.float32)
    lp = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    return StepOutput(next_sample=nxt, log_prob=lp, mean=mean, std=std)


_CPS_LOG_PROBS = ("gaussian", "anchor")


def _cps_anchor_log_prob(x, mean, std, reduction):
    # The anchor's CPS "log-prob": -(x' - mu)^2 reduced, without 1/(2 s^2), -log s, constants.
    return _reduce(-((x - mean) ** 2), reduction)


def cps_step(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma,
    sigma_next,
    *,
    a: float,
    next_sample: torch.Tensor | None = None,
    generator: GeneratorArg = None,
    reduction: str = "mean",
    log_prob: str = "gaussian",
) -> StepOutput:
    """Coefficients-Preserving Sampling (Flow-GRPO-Fast; docs/api.md §2).

    ``s = sigma_next * sin(a pi / 2)``,
    ``mu = (1 - sigma_next) * x0_hat + sqrt(sigma_next^2 - s^2) * x1_hat``. ``a`` in [0, 1];
    ``a = 0`` is exactly Euler. At ``sigma_next = 0`` the std is 0: deterministic, log-prob 0.

    ``log_prob="gaussian"`` (default) is the true Gaussian log-prob of section 3.
    ``log_prob="anchor"`` reproduces the anchor's variant ``-reduce((x' - mu)^2)``: it drops
    ``1/(2 s^2)``, ``-log s`` and constants, so ``exp`` of its difference is NOT a likelihood
    ratio (its differences are ``2 s^2`` times larger; the anchor pairs it with clip 1e-5).
    """
    _check_noise(a, "a")
    if a > 1:
        raise ValueError(f"cps noise parameter a must be in [0, 1], got {a!r}")
    _check_reduction(reduction)
    if log_prob not in _CPS_LOG_PROBS:
        raise ValueError(f"log_prob must be one of {_CPS_LOG_PROBS}, got {log_prob!r}")
    v, x, sig, sig_n = _prepare(velocity, sample, sigma, sigma_next)
    nd = x.ndim
    s_ = _bcast(sig, nd)
    x0_hat = x - s_ * v
    x1_hat = x + (1.0 - s_) * v
    std = sig_n * math.sin(a * math.pi / 2.0)
    coef = torch.sqrt(torch.clamp(sig_n**2 - std**2, min=0.0))
    mean = _bcast(1.0 - sig_n, nd) * x0_hat + _bcast(coef, nd) * x1_hat
    fn = _cps_anchor_log_prob if log_prob == "anchor" else None
    return _finish(mean, std, next_sample, generator, reduction, log_prob_fn=fn)


# --------------------------------------------------------------------------------------------
# kernels: a step function with its noise parameter, as a recipe component
#
# Each class is a frozen dataclass whose fields ARE the recipe keys of ``[kernel]`` (documented
# once, here): the built-in plugin registers the class as its own params. Every class
# implements :class:`flowrl.interfaces.Kernel`; what they share is in :class:`_StepKernel`.


class _StepKernel:
    """A step function as a kernel: ``step`` calls it with the kernel's fields as keywords.

    A subclass is a frozen dataclass naming its step function (``_step_fn``) and the field that
    sets its noise level (``_noise``, None for a deterministic kernel); the step function takes
    every field of the dataclass as a keyword argument. The kernel is stochastic when its noise
    level is > 0.
    """

    _step_fn: ClassVar[Callable[..., StepOutput]]
    _noise: ClassVar[str | None] = None

    def __post_init__(self):
        if self._noise is not None:
            _check_noise(getattr(self, self._noise), self._noise)

    @property
    def is_stochastic(self) -> bool:
        return self._noise is not None and getattr(self, self._noise) > 0

    def stochastic_at(self, sigma: float, sigma_next: float) -> bool:
        return self.is_stochastic

    def step(self, velocity, sample, sigma, sigma_next, *, next_sample=None, generator=None,
             reduction="mean") -> StepOutput:
        params = {f.name: getattr(self, f.name) for f in fields(self)}
        return self._step_fn(velocity, sample, sigma, sigma_next, next_sample=next_sample, generator=generator,
                             reduction=reduction, **params)


@dataclass(frozen=True)
class FlowKernel(_StepKernel):
    """``flow`` kernel (Flow-GRPO 'sde', MixGRPO, GCPO): ``g = a sqrt(sigma / (1 - sigma))``;
    see :func:`flow_step`."""

    a: float = param(
        0.7,
        "Noise level a of g(sigma) = a sqrt(sigma / (1 - sigma)); the first step's std is exactly a. "
        "0.7 in GCPO/MixGRPO/Flow-GRPO SD3, 0.9 in Flow-GRPO FLUX (their 'eta' is this a).",
        min=0.0,
    )
    name: ClassVar[str] = "flow"
    _step_fn = staticmethod(flow_step)
    _noise = "a"


@dataclass(frozen=True)
class DanceKernel(_StepKernel):
    """``dance`` kernel (DanceGRPO's flux_step): constant ``g = eta``; see :func:`dance_step`."""

    eta: float = param(0.3, "Constant diffusion coefficient g = eta (DanceGRPO's flux_step).", min=0.0)
    name: ClassVar[str] = "dance"
    _step_fn = staticmethod(dance_step)
    _noise = "eta"


@dataclass(frozen=True)
class ODEKernel(_StepKernel):
    """Deterministic Euler step (no noise; never trainable); see :func:`ode_step`."""

    name: ClassVar[str] = "ode"
    _step_fn = staticmethod(ode_step)


@dataclass(frozen=True)
class CPSKernel(_StepKernel):
    """Coefficients-preserving sampling (Flow-GRPO-Fast); see :func:`cps_step`."""

    a: float = param(
        0.7, "Coefficients-preserving sampling noise: s = sigma_next sin(a pi / 2). 0 = Euler.", min=0.0, max=1.0
    )
    log_prob: Literal["gaussian", "anchor"] = param(
        "gaussian",
        "'gaussian': the true Gaussian log-prob; 'anchor': Flow-GRPO-Fast's -(x' - mu)^2 without "
        "1/(2 s^2) (not a likelihood ratio; pair it with a clip range of about 1e-5).",
    )
    name: ClassVar[str] = "cps"
    _step_fn = staticmethod(cps_step)
    _noise = "a"

    def __post_init__(self):
        super().__post_init__()
        if self.a > 1:
            raise ValueError(f"cps noise parameter a must be in [0, 1], got {self.a!r}")
        if self.log_prob not in _CPS_LOG_PROBS:
            raise ValueError(f"log_prob must be one of {_CPS_LOG_PROBS}, got {self.log_prob!r}")

    def stochastic_at(self, sigma: float, sigma_next: float) -> bool:
        # a step to sigma_next = 0 has std sigma_next sin(a pi / 2) = 0
        return self.is_stochastic and float(sigma_next) > 0

    def flow_grpo_scale(self, std, sigma, sigma_next) -> torch.Tensor:
        """Flow-GRPO's ``std_dev_t`` for cps is the step std itself (its KL then equals the exact
        Gaussian KL), not ``std / sqrt(sigma - sigma_next)`` (flowrl.interfaces.ScalesFlowGRPOKL)."""
        return torch.as_tensor(std, dtype=torch.float32)
