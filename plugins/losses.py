"""Built-in ``[loss]`` components (docs/api.md, losses and KL; docs/objectives.md).

- ``clipped``: the PPO/GRPO clipped surrogate per unit (step, chunk or sequence).
- ``guard``: GRPO-Guard. The clipped surrogate on the normalised step log-ratio
  ``zh = mean(eps (mu - mu_old))`` with each step's gradient weighted by ``1 / h``; at chunk
  level a unit's log-ratio is the mean of its steps' ``zh``.
- ``gardo``: GARDO's anti-hacking regulariser: the clipped surrogate plus a KL to the reference
  on the samples whose proxy reward disagrees most with auxiliary rewards, with a reference
  that is reset to the current weights periodically.
- ``nft``: DiffusionNFT, likelihood-free: an :class:`flowrl.interfaces.Objective` that owns the
  backward (no trajectory log-probs, no chunks; any sampler, e.g. ``[window] use = "ode"``).
- ``awm``: AWM (Advantage Weighted Matching), likelihood-free: the flow-matching loss on the
  rollout's clean samples at fresh noise, weighted by their advantages (through a ratio to each
  point's anchor, clipped as PPO).
- ``dppo``: Flow-DPPO: the unclipped ratio surrogate, with a unit's gradient dropped where the
  exact Gaussian KL of its steps to the rollout policy exceeds a threshold and the ratio moves
  further in the advantage's direction (step or chunk units).
- ``dpo``: online Diffusion-DPO, likelihood-free: per prompt group the best and the worst sample
  form a pair, and the DPO loss is taken on their flow-matching errors against the frozen
  reference's at shared noise and sigma.
- ``dgpo``: DGPO, likelihood-free: DPO between the group's positive and negative samples, the
  advantage-weighted flow-matching loss weighted by the sigmoid of the group's preference margin.
- ``epg``, ``pepg``, ``par``: the policy-gradient losses of "Rethinking the Design Space of RL for
  Diffusion Models" (EPG: ``-sg(rho) A z``; PEPG: ``-sg(rho) (A - sg(z)) z``; PAR:
  ``sg(rho) (A - z)^2 / 2``), on either likelihood; the paper runs them with ``[likelihood] use = "elbo"``.
- ``vgrpo``: V-GRPO, the clipped ratio with soft-clipped advantages on one ELBO ratio per sample
  (needs ``[likelihood] use = "elbo"``).
- ``fdfo``: FDFO, finite-difference flow optimisation: paired rollouts from one starting noise, each
  sample's velocity pushed along its endpoint's half of the pair difference, weighted by its half
  of the reward difference (an SPO surrogate).
- ``sft`` and ``offline_dpo``: offline training from a ``[data]`` table instead of rollouts: the
  flow-matching loss on a table of images, or Diffusion-DPO on a table of preference pairs against
  the frozen reference.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from flowrl import hookimpl
from flowrl.config import param
from flowrl.objectives.awm import WEIGHTINGS, AdvantageWeightedMatching
from flowrl.objectives.dgpo import GroupPreference
from flowrl.objectives.dpo import OnlineDPO
from flowrl.objectives.dppo import KLMaskedPolicyGradient, KLMaskedSurrogate
from flowrl.objectives.fdfo import FiniteDifferenceObjective
from flowrl.objectives.gardo import GatedKLPolicyGradient
from flowrl.objectives.guard import guard_step_ratio
from flowrl.objectives.losses import ClippedObjective
from flowrl.objectives.nft import ForwardProcessObjective
from flowrl.objectives.offline import OfflineDPO, OfflineSFT
from flowrl.objectives.rethinking import EPGObjective, PARObjective, PEPGObjective
from flowrl.objectives.vgrpo import VGRPOObjective


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
    zero_without_advantage = True  # under the ELBO, samples with A = 0 skip their forwards

    def __init__(self, config: ClippedConfig):
        self.config = config
        self.beta = config.beta
        self.kl = config.kl
        self.kl_direction = config.kl_direction
        self.objective = ClippedObjective(config.eps_low, config.eps_high)


# ----------------------------------------------------------------------------- GRPO-Guard


@dataclasses.dataclass(frozen=True)
class GuardConfig:
    eps_low: float = param(
        2e-6, "Lower clip on the normalised ratio exp(zh) (flow_grpo's GRPO-Guard configs: 2e-6 to 4e-6).", min=0.0)
    eps_high: float = param(2e-6, "Upper clip on the normalised ratio.", min=0.0)
    reweight: bool = param(True, "Multiply each step's gradient by 1 / (sigma - sigma_next) (GRPO-Guard's "
                           "gradient reweighting); False = ratio normalisation only.")
    beta: float = param(0.0, "Weight of the KL term to the reference (0 = none, GRPO-Guard's default).", min=0.0)
    kl: Literal["gaussian_exact", "flow_grpo", "old_policy_k3"] = param(
        "gaussian_exact", "KL kind, as for the 'clipped' loss (old_policy_k3 reads the normalised log-ratio).")


class GuardSurrogate:
    """GRPO-Guard: the clipped surrogate on the bias-free, step-consistent log-ratio
    ``zh = mean(eps * (mu - mu_old))``, gradient reweighted by ``1 / h`` per step."""

    Config = GuardConfig
    keep_means = True

    def __init__(self, config: GuardConfig):
        self.config = config
        self.beta, self.kl = config.beta, config.kl
        self.objective = ClippedObjective(config.eps_low, config.eps_high)

    def step_ratio(self, out, old):
        return guard_step_ratio(out, old, reweight=self.config.reweight)


# ----------------------------------------------------------------------------- GARDO


class _Clipped:
    def __init__(self, eps_low, eps_high, beta, kl):
        self.objective = ClippedObjective(eps_low, eps_high)
        self.beta, self.kl = beta, kl


@dataclasses.dataclass(frozen=True)
class GardoConfig:
    eps_low: float = param(5e-3, "Lower clip of the policy ratio.", min=0.0)
    eps_high: float = param(5e-3, "Upper clip of the policy ratio.", min=0.0)
    beta: float = param(0.04, "Weight of the gated KL (GARDO: 0.04 OCR, 0.07 GenEval, 0.01 FLUX).", min=0.0,
                        exclusive_min=True)
    kl: Literal["gaussian_exact", "flow_grpo"] = param(
        "flow_grpo", "KL kind to the reference (GARDO: Flow-GRPO's mean((mu - mu_ref)^2) / (2 g^2)).")
    main: str = param("", "Label of the proxy reward the gate distrusts (the first [[rewards]] entry when empty).")
    auxiliary: list[str] = param([], "Labels of the auxiliary rewards (weight 0 is fine) whose ranks the proxy's "
                                 "ranks are compared with; at least one.")
    sign: Literal["code", "proxy_high"] = param(
        "code", "'code': gate where the proxy ranks worse than the auxiliaries (flow_grpo's code); 'proxy_high': "
        "where it ranks better (the proxy is high but the auxiliaries disagree).")
    q: float = param(0.1, "Initial share of the samples under the KL (adapted in [0.02, 0.2]).", min=0.02, max=0.2)
    reset_every: int = param(
        15, "Reset the reference to the current weights once more than this many iterations have passed since the "
        "last reset (GARDO's rule: iteration - last > reset_every).", min=1)
    kl_threshold: float = param(3e-4, "Also reset after an iteration whose KL exceeded this.", min=0.0)

    def __post_init__(self):
        if not self.auxiliary:
            raise ValueError("gardo needs auxiliary = [...] reward labels (e.g. ['verifier'])")


def build_gardo(config: GardoConfig):
    """GARDO: gated KL, reference reset (needs [train].finetune = 'full')."""
    return GatedKLPolicyGradient(
        _Clipped(config.eps_low, config.eps_high, config.beta, config.kl), main=config.main or None,
        auxiliary=tuple(config.auxiliary), sign=config.sign, q=config.q, reset_every=config.reset_every,
        kl_threshold=config.kl_threshold)


# ----------------------------------------------------------------------------- DiffusionNFT


@dataclasses.dataclass(frozen=True)
class NftConfig:
    beta: float = param(1.0, "Mixing of the implicit policies v+- (NFT: 1.0; 0.1 for OCR and multi-reward).",
                        min=0.0, exclusive_min=True)
    clip: float = param(5.0, "Advantage clip C; r = clip(A, -C, C) / (2 C) + 1/2.", min=0.0, exclusive_min=True)
    timesteps: int = param(8, "Sigmas trained per sample (a random subset of the sampling schedule's; NFT: 9 of 10).",
                           min=1)
    decay_type: Literal[0, 1, 2] = param(
        1, "Old-policy update after each rollout: 0 = copy, 1 = decay min(0.001 step, 0.5), "
        "2 = 0 for 75 steps then min(0.0075 (step - 75), 0.999) (NFT's types).")
    beta_kl: float = param(0.0, "Weight of mean((v - v_ref)^2) to the reference model (NFT: 1e-4).", min=0.0)


def build_nft(config: NftConfig):
    """DiffusionNFT: forward-process objective on clean samples, sampled with the old weights."""
    return ForwardProcessObjective(beta=config.beta, clip=config.clip, timesteps=config.timesteps,
                                   decay_type=config.decay_type, beta_kl=config.beta_kl)


# ----------------------------------------------------------------------------- AWM


@dataclasses.dataclass(frozen=True)
class AwmConfig:
    timesteps: int = param(6, "Sigmas trained per sample (a random subset of the sampling schedule's; AWM: 6).", min=1)
    weighting: Literal["uniform", "sigma", "ghuber"] = param(
        "uniform", "Weight of each point's flow-matching error: 'uniform' (AWM's 'Uniform'), 'sigma' (its 't'), "
        "'ghuber' (sigma ((mse + 1e-10)^p - 1e-10^p) / p, its 'ghuber').")
    power: float = param(1.0, "Power p of the 'ghuber' weighting.", min=0.0, exclusive_min=True)
    clip_range: float = param(
        0.5, "PPO clip of the per-point ratio exp(l - l_anchor) (acts only off-policy; AWM's configs use 1).",
        min=0.0, max=0.99)
    adv_clip: float = param(5.0, "Advantages are clipped to [-adv_clip, adv_clip] (AWM: 5).", min=0.0,
                            exclusive_min=True)
    beta_kl: float = param(0.0, "Weight of mean((v - v_ref)^2) to the reference model (AWM's 'Uniform' KL; "
                           "its configs: 1e-4 to 3e-3).", min=0.0)

    def __post_init__(self):
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {self.weighting!r}")


def build_awm(config: AwmConfig):
    """AWM: advantage-weighted flow matching on the rollout's clean samples."""
    return AdvantageWeightedMatching(timesteps=config.timesteps, weighting=config.weighting, power=config.power,
                                     clip_range=config.clip_range, adv_clip=config.adv_clip, beta_kl=config.beta_kl)


