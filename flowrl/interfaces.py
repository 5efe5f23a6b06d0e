"""The small interfaces that components implement, with tensor shapes.

Shapes use: B samples, N sampling steps (N + 1 sigmas), T trainable transitions, K chunks,
``*L`` a model's latent shape (for FLUX, packed tokens ``[seq, channels]``).

Conventions (docs/api.md, docs/api.md §1): sigma runs from 1 (noise) to 0 (data),
``x_sigma = (1 - sigma) * x0 + sigma * eps`` and the network predicts ``v = eps - x0``.
Every component is built from its recipe table by its registered factory; see
:mod:`flowrl.hookspecs`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
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
        """Images ``[B, 3, H, W]`` in [0, 1] (float32) from clean latents ``[B, *L]``; a video
        model returns clips ``[B, F, 3, H, W]`` (F frames) and its ``*L`` usually carries the
        frames axis too (the engine never looks inside ``*L``). docs/video.md."""

    def trainable_parameters(self) -> Iterable[torch.nn.Parameter]:
        """The parameters the optimizer updates (all, or only LoRA)."""

    def sigmas(self, num_steps: int) -> torch.Tensor | None:
        """The model's own schedule ``[N + 1]`` from 1 to 0, or None if it has none."""

    def prompt_source(self) -> Sequence[str] | None:
        """Prompts the model ships with (the embedded model's grammar), or None. A model class
        whose answer is None may say so without being built (``ships_prompts = False``), so that
        ``flowrl validate`` refuses ``[prompts] source = "model"`` before the model loads."""

    def to(self, device: torch.device) -> Any:
        """Move every module the adapter runs (denoiser, encoders, decoder) to ``device``."""


# ------------------------------------------------------------------ optional model capabilities
# The engine and the commands check these with ``isinstance``; an adapter implements the ones
# it supports. The conformance suite (:mod:`flowrl.testing.conformance`) tests each one an
# adapter claims.


