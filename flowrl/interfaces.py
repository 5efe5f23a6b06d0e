"""The small interfaces that components implement, with tensor shapes.

Shapes use: B samples, N sampling steps (N + 1 sigmas), T trainable transitions, K chunks,
``*L`` a model's latent shape (for FLUX, packed tokens ``[seq, channels]``).

Conventions (docs/api.md, algorithms.md section 1): sigma runs from 1 (noise) to 0 (data),
``x_sigma = (1 - sigma) * x0 + sigma * eps`` and the network predicts ``v = eps - x0``.
Every component is built from its recipe table by its registered factory; see
:mod:`flowrl.hookspecs`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

#: Text conditioning of a batch: named tensors, each with the batch on dim 0, so the engine can
#: index, repeat and cache them without knowing the model (FLUX: ``prompt_embeds [B, L, D]``,
#: ``pooled [B, P]``; SD3 adds negative embeddings for true CFG).
TextEmbeddings = dict[str, torch.Tensor]


def select_embeddings(text: TextEmbeddings, index: torch.Tensor) -> TextEmbeddings:
    """Rows ``index`` of every tensor in ``text`` (used to expand prompts to their groups)."""
    return {k: v.index_select(0, index.to(v.device)) for k, v in text.items()}


@runtime_checkable
class ModelAdapter(Protocol):
    """A flow-matching text-to-image model, as the engine sees it.

    Attributes:
        denoiser: the ``nn.Module`` that is trained (LoRA attaches here; DDP/FSDP wrap it).
            ``velocity`` must call it through ``self.denoiser(...)`` so a wrapped module is used.
        latent_shape: the shape ``*L`` of one sample's latent.
    """

    denoiser: torch.nn.Module
    latent_shape: tuple[int, ...]

    def encode_prompts(self, prompts: Sequence[str]) -> TextEmbeddings:
        """Encode ``B`` prompts (no grad). The engine caches the result per prompt."""

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, text: TextEmbeddings) -> torch.Tensor:
        """Velocity ``v [B, *L]`` at ``latents [B, *L]`` and noise level ``sigma [B]``.

        The adapter applies its own timestep convention (FLUX: ``sigma``; SD3: ``1000 * sigma``)
        and its guidance (FLUX's embedded guidance or SD3's true CFG, whose combined velocity
        is the policy).
        """

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` in [0, 1] (float32) from clean latents ``[B, *L]``."""

    def trainable_parameters(self) -> Iterable[torch.nn.Parameter]:
        """The parameters the optimizer updates (all, or only LoRA)."""

    def sigmas(self, num_steps: int) -> torch.Tensor | None:
        """The model's own schedule ``[N + 1]`` from 1 to 0, or None if it has none."""

    def prompt_source(self) -> Sequence[str] | None:
        """Prompts the model ships with (the embedded model's grammar), or None."""


class Schedule(Protocol):
    """``sigmas(N, model) -> Tensor[N + 1]``: decreasing float32 sigmas, 1 to 0."""

    def sigmas(self, num_steps: int, model: ModelAdapter | None = None) -> torch.Tensor: ...


class Kernel(Protocol):
    """One sampling step with a Gaussian transition ``N(mean, std^2 I)`` (algorithms.md 2-3).

    ``step`` samples ``x_{i+1}`` when ``next_sample`` is None, otherwise scores the given one;
    it returns a :class:`flowrl.sde.StepOutput` with ``next_sample [B, *L]``,
    ``log_prob [B]`` (float32), ``mean [B, *L]`` and ``std``.
    """

    is_stochastic: bool

    def step(
        self,
        velocity: torch.Tensor,
        sample: torch.Tensor,
        sigma: torch.Tensor,
        sigma_next: torch.Tensor,
        *,
        next_sample: torch.Tensor | None = None,
        generator: torch.Generator | Sequence[torch.Generator] | None = None,
        reduction: str = "mean",
    ) -> Any: ...