# ----------------------------------------------------------------------------- Flow-DPPO


@dataclasses.dataclass(frozen=True)
class DppoConfig:
    kl_threshold: float = param(
        1e-5, "Trust region delta: a unit whose exact Gaussian KL to the rollout policy (per element, mean over "
        "its steps) is >= delta and whose ratio moves further in the advantage's direction is dropped "
        "(UniRL's kl_mask_threshold: 1e-5). Under [likelihood] use = 'elbo' the divergence is each ELBO point's "
        "mean((v - v_old)^2) instead (docs/objectives.md, Flow-DPPO on the ELBO).", min=0.0)
    beta: float = param(0.0, "Weight of the KL term to the reference (0 = none, Flow-DPPO's default).", min=0.0)
    kl: Literal["gaussian_exact", "flow_grpo", "old_policy_k3"] = param(
        "gaussian_exact", "KL kind of the beta term, as for the 'clipped' loss.")


class _KLMasked:
    keep_means = True  # on the trajectory; under the ELBO the trust region is measured at its points
    zero_without_advantage = True  # -A rho: under the ELBO, samples with A = 0 skip their forwards

    def __init__(self, config: DppoConfig):
        self.objective = KLMaskedSurrogate(config.kl_threshold)
        self.beta, self.kl = config.beta, config.kl


