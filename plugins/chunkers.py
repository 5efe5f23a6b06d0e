"""Built-in chunkers: step, sequence, fixed, explicit (algorithms.md sections 4-5).

``dynamics`` (boundaries from a ``flowrl profile`` file) lives in :mod:`flowrl_plugins.profiling`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from flowrl import hookimpl
from flowrl.config import param


class StepChunker:
    """Every transition is its own unit: step-level GRPO (DanceGRPO / Flow-GRPO)."""

    def sizes(self, num_transitions):
        from flowrl.chunking import step_chunks

        return step_chunks(num_transitions)


class SequenceChunker:
    """One unit spanning every trained transition: GSPO's sequence-level ratio."""

    def sizes(self, num_transitions):
        from flowrl.chunking import sequence_chunks

        return sequence_chunks(num_transitions)


@dataclasses.dataclass(frozen=True)
class FixedConfig:
    size: int = param(4, "Chunk size k.", min=1)
    remainder: Literal["last", "merge", "first"] = param(
        "last",
        "When k does not divide T: 'last' makes a final smaller chunk, 'merge' adds the remainder "
        "to the last full chunk, 'first' puts the smaller chunk first.",
    )


class FixedChunker:
    """Consecutive chunks of a fixed size k."""

    Config = FixedConfig

    def __init__(self, config: FixedConfig):
        self.config = config

    def sizes(self, num_transitions):
        from flowrl.chunking import fixed_chunks

        return fixed_chunks(num_transitions, self.config.size, remainder=self.config.remainder)


@dataclasses.dataclass(frozen=True)
class ExplicitConfig:
    sizes: list[int] = param(
        [2, 3, 4, 7],
        "Chunk sizes in sampling order; must sum to the number of trainable transitions T "
        "(the paper's [2, 3, 4, 7] for 17 steps).",
        min=1,
    )


class ExplicitChunker:
    """Chunks given as an explicit list of sizes."""

    Config = ExplicitConfig

    def __init__(self, config: ExplicitConfig):
        self.config = config

    def sizes(self, num_transitions):
        from flowrl.chunking import explicit_chunks

        return explicit_chunks(num_transitions, self.config.sizes)


@hookimpl(trylast=True)
def register_chunkers(register):
    register("step", StepChunker)
    register("sequence", SequenceChunker)
    register("fixed", FixedChunker)
    register("explicit", ExplicitChunker)


@hookimpl(trylast=True)
def default_component(kind):
    return "step" if kind == "chunker" else None
