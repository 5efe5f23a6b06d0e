"""Built-in SDE step kernels: flow (a), dance (eta), ode and cps (docs/api.md, kernels).

Each kernel class in :mod:`flowrl.sampling.kernels` is a frozen dataclass whose fields are its recipe keys,
so the class is registered as its own params: the validated params ARE the kernel.
"""

from __future__ import annotations

from flowrl import hookimpl
from flowrl.sampling.kernels import CPSKernel, DanceKernel, FlowKernel, ODEKernel


def _kernel(params):
    """The validated ``[kernel]`` table is the kernel itself."""
    return params


@hookimpl(trylast=True)
def register_kernels(register):
    register("flow", _kernel, params=FlowKernel, help="Flow-GRPO's SDE: g = a sqrt(sigma / (1 - sigma)) (also MixGRPO, GCPO).")
    register("dance", _kernel, params=DanceKernel, help="DanceGRPO's SDE: constant g = eta.")
    register("ode", ODEKernel, help="Deterministic Euler step (no noise; not trainable).")
    register("cps", _kernel, params=CPSKernel,
             help="Coefficients-preserving sampling (Flow-GRPO-Fast), Gaussian or anchor log-prob.")


@hookimpl(trylast=True)
def default_component(kind):
    return "flow" if kind == "kernel" else None
