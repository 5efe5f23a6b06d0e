"""Built-in advantage estimators (docs/api.md, advantages).

- ``group_zscore``: the group z-score and its anchor variants.
- ``diversity``: the group z-score whose non-negative advantages are multiplied by each sample's
  nearest-neighbour cosine distance to its group over the group's mean distance (GARDO's
  diversity-aware advantage).
- ``group_centred``: ``scale (r - group mean)``, in the reward's units (FDFO's pair difference; the
  Rethinking scripts' advantage).
- ``tree``: BranchGRPO's tree advantage, on the tree rollouts of ``[window] use = "branch"``: each
  transition gets the advantage of the node it leads into (the group z-scores of the leaves below it,
  fused), with BranchGRPO's depth pruning (``prune_steps``, ``prune_slide``) and width pruning
  (``keep``) (:mod:`flowrl.sampling.branching`).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from flowrl import hookimpl
from flowrl.config import param
from flowrl.objectives.advantages import combine_group_advantages, group_means, group_zscore, weighted_sum_rewards
from flowrl.objectives.gardo import diversity_multipliers
from flowrl.sampling.branching import TreeAdvantages, pruned_steps, tree_unit_advantages


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
        kwargs = dict(std=c.std, eps=c.eps, global_std=c.global_std, clip=c.clip or None)  # 0: no clamp
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
    #: the model card's words for this advantage (flowrl.hub)
    variant = (", with GARDO's diversity-aware advantage", "GARDO, arXiv:2512.24138")

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


# ----------------------------------------------------------------------------- BranchGRPO's tree


@dataclasses.dataclass(frozen=True)
class TreeConfig(GroupZScoreConfig):
    """The group z-score's keys (the leaves' advantages, as ``group_zscore`` computes them) and the tree's."""

    fusion: Literal["mean", "probability"] = param(
        "mean", "A node's value: the mean of its leaves ('mean'), or at each split the children weighted by the "
        "softmax of their transitions' rollout log-probs ('probability').")
    keep: int = param(
        0, "Width pruning, BranchGRPO-style: below the last split only the `keep` leaves of each group with the "
        "largest |advantage| are trained (the others' transitions there get advantage 0 and cost nothing "
        "on-policy); 0 = every leaf.", min=0)
    prune_steps: list[int] = param(
        [], "Depth pruning, BranchGRPO-style: the sampling steps whose transitions are not trained (advantage 0: "
        "no forward on-policy); sampling and rewards are unchanged. Strictly increasing, in [0, [sampler].steps). "
        "Empty = none.", min=0, max=10_000)
    prune_slide: int = param(
        0, "With `prune_steps`: every this many iterations the pruned steps move one step earlier, until the "
        "earliest is the last of [window].steps (a sliding window over the leaf segment); 0 = they stay.", min=0)

    def __post_init__(self):
        p = self.prune_steps
        if any(b <= a for a, b in zip(p, p[1:])):
            raise ValueError(f"prune_steps must be strictly increasing steps, got {list(p)}")
        if self.prune_slide and not p:
            raise ValueError("prune_slide slides the pruned steps: set prune_steps too, or prune_slide = 0")


class TreeAdvantage(GroupZScore):
    """BranchGRPO's tree advantage, per transition of ``[window] use = "branch"``'s trees.

    Each transition gets the advantage of the node it leads into: the leaves' group z-scores (as
    ``group_zscore`` computes them) fused and standardised per depth, each distinct transition
    trained once (step units); with BranchGRPO's depth and width pruning."""

    Config = TreeConfig

    def check_tree(self, tree, trainable_steps, num_steps, group_size):
        c, steps = self.config, list(trainable_steps)
        if c.keep >= group_size:
            raise ValueError(f"keep = {c.keep} keeps every leaf of a group of {group_size} (width pruning would "
                             f"prune nothing): keep fewer than group_size = {group_size} leaves, or keep = 0 for every leaf")
        prune, stop = list(c.prune_steps), tree.last_step
        if prune and prune[-1] >= num_steps:
            raise ValueError(f"prune_steps must be strictly increasing steps in [0, steps = {num_steps}), got {prune}")
        if prune and c.prune_slide and prune[0] <= stop:
            raise ValueError(f"prune_slide = {c.prune_slide} slides the pruned steps earlier until the first is the "
                             f"last branch step ({stop}); prune_steps starts at step {prune[0]}, so it would never "
                             f"move: start prune_steps after step {stop}, or prune_slide = 0")
        # the pruned steps at every position the slide takes them to (pruned_steps in on_tree)
        shifts = range(max(0, prune[0] - stop) + 1 if c.prune_slide else 1) if prune else range(0)
        for shift in shifts:
            if steps and set(steps) <= {p - shift for p in prune}:
                moved = f" (slid {shift} step{'s' if shift != 1 else ''} earlier)" if shift else ""
                raise ValueError(f"prune_steps{moved} prunes every trainable transition of the sampler (steps "
                                 f"{steps[0]} to {steps[-1]}): no transition would be trained; prune some of the "
                                 "steps after the last split only")

    def on_tree(self, advantages, trajectory, tree, group_size, iteration):
        c = self.config
        pruned = pruned_steps(c.prune_steps, c.prune_slide, iteration, tree.last_step)
        values, trained = tree_unit_advantages(advantages, trajectory, tree, group_size, fusion=c.fusion, keep=c.keep,
                                               pruned=pruned)
        return TreeAdvantages(values, trained, {"branch/prune_start": pruned[0]} if pruned else {})


@hookimpl(trylast=True)
def register_advantages(register):
    register("group_zscore", GroupZScore)
    register("diversity", DiversityAdvantage)
    register("group_centred", GroupCentred)
    register("tree", TreeAdvantage)


@hookimpl(trylast=True)
def default_component(kind):
    return "group_zscore" if kind == "advantage" else None
