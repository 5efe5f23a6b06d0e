"""Built-in chunk selectors: all, uniform fraction, L1rel-weighted (docs/api.md §4, §6), and two
that train fewer steps: Flash-GRPO's one step per sample shared by its prompt group (``flash``)
and E-GRPO's highest-entropy steps (``entropy``); docs/objectives.md."""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from flowrl import hookimpl
from flowrl.config import param
from flowrl.dynamics.profile_file import read_l1rel
from flowrl.selection import (
    chunk_weights_from_l1rel,
    rollout_chunk_weights,
    select_all,
    select_one_per_group,
    select_top_entropy,
    select_uniform,
    select_weighted,
    selection_count,
    unit_entropy,
)


class AllSelector:
    """Train every chunk of every sample."""

    def select(self, num_samples, sizes, generator):
        return select_all(num_samples, len(sizes))


@dataclasses.dataclass(frozen=True)
class UniformConfig:
    fraction: float = param(
        0.5,
        "Fraction of chunks trained per sample, drawn uniformly without replacement; the count is "
        "max(1, int(K * fraction)), never zero (DanceGRPO 0.6 of steps, GCPO 0.5).",
        min=0.0, max=1.0, exclusive_min=True,
    )


class UniformSelector:
    """A uniform random subset of the chunks, per sample."""

    Config = UniformConfig

    def __init__(self, config: UniformConfig):
        self.config = config

    def select(self, num_samples, sizes, generator):
        return select_uniform(num_samples, len(sizes), self.config.fraction, generator)


@dataclasses.dataclass(frozen=True)
class WeightedConfig:
    fraction: float = param(0.5, "Fraction of chunks per sample: max(1, int(K * fraction)).", min=0.0, max=1.0, exclusive_min=True)
    profile: str = param(
        "",
        "profile.json from `flowrl profile`; its mean L1rel per transition gives chunk weights "
        "(paper Eq. 16). Empty = the chunker's profile.", path=True,
    )
    source: Literal["profile", "rollout"] = param(
        "profile",
        "Where L1rel comes from: 'profile' = one curve shared by all samples (the profile above or the "
        "chunker's); 'rollout' = each sample's own L1rel over its current rollout's transitions, as GCPO's "
        "released code (--sample_weight, the paper's weighted-sampling runs) computes it.",
    )


class WeightedSelector:
    """Chunks drawn without replacement with probability proportional to their mean L1rel."""

    Config = WeightedConfig
    #: the model card's words for this selector (flowrl.hub)
    variant = (", with chunks sampled by their temporal-dynamics weight", "")

    def __init__(self, config: WeightedConfig):
        self.config = config
        #: the curve in use: from ``profile`` (read on first use), or handed over by the engine
        #: from the chunker's profile (flowrl.interfaces.CurveWeightedSelector)
        self.l1rel = None
        self.has_own_profile = bool(config.profile)

    def select(self, num_samples, sizes, generator):
        if self.l1rel is None:
            self.l1rel = read_l1rel(self.config.profile, num_transitions=sum(sizes))
        weights = chunk_weights_from_l1rel(self.l1rel, sizes)
        count = max(1, int(len(sizes) * self.config.fraction))
        return select_weighted(num_samples, weights, count, generator)

    def select_from_rollout(self, num_samples, sizes, generator, l1rel):
        if self.config.source != "rollout":
            return self.select(num_samples, sizes, generator)
        count = max(1, int(len(sizes) * self.config.fraction))
        return select_weighted(num_samples, rollout_chunk_weights(l1rel, sizes), count, generator)


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    span: float = param(
        0.5,
        "The trained unit is drawn uniformly from the first max(1, int(K * span)) units, the high-noise "
        "end (Flash-GRPO's code: the first 10 of 20 steps, 0.5; 1 = any unit).",
        min=0.0, max=1.0, exclusive_min=True,
    )


class FlashSelector:
    """Flash-GRPO: one unit per sample and iteration, shared by the samples of its prompt group.

    Iso-temporal grouping: the group's samples train the same unit, drawn per (seed, iteration,
    group)."""

    Config = FlashConfig
    #: the model card's words for this selector (flowrl.hub)
    variant = (", with Flash-GRPO's one trained step per group", "Flash-GRPO, arXiv:2605.15980")

    def __init__(self, config: FlashConfig):
        self.config = config

    def select(self, num_samples, sizes, generator):
        """Without group ids every row is its own group (the engine calls select_per_group)."""
        return select_one_per_group(torch.arange(num_samples), len(sizes), self.config.span, generator)

    def select_per_group(self, num_samples, sizes, generators, group_ids):
        if len(group_ids) != num_samples:
            raise ValueError(f"group_ids must have one entry per sample ({num_samples}), got {len(group_ids)}")
        return select_one_per_group(group_ids, len(sizes), self.config.span, generators)


@dataclasses.dataclass(frozen=True)
class EntropyConfig:
    rule: Literal["top", "threshold"] = param(
        "top",
        "'top': per sample the max(1, int(K * fraction)) units whose Gaussian step has the highest entropy "
        "(E-GRPO trains the high-entropy first half of the steps); 'threshold': every unit whose per-element "
        "entropy 0.5 log(2 pi e std^2) is >= threshold (at least the highest).",
    )
    fraction: float = param(0.5, "Rule 'top': fraction of units trained, max(1, int(K * fraction)).",
                            min=0.0, max=1.0, exclusive_min=True)
    threshold: float = param(
        -2.0, "Rule 'threshold': the least per-element entropy in nats of a trained unit (std 0.1 gives "
        "-0.88, std 0.03 gives -2.09).",
    )


class EntropySelector:
    """E-GRPO: train the units whose Gaussian step has the highest entropy (the largest std).

    The kernel's std is read off the current rollout's sigmas, so per-sample windows are honoured."""

    Config = EntropyConfig
    #: the model card's words for this selector (flowrl.hub)
    variant = (", with E-GRPO's highest-entropy steps", "E-GRPO, arXiv:2601.00423")

    def __init__(self, config: EntropyConfig):
        self.config = config

    def select(self, num_samples, sizes, generator):
        raise ValueError("the 'entropy' selector needs the kernel's std at each step: use it with an objective that "
                         "hands it over (flowrl.interfaces.SelectsByStepStd; the ratio-based losses do)")

    def select_from_std(self, num_samples, sizes, generators, std):
        h = unit_entropy(std, sizes)
        if h.shape[0] != num_samples:
            raise ValueError(f"std must have one row per sample ({num_samples}), got {h.shape[0]}")
        if self.config.rule == "threshold":
            return select_top_entropy(h, threshold=self.config.threshold)
        return select_top_entropy(h, count=selection_count(len(sizes), self.config.fraction))


@hookimpl(trylast=True)
def register_selectors(register):
    register("all", AllSelector)
    register("uniform", UniformSelector)
    register("weighted", WeightedSelector)
    register("flash", FlashSelector)
    register("entropy", EntropySelector)


@hookimpl(trylast=True)
def default_component(kind):
    return "all" if kind == "selector" else None
