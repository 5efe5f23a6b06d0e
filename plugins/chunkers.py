"""Built-in chunkers: step, sequence, fixed, explicit, and dynamics (docs/api.md, chunking).

``dynamics`` takes its boundaries from the sampler's temporal dynamics: a ``flowrl profile``
file, or a profile of the model measured when training starts (docs/profile.md)::

    [chunker]
    use = "dynamics"
    profile = "recipes/profiles/embedded.json"   # from `flowrl profile`; "" = profile at start
    method = "dp"                                # "dp" | "curvature" | "derivative"
    curve = "l1rel"                              # which curve to segment
    num_chunks = 4                               # 0 = choose
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch

from flowrl import hookimpl
from flowrl.chunking import explicit_chunks, fixed_chunks, sequence_chunks, step_chunks, validate_chunks
from flowrl.config import param
from flowrl.dynamics.measure import pick_prompts, profile_model
from flowrl.dynamics.profile_file import profile_to_dict, read_profile, trainable_curve, write_profile
from flowrl.dynamics.segment import segment
from flowrl.errors import FlowrlError
from flowrl.sampling.rollout import trainable_mask


class StepChunker:
    """Every transition is its own unit: step-level GRPO (DanceGRPO / Flow-GRPO)."""

    #: the model card's name for a GRPO-family run with these units (flowrl.hub)
    algorithm = ('step-level GRPO (DanceGRPO / Flow-GRPO)',
                 'DanceGRPO, arXiv:2505.07818; Flow-GRPO, arXiv:2505.05470')

    def sizes(self, num_transitions):
        return step_chunks(num_transitions)


class SequenceChunker:
    """One unit spanning every trained transition: GSPO's sequence-level ratio."""

    #: the model card's name for a GRPO-family run with these units (flowrl.hub)
    algorithm = ('GSPO-style sequence-level optimisation',
                 'GSPO, arXiv:2507.18071')

    def sizes(self, num_transitions):
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

    #: the model card's name for a GRPO-family run with these units (flowrl.hub)
    algorithm = ('GRPO on fixed chunks of transitions',
                 'Chunk-GRPO, arXiv:2510.21583')

    Config = FixedConfig

    def __init__(self, config: FixedConfig):
        self.config = config

    def sizes(self, num_transitions):
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

    #: the model card's name for a GRPO-family run with these units (flowrl.hub)
    algorithm = ('Chunk-GRPO',
                 'Sample By Step, Optimize By Chunk (Chunk-GRPO), arXiv:2510.21583')

    Config = ExplicitConfig

    def __init__(self, config: ExplicitConfig):
        self.config = config

    def sizes(self, num_transitions):
        return explicit_chunks(num_transitions, self.config.sizes)


@dataclasses.dataclass(frozen=True)
class DynamicsConfig:
    profile: str = param(
        "",
        "profile.json written by `flowrl profile`. "
        "Empty = profile the recipe's model with the training sampler when training starts.", path=True,
    )
    method: Literal["dp", "curvature", "derivative"] = param(
        "dp",
        "'dp': exact least-squares segmentation of the curve; 'curvature': cut at the largest "
        "|second differences| (paper v1); 'derivative': cut where the first difference changes "
        "sign, recursing with higher differences in chunks above max_size (paper v3).",
    )
    curve: Literal["l1rel", "l1rel_norm", "x0_change", "v_change"] = param(
        "l1rel",
        "Curve to segment: 'l1rel' (||x_{i+1} - x_i||_1 / ||x_i||_1, the paper's), 'l1rel_norm' "
        "(L1rel / |dsigma|), 'x0_change' (relative change of x0_hat), 'v_change' (of the velocity).",
    )
    num_chunks: int = param(4, "Number of chunks K; 0 = choose it from the curve.", min=0)
    min_size: int = param(1, "Smallest chunk size allowed.", min=1)
    max_size: int = param(0, "Largest chunk size allowed; 0 = no limit.", min=0)
    reprofile_every: int = param(
        0,
        "Adaptive chunking: re-profile the current policy every N iterations and move the "
        "boundaries (each change is logged as chunk_sizes_changed); 0 = never.",
        min=0,
    )
    num_prompts: int = param(32, "Prompts sampled when profiling at start (profile empty).", min=1)
    seeds: int = param(2, "Noise seeds per prompt when profiling at start (profile empty).", min=1)

    def __post_init__(self):
        if self.max_size and self.max_size < self.min_size:
            raise ValueError(f"max_size ({self.max_size}) is smaller than min_size ({self.min_size}); "
                             "max_size = 0 means no limit")


