"""Built-in SDE step kernels: flow (a), dance (eta), ode and cps (algorithms.md section 2)."""

from __future__ import annotations

import dataclasses

from flowrl import hookimpl
from flowrl.config import param


@dataclasses.dataclass(frozen=True)
class FlowConfig:
    a: float = param(
        0.7,
        "Noise level a of g(sigma) = a sqrt(sigma / (1 - sigma)); the first step's std is exactly a. "
        "0.7 in GCPO/MixGRPO/Flow-GRPO SD3, 0.9 in Flow-GRPO FLUX (their 'eta' is this a).",
        min=0.0,
    )


@dataclasses.dataclass(frozen=True)
class DanceConfig:
    eta: float = param(0.3, "Constant diffusion coefficient g = eta (DanceGRPO's flux_step).", min=0.0)


@dataclasses.dataclass(frozen=True)
class CPSConfig:
    a: float = param(
        0.7, "Coefficients-preserving sampling noise: s = sigma_next sin(a pi / 2). 0 = Euler.", min=0.0, max=1.0
    )


def _flow(config: FlowConfig):
    """Flow-GRPO's SDE: g = a sqrt(sigma / (1 - sigma)) (also MixGRPO, GCPO)."""
    from flowrl.sde import FlowKernel

    return FlowKernel(a=config.a)


def _dance(config: DanceConfig):
    """DanceGRPO's SDE: constant g = eta."""
    from flowrl.sde import DanceKernel

    return DanceKernel(eta=config.eta)


def _ode():
    """Deterministic Euler step (no noise; not trainable)."""
    from flowrl.sde import ODEKernel

    return ODEKernel()


def _cps(config: CPSConfig):
    """Coefficients-preserving sampling (Flow-GRPO-Fast), with a true Gaussian log-prob."""
    from flowrl.sde import CPSKernel

    return CPSKernel(a=config.a)


@hookimpl(trylast=True)
def register_kernels(register):
    register("flow", _flow, params=FlowConfig)
    register("dance", _dance, params=DanceConfig)
    register("ode", _ode)
    register("cps", _cps, params=CPSConfig)


@hookimpl(trylast=True)
def default_component(kind):
    return "flow" if kind == "kernel" else None