class Chunker(Protocol):
    """Splits T trainable transitions into consecutive chunks.

    ``sizes(T)`` returns K positive chunk sizes summing to T, or raises ``ValueError``
    saying what is wrong (e.g. what the sizes must sum to).
    """

    def sizes(self, num_transitions: int) -> tuple[int, ...]: ...


class ChunkSelector(Protocol):
    """Chooses which chunks each sample trains in one update.

    ``select(B, sizes, generator)`` returns a bool mask ``[B, K]``; every row selects at least
    one chunk. The engine logs the selected indices.
    """

    def select(
        self, num_samples: int, sizes: Sequence[int], generator: torch.Generator
    ) -> torch.Tensor: ...


class AdvantageEstimator(Protocol):
    """Rewards of a batch of groups to one advantage per sample.

    ``rewards`` maps each reward name to ``[B]`` scores, ``weights`` gives each reward's weight,
    ``group_ids [B]`` says which prompt group each sample belongs to. Returns ``[B]`` float32.
    Must equal the single-process result when the batch was gathered from several processes.
    """

    def __call__(
        self,
        rewards: Mapping[str, torch.Tensor],
        weights: Mapping[str, float],
        group_ids: torch.Tensor,
    ) -> torch.Tensor: ...


class PolicyLoss(Protocol):
    """The per-unit policy objective.

    ``objective(log_ratio [U], advantages [U]) -> [U]`` is differentiable in ``log_ratio``
    (a unit's mean step log-ratio: a step, a chunk, or the sequence). The engine averages it over
    the trained units of each sample and over samples, and back-propagates it one step at a
    time (see :mod:`flowrl.chunk_update`). ``beta`` and ``kl`` name an optional KL term.
    """

    beta: float
    kl: str

    def objective(self, log_ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor: ...


@dataclasses.dataclass
class RewardOutput:
    """``scores [B]`` float32, plus named ``extras`` (each ``[B]``) that are logged."""

    scores: torch.Tensor
    extras: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


@runtime_checkable
class Reward(Protocol):
    """Scores images against prompts.

    ``__call__(images [B, 3, H, W] float in [0, 1], prompts list[str], metadata=None)``
    returns a :class:`RewardOutput` (or a ``[B]`` tensor). Runs batched under no_grad.
    A reward that cannot score raises: it never returns a sentinel value.
    """

    name: str

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Mapping[str, Any] | None = None
    ) -> RewardOutput | torch.Tensor: ...


class FunctionReward:
    """A plain function ``fn(images, prompts, **kwargs) -> Tensor[B]`` as a :class:`Reward`."""

    def __init__(self, fn: Callable[..., torch.Tensor], *, name: str, kwargs: Mapping[str, Any] | None = None):
        self.fn = fn
        self.name = name
        self.kwargs = dict(kwargs or {})

    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        with torch.no_grad():
            scores = self.fn(images, list(prompts), **self.kwargs)
        return RewardOutput(scores=torch.as_tensor(scores, dtype=torch.float32).reshape(-1))


def score(reward: Reward, images: torch.Tensor, prompts: Sequence[str], metadata=None) -> RewardOutput:
    """Call a reward and check its output: ``[B]`` finite-or-not float32 scores, one per image."""
    out = reward(images, prompts, metadata)
    if not isinstance(out, RewardOutput):
        out = RewardOutput(scores=torch.as_tensor(out))
    scores = out.scores.detach().to(torch.float32).reshape(-1).cpu()
    if scores.shape[0] != images.shape[0]:
        raise ValueError(
            f"reward '{reward.name}' returned {scores.shape[0]} scores for {images.shape[0]} images"
        )
    return RewardOutput(scores=scores, extras={k: v.detach().float().cpu() for k, v in out.extras.items()})


class Tracker(Protocol):
    """Receives metrics and images each step (metrics.jsonl is always written separately)."""

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def log_image(self, step: int, name: str, image: Any) -> None: ...

    def close(self) -> None: ...