class DynamicsChunker:
    """Chunks from a temporal-dynamics profile (`flowrl profile`): dp, curvature or derivative rule."""

    #: the model card's name for a GRPO-family run with these units (flowrl.hub)
    algorithm = ("Chunk-GRPO with chunks from the sampler's temporal dynamics",
                 'Sample By Step, Optimize By Chunk (Chunk-GRPO), arXiv:2510.21583')

    Config = DynamicsConfig

    def __init__(self, config: DynamicsConfig):
        self.config = config
        #: True when boundaries can only be known after profiling the model (no profile file):
        #: recipe validation then skips its size check and the engine calls profile_at_start.
        self.needs_model = not config.profile
        self._data: dict[str, Any] | None = None  # the profile (file contents or measured)
        self._source = config.profile or "the start-of-training profile"
        self._override: tuple[int, ...] | None = None

    # ------------------------------------------------------------------ profile access

    @property
    def profile_data(self) -> dict[str, Any] | None:
        """The profile in use (``profile.json`` layout), or None before it is loaded / measured."""
        if self._data is None and self.config.profile:
            self._load()
        return self._data

    def _load(self) -> None:
        self._data = read_profile(self.config.profile, where="[chunker].profile")

    def _curve(self, num_transitions: int, curve: str) -> list[float]:
        data = self.profile_data
        if data is None:
            raise FlowrlError(
                "chunker 'dynamics' has no profile yet: the engine must call "
                "chunker.profile_at_start(...) before asking for chunk sizes",
                where="[chunker].profile",
                hint='write a profile with `flowrl profile RECIPE -o profile.json` and set profile = "profile.json"',
            )
        return trainable_curve(data, curve, num_transitions, source=self._source, where="[chunker].profile")

    # ------------------------------------------------------------------ Chunker interface

    def sizes(self, num_transitions):
        if self._override is not None:
            if sum(self._override) != num_transitions:
                raise ValueError(f"chunk sizes {list(self._override)} do not sum to T = {num_transitions}")
            return self._override
        c = self.config
        y = self._curve(num_transitions, c.curve)
        return segment(y, c.method, c.num_chunks, c.min_size, c.max_size or None, curve=c.curve).sizes

    def l1rel(self, num_transitions: int):
        """Mean L1rel per trainable transition, float32 ``[T]``, for the ``weighted`` selector."""
        return torch.tensor(self._curve(num_transitions, "l1rel"), dtype=torch.float32)

    # ------------------------------------------------------------------ optional capabilities
    # ProfilingChunker, AdaptiveChunker and CurveSource (flowrl.interfaces)

    @property
    def reprofile_every(self) -> int:
        return self.config.reprofile_every

    def profile_at_start(self, model, sigmas, kernels, prompts, *, image_from: str = "x0_hat",
                         seed: int = 0, batch_size: int = 64):
        """Profile the model with the training sampler (when no profile file was given).

        ``sigmas`` and ``kernels`` are exactly what training samples with, ``prompts`` the
        training prompts (``num_prompts`` of them are used, a fixed seeded subset). Deterministic
        for a given seed. Returns the :class:`~flowrl.dynamics.measure.ProfileResult`.
        """
        return self._measure(model, sigmas, kernels, prompts, image_from=image_from, seed=seed,
                             num_seeds=self.config.seeds, batch_size=batch_size, purpose="start")

    def reprofile(self, model, sigmas, kernels, prompts, *, image_from: str = "x0_hat",
                  seed: int = 0, batch_size: int = 64, num_seeds: int = 1):
        """Adaptive chunking: re-measure the current policy and move the boundaries.

        Returns ``(old_sizes, new_sizes)``; afterwards :meth:`sizes` and :meth:`l1rel` follow the
        new profile. The same ``seed`` every time means the same noise, so a change reflects the
        policy. The engine logs the change and stores the sizes in its checkpoint (restore them
        with :meth:`set_sizes`).
        """
        T = int(trainable_mask(tuple(kernels), torch.as_tensor(sigmas).float().cpu(), image_from).sum())
        old = tuple(self.sizes(T)) if self._override is not None or self.profile_data is not None else None
        self._measure(model, sigmas, kernels, prompts, image_from=image_from, seed=seed,
                      num_seeds=num_seeds, batch_size=batch_size, purpose="reprofile")
        self._override = None
        new = tuple(self.sizes(T))
        return old, new

    def set_sizes(self, sizes) -> None:
        """Pin the layout (e.g. restored from a checkpoint after adaptive re-profiling)."""
        self._override = validate_chunks(sizes)

    def save_profile(self, path) -> None:
        """Write the profile in use to ``path`` (e.g. ``RUN_DIR/profile.json``)."""
        if self.profile_data is None:
            raise ValueError("no profile to save yet")
        write_profile(path, self.profile_data)

    def load_profile(self, path) -> None:
        """Use the start profile a run wrote (``RUN_DIR/profile.json``) rather than measuring it again."""
        self._data = read_profile(path, where=str(path))
        self._source = f"the start-of-training profile ({path})"

    def _measure(self, model, sigmas, kernels, prompts, *, image_from, seed, num_seeds, batch_size, purpose):
        c = self.config
        chosen = pick_prompts(prompts, c.num_prompts, seed)
        result = profile_model(
            model, sigmas, kernels, chosen, num_seeds=num_seeds, seed=seed, batch_size=batch_size,
            image_from=image_from, num_chunks=c.num_chunks, min_size=c.min_size, max_size=c.max_size or None,
            settings={"purpose": purpose, "chunker": dataclasses.asdict(c), "prompts": chosen},
        )
        self._data = profile_to_dict(result)
        self._source = f"the {purpose} profile"
        return result


@hookimpl(trylast=True)
def register_chunkers(register):
    register("step", StepChunker)
    register("sequence", SequenceChunker)
    register("fixed", FixedChunker)
    register("explicit", ExplicitChunker)
    register("dynamics", DynamicsChunker)


@hookimpl(trylast=True)
def default_component(kind):
    return "step" if kind == "chunker" else None
