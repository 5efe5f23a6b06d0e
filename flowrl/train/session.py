"""A recipe's components built and placed on a device: the one way to load a policy.

``flowrl train``, ``sample``, ``eval``, ``profile`` and ``export`` all start from a
:class:`Session`: the components the recipe names (built by their plugins), the device, the
sampler training uses (sigmas, one kernel per step, the number of trainable transitions) and a
per-prompt cache of text embeddings. :meth:`Session.load_policy` puts a checkpoint's trained
weights into the model (attaching the LoRA first when the run trained one).
"""

from __future__ import annotations

import contextlib
import functools
import threading

import dataclasses
from collections import OrderedDict
from pathlib import Path
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ..distributed import resolve_device, weights_from_rank_zero
from ..embeddings import EmbeddingStore, open_store, without_text_encoders
from ..errors import FlowrlError
from ..interfaces import TextEmbeddings, WarpsTime
from ..sampling.plans import PlanContext
from ..plugins import Registry, get_registry
from ..offline import read_offline_rows
from ..prompts import CACHED_PROMPTS, read_prompts
from ..recipe import Recipe, build_loss
from ..rewards import for_clips
from ..sampling.rollout import Sampler, make_kernels, trainable_mask
from .accel import default_attention, exact_float32
from .checkpoint import read_model_weights
from .evaluate import evaluation_set
from .finetune import load_trainable_state_dict, prepare_trainable


class RewardEntry(NamedTuple):
    """One ``[[rewards]]`` entry, built: its label (in logs), its weight, the reward."""

    label: str
    weight: float
    reward: Any


@dataclasses.dataclass
class Components:
    """Everything the recipe names, built."""

    model: Any
    schedule: Any
    kernel: Any
    chunker: Any
    selector: Any
    advantage: Any
    loss: Any
    rewards: list[RewardEntry]
    trackers: list[Any]
    window: Any = None


def build_components(recipe: Recipe, registry: Registry, *, rewards: bool = True, trackers: bool = True) -> Components:
    """Build every component of ``recipe``; rewards and trackers can be left out (they play no
    part in sampling and can be heavy)."""

    def build(section: str):
        choice = recipe.components[section]
        return registry.get(section, choice.use).build(choice.params)

    return Components(
        model=build("model"),
        schedule=build("schedule"),
        kernel=build("kernel"),
        chunker=build("chunker"),
        selector=build("selector"),
        advantage=build("advantage"),
        loss=build_loss(recipe, registry),  # as its [likelihood] serves it
        window=build("window"),
        rewards=[
            RewardEntry(c.label, c.weight, for_clips(registry.get("reward", c.use).build(c.params), c.frames))
            for c in recipe.rewards
        ] if rewards else [],
        trackers=[registry.get("tracker", t.use).build(t.params) for t in recipe.trackers] if trackers else [],
    )


def build_sampler(recipe: Recipe, components: Components, device: torch.device) -> Sampler:
    """The sampler training uses (``flowrl profile`` measures this one): the schedule's sigmas on
    ``device``, the kernel inside ``[sampler].sde_window`` (ODE outside), and T as validation
    computed it."""
    n = recipe.sampler.steps
    sigmas = components.schedule.sigmas(n, components.model).to(device=device, dtype=torch.float32)
    sde_window = tuple(recipe.sampler.sde_window) if recipe.sampler.sde_window else None
    return Sampler(
        sigmas=sigmas,
        kernels=make_kernels(n, components.kernel, sde_window),
        num_trainable=recipe.num_trainable,
        image_from=recipe.sampler.image_from,
        reduction=recipe.sampler.logprob_reduction,
    )


@contextlib.contextmanager
def staying_in_place(module: torch.nn.Module):
    """``module`` ignores ``.to()`` / ``.cuda()`` inside the block, so that an adapter's
    ``to(device)``, which moves every module it runs, moves all but this one."""
    module._apply = lambda fn, recurse=True: module  # an instance attribute shadows nn.Module._apply
    try:
        yield
    finally:
        del module._apply


