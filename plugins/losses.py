"""Built-in policy loss: the PPO/GRPO clipped surrogate per unit (docs/api.md, losses and KL)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from flowrl import hookimpl
from flowrl.config import param
from flowrl.losses import ClippedObjective


@dataclasses.dataclass(frozen=True)
class ClippedConfig:
    eps_low: float = param(
        5e-5, "Lower clip: ratios below 1 - eps_low stop contributing (GCPO 5e-5, DanceGRPO 1e-4, GSPO 3e-4).", min=0.0
    )
    eps_high: float = param(5e-5, "Upper clip: ratios above 1 + eps_high stop contributing (GSPO 4e-4).", min=0.0)
    beta: float = param(
        0.0,
        "Weight of the KL term (0 = none, the anchors' default). With beta > 0 the KL is added per "
        "trained transition and logged as kl/<kind>; approx_kl_old (to the rollout policy) is always logged.",
        min=0.0,
    )
    kl: Literal["gaussian_exact", "flow_grpo", "old_policy_k3"] = param(
        "gaussian_exact",
        "KL kind: 'gaussian_exact' = exact KL between the step Gaussians of policy and reference; "
        "'flow_grpo' = mean((mu - mu_ref)^2) / (2 g^2); 'old_policy_k3' = k3 estimator against the "
        "rollout (old) policy, no reference model (MixGRPO/GCPO's 'KL').",
    )
    kl_direction: Literal["old_theta", "theta_old"] = param(
        "old_theta",
        "Direction of 'old_policy_k3' (per step): 'old_theta' = e^z - 1 - z, KL(pi_old || pi_theta) from the "
        "rollout's samples; 'theta_old' = e^-z - 1 + z, GCPO's (and DeepSeekMath's) form. Same to second order.",
    )


class ClippedSurrogate:
    """max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high)) per unit (step, chunk or sequence)."""

    Config = ClippedConfig

    def __init__(self, config: ClippedConfig):
        self.config = config
        self.beta = config.beta
        self.kl = config.kl
        self.kl_direction = config.kl_direction
        self.objective = ClippedObjective(config.eps_low, config.eps_high)


@hookimpl(trylast=True)
def register_losses(register):
    register("clipped", ClippedSurrogate)


@hookimpl(trylast=True)
def default_component(kind):
    return "clipped" if kind == "loss" else None
