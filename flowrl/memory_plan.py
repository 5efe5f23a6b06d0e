"""The memory plan behind ``flowrl plan``: an estimate of peak GPU memory per process.

Needs no GPU and no weights. The estimate adds, per process:

- persistent: the denoiser's weights, the trainable parameters' gradients and AdamW state
  (two moments in the trainable dtype: LoRA trains in fp32), a frozen reference copy (full
  fine-tuning with a KL term), text encoders / VAE / reward model when not offloaded, the stored
  trajectories (fp32 latents of every step) and the text embeddings of the iteration's samples;
- plus the largest transient of one phase: encoding (offloaded text encoders visit the GPU),
  rollout (every local sample in one batch, no grad), decoding (VAE and its activations),
  scoring (an offloaded reward model), or the update (activations of one micro-batch forward
  with grad; with gradient checkpointing only block inputs plus one block are kept);
- 1.5 GB for the CUDA context and allocator slack.

Kept in CPU memory (phase ``cpu``, not in the GPU peak): offloaded shards, a CPU reference copy,
and the prompt-embedding cache (at most :data:`flowrl.prompts.CACHED_PROMPTS` prompts).

Where the numbers come from: parameter counts are exact (models instantiated on the ``meta``
device from their configs); activation constants are measured by running a one-block replica of
the model's transformer on the CPU and counting the tensors autograd saves. A model's params
provide these through ``memory_spec()`` (:class:`flowrl.interfaces.PlansMemory`); without it,
the model is built (fine for small models) and measured directly. Reward models declare
``memory_bytes()`` on their params
(:class:`flowrl.interfaces.PlansRewardMemory`); one that does not is listed, uncounted. This is an
estimate: measure the real peak on the first iterations (``torch.cuda.max_memory_allocated``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from flowrl.distributed import choose_strategy
from flowrl.errors import FlowrlError
from flowrl.geometry import resolve_geometry
from flowrl.interfaces import HasLoraTargets, PlansMemory, PlansRewardMemory, RewardPlacement
from flowrl.offline import CACHED_LATENTS
from flowrl.plugins import get_registry
from flowrl.prompts import CACHED_PROMPTS, TABLE_SUFFIXES, distinct_rows, read_prompts
from flowrl.recipe import build_component, build_loss, keeps_reference_copy, uses_units

GB = 1024**3
#: Bytes of the CUDA context plus allocator fragmentation, added once.
CUDA_OVERHEAD = int(1.5 * GB)
#: Live activations of a forward WITHOUT grad, in elements per token per unit of width: q, k, v,
#: attention output, the 4x MLP hidden and its activation, residuals, norms' upcasts.
INFERENCE_WIDTHS = 17.2  # FLUX.1-dev at full size under torch's MemTracker (benchmarks/memory_plan.py)


@dataclasses.dataclass
class ModelMemory:
    """What ``flowrl plan`` needs to know about a model (see the module docstring)."""

    denoiser_params: int
    denoiser_bytes: int  # storage bytes per denoiser weight
    compute_bytes: int  # bytes per activation element
    frozen: dict[str, tuple[int, int]]  # component -> (parameters, bytes per parameter)
    offload_frozen: bool
    lora_shapes: dict[str, tuple[int, int]] | None  # denoiser Linear layers, for LoRA sizes
    default_lora_targets: list[str]
    tokens: int  # tokens per sample in one transformer forward (image + text)
    width: int
    blocks: dict[str, int]  # block kind -> count
    per_block: dict[str, float]  # block kind -> saved elements per token per width (measured)
    outside: float  # saved elements per token per width outside the blocks (measured)
    forwards_per_velocity: int = 1  # 2 with true CFG (the batch doubles)
    latent_elements: int = 0
    text_bytes_per_prompt: int = 0
    decode_bytes_per_image: int = 0
    vae_batch: int = 1
    vae_names: tuple[str, ...] = ("vae",)
    gradient_checkpointing: bool = False
    #: live elements per token per width in a no-grad forward (None: INFERENCE_WIDTHS)
    inference_widths: float | None = None
    #: with checkpointing, saved elements per token per width besides one input per block: the
    #: recompute of one block plus everything outside the blocks (None: the largest per-block
    #: constant plus ``outside``)
    checkpoint_outside: float | None = None
    #: ``per_block`` and ``outside`` when the recipe trains a LoRA (None: the same): a frozen base
    #: saves fewer tensors (no weight gradients), a float32 LoRA on a 16-bit base saves copies of
    #: its inputs
    lora_per_block: dict[str, float] | None = None
    lora_outside: float | None = None
    #: the denoiser's storage in bytes when it is not params x denoiser_bytes (a quantised base)
    denoiser_weight_bytes: float | None = None
    #: parameters of the largest transformer block (FSDP2 gathers one block at a time) and
    #: outside the blocks (the root, which FSDP2 keeps gathered); 0 when unknown
    largest_block_params: int = 0
    outside_block_params: int = 0
    #: bytes per parameter of the KL reference's frozen copy (full fine-tuning with a KL term),
    #: as the model keeps it: the diffusers adapters in the compute dtype
    #: (``DiffusersAdapter.snapshot_reference``); None: as the denoiser is stored
    #: (``denoiser_bytes``; the engine's own copy, :class:`flowrl.objectives.kl.ReferencePolicy`)
    reference_bytes: int | None = None
    #: parameters full fine-tuning trains (None: all ``denoiser_params``; a two-expert model that
    #: trains one expert trains half)
    trainable_params: int | None = None
    notes: list[str] = dataclasses.field(default_factory=list)


def reference_copy_bytes(mm: ModelMemory) -> float:
    """Bytes of the KL reference's whole frozen copy (before any sharding)."""
    return mm.denoiser_params * (mm.reference_bytes if mm.reference_bytes is not None else mm.denoiser_bytes)