def plan_context(recipe: Recipe, components: Components, sampler: Sampler) -> PlanContext:
    """What the ``[window]`` planner plans with (:class:`flowrl.sampling.plans.PlanContext`)."""
    schedule = components.schedule
    return PlanContext(
        num_steps=recipe.sampler.steps, sigmas=sampler.sigmas,
        trainable=trainable_mask(sampler.kernels, sampler.sigmas.cpu(), sampler.image_from),
        warp=schedule.sigma_at if isinstance(schedule, WarpsTime) else None, seed=recipe.run.seed,
        group_size=recipe.train.group_size, sde_window=tuple(recipe.sampler.sde_window),
    )


class PromptCache:
    """Text embeddings computed once per prompt and reused.

    Each prompt is encoded on its own, so its embedding does not depend on which other prompts
    happened to be new in the same iteration (batched matmuls may round differently with the
    batch size): an uninterrupted run and a resumed one see bit-identical embeddings. The cost
    is one encoder call per distinct prompt over the whole run.

    The cache lives in CPU memory and keeps the ``max_prompts`` most recently used prompts
    (:data:`flowrl.prompts.CACHED_PROMPTS`, which ``flowrl plan`` counts), so a large prompt set
    (HPDv2 has 100k+) neither fills the GPU nor grows without bound; an evicted prompt is
    re-encoded to the identical embedding. Only a batch's rows (:meth:`get`) go to the device.

    With a ``store`` (``[prompts] embeddings``, :mod:`flowrl.embeddings`) a prompt not cached is
    read from it instead of encoded: the store holds what :meth:`encode` gives, bit for bit.
    """

    def __init__(self, model, max_prompts: int = CACHED_PROMPTS, store: EmbeddingStore | None = None):
        self.model = model
        self.max_prompts = max_prompts
        self.store = store
        self.cache: OrderedDict[str, TextEmbeddings] = OrderedDict()
        # [pipeline] worker = "thread" draws rollouts beside the main thread's evaluation: both read
        # and evict here, and an OrderedDict is not safe to change from two threads at once
        self._lock = threading.Lock()

    @torch.no_grad()
    def encode(self, prompt: str) -> TextEmbeddings:
        """One prompt's embeddings as the cache keeps them (``[1, ...]`` each, on the CPU)."""
        return {k: v[:1].cpu() for k, v in self.model.encode_prompts([prompt]).items()}

    def require(self, prompts, what: str) -> None:
        """With a store, refuse (one message) when it lacks any of ``prompts`` (the ``what`` of the run)."""
        missing = self.store.missing(str(p) for p in prompts) if self.store is not None else []
        if missing:
            raise FlowrlError(f"{len(missing)} of the {what} are not in the prompt embeddings of "
                              f"{self.store.directory}, e.g. {missing[0]!r}",
                              hint="write the store again with them (`flowrl embed RECIPE -o NEW_DIR` embeds the "
                                   "recipe's training and evaluation prompts), or remove [prompts] embeddings")

    def get(self, prompts: list[str], device: torch.device | str = "cpu") -> TextEmbeddings:
        rows = {}
        with self._lock:
            for p in dict.fromkeys(prompts):
                if p in self.cache:
                    self.cache.move_to_end(p)
                    rows[p] = self.cache[p]
                    continue
                rows[p] = self.cache[p] = self.store.get(str(p)) if self.store is not None else self.encode(p)
                if len(self.cache) > self.max_prompts:
                    self.cache.popitem(last=False)
        keys = rows[prompts[0]].keys()
        return {k: torch.cat([rows[p][k] for p in prompts]).to(device) for k in keys}


class StoreEncodedModel:
    """The model, with ``encode_prompts`` answered by a run's prompt store (through its cache):
    what code that encodes prompts itself (the temporal-dynamics profile) is given when the
    model loaded no text encoder. Everything else is the model's."""

    def __init__(self, model, cache: PromptCache, device: torch.device):
        self._model, self._cache, self._device = model, cache, device

    def encode_prompts(self, prompts) -> TextEmbeddings:
        return self._cache.get(list(prompts), self._device)

    def __getattr__(self, name: str):
        return getattr(self._model, name)


