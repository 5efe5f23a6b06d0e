"""Built-in ``[likelihood]`` components: where a ratio-based loss reads a sample's log-likelihood
(docs/objectives.md, "The likelihood estimator").

- ``trajectory`` (the default): the SDE transitions' Gaussian log-probs, re-scored along the stored
  trajectory; units are the chunker's steps, chunks or the sequence (the GRPO family as before).
- ``elbo``: the final image's flow-matching ELBO over ``timesteps`` forward-noised copies, the
  points seeded and shared by the old and the new policy (:mod:`flowrl.objectives.elbo`); no
  trajectory log-probs, so ODE rollouts with few steps. Rollouts are drawn with a trailing old
  policy (NFT's decay types).

A likelihood turns the recipe's ``[loss]`` into the objective the update runs
(``objective(loss)``) and refuses, with one message, a loss it cannot serve: an objective that
owns its update (``nft``, ``awm``, ``dpo``, ...) has its own likelihood; GRPO-Guard reads the
rollout's per-step Gaussian means, which an ELBO does not have; ``vgrpo`` is defined on the ELBO
only. Flow-DPPO runs on either: on the ELBO its trust region is measured at the ELBO's points
(:mod:`flowrl.objectives.elbo`).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from flowrl import hookimpl
from flowrl.config import param
from flowrl.interfaces import KeepsRolloutMeans, KLRegularised, Objective
from flowrl.objectives.dppo import KLMaskedPolicyGradient
from flowrl.objectives.elbo import ElboPolicyGradient

#: the ratio losses that run on either estimator, for the messages
RATIO_LOSSES = "clipped, epg, pepg, par, dppo"


class TrajectoryLikelihood:
    """The SDE trajectory's transition log-probs (the ratio-based family's own)."""

    name = "trajectory"

    def objective(self, loss):
        if getattr(loss, "requires_likelihood", "trajectory") != "trajectory":
            raise ValueError(f"this loss is defined on the {loss.requires_likelihood} likelihood of the final image, "
                             "not on the trajectory's log-probs")
        return loss


@dataclasses.dataclass(frozen=True)
class ElboConfig:
    timesteps: int = param(
        9, "Points (sigma, noise) per sample, on the sampling schedule's sigmas without 0 (the Rethinking code: "
        "9 of 10 steps).", min=1)
    weighting: Literal["adaptive", "uniform", "sigma", "exact"] = param(
        "adaptive", "Weighting of each point's error: 'adaptive' = mean((x0_hat - x0)^2) / sg(mean|x0_hat - x0|) "
        "(the Rethinking code's default), 'uniform' = the velocity MSE, 'sigma' = the x0 MSE, 'exact' = "
        "(1 - sigma) / (sigma + 1e-3) x the velocity MSE.")
    units: Literal["point", "sample"] = param(
        "point", "What one ratio covers: each point (the Rethinking code's per-timestep loss) or the whole sample "
        "(the mean of its points' log-ratios: V-GRPO's one action per generation).")
    noise: Literal["sample", "group"] = param(
        "sample", "Points drawn per sample, or shared by every sample of a prompt group (V-GRPO's group-shared "
        "timestep-noise pairs).")
    stratified: bool = param(False, "One sigma per stratum of the schedule (V-GRPO) instead of a random subset.")
    decay_type: Literal[0, 1, 2] = param(
        1, "Old policy after each rollout (it draws the rollouts and scores the ratios' denominators): 0 = the "
        "trained weights, 1 = decay min(0.001 step, 0.5), 2 = 0 for 75 steps then min(0.0075 (step - 75), 0.999) "
        "(NFT's types; the Rethinking scripts use 1). While the old weights equal the trained ones their forward "
        "is skipped.")
    beta_kl: float = param(0.0, "Weight of mean((v - v_ref)^2) to the reference model (the Rethinking scripts' "
                           "Girsanov KL: 1e-4).", min=0.0)


class ElboLikelihood:
    """The final image's flow-matching ELBO (:mod:`flowrl.objectives.elbo`)."""

    name = "elbo"
    Config = ElboConfig
    algorithm = ("policy optimisation on the final image's ELBO likelihood",
                 "Rethinking the Design Space of RL for Diffusion Models, ICML 2026")

    def __init__(self, config: ElboConfig):
        self.config = config

    def objective(self, loss):
        if isinstance(loss, KLMaskedPolicyGradient):
            # Flow-DPPO: its unit objective, with the trust region measured at the ELBO's points
            loss = loss.loss
        elif isinstance(loss, Objective):
            raise ValueError("this loss owns its update and estimates its own likelihood; [likelihood] use = 'elbo' "
                             f"serves the ratio losses ({RATIO_LOSSES}, vgrpo)")
        elif isinstance(loss, KeepsRolloutMeans) and loss.keep_means:
            raise ValueError("this loss reads the rollout's per-step Gaussian means, which the final image's ELBO "
                             f"does not have; use [likelihood] use = 'trajectory', or one of {RATIO_LOSSES}, vgrpo")
        if isinstance(loss, KLRegularised) and float(loss.beta or 0.0) > 0:
            raise ValueError(f"the loss's KL term (beta = {loss.beta}) is a trajectory KL; under the ELBO the KL to "
                             "the reference is [likelihood].beta_kl (set the loss's beta = 0)")
        c = self.config
        return ElboPolicyGradient(loss, timesteps=c.timesteps, weighting=c.weighting, units=c.units, noise=c.noise,
                                  stratified=c.stratified, decay_type=c.decay_type, beta_kl=c.beta_kl)


@hookimpl(trylast=True)
def register_likelihoods(register):
    register("trajectory", TrajectoryLikelihood)
    register("elbo", ElboLikelihood)


@hookimpl(trylast=True)
def default_component(kind):
    return "trajectory" if kind == "likelihood" else None