@dataclasses.dataclass
class Line:
    phase: str
    item: str
    bytes: float
    note: str = ""


def measured_memory(model) -> ModelMemory:
    """A model's memory facts measured by building it and running one CPU forward."""
    denoiser = model.denoiser
    den_params = list(denoiser.parameters())
    den_ids = {id(p) for p in den_params}
    frozen: dict[str, tuple[int, int]] = {}
    for name, value in vars(model).items():
        if isinstance(value, torch.nn.Module) and value is not denoiser:
            ps = [p for p in value.parameters() if id(p) not in den_ids]
            if ps:
                frozen[name] = (sum(p.numel() for p in ps), ps[0].element_size())
    bytes_per = den_params[0].element_size() if den_params else 4
    prompts = list(model.prompt_source() or ["a photo"])[:1]
    with torch.no_grad():
        text = model.encode_prompts(prompts)
    x = torch.randn(1, *model.latent_shape)
    param_ptrs = {p.untyped_storage().data_ptr() for p in denoiser.parameters()}
    seen: set[int] = set()
    total = [0]

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in param_ptrs and ptr not in seen:
            seen.add(ptr)
            total[0] += t.untyped_storage().nbytes()
        return t

    denoiser.requires_grad_(True)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            v = model.velocity(x, torch.tensor([0.5]), text)
        v.sum()
    finally:
        denoiser.requires_grad_(False)
    text_bytes = sum(t[:1].numel() * t.element_size() for t in text.values())
    return ModelMemory(
        denoiser_params=sum(p.numel() for p in den_params), denoiser_bytes=bytes_per, compute_bytes=bytes_per,
        frozen=frozen, offload_frozen=False, lora_shapes={
            n: (m.in_features, m.out_features) for n, m in denoiser.named_modules() if isinstance(m, torch.nn.Linear)
        }, default_lora_targets=list(model.lora_targets) if isinstance(model, HasLoraTargets) else [],
        # tokens = width = 1: the measured constant is the whole sample's saved elements. A no-grad
        # forward keeps at most what a grad forward saves, so that is the rollout's upper bound.
        tokens=1, width=1, blocks={"measured": 1}, per_block={"measured": total[0] / bytes_per}, outside=0.0,
        inference_widths=total[0] / bytes_per,
        latent_elements=int(torch.tensor(model.latent_shape).prod()), text_bytes_per_prompt=text_bytes,
        notes=["measured by building the model and one CPU forward (no memory_spec on its factory)"],
    )


def lora_parameter_count(shapes: dict[str, tuple[int, int]], targets: list[str], rank: int) -> int:
    """LoRA parameters, matching targets as peft does (a module named exactly a target, or
    ending in ``.target``): ``r * (in + out)`` per matched Linear."""
    total = 0
    for name, (fan_in, fan_out) in shapes.items():
        if any(name == t or name.endswith("." + t) for t in targets):
            total += rank * (fan_in + fan_out)
    return total


def model_memory(recipe, registry) -> ModelMemory:
    """The model's memory facts: from its params' ``memory_spec()``, or measured. With prompt
    embeddings from a store (``[prompts] embeddings``) an adapter that honours it
    (``loads_without_text_encoders``, the diffusers ones) loads no text encoder: only the VAE stays
    of the frozen components."""
    choice = recipe.components["model"]
    if isinstance(choice.params, PlansMemory):
        mm = choice.params.memory_spec()
    else:
        mm = measured_memory(registry.get("model", choice.use).build(choice.params))
    honours = getattr(registry.get("model", choice.use).factory, "loads_without_text_encoders", False)
    if not recipe.prompts.embeddings or not honours or not mm.frozen.keys() - set(mm.vae_names):
        return mm
    kept = {k: v for k, v in mm.frozen.items() if k in mm.vae_names}
    return dataclasses.replace(mm, frozen=kept, notes=[*mm.notes, "text encoders not loaded: the prompt embeddings "
                                                       "are read from [prompts].embeddings"])


