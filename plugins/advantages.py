"""Built-in advantage estimators (docs/api.md, advantages).

- ``group_zscore``: the group z-score and its anchor variants.
- ``diversity``: the group z-score whose non-negative advantages are multiplied by each sample's
  nearest-neighbour cosine distance to its group over the group's mean distance (GARDO's
  diversity-aware advantage).
- ``group_centred``: ``scale (r - group mean)``, in the reward's units (FDFO's pair difference; the
  Rethinking scripts' advantage).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from flowrl import hookimpl
from flowrl.config import param
from flowrl.objectives.advantages import combine_group_advantages, group_means, group_zscore, weighted_sum_rewards
from flowrl.objectives.gardo import diversity_multipliers


@dataclasses.dataclass(frozen=True)
class GroupZScoreConfig:
    std: Literal["unbiased", "biased"] = param(
        "unbiased", "Group std estimator: 'unbiased' (DanceGRPO, MixGRPO, GCPO) or 'biased' (Flow-GRPO)."
    )
    eps: float = param(1e-8, "Added to the std: A = (r - mean) / (std + eps). Flow-GRPO uses 1e-4.", min=0.0)
    global_std: bool = param(False, "Divide by the std of ALL rewards in the batch (Flow-GRPO's default).")
    clip: float = param(5.0, "Clip advantages to [-clip, clip]; 0 disables.", min=0.0)
    multi_reward: Literal["normalise_then_weight", "weighted_sum"] = param(
        "normalise_then_weight",
        "Several rewards: z-score each within its group then combine with the weights (MixGRPO), "
        "or z-score the weighted sum of raw rewards (Flow-GRPO).",
    )


class GroupZScore:
    """A = (r - group mean) / (group std + eps), clipped; all-equal groups get 0."""

    Config = GroupZScoreConfig

    def __init__(self, config: GroupZScoreConfig):
        self.config = config

    def __call__(self, rewards, weights, group_ids):
        c = self.config
        kwargs = dict(std=c.std, eps=c.eps, global_std=c.global_std, clip=c.clip)
        if c.multi_reward == "weighted_sum" or len(rewards) == 1:
            total = weighted_sum_rewards(rewards, weights)
            return group_zscore(total, group_ids, **kwargs)
        return combine_group_advantages(rewards, group_ids, weights, **kwargs)


# ----------------------------------------------------------------------------- diversity


@dataclasses.dataclass(frozen=True)
class DiversityConfig:
    scale: Literal["std", "none"] = param(
        "std", "Base advantage: 'std' = group z-score (unbiased std), 'none' = r - group mean (GARDO).")
    eps: float = param(1e-8, "Added to the std.", min=0.0)
    clip: float = param(5.0, "Clip the shaped advantages to [-clip, clip]; 0 disables.", min=0.0)


class DiversityAdvantage:
    """Group advantages of the weighted reward sum; each non-negative one multiplied by the
    sample's nearest-neighbour cosine distance in its group over the group's mean distance.
    Features: the decoded image, centred per image (parameter-free, offline)."""

    Config = DiversityConfig

    def __init__(self, config: DiversityConfig):
        self.config = config

    def features(self, images: torch.Tensor) -> torch.Tensor:
        f = images.detach().float().reshape(images.shape[0], -1)
        return f - f.mean(dim=1, keepdim=True)

    def __call__(self, rewards, weights, group_ids, features=None):
        c = self.config
        total = weighted_sum_rewards(rewards, weights)
        if c.scale == "std":
            base = group_zscore(total, group_ids, std="unbiased", eps=c.eps, clip=None)
        else:
            r = total.double().cpu()
            base = (r - group_means(r, group_ids)).to(torch.float32).to(total.device)
        if features is None:
            return base
        m = diversity_multipliers(features.cpu(), torch.as_tensor(group_ids).cpu(), base.cpu()).to(torch.float32)
        out = base * m.to(base.device)
        return out.clamp(-c.clip, c.clip) if c.clip else out


# ----------------------------------------------------------------------------- centred, unscaled


@dataclasses.dataclass(frozen=True)
class GroupCentredConfig:
    scale: float = param(1.0, "A = scale (r - group mean) of the weighted reward sum, not divided by a std (the "
                         "Rethinking scripts' 'exact' advantage: 0.1; FDFO's reward difference of a pair: 1).",
                         min=0.0, exclusive_min=True)
    clip: float = param(0.0, "Clip advantages to [-clip, clip]; 0 disables.", min=0.0)


class GroupCentred:
    """A = scale (r - group mean) of the weighted reward sum: the reward's own units, no std (in a
    pair: half the reward difference, FDFO's dR)."""

    Config = GroupCentredConfig

    def __init__(self, config: GroupCentredConfig):
        self.config = config

    def __call__(self, rewards, weights, group_ids):
        c = self.config
        total = weighted_sum_rewards(rewards, weights)
        r = total.double().cpu()
        out = (c.scale * (r - group_means(r, group_ids))).to(torch.float32).to(total.device)
        return out.clamp(-c.clip, c.clip) if c.clip else out


@hookimpl(trylast=True)
def register_advantages(register):
    register("group_zscore", GroupZScore)
    register("diversity", DiversityAdvantage)
    register("group_centred", GroupCentred)


@hookimpl(trylast=True)
def default_component(kind):
    return "group_zscore" if kind == "advantage" else None