def build_dppo(config: DppoConfig):
    """Flow-DPPO: the unclipped surrogate inside an exact per-step Gaussian-KL trust region."""
    return KLMaskedPolicyGradient(_KLMasked(config))


# ----------------------------------------------------------------------------- online DPO


@dataclasses.dataclass(frozen=True)
class DpoConfig:
    beta: float = param(
        5000.0, "DPO temperature on the flow-matching errors: loss = softplus(beta / 2 * ((e_w - r_w) - (e_l - r_l))) "
        "(Diffusion-DPO: 5000 for SD 1.5, 2500 for SDXL).", min=0.0, exclusive_min=True)
    timesteps: int = param(
        1, "Points (sigma and noise, shared by the pair) trained per pair, from the sampling schedule's sigmas "
        "(Diffusion-DPO: 1 per step).", min=1)
    leading_steps: int = param(
        0, "Draw the sigmas from the first this many of the sampling schedule (the high-noise end); 0 = all "
        "but the final 0.", min=0)


def build_dpo(config: DpoConfig):
    """Online DPO: the best and the worst sample of each group as a pair, on flow-matching errors."""
    return OnlineDPO(beta=config.beta, timesteps=config.timesteps, leading_steps=config.leading_steps)


# ----------------------------------------------------------------------------- DGPO