def count_prompts(source: str, config=None) -> int | None:
    """Prompts in a prompt file, table or dataset (None for the model's own, or an unreadable source)."""
    path = Path(source)
    if path.is_file() and path.suffix.lower() not in TABLE_SUFFIXES:
        return sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    if source == "model" or not (path.exists() or source.startswith("hf:")):
        return None
    try:
        return len(distinct_rows(read_prompts(source, None, "[prompts].source", config)))
    except FlowrlError:
        return None


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the trained denoiser is laid out over processes, as the recipe's ``[distributed]``
    table and the launch decide (flowrl.train.parallel implements it)."""

    strategy: str  # "none", "ddp" or "fsdp2"
    world_size: int
    shard_degree: int  # processes a weight is sharded over: 1 unless fsdp2
    cpu_offload: bool
    checkpointing: bool
    bf16: bool
    #: fsdp2: gradients reduce-scattered once per optimizer step ("step") or after every
    #: backward ("micro_batch"); "step" for the other strategies
    gradient_sync: str = "step"

    @classmethod
    def from_recipe(cls, recipe, mm: ModelMemory, world_size: int, num_nodes: int = 1,
                    gradient_sync: str = "step") -> "Layout":
        d = recipe.distributed
        # no launcher when planning: "auto" plans ddp or none (plan fsdp2 by naming it)
        strategy = choose_strategy(d.strategy, world_size, hint="plan one process, or use 'ddp' or 'fsdp2'")
        if world_size % num_nodes:
            raise FlowrlError(f"{world_size} processes cannot be spread evenly over {num_nodes} nodes",
                              where="--num-nodes", hint="use a number of processes that is a multiple of the nodes")
        degree = 1 if strategy != "fsdp2" else (world_size if d.shard == "full" else world_size // num_nodes)
        return cls(strategy, world_size, degree, d.cpu_offload, mm.gradient_checkpointing or d.activation_checkpointing,
                   d.mixed_precision == "bf16", gradient_sync if strategy == "fsdp2" else "step")

    def describe(self) -> str:
        if self.strategy != "fsdp2":
            return f"{self.strategy}: weights, gradients and AdamW state replicated on each of {self.world_size} process(es)"
        sync = ("gradients reduce-scattered once per optimizer step" if self.gradient_sync == "step" else
                "gradients reduce-scattered after every backward")
        return (f"fsdp2: weights, gradients and AdamW state sharded over {self.shard_degree} of {self.world_size} "
                "processes" + (" and kept in CPU memory" if self.cpu_offload else "") + f"; {sync}")


def estimate(recipe, registry, world_size: int, num_nodes: int = 1,
             gpu_memory: float | None = None) -> tuple[Any, ModelMemory, list[Line]]:
    """The geometry, the model's memory facts and the estimate's lines (phase, item, bytes).

    ``gpu_memory`` (bytes of one GPU): what ``[distributed].gradient_sync = "auto"`` decides
    against (:func:`choose_gradient_sync`); None plans ``"auto"`` as ``"step"``."""
    mm = model_memory(recipe, registry)
    sync, why = choose_gradient_sync(recipe, registry, world_size, num_nodes, gpu_memory, mm=mm)
    geometry, lines = _estimate(recipe, dataclasses.replace(mm, notes=list(mm.notes)), world_size, num_nodes, sync,
                                registry)
    layout = Layout.from_recipe(recipe, mm, world_size, num_nodes, sync)
    mm.notes.insert(0, f"layout: {layout.describe()}" + (f" ({why})" if why else ""))
    return geometry, mm, lines


def choose_gradient_sync(recipe, registry, world_size: int, num_nodes: int = 1, gpu_memory: float | None = None,
                         mm: ModelMemory | None = None) -> tuple[str, str]:
    """``[distributed].gradient_sync`` for a run: the recipe's choice, or for ``"auto"`` under
    fsdp2 ``"step"`` (one reduce-scatter per optimizer step) when its planned peak fits
    ``gpu_memory`` bytes (None: no limit known, e.g. a CPU), else ``"micro_batch"`` (gradients
    stay sharded). Returns the choice and why (empty when the recipe chose)."""
    choice = recipe.distributed.gradient_sync
    if choice != "auto":
        return choice, ""
    mm = mm or model_memory(recipe, registry)
    if Layout.from_recipe(recipe, mm, world_size, num_nodes).strategy != "fsdp2":
        return "step", ""
    if gpu_memory is None:
        return "step", "gradient_sync 'auto': no GPU memory to plan against, so once per optimizer step"
    step_peak, _ = peak(_estimate(recipe, dataclasses.replace(mm, notes=[]), world_size, num_nodes, "step", registry)[1])
    if step_peak <= gpu_memory:
        return "step", (f"gradient_sync 'auto': once per optimizer step, whose {step_peak / GB:.1f} GB fits "
                        f"{gpu_memory / GB:.0f} GB")
    return "micro_batch", (f"gradient_sync 'auto': after every backward, since once per optimizer step would "
                           f"need {step_peak / GB:.1f} GB of {gpu_memory / GB:.0f} GB")


def _estimate(recipe, mm: ModelMemory, world_size: int, num_nodes: int, gradient_sync: str,
              registry) -> tuple[Any, list[Line]]:
    # a context-parallel group shares its samples: the data is split over world / C ranks
    data_ranks = max(1, world_size // recipe.distributed.context_parallel)
    geometry = resolve_geometry(recipe.train, data_ranks, recipe.source, group_size=recipe.group_size)
    layout = Layout.from_recipe(recipe, mm, world_size, num_nodes, gradient_sync)
    lines = _denoiser_state(recipe, mm, layout, keeps_reference_copy(recipe, registry),
                            old_policy=keeps_old_policy(recipe, registry))
    lines += _frozen_and_data(recipe, mm, geometry, offline_sides(recipe, registry))
    samples = not recipe.data.enabled or recipe.prompts.num_eval > 0  # an offline run samples only to evaluate
    lines += _reward_lines(recipe) if samples else []
    group = recipe.train.update_group if uses_units(recipe, registry) else 1  # [train].update_group: steps per forward
    lines += _transients(recipe, mm, layout, geometry, next((l for l in lines if l.item == "reference copy (KL)"), None),
                         group, offline_points(recipe, registry))
    lines.append(Line("persistent", "CUDA context + allocator slack", CUDA_OVERHEAD))
    return geometry, lines


def offline_sides(recipe, registry) -> int:
    """Images per table row of an offline objective (2 for a preference pair); 0 for an online run."""
    if not recipe.data.enabled:
        return 0
    choice = recipe.components["loss"]
    return int(getattr(registry.get("loss", choice.use).build(choice.params), "sides", 1))  # a plain object


def offline_points(recipe, registry) -> int:
    """Points an offline objective forwards per table row in one forward (its sides times
    ``[loss].timesteps``), without CFG (flowrl.objectives.offline); 0 for an online run."""
    return offline_sides(recipe, registry) * int(getattr(recipe.components["loss"].params, "timesteps", 1))


def _trainable(recipe, mm: ModelMemory) -> tuple[int, int, str]:
    """(trainable parameters, bytes each, how: the LoRA's size, empty for full fine-tuning) of the
    recipe's fine-tuning."""
    t = recipe.train
    if t.finetune == "lora":
        targets = list(t.lora_targets) or mm.default_lora_targets
        n = lora_parameter_count(mm.lora_shapes or {}, targets, t.lora_rank)
        return n, 4, f"{n / 1e6:.1f}e6 params (r = {t.lora_rank}), fp32"
    n = mm.denoiser_params if mm.trainable_params is None else mm.trainable_params
    return n, mm.denoiser_bytes, ""


def keeps_old_policy(recipe, registry) -> bool:
    """Whether the run's objective keeps a trailing old copy of the trained parameters
    (``keeps_old_policy``: DiffusionNFT, the ELBO losses, FDFO; flowrl.objectives.old_policy)."""
    return bool(getattr(build_loss(recipe, registry), "keeps_old_policy", False))


def _denoiser_state(recipe, mm: ModelMemory, layout: Layout, reference: bool, old_policy: bool = False) -> list[Line]:
    """Weights, gradients, AdamW state, the optimizer step's temporary, a frozen KL reference
    (``reference``: the run keeps one, :func:`flowrl.recipe.keeps_reference_copy`; a KL term of the
    ``[loss]`` or an objective's own, DiffusionNFT's velocity KL): divided by the shard degree
    under fsdp2, and off the GPU with its CPU offload."""
    n = layout.shard_degree
    where = "persistent" if not layout.cpu_offload else "cpu"
    per = f" / {n} shards" if n > 1 else ""
    weights = mm.denoiser_weight_bytes if mm.denoiser_weight_bytes is not None else mm.denoiser_params * mm.denoiser_bytes
    how = (f"{mm.denoiser_params / 1e9:.3f}e9 params x {mm.denoiser_bytes} B" if mm.denoiser_weight_bytes is None else
           f"{mm.denoiser_params / 1e9:.3f}e9 params, {weights / mm.denoiser_params:.3f} B each on average (quantised)")
    lines = [Line(where, "denoiser weights", weights / n, how + per)]
    trainable, tbytes, lora = _trainable(recipe, mm)
    if lora:
        lines.append(Line(where, "LoRA weights", trainable * tbytes / n, lora + per))
    adam_bytes = 2 if recipe.train.optimizer == "adamw_8bit" else 2 * tbytes
    adam = "AdamW state (2 moments)" + (", 8-bit" if adam_bytes == 2 else "")
    lines.append(Line(where, adam, trainable * adam_bytes / n, per.strip(" /")))
    # The gradients live from the first backward to the step. With one reduce-scatter per
    # optimizer step, fsdp2 holds them unsharded (in float32, the reduce dtype) while the step's
    # backwards accumulate without communication, and sharded from the reduce-scatter to the
    # step; reduce-scattered after every backward, they are sharded throughout.
    grads = trainable * tbytes / n
    if layout.strategy == "fsdp2":
        sharded = 0.0 if layout.cpu_offload else grads
        lines.append(Line("step", "gradients (sharded)", sharded, per.strip(" /")))
        if layout.gradient_sync == "step":
            lines.append(Line("update", "gradients (unsharded, accumulating)", trainable * 4,
                              "one reduce-scatter per optimizer step: every backward adds to full-size float32 "
                              "gradients ([distributed].gradient_sync)"))
        else:
            lines.append(Line("update", "gradients (sharded, accumulating)", sharded,
                              "reduce-scattered after every backward ([distributed].gradient_sync = 'micro_batch')"))
    else:
        lines.append(Line("persistent", "gradients", grads))
    if not layout.cpu_offload:  # foreach AdamW: a temporary the size of one moment (sqrt of v)
        lines.append(Line("step", "AdamW step temporary", trainable * tbytes / n, "foreach AdamW's sqrt(v)"))
    if old_policy:  # swapped in by storage: the copy itself, no transient (flowrl.objectives.old_policy)
        lines.append(Line(where, "old policy (trailing copy)", trainable * tbytes / n,
                          "a copy of the trained parameters that draws the rollouts" + per))
    ema = recipe.ema
    if ema.enabled:  # a float32 shadow of every trained weight (flowrl.train.ema), sharded like them
        lines.append(Line("cpu" if ema.on_cpu else where, "EMA weights", trainable * 4 / n,
                          "float32 shadow of the trained parameters ([ema])" + per))
        if ema.evaluate:  # the evaluation samples as the rollout does, the trained weights set aside on the device
            lines.append(Line("rollout", "trained weights set aside (EMA evaluation)", trainable * tbytes / n,
                              "[ema].evaluate: the EMA is swapped in, a copy of the trained weights waits" + per))
    if reference:
        ref_where = "cpu" if recipe.train.reference_on_cpu else "persistent"
        ref_bytes = mm.reference_bytes if mm.reference_bytes is not None else mm.denoiser_bytes
        lines.append(Line(ref_where, "reference copy (KL)", reference_copy_bytes(mm) / n,
                          f"a frozen copy of the denoiser, {ref_bytes} B per param" + (", sharded like it" if n > 1 else "")))
    pipe = recipe.pipeline
    # the behaviour policy draws the rollouts (fsdp2 is refused with it); a rollout process on a
    # GPU of its own ('cuda:N', N >= 1, offset by the local rank as the learners are) holds it
    # there, not on this one; 'cuda' and 'cuda:0' are each learner's own GPU
    elsewhere = pipe.worker == "process" and pipe.device.startswith("cuda:") and int(pipe.device[5:]) > 0
    if pipe.enabled and not elsewhere:
        lines.append(Line("cpu" if pipe.device == "cpu" else "persistent", "rollout copy (pipeline)",
                          weights + trainable * tbytes * bool(lora),
                          "a second copy of the denoiser that draws the next rollout"
                          + (" (in the rollout process)" if pipe.worker == "process" else "")))
    return lines


def _frozen_and_data(recipe, mm: ModelMemory, geometry, sides: int = 0) -> list[Line]:
    """Text encoders and VAE (unless offloaded), stored trajectories (an offline run's table rows:
    ``sides`` clean latents a row, and their cache in CPU memory), the text embeddings of the
    iteration's samples (on the device) and the prompt-embedding cache (in CPU memory)."""
    lines = []
    if not mm.offload_frozen:
        for k, (p, b) in mm.frozen.items():
            lines.append(Line("persistent", k, p * b, f"{p / 1e9:.3f}e9 params"))
    s = geometry.samples_per_process
    n = recipe.sampler.steps
    if sides:  # flowrl.offline.LatentCache: each table image's latent, kept once encoded
        lines.append(Line("persistent", "table latents", s * sides * mm.latent_elements * 4,
                          f"{s} rows x {sides} fp32 clean latents"))
        lines.append(Line("cpu", "table latent cache", CACHED_LATENTS * mm.latent_elements * 4,
                          f"at most {CACHED_LATENTS} latents in CPU memory (the most recently used)"))
    else:
        lines.append(Line("persistent", "trajectories", s * (n + 1) * mm.latent_elements * 4,
                          f"{s} samples x {n + 1} fp32 latents"))
    if recipe.pipeline.enabled:  # the next iteration's, drawn while this one trains
        lines.append(Line("persistent", "pending rollout (pipeline)", s * (n + 1) * mm.latent_elements * 4,
                          "the next iteration's trajectories"))
    mb = mm.text_bytes_per_prompt / 2**20
    batches = 2 if recipe.pipeline.enabled else 1
    lines.append(Line("persistent", TEXT_EMBEDDINGS, batches * s * mm.text_bytes_per_prompt,
                      f"{s} samples x {mb:.1f} MB, a row per sample on the device"
                      + (", for this iteration and the next" if batches > 1 else "")))
    cached = cached_prompts(recipe)
    lines.append(Line("cpu", PROMPT_CACHE, cached * mm.text_bytes_per_prompt,
                      f"{cached} prompts x {mb:.1f} MB in CPU memory (the engine keeps the {CACHED_PROMPTS} most "
                      "recently used)"))
    return lines


#: The plan's lines for the text embeddings: the batch's on the device, the cache's in CPU memory.
TEXT_EMBEDDINGS = "text embeddings (the iteration's samples)"
PROMPT_CACHE = "prompt-embedding cache"


def cached_prompts(recipe) -> int:
    """Prompts the run's prompt-embedding cache holds at its fullest: every distinct prompt it
    encodes (the training prompts it visits, at most the prompt file's; the evaluation's), but at
    most :data:`~flowrl.prompts.CACHED_PROMPTS` (the engine's cache drops the least recently used)."""
    in_file = count_prompts(recipe.prompts.source, recipe.prompts)
    seen = recipe.train.prompts_per_iteration * recipe.train.iterations
    trained = min(in_file, seen) if in_file else seen
    return min(trained + recipe.prompts.num_eval, CACHED_PROMPTS)


def _reward_lines(recipe) -> list[Line]:
    """One line per reward, as its params declare its model (PlansRewardMemory)."""
    lines = []
    for r in recipe.rewards:
        declared = r.params.memory_bytes() if isinstance(r.params, PlansRewardMemory) else None
        rbytes, note = (0.0, "size unknown (not counted)") if declared is None else (float(declared), r.params.memory_note)
        offload = isinstance(r.params, RewardPlacement) and bool(r.params.offload)
        lines.append(Line("reward" if offload else "persistent", f"reward '{r.label}'", rbytes,
                          note + (" (offloaded: on the GPU while scoring)" if offload else "")))
    return lines


def saved_widths(recipe, mm: ModelMemory) -> tuple[dict[str, float], float]:
    """The per-block and outside constants of the recipe's fine-tuning (LoRA's where the model
    declares them)."""
    if recipe.train.finetune == "lora" and mm.lora_per_block is not None:
        return mm.lora_per_block, mm.lora_outside if mm.lora_outside is not None else mm.outside
    return mm.per_block, mm.outside


def _transients(recipe, mm: ModelMemory, layout: Layout, geometry, reference: Line | None = None,
                group: int = 1, points: int = 0) -> list[Line]:
    """The largest transient of each phase: encode, rollout, decode and the update's forward with
    grad (``group`` steps of a chunk per forward: ``[train].update_group``; an offline run's
    ``points`` per table row in one forward, without CFG: :func:`offline_points`); under fsdp2 the
    start-up's (``reference``: the KL reference copy's line, if any)."""
    compute = 2 if layout.bf16 else mm.compute_bytes
    # context parallelism: each process of the group holds its share of every sequence's tokens
    cp = recipe.distributed.context_parallel
    tokens = -(-mm.tokens // cp)
    tw = tokens * mm.width * compute * mm.forwards_per_velocity
    lines = []
    encoders = {k: v for k, v in mm.frozen.items() if k not in mm.vae_names}
    if mm.offload_frozen and encoders:  # none with prompt embeddings from a store
        enc_bytes = sum(p * b for p, b in encoders.values())
        lines.append(Line("encode", "text encoders (visiting)", enc_bytes, f"{enc_bytes / GB:.1f} GB moved in to encode"))
    s = geometry.samples_per_process
    infer = mm.inference_widths if mm.inference_widths is not None else INFERENCE_WIDTHS
    if mm.width <= 1:
        shape = "measured per sample"
    elif cp == 1:
        shape = f"{mm.tokens} tokens x width {mm.width}"
    else:
        shape = f"{tokens} of {mm.tokens} tokens x width {mm.width} (context parallel {cp})"
    rolled = min(s, recipe.sampler.batch_size or s)  # [sampler].batch_size; an offline run samples only to evaluate
    rolled = 0 if points and not recipe.prompts.num_eval else rolled
    lines.append(Line("rollout", "activations, no grad", rolled * tw * infer,
                      f"{rolled} samples x {mm.forwards_per_velocity} forward(s), {shape}"))
    if recipe.sampler.rollout_precision == "fp8":  # flowrl.sampling.precision: copied, then quantised
        lines.append(Line("rollout", "FP8 copy of the denoiser", mm.denoiser_params * mm.denoiser_bytes,
                          f"made in the stored dtype ({mm.denoiser_bytes} B per weight) before every rollout, then "
                          "quantised to 1 byte per linear weight"))
    vae_bytes = sum(p * b for k, (p, b) in mm.frozen.items() if k in mm.vae_names)
    decode = (vae_bytes if mm.offload_frozen else 0) + min(s, mm.vae_batch) * mm.decode_bytes_per_image
    lines.append(Line("decode", "VAE + decode activations", decode if rolled else 0.0, f"{mm.vae_batch} images per VAE call"))
    m = recipe.train.micro_batch_size
    total_blocks = sum(mm.blocks.values())
    per_block, outside = saved_widths(recipe, mm)
    if layout.checkpointing:
        rest = mm.checkpoint_outside if mm.checkpoint_outside is not None else max(per_block.values()) + outside
        widths = total_blocks * 1.0 + rest
        how = f"checkpointed: {total_blocks} block inputs + 1 block"
    else:
        widths = sum(per_block[k] * c for k, c in mm.blocks.items()) + outside
        how = f"{widths:.0f} widths per token saved over {total_blocks} blocks" if mm.width > 1 else "measured per sample"
    rows, per = group * m * tw, f"micro-batch {m}" + (f" x {group} steps per forward ([train].update_group)" if group > 1 else "")
    if points:  # offline SFT / DPO: every point of a row in one forward, the conditional velocity alone
        rows, per = points * m * tw / mm.forwards_per_velocity, f"micro-batch {m} rows x {points} points per forward, no CFG"
    lines.append(Line("update", "activations, forward with grad", rows * widths, f"{per}; {how}"))
    if layout.strategy == "fsdp2":
        # shard before moving: one block (or the root's own parameters) whole on the device at a
        # time, in the storage dtype, on top of the shards placed so far
        largest = max(mm.largest_block_params, mm.outside_block_params) or mm.denoiser_params
        block, how = largest * mm.denoiser_bytes, f"{largest / 1e6:.0f}e6 params x {mm.denoiser_bytes} B"
        if reference is not None:
            # the reference is placed after the denoiser, its blocks in its own dtype: its shards
            # (when they stay on the GPU) do not exist yet while the denoiser's blocks visit
            rbytes = mm.reference_bytes if mm.reference_bytes is not None else mm.denoiser_bytes
            shards = reference.bytes if reference.phase == "persistent" else 0.0
            block = max(block - shards, largest * rbytes)
            how = (f"the larger of a denoiser block ({how}) before the reference's shards exist and a reference "
                   f"block ({rbytes} B per param) on top of them") if rbytes != mm.denoiser_bytes or shards else how
        lines.append(Line("start-up", "one block placed whole while sharding", block,
                          how + "; the rest stays in CPU memory until its turn"
                          + ("" if mm.largest_block_params else " (blocks unknown: the whole denoiser)")))
    elif reference is not None and reference.phase == "cpu":
        # none / ddp: the copy is taken from the denoiser already placed on the GPU, then moved to
        # CPU memory (Strategy.prepare_frozen): whole on the GPU for a moment at start-up
        lines.append(Line("start-up", "reference copy taken on the GPU", reference_copy_bytes(mm),
                          "taken from the placed denoiser, then moved to CPU memory ([train].reference_on_cpu)"))
    if layout.strategy == "fsdp2" and mm.largest_block_params:
        b, r = mm.largest_block_params, mm.outside_block_params
        lines.append(Line("update", "FSDP2 gathered parameters", compute * (r + 3 * b),
                          f"the root ({r / 1e6:.0f}e6) stays gathered, the running block and two prefetched "
                          f"({b / 1e6:.0f}e6 each), in {compute}-byte compute dtype"))
        lines.append(Line("update", "FSDP2 reduce-scatter buffers", 6 * b, "one block's float32 reduce-scatter input "
                          "and the next block's unsharded gradients"))
        lines.append(Line("update", "temporaries", 2 * b + m * tw * (5.7 + (total_blocks if layout.checkpointing else 0)),
                          "measured with torch's FSDPMemTracker (benchmarks/memory_plan.py)"))
    return lines


def startup_peak(lines: list[Line], mm: ModelMemory) -> float:
    """GPU memory per process while the model is placed, before the first iteration: the
    weights (sharded under fsdp2) and whatever else is placed for good (encoders, a reward
    kept on the GPU, the CUDA context), plus the ``start-up`` transient. Gradients, AdamW state,
    trajectories and caches do not exist yet."""
    held = ("denoiser weights", "LoRA weights", "reference copy (KL)", "CUDA context + allocator slack")
    placed = sum(l.bytes for l in lines if l.phase == "persistent" and
                 (l.item in held or l.item in mm.frozen or l.item.startswith("reward '")))
    return placed + sum(l.bytes for l in lines if l.phase == "start-up")


def host_lines(recipe, mm: ModelMemory, lines: list[Line], world_size: int, num_nodes: int = 1) -> list[Line]:
    """Host (CPU) memory per node: what the processes on one node keep in CPU memory for the
    whole run (phase ``held``) and the start-up transient (``loading``), each the sum over the
    node's ``world_size / num_nodes`` processes (for the start-up, rank 0's node: the largest).

    Loading: under fsdp2 with several processes only rank 0 loads the denoiser's weights into
    CPU memory (and takes the KL reference's copy there before sharding it); every other process
    builds the denoiser without weights and receives each block from rank 0 as it is sharded
    (:mod:`flowrl.train.parallel`), so a node holds one copy, not one per process. Under ``none``
    and ``ddp`` every process loads the whole model. Text encoders and VAE that stay on the GPU are
    loaded by every process before they move there (offloaded ones are counted as held). A
    quantised base (``denoiser_weight_bytes`` set) is loaded in its storage dtype and quantised
    in CPU memory, layer by layer, before it is placed: the transient is the unquantised weights."""
    per_node = world_size // max(num_nodes, 1)
    node = f" x {per_node} processes" if per_node > 1 else ""
    weights = mm.denoiser_params * mm.denoiser_bytes  # as loaded, before any quantisation
    frozen = sum(p * b for p, b in mm.frozen.values())
    out = []
    held = cpu_bytes(lines) + (frozen if mm.offload_frozen else 0.0)
    held += sum(l.bytes for l in lines if l.phase == "reward")  # offloaded rewards wait in CPU memory
    if held:
        out.append(Line("held", "offloaded state (shards, encoders, rewards, a CPU reference, the prompt cache)",
                        held * per_node,
                        f"per process {held / GB:.1f} GB{node}"))
    each = 0.0 if mm.offload_frozen else frozen  # every process loads its own encoders and VAE
    reference = any(l.item == "reference copy (KL)" for l in lines)
    sharded = "sharded over" in (mm.notes[0] if mm.notes else "") or any(l.item.startswith("FSDP2") for l in lines)
    if sharded and world_size > 1:  # one copy of the denoiser, on rank 0's node
        once = weights + (reference_copy_bytes(mm) if reference else 0.0)
        what = (f"rank 0 alone loads the denoiser ({weights / GB:.1f} GB)"
                + (" and takes the KL reference's copy" if reference else "")
                + "; the other processes receive each block from it as it is sharded")
        if each:
            what += f"; encoders and VAE {each / GB:.1f} GB per process{node}"
        out.append(Line("loading", "start-up transient", once + each * per_node, what))
        return out
    loading = weights + each
    what = "the whole model loaded into CPU memory before placing it"
    if mm.denoiser_weight_bytes is not None:
        what += " (the transformer in dtype, quantised there)"
    if reference and sharded:  # one process under fsdp2: the reference's copy is taken in CPU memory too
        loading += reference_copy_bytes(mm)
        what += ", and the KL reference's copy taken there before sharding"
    out.append(Line("loading", "start-up transient", loading * per_node, f"{what}: per process {loading / GB:.1f} GB{node}"))
    return out


def cpu_bytes(lines: list[Line]) -> float:
    """Host memory per process of what is kept in CPU memory (offloaded shards, a CPU reference,
    the prompt-embedding cache)."""
    return sum(l.bytes for l in lines if l.phase == "cpu")


def largest_update_group(recipe, lines: list[Line], budget: float, registry=None) -> int | None:
    """The largest ``[train].update_group`` whose peak fits in ``budget`` bytes (None when the
    objective has no steps to group, or not even 1 fits): each step of a group adds the update's
    activations of one step (:func:`_transients`), capped at the largest chunk (a group never
    spans chunks)."""
    registry = registry or get_registry()
    current = recipe.train.update_group if uses_units(recipe, registry) else 0
    line = next((l for l in lines if l.phase == "update" and l.item == "activations, forward with grad"), None)
    if not current or line is None:
        return None
    per_step = line.bytes / current
    persistent, phases = _phase_totals(lines)
    others = max((v for k, v in phases.items() if k != "update"), default=0.0)
    rest = phases.get("update", 0.0) - line.bytes
    try:
        cap = max(build_component(recipe, registry, "chunker").sizes(recipe.num_trainable))
    except (FlowrlError, ValueError, TypeError, FileNotFoundError):  # a profiling chunker decides at start
        cap = recipe.num_trainable
    fits = [k for k in range(1, max(1, cap) + 1) if persistent + max(others, rest + k * per_step) <= budget]
    return max(fits) if fits else None


def _phase_totals(lines: list[Line]) -> tuple[float, dict[str, float]]:
    """The persistent bytes on the GPU, and each phase's transient bytes (lines kept in CPU
    memory and the start-up's, which :func:`startup_peak` counts, left out)."""
    persistent = sum(l.bytes for l in lines if l.phase == "persistent")
    phases: dict[str, float] = {}
    for l in lines:
        if l.phase not in ("persistent", "cpu", "start-up", "held", "loading"):
            phases[l.phase] = phases.get(l.phase, 0.0) + l.bytes
    return persistent, phases


def peak(lines: list[Line]) -> tuple[float, str]:
    """The peak of GPU memory: everything persistent plus the largest phase's transients, and
    that phase (lines kept in CPU memory do not count)."""
    persistent, phases = _phase_totals(lines)
    worst = max(phases, key=phases.get) if phases else "none"
    return persistent + phases.get(worst, 0.0), worst
