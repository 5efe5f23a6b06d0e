"""Built-in advantage estimator: the group z-score and its anchor variants (docs/api.md, advantages)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from flowrl import hookimpl
from flowrl.advantages import combine_group_advantages, group_zscore, weighted_sum_rewards
from flowrl.config import param


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


@hookimpl(trylast=True)
def register_advantages(register):
    register("group_zscore", GroupZScore)


@hookimpl(trylast=True)
def default_component(kind):
    return "group_zscore" if kind == "advantage" else None