@dataclasses.dataclass(frozen=True)
class DgpoConfig:
    beta: float = param(100.0, "DPO temperature of the group preference, in sigmoid(sum_i A_i beta (e_i - r_i) / G) "
                        "(DGPO's beta_dpo: 100; its README: 10 to 100 with a frozen reference).",
                        min=0.0, exclusive_min=True)
    timesteps: int = param(4, "Points (sigma and noise, shared by the group) trained per sample (DGPO's "
                           "num_train_timesteps: 4).", min=1)
    leading_steps: int = param(
        0, "Draw the sigmas from the first this many of the sampling schedule (DGPO: trunc_steps + 1 = 5 to 7 of "
        "10 steps, the high-noise end); 0 = all but the final 0.", min=0)
    clip_range: float = param(
        1e-2, "PPO-style clip: a point's gradient stops once exp(e_anchor - e) leaves [1 - c, 1 + c] on its "
        "advantage's side (DGPO's clip_range: 1e-2 GenEval and OCR; acts only off-policy).", min=0.0, max=0.99)
    adv_clip: float = param(5.0, "Advantages are clipped to [-adv_clip, adv_clip] (DGPO's adv_clip_max: 5).",
                            min=0.0, exclusive_min=True)
    beta_kl: float = param(0.0, "Weight of mean((v - v_ref)^2) to the reference (DGPO's train.beta: 1e-3 in its "
                           "README, 0.02 GenEval and OCR; 0 = none).", min=0.0)


def build_dgpo(config: DgpoConfig):
    """DGPO: group-level DPO on the rollout's clean samples."""
    return GroupPreference(beta=config.beta, timesteps=config.timesteps, leading_steps=config.leading_steps,
                           clip_range=config.clip_range, adv_clip=config.adv_clip, beta_kl=config.beta_kl)


# ----------------------------------------------------------------------------- EPG, PEPG, PAR ("Rethinking")


@dataclasses.dataclass(frozen=True)
class RethinkingConfig:
    ratio: bool = param(True, "Weight each unit by sg(rho) (the importance ratio to the old policy); false = the "
                        "authors' '_noratio' variants.")


class _RethinkingLoss:
    Config = RethinkingConfig
    beta, kl = 0.0, "gaussian_exact"  # no trajectory KL term (under the ELBO: [likelihood].beta_kl)
    unit = None

    def __init__(self, config: RethinkingConfig):
        self.config = config
        self.objective = self.unit(ratio=config.ratio)


class EPG(_RethinkingLoss):
    """EPG: -sg(rho) A z per unit (the policy gradient, importance-weighted)."""

    unit = EPGObjective
    zero_without_advantage = True
    variant = (", with EPG's policy-gradient loss", 'Rethinking the Design Space of RL for Diffusion Models, ICML 2026')


class PEPG(_RethinkingLoss):
    """PEPG: -sg(rho) (A - sg(z)) z per unit (EPG with a proximal pull-back)."""

    unit = PEPGObjective
    zero_without_advantage = False
    variant = (", with PEPG's proximal policy-gradient loss",
               'Rethinking the Design Space of RL for Diffusion Models, ICML 2026')


class PAR(_RethinkingLoss):
    """PAR: sg(rho) (A - z)^2 / 2 per unit (the log-ratio regressed on the advantage)."""

    unit = PARObjective
    zero_without_advantage = False
    variant = (", with PAR's advantage-regression loss",
               'Rethinking the Design Space of RL for Diffusion Models, ICML 2026')


# ----------------------------------------------------------------------------- V-GRPO


@dataclasses.dataclass(frozen=True)
class VgrpoConfig:
    eps: float = param(1e-3, "Clip of the per-sample ELBO ratio: max(-A rho, -A clip(rho, 1 - eps, 1 + eps)) (the "
                       "Rethinking code's GRPO on the ELBO: 1e-3; V-GRPO's own value is not public).", min=0.0,
                       exclusive_min=True, max=0.99)
    adv_soft_clip: float = param(3.0, "Advantage soft-clipping A -> c tanh(A / c) (0 = none).", min=0.0)


class VGRPO:
    """V-GRPO: the clipped surrogate of one ELBO ratio per sample, advantages soft-clipped."""

    Config = VgrpoConfig
    beta, kl = 0.0, "gaussian_exact"
    requires_likelihood = "elbo"
    zero_without_advantage = True
    algorithm = ('V-GRPO (GRPO on the final image\'s ELBO)', 'V-GRPO, arXiv:2604.23380')

    def __init__(self, config: VgrpoConfig):
        self.config = config
        self.objective = VGRPOObjective(config.eps, config.adv_soft_clip)


