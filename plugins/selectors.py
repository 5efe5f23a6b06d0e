"""Built-in chunk selectors: all, uniform fraction, L1rel-weighted (docs/api.md §4, §6)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from flowrl import hookimpl
from flowrl.config import param
from flowrl.dynamics.profile_file import read_l1rel
from flowrl.selection import (
    chunk_weights_from_l1rel,
    rollout_chunk_weights,
    select_all,
    select_uniform,
    select_weighted,
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


@hookimpl(trylast=True)
def register_selectors(register):
    register("all", AllSelector)
    register("uniform", UniformSelector)
    register("weighted", WeightedSelector)


@hookimpl(trylast=True)
def default_component(kind):
    return "all" if kind == "selector" else None