@runtime_checkable
class EncodesImages(Protocol):
    """An adapter that turns images back into its clean latents (the "VAE" encoder): what
    training from an offline dataset of images needs (:mod:`flowrl.offline`). Optional: the image
    models implement it (the embedded ones exactly: their pixel "VAE" gives decode(encode(x)) = x up
    to float rounding; the diffusers ones through their VAE, whose round trip loses detail)."""

    #: ``(height, width)`` in pixels of the images it encodes (offline images are resized to it)
    image_size: tuple[int, int]

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Clean latents ``[B, *L]`` (``L = latent_shape``) of images ``[B, 3, H, W]`` in [0, 1]
        at :attr:`image_size`."""


@runtime_checkable
class HasReferencePolicy(Protocol):
    """An adapter that runs the model before RL itself (e.g. its LoRA disabled), for KL terms
    and hybrid inference, instead of the engine keeping a frozen copy of the denoiser."""

    def snapshot_reference(self) -> None:
        """Called once, before the first update: fix the reference to the current weights."""

    def reference_velocity(self, latents: torch.Tensor, sigma: torch.Tensor, text: TextEmbeddings) -> torch.Tensor:
        """``velocity`` of the reference model, without gradient.

        An adapter that keeps a frozen copy for it should also expose it as a settable
        ``reference_module`` attribute (None when it keeps none): the engine then places that copy
        as it places its own (sharded like the denoiser under FSDP2, in CPU memory with
        ``[train].reference_on_cpu``) instead of a whole copy on every GPU."""


@dataclasses.dataclass(frozen=True)
class BenchmarkSuite:
    """A benchmark a model carries with it (``flowrl eval --suite NAME``): its prompts, how many
    images of each, each prompt's category, and the scorer (``score(images, prompts)`` -> one
    :class:`flowrl.geneval.PromptScore` per image, whose ``strict`` verdicts make the table).
    It takes precedence over flowrl's suite of the same name (:data:`flowrl.suites.SUITES`: prompt
    sets scored by a reward, for any model); both are tabulated by the same code."""

    name: str
    prompts: list[str]
    images_per_prompt: list[int]
    categories: list[str]
    score: Callable[[torch.Tensor, list[str]], list]
    steps: int | None = None  # the benchmark's sampling steps (None: the recipe's)
    description: str = ""


@runtime_checkable
class HasBenchmarkSuites(Protocol):
    """An adapter that ships benchmarks of its own world (the compositional embedded model: GenEval
    over its held-out prompts, scored by its embedded detector)."""

    def benchmark_suite(self, name: str) -> BenchmarkSuite | None:
        """The suite called ``name``, or None when the model has none by that name."""


@runtime_checkable
class DeclaresTimestep(Protocol):
    """An adapter whose network's time runs differently from sigma (Z-Image: ``t = 1 - sigma``)
    declares the map; the conformance suite then checks the denoiser receives exactly it."""

    def timestep_from_sigma(self, sigma: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class CountsForwards(Protocol):
    """An adapter whose velocity runs its network on more than one row per sample (true
    classifier-free guidance: 2). Compute accounting uses it for the algorithmic minimum."""

    forwards_per_velocity: int


@runtime_checkable
class HasImageSeqLen(Protocol):
    """An adapter that knows its packed image sequence length (FLUX's dynamic shift needs it)."""

    image_seq_len: int


@runtime_checkable
class TakesConditionImage(Protocol):
    """An image-editing adapter: every prompt carries a condition image
    (:class:`flowrl.prompts.PromptRow`), which ``encode_prompts`` resizes to ``condition_size``
    ``(height, width)`` and encodes into the text embeddings (batch on dim 0), so ``velocity``
    sees it without anything else changing. The conformance suite gives such an adapter prompts
    with condition images and checks that the velocity depends on them."""

    condition_size: tuple[int, int]


@runtime_checkable
class HasLoraTargets(Protocol):
    """An adapter with default LoRA target modules (used when ``[train].lora_targets`` is empty)."""

    lora_targets: list[str]


@runtime_checkable
class SavesLora(Protocol):
    """An adapter that writes its trained LoRA in its pipeline's format (``flowrl export``)."""

    def save_lora(self, out: Path) -> None:
        """Write the LoRA into directory ``out`` (e.g. loadable by ``pipe.load_lora_weights``)."""


@runtime_checkable
class SavesPretrained(Protocol):
    """An adapter (or a denoiser module) that writes itself with ``save_pretrained``."""

    def save_pretrained(self, out: Path) -> None:
        """Write the whole model into directory ``out``."""


@runtime_checkable
class DiffusersLoraModule(Protocol):
    """A denoiser module with diffusers' LoRA methods (``diffusers.loaders.PeftAdapterMixin``):
    flowrl attaches LoRA with ``add_adapter`` (so ``save_lora_weights`` works) and exports it
    with ``save_lora_adapter``, or merges it with ``fuse_lora`` + ``unload_lora``."""

    def add_adapter(self, adapter_config: Any) -> None: ...

    def save_lora_adapter(self, save_directory: str) -> None: ...

    def fuse_lora(self) -> None: ...

    def unload_lora(self) -> None: ...


@runtime_checkable
class HasShardableBlocks(Protocol):
    """An adapter that names its denoiser's transformer blocks: FSDP2 shards, and activation
    checkpointing recomputes, block by block (``[distributed]``, docs/distributed.md). Without
    it, flowrl takes the modules of every ``nn.ModuleList`` whose attribute name ends in
    ``blocks`` (diffusers' FLUX and SD3 transformers: ``transformer_blocks``,
    ``single_transformer_blocks``)."""

    def shardable_blocks(self) -> Sequence[torch.nn.Module]:
        """The denoiser's blocks, each a submodule of ``denoiser``, none inside another."""


@runtime_checkable
class PlansMemory(Protocol):
    """A model's params dataclass that can tell ``flowrl plan`` its sizes without loading
    weights: ``memory_spec()`` returns a :class:`flowrl.memory_plan.ModelMemory`."""

    def memory_spec(self) -> Any: ...


@runtime_checkable
class Schedule(Protocol):
    """``sigmas(N, model) -> Tensor[N + 1]``: decreasing float32 sigmas, 1 to 0."""

    def sigmas(self, num_steps: int, model: ModelAdapter | None = None) -> torch.Tensor: ...


@runtime_checkable
class WarpsTime(Protocol):
    """A schedule that is a function of uniform time: ``sigmas(N)`` is ``sigma_at(linspace(1, 0,
    N + 1))``. MixGRPO-Flash's compression evaluates it between the grid points."""

    def sigma_at(self, t: torch.Tensor) -> torch.Tensor:
        """float64 sigmas at uniform times ``t`` in [0, 1] (1 = noise)."""


@runtime_checkable
class Kernel(Protocol):
    """One sampling step with a Gaussian transition ``N(mean, std^2 I)`` (docs/api.md).

    ``step`` samples ``x_{i+1}`` when ``next_sample`` is None, otherwise scores the given one;
    it returns a :class:`flowrl.sampling.kernels.StepOutput` with ``next_sample [B, *L]``,
    ``log_prob [B]`` (float32), ``mean [B, *L]`` and ``std [B]``. ``stochastic_at`` says
    whether the step from ``sigma`` to ``sigma_next`` injects noise (only such steps are
    trainable). The built-in kernels are in :mod:`flowrl.sampling.kernels`.
    """

    def stochastic_at(self, sigma: float, sigma_next: float) -> bool: ...

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


@runtime_checkable
class ScalesFlowGRPOKL(Protocol):
    """A kernel that says what Flow-GRPO's KL divides by: its ``std_dev_t``. For the SDE kernels
    that is the diffusion coefficient ``g = std / sqrt(sigma - sigma_next)``; for ``cps`` it is
    the step std itself (Flow-GRPO's cps ``std_dev_t``), so kind ``flow_grpo`` then equals
    ``gaussian_exact`` (docs/api.md §8)."""

    def flow_grpo_scale(self, std: torch.Tensor, sigma, sigma_next) -> torch.Tensor:
        """float32 ``[B]``: the divisor ``c`` of ``mean((mu - mu_ref)^2) / (2 c^2)``."""


@runtime_checkable
class WindowPlanner(Protocol):
    """Where each rollout's SDE window sits (``[window]``): the steps sampled with the kernel and
    trained, the solver elsewhere, and the schedule (:mod:`flowrl.sampling.plans`).

    ``num_trainable(context)`` is T, the same at every iteration (the chunk layout needs it).
    ``plan(iteration, keys, context)`` returns a :class:`flowrl.sampling.plans.RolloutPlan` for the
    samples with global indices ``keys``, or None for the run's static sampler (one kernel per
    step, ``[sampler].sde_window``). ``context`` is a :class:`flowrl.sampling.plans.PlanContext`: the
    number of steps, the run's sigmas, which steps could be trained, the schedule's time warp
    (None unless the schedule is :class:`WarpsTime`), the seed and the group size. A plan must
    depend only on (seed, iteration, keys), never on the process layout."""

    def num_trainable(self, context: Any) -> int: ...

    def plan(self, iteration: int, keys: Sequence[int], context: Any) -> Any: ...


@runtime_checkable
class SamplesTrees(Protocol):
    """A ``[window]`` planner whose rollouts are trees (BranchGRPO; ``[window] use = "branch"``):
    ``tree()`` is the shape (a :class:`flowrl.sampling.branching.Tree`). Its ``plan`` is None: the tree samples with the
    sampler's own kernels (``[sampler].sde_window``), one whole group per sub-batch and process.
    The collect phase samples with :func:`flowrl.sampling.branching.branch_rollout` on that tree, the
    update counts the forwards it ran (``Tree.forward_rows``), and a tree advantage reads its nodes from it."""

    def tree(self) -> Any: ...


@runtime_checkable
class AdvantagesOnTrees(Protocol):
    """An ``[advantage]`` estimator that gives each transition of a tree rollout its own advantage
    (BranchGRPO's tree advantage; ``[advantage] use = "tree"``). Called as any estimator first
    (one advantage per sample, over every process's groups), then on this process's whole groups:
    ``on_tree(advantages [B], trajectory, tree, group_size, iteration)`` -> :class:`flowrl.sampling.branching.TreeAdvantages`.
    ``check_tree(tree, trainable_steps, num_steps, group_size)`` raises ``ValueError`` (one message,
    naming the estimator's key) where its parameters do not fit the tree and the sampler; recipe
    validation calls it. It runs only with a :class:`SamplesTrees` window and step units."""

    def check_tree(self, tree: Any, trainable_steps: Sequence[int], num_steps: int, group_size: int) -> None: ...

    def on_tree(self, advantages: torch.Tensor, trajectory: Any, tree: Any, group_size: int,
                iteration: int) -> Any: ...


@runtime_checkable
class Chunker(Protocol):
    """Splits T trainable transitions into consecutive chunks.

    ``sizes(T)`` returns K positive chunk sizes summing to T, or raises ``ValueError``
    saying what is wrong (e.g. what the sizes must sum to).
    """

    def sizes(self, num_transitions: int) -> tuple[int, ...]: ...


@runtime_checkable
class ProfilingChunker(Protocol):
    """A chunker whose boundaries come from profiling the model with the training sampler
    (the ``dynamics`` chunker). ``needs_model`` is True while it has no profile: recipe
    validation then cannot check its sizes, and training calls :meth:`profile_at_start` first
    (and saves the profile into the run directory with :meth:`save_profile`); a resumed run reads
    that file back with :meth:`load_profile` instead of measuring the same profile again."""

    needs_model: bool

    def profile_at_start(self, model: ModelAdapter, sigmas: torch.Tensor, kernels: Sequence[Any],
                         prompts: Sequence[str], *, image_from: str = "x0_hat", seed: int = 0) -> Any:
        """Measure the model's temporal dynamics; afterwards :meth:`sizes` answers."""

    def save_profile(self, path: Path) -> None:
        """Write the profile in use (``profile.json`` layout) to ``path``."""

    def load_profile(self, path: Path) -> None:
        """Use the profile :meth:`save_profile` wrote (a resumed run's start profile); afterwards
        :meth:`sizes` answers as after the :meth:`profile_at_start` that measured it."""


@runtime_checkable
class AdaptiveChunker(Protocol):
    """A chunker that re-profiles the current policy every ``reprofile_every`` iterations
    (0 = never) and moves its boundaries; the sizes in use are checkpointed and restored with
    :meth:`set_sizes`."""

    reprofile_every: int

    def reprofile(self, model: ModelAdapter, sigmas: torch.Tensor, kernels: Sequence[Any],
                  prompts: Sequence[str], *, image_from: str = "x0_hat", seed: int = 0) -> tuple[Any, tuple[int, ...]]:
        """Re-measure; returns ``(old sizes or None, new sizes)``."""

    def set_sizes(self, sizes: Sequence[int]) -> None:
        """Pin the layout (restored from a checkpoint)."""


@runtime_checkable
class CurveSource(Protocol):
    """A chunker that knows the mean L1rel of each trainable transition (from its profile)."""

    def l1rel(self, num_transitions: int) -> torch.Tensor:
        """float32 ``[T]``, the relative L1 change of each trainable transition."""


@runtime_checkable
class ChunkSelector(Protocol):
    """Chooses which chunks each sample trains in one update.

    ``select(B, sizes, generator)`` returns a bool mask ``[B, K]``; every row selects at least
    one chunk. The engine logs the selected indices.
    """

    def select(
        self, num_samples: int, sizes: Sequence[int], generator: torch.Generator
    ) -> torch.Tensor: ...


@runtime_checkable
class CurveWeightedSelector(Protocol):
    """A selector whose chunk weights come from a per-transition L1rel curve ``l1rel [T]``.

    When ``has_own_profile`` is False the engine hands it the chunker's curve (a
    :class:`CurveSource`), again after every adaptive re-profiling; the curve in use is
    checkpointed.
    """

    l1rel: torch.Tensor | None
    has_own_profile: bool


@runtime_checkable
class SelectsFromRollout(Protocol):
    """A selector whose chunk weights come from each sample's own rollout (GCPO's weighted
    sampling): ``select_from_rollout(B, sizes, generators, l1rel [B, T])`` with the per-sample
    relative L1 change of every trainable transition of the current rollout
    (:func:`flowrl.selection.rollout_l1rel`)."""

    def select_from_rollout(self, num_samples: int, sizes: Sequence[int], generators: Any,
                            l1rel: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class SelectsPerGroup(Protocol):
    """A selector whose draw the samples of one prompt group share (Flash-GRPO's iso-temporal
    grouping): ``select_per_group(B, sizes, generators, group_ids [B])``. The engine seeds row
    ``b``'s generator by (seed, iteration, ``group_ids[b]``), the same in every pass over the
    rollout, so a group split over micro-batches or processes draws the same units in each part
    and a sample trains the same units in every pass."""

    def select_per_group(self, num_samples: int, sizes: Sequence[int], generators: Any,
                         group_ids: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class SelectsByStepStd(Protocol):
    """A selector that ranks units by the entropy of the policy's Gaussian step (E-GRPO):
    ``select_from_std(B, sizes, generators, std [B, T])`` with the kernel's std at every
    trainable transition of each sample of the current rollout
    (:meth:`flowrl.sampling.trajectory.Trajectory.position_std`)."""

    def select_from_std(self, num_samples: int, sizes: Sequence[int], generators: Any,
                        std: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
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


@runtime_checkable
class UsesImageFeatures(Protocol):
    """An estimator that also needs a feature vector per image (a group-diversity bonus): the
    engine calls ``features(images [B, 3, H, W]) -> [B, F]`` on each process's images, gathers
    them like the rewards, and passes ``features=`` (``[S, F]``, every sample of the iteration)
    to the estimator's call."""

    def features(self, images: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class LikelihoodEstimator(Protocol):
    """Where a ratio-based loss reads a sample's log-likelihood (``[likelihood]``):
    ``objective(loss)`` returns what the update runs for the recipe's ``[loss]`` (the loss itself,
    or an :class:`Objective` around its unit objective), or raises ``ValueError`` saying why this
    estimator cannot serve that loss. A :class:`PolicyLoss` that is defined on one estimator only
    says so with ``requires_likelihood`` (its name)."""

    def objective(self, loss: Any) -> Any: ...


@runtime_checkable
class PolicyLoss(Protocol):
    """A loss of the ratio-based family: its *unit objective* (not an :class:`Objective`, which
    is what an update optimises; the ``PolicyGradient`` objective runs this one).

    ``objective(log_ratio [B, K], advantages [B, K]) -> [B, K]`` is differentiable in
    ``log_ratio`` (a unit's mean step log-ratio: a step, a chunk, or the sequence) and
    elementwise in the units. The engine averages it over the trained units of each sample and
    over samples, and back-propagates it one step at a time (see
    :mod:`flowrl.objectives.chunk_gradient`).
    """

    objective: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@runtime_checkable
class KLRegularised(Protocol):
    """A loss with a KL term: weight ``beta`` (0 = none) and ``kl``, one of
    ``gaussian_exact``, ``flow_grpo`` or ``old_policy_k3`` (docs/api.md, KL kinds)."""

    beta: float
    kl: str


@runtime_checkable
class NeedsReferencePolicy(Protocol):
    """A ``[loss]`` that is not :class:`KLRegularised` but runs a frozen reference of the starting
    policy itself (DiffusionNFT's velocity KL, ``beta_kl > 0``): when ``needs_reference()`` says
    so, the engine fixes the reference before the denoiser is sharded, lays it out like the
    denoiser (``Strategy.prepare_frozen``: sharded under fsdp2, ``[train].reference_on_cpu``) and
    hands it over as the update context's ``kl.reference``."""

    def needs_reference(self) -> bool: ...


@runtime_checkable
class ChoosesKLForm(Protocol):
    """A loss with KL kind ``old_policy_k3`` that says its direction, applied to every trained
    transition's log-ratio ``z``: ``kl_direction`` ``"old_theta"`` (``e^z - 1 - z``,
    KL(pi_old || pi_theta) from pi_old's samples) or ``"theta_old"`` (``e^-z - 1 + z``, GCPO's and
    DeepSeekMath's form; GCPO applies it to the chunk's mean log-ratio, flowrl per step)."""

    kl_direction: str


@runtime_checkable
class NormalisesStepRatio(Protocol):
    """A loss whose step log-ratio is not ``l - l_old`` but a transform of the re-scored step
    (GRPO-Guard): ``step_ratio(out, old)`` maps the kernel's :class:`flowrl.sampling.kernels.StepOutput`
    ``out`` of a trainable position and the rollout's :class:`flowrl.sampling.trajectory.Position`
    ``old`` (its states, sigmas, log-prob and proposal mean) to the log-ratio ``[n]`` used in the
    unit ratios, with gradient. The rollout keeps the proposal means for it."""

    def step_ratio(self, out: Any, old: Any) -> torch.Tensor: ...


@runtime_checkable
class ReportsClipping(Protocol):
    """An objective that can say where its clipped branch is active (logged as clip_fraction)."""

    def clip_mask(self, log_ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        """bool, ``log_ratio``'s shape: True where the unit's gradient is clipped to zero."""


@runtime_checkable
class Objective(Protocol):
    """What an update optimises (the ``[loss]`` component, or what it runs as): it owns the whole
    forward and backward of every micro-batch, so that objectives with nothing in common (a
    likelihood ratio per chunk, a forward-process regression) run in the same update.

    The update (:class:`flowrl.train.update.PolicyUpdate`) keeps the optimizer, the LR schedule,
    the distributed strategy, the passes over a rollout, gradient clipping, skipping non-finite
    steps and the on-policy check. It calls, in this order::

        prepare(ctx)                     once, before any update and before a resume loads
                                         weights (e.g. take an old copy of the weights)
        start_rollout(ctx, batch, sizes) after the advantages of an iteration
        backward(ctx, micro)             per micro-batch: back-propagate its loss (gradients
                                         accumulate into the parameters' .grad; the update
                                         clips and steps); returns a MicroBatchResult
        end_rollout(ctx, batch)          after the rollout's last optimizer step; returns
                                         metrics (already reduced over processes) for the row

    ``ctx`` is a :class:`flowrl.objectives.base.UpdateContext`, the same object every call: the
    model, the device, the seed, the process layout, the compute counter, the selector, the
    lockstep agreement, the trainable parameters, the KL settings and reference
    (``ctx.kl``), the update mode and the optimizer-step count, typed; an objective needs
    nothing else of the update. ``micro`` is a :class:`flowrl.objectives.base.MicroBatch` (the
    iteration's batch, the micro-batch's rows, the chunk layout, the pass, the normaliser, and
    on the first, on-policy optimizer step the probe to feed re-scored log-probs to); the result
    a :class:`flowrl.objectives.base.MicroBatchResult` (the loss terms, the metrics, the units
    each row trained). Build on :class:`flowrl.objectives.policy_gradient.PolicyGradient` to add
    to the ratio-based family (as GARDO does), or write the backward from scratch (as DiffusionNFT
    does; docs/objectives.md, "Writing an objective").

    ``uses_units``: the chunk layout (chunker, selector) and the sampler's trainable transitions
    apply (the ratio-based family, ``policy_gradient``); False for objectives that need no
    trajectory log-probs (``nft``), which then train with any sampler."""

    # The annotations name flowrl.objectives.base's classes without importing them: that module
    # builds on this one (its context holds a ModelAdapter and a ChunkSelector).
    uses_units: bool

    def prepare(self, ctx: UpdateContext) -> None: ...  # noqa: F821

    def start_rollout(self, ctx: UpdateContext, batch: Any, sizes: Sequence[int]) -> None: ...  # noqa: F821

    def backward(self, ctx: UpdateContext, micro: MicroBatch) -> MicroBatchResult: ...  # noqa: F821

    def end_rollout(self, ctx: UpdateContext, batch: Any) -> dict[str, Any]: ...  # noqa: F821


def trains_on_units(loss) -> bool:
    """Whether the built ``[loss]`` (a :class:`PolicyLoss`, or an :class:`Objective` as its
    likelihood serves it) trains on the trajectory's units: False for an objective with
    ``uses_units`` False (DiffusionNFT, any loss on the ELBO), whose run never reads the chunk layout."""
    return not (isinstance(loss, Objective) and not loss.uses_units)


@runtime_checkable
class SamplesWithOwnWeights(Protocol):
    """An objective whose rollouts are drawn with other weights than the trained ones
    (DiffusionNFT samples with its old policy): ``rollout_weights()`` is a context manager
    inside which the model's trainable weights are those."""

    def rollout_weights(self) -> Any: ...


@runtime_checkable
class KeepsRolloutMeans(Protocol):
    """An objective that needs the rollout's proposal means at the trainable transitions
    (``Trajectory.means``) when ``keep_means`` is True (GRPO-Guard's normalised ratio)."""

    keep_means: bool


@runtime_checkable
class NeedsReferenceCopy(Protocol):
    """An objective that acts on the KL reference as a frozen copy of the denoiser (GARDO resets
    it to the current weights) when ``needs_reference_copy`` is True. Only full fine-tuning with a
    reference KL term keeps such a copy (with LoRA the reference is the base with the adapter
    off): ``flowrl validate`` refuses the other recipes from this declaration
    (:func:`flowrl.recipe.keeps_reference_copy`), before any model loads."""

    needs_reference_copy: bool


@runtime_checkable
class TrainsOnData(Protocol):
    """An objective that trains on an offline table (``[data]``, :mod:`flowrl.offline`) instead of
    rollouts: ``data_kind`` is the kind of table it reads, ``"images"`` (SFT) or ``"pairs"``
    (DPO). The iteration's batch then holds the table's rows (``Batch.data``), not a trajectory.
    ``flowrl validate`` refuses such a loss without ``[data]``, and ``[data]`` with any other loss."""

    data_kind: str


@runtime_checkable
class CheckpointsState(Protocol):
    """An objective with state that must survive a resume (an old policy, a reset reference, an
    adaptive gate): ``state_dict()`` (JSON-able) and ``tensors()`` are written into every
    checkpoint and handed back to ``load_state(state, tensors)``."""

    def state_dict(self) -> dict[str, Any]: ...

    def tensors(self) -> dict[str, torch.Tensor]: ...

    def load_state(self, state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None: ...


@dataclasses.dataclass
class RewardOutput:
    """``scores [B]`` float32, plus named ``extras`` (each ``[B]``) that are logged."""

    scores: torch.Tensor
    extras: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


@runtime_checkable
class Reward(Protocol):
    """Scores images against prompts.

    ``__call__(images [B, 3, H, W] float in [0, 1], prompts list[str], metadata=None)``; from
    a video model the engine hands it one frame per row (a clip's prompt repeated), unless it
    declares :class:`ScoresClips` and gets clips ``[B, F, 3, H, W]``.
    returns a :class:`RewardOutput` (or a ``[B]`` tensor). Runs batched under no_grad.
    A reward that cannot score raises: it never returns a sentinel value.
    """

    name: str

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Mapping[str, Any] | None = None
    ) -> RewardOutput | torch.Tensor: ...


@runtime_checkable
class ScoresClips(Protocol):
    """A reward that scores whole clips ``[B, F, 3, H, W]`` (motion, temporal consistency):
    ``scores_clips = True``. Any other reward is an image reward, and a video run scores it frame
    by frame, then aggregates (the ``[[rewards]]`` key ``frames``: ``mean``, ``first``, ``last``,
    ``min``); docs/video.md. A plain function declares it with ``fn.scores_clips = True``."""

    scores_clips: bool


@runtime_checkable
class ScoresLatents(Protocol):
    """A reward that scores the model's clean latents ``[B, *L]`` (sigma 0, the rollout's last
    state, the tensor ``decode`` would take) instead of decoded images: ``scores_latents = True``.
    It is called as ``reward(latents, prompts, metadata)``; when every reward of a run scores
    latents (and no advantage needs image features), training never decodes: no ``decode`` phase,
    ``compute/decoded`` 0. Evaluation still decodes, for its grids. A plain function declares it
    with ``fn.scores_latents = True``. Such a reward is tied to its model's latent space, so it
    cannot be served over HTTP (the server receives images)."""

    scores_latents: bool


def scores_latents(reward) -> bool:
    """Whether ``reward`` declares :class:`ScoresLatents`."""
    return isinstance(reward, ScoresLatents) and bool(reward.scores_latents)


@runtime_checkable
class RewardPlacement(Protocol):
    """A reward's params that say where its model lives: ``device``, the weights' ``dtype``
    (``auto``, ``float32``, ``float16``, ``bfloat16``) and ``offload`` (kept on the CPU between
    calls). ``flowrl plan`` reads them."""

    device: str
    dtype: str
    offload: bool


@runtime_checkable
class PlansRewardMemory(Protocol):
    """A reward's params that can tell ``flowrl plan`` the bytes its model occupies on the device
    (``None``: not known for this choice of weights, so not counted) and say in ``memory_note``
    what the figure is (e.g. ``"Qwen2-VL-7B, 8.29e9 params"``)."""

    memory_note: str

    def memory_bytes(self) -> int | None: ...


@runtime_checkable
class Tracker(Protocol):
    """Receives metrics and images each step (metrics.jsonl is always written separately)."""

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def log_image(self, step: int, name: str, image: Any) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class NeedsRunDir(Protocol):
    """A tracker that must know the run directory before the first iteration (to put its files
    there); ``start`` is called once, on the main process."""

    def start(self, run_dir: Path) -> None: ...


@runtime_checkable
class RewindsOnResume(Protocol):
    """A tracker that drops what it logged at iteration ``step`` and later: a resumed run redoes
    the iterations after its checkpoint and logs them again (``metrics.jsonl`` drops its own rows
    of them). Called once, before ``start``, when a run resumes at ``step``."""

    def rewind(self, step: int) -> None: ...