# ----------------------------------------------------------------------------- FDFO


@dataclasses.dataclass(frozen=True)
class FdfoConfig:
    clip_range: float = param(0.03, "c of the SPO surrogate -dR rho + |dR| / (2 c) (rho - 1)^2 (FDFO: 3e-2).",
                              min=0.0, exclusive_min=True)
    timesteps: int = param(0, "Trajectory states trained per sample, a seeded random subset of its stochastic steps "
                           "(0 = all of them, FDFO's choice).", min=0)
    kl_weight: float = param(0.0, "Weight of mean((v - v_ref)^2) to the reference model (FDFO: 0).", min=0.0)


def build_fdfo(config: FdfoConfig):
    """FDFO: finite differences of paired rollouts, pushed into the velocity along the trajectory."""
    return FiniteDifferenceObjective(clip_range=config.clip_range, timesteps=config.timesteps,
                                     kl_weight=config.kl_weight)


# ----------------------------------------------------------------------------- offline SFT and DPO


@dataclasses.dataclass(frozen=True)
class SftConfig:
    timesteps: int = param(
        2, "Points (sigma and noise) per table row, drawn without replacement from the sampling schedule's sigmas "
        "(never the final 0).", min=1)


def build_sft(config: SftConfig):
    """Offline SFT: the flow-matching loss on the [data] table's images."""
    return OfflineSFT(timesteps=config.timesteps)


@dataclasses.dataclass(frozen=True)
class OfflineDpoConfig:
    beta: float = param(
        100.0, "DPO temperature on the flow-matching errors: loss = softplus(beta / 2 * ((e_w - r_w) - (e_l - r_l))) "
        "(Diffusion-DPO: 5000 for SD 1.5, 2500 for SDXL).", min=0.0, exclusive_min=True)
    timesteps: int = param(
        2, "Points (sigma and noise, shared by the pair) per table row, drawn without replacement from the "
        "sampling schedule's sigmas (never the final 0).", min=1)


def build_offline_dpo(config: OfflineDpoConfig):
    """Offline Diffusion-DPO on the [data] table's preference pairs, against the frozen reference."""
    return OfflineDPO(beta=config.beta, timesteps=config.timesteps)


# The model card names the algorithm from the components (flowrl.hub.algorithm_of): an objective that owns
# its update says what it is (``algorithm``); a ratio-based loss refines the chunker's GRPO (``variant``).
build_nft.algorithm = ('DiffusionNFT (forward-process RL)', 'DiffusionNFT, NVlabs/DiffusionNFT')
build_awm.algorithm = ('AWM (Advantage Weighted Matching)', 'arXiv:2509.25050')
build_dpo.algorithm = ('online DPO (Diffusion-DPO for flow models)', 'Diffusion-DPO, arXiv:2311.12908')
build_dgpo.algorithm = ('DGPO (group preference optimisation)', 'DGPO, arXiv:2510.08425')
build_fdfo.algorithm = ('FDFO (finite-difference flow optimisation)', 'FDFO, arXiv:2603.12893')
build_sft.algorithm = ('supervised fine-tuning on a dataset', '')
build_offline_dpo.algorithm = ('offline Diffusion-DPO on preference pairs', 'Diffusion-DPO, arXiv:2311.12908')
build_gardo.variant = (", with GARDO's gated KL and reference reset", 'GARDO, arXiv:2512.24138')
build_dppo.variant = (", with Flow-DPPO's trust region", 'Flow-DPPO, arXiv:2606.11025')
GuardSurrogate.variant = (", with GRPO-Guard's ratio correction", "GRPO-Guard, arXiv:2510.22319")


@hookimpl(trylast=True)
def register_losses(register):
    register("clipped", ClippedSurrogate)
    register("guard", GuardSurrogate)
    register("gardo", build_gardo, params=GardoConfig)
    register("nft", build_nft, params=NftConfig)
    register("awm", build_awm, params=AwmConfig)
    register("dppo", build_dppo, params=DppoConfig)
    register("dpo", build_dpo, params=DpoConfig)
    register("dgpo", build_dgpo, params=DgpoConfig)
    register("epg", EPG)
    register("pepg", PEPG)
    register("par", PAR)
    register("vgrpo", VGRPO)
    register("fdfo", build_fdfo, params=FdfoConfig)
    register("sft", build_sft, params=SftConfig)
    register("offline_dpo", build_offline_dpo, params=OfflineDpoConfig)


@hookimpl(trylast=True)
def default_component(kind):
    return "clipped" if kind == "loss" else None