@dataclasses.dataclass
class Session:
    """A recipe's built components on a device, with the training sampler and a prompt cache."""

    recipe: Recipe
    registry: Registry
    components: Components
    device: torch.device
    sampler: Sampler
    cache: PromptCache
    plan_context: PlanContext | None = None

    @classmethod
    def open(
        cls,
        recipe: Recipe,
        registry: Registry | None = None,
        *,
        device: torch.device | str | None = None,
        rewards: bool = True,
        trackers: bool = True,
        place_denoiser: bool = True,
        receive_weights: bool = False,
    ) -> Session:
        """Build the recipe's components and move the model to ``device`` (default: the recipe's
        ``[run].device``). ``place_denoiser=False`` leaves the denoiser where it was loaded (CPU
        memory) for FSDP2, which moves it to the device one block at a time as it shards it
        (:meth:`flowrl.train.parallel.Strategy.prepare`). ``receive_weights=True`` (an FSDP2
        process other than rank 0) lets the model adapter build the denoiser without weights, on
        the ``meta`` device: FSDP2 gives each block rank 0's weights as it shards it
        (:func:`flowrl.distributed.weights_from_rank_zero`)."""
        registry = registry or get_registry()
        if not isinstance(device, torch.device):
            device = resolve_device(device or recipe.run.device)
        default_attention(device)  # no faulting attention kernel before the loop's own context
        store = open_store(recipe)  # [prompts] embeddings: the model then loads no text encoder
        with weights_from_rank_zero(receive_weights), without_text_encoders(store is not None):
            components = build_components(recipe, registry, rewards=rewards, trackers=trackers)
        with contextlib.nullcontext() if place_denoiser else staying_in_place(components.model.denoiser):
            components.model.to(device)
        exact_float32(device, components.model.denoiser, recipe.distributed.mixed_precision,
                      getattr(components.model, "dtype", None))  # a diffusers model's compute dtype
        sampler = build_sampler(recipe, components, device)
        return cls(recipe, registry, components, device, sampler, PromptCache(components.model, store=store),
                   plan_context(recipe, components, sampler))

    @property
    def model(self):
        return self.components.model

    def run_prompts(self) -> tuple[Sequence[str], list[str]]:
        """The training prompts (``[prompts].source``) and the fixed evaluation set; with a prompt
        store, one message when it lacks any of them (before the first iteration, not at the first
        batch that draws one)."""
        cfg = self.recipe
        prompts = read_prompts(cfg.prompts.source, self.model, f"{cfg.source}: [prompts].source", cfg.prompts)
        eval_set = evaluation_set(cfg, self.model)
        table = read_offline_rows(cfg.data.path, f"{cfg.source}: [data].path").prompts if cfg.data.enabled else []
        self.cache.require([*prompts, *eval_set, *table], "run's prompts")
        return prompts, eval_set

    @property
    def encoding_model(self):
        """The model for code that encodes prompts itself: the model, or with a prompt store
        (``[prompts] embeddings``) the model with its prompts read from the store."""
        if self.cache.store is None:
            return self.model
        return StoreEncodedModel(self.model, self.cache, self.device)

    @functools.cached_property
    def eval_sigmas(self) -> torch.Tensor:
        """The evaluation's sigmas: ``[log].eval_steps`` of the recipe's schedule, or the
        training sampler's own when it is 0."""
        steps = self.recipe.log.eval_steps
        if not steps or steps == self.recipe.sampler.steps:
            return self.sampler.sigmas
        return self.components.schedule.sigmas(steps, self.model).to(device=self.device, dtype=torch.float32)

    def load_policy(self, checkpoint: Path) -> None:
        """Load a checkpoint's trained weights for inference: the LoRA is attached first when the
        run trained one, and afterwards nothing requires grad."""
        prepare_trainable(self.model, self.recipe.train, self.recipe.run.seed)
        load_trainable_state_dict(self.model.denoiser, read_model_weights(checkpoint))
        self.model.denoiser.requires_grad_(False)
        self.model.to(self.device)  # LoRA matrices are created on the CPU
