"""How the trained denoiser is spread over processes: ``none``, ``ddp`` or ``fsdp2``
(the recipe's ``[distributed]`` table; docs/distributed.md).

A :class:`Strategy` wraps the denoiser and its optimizer once, then owns everything that
depends on how they are laid out. Per optimizer step, on every process::

    strategy.zero_grad()
    with strategy.accumulate():      # any number of backward() calls: no gradient communication
        ...
    # leaving the block reduces the accumulated gradients, exactly once per step
    norm = strategy.clip_grad_norm_(max_norm)   # global norm, also over sharded gradients
    if finite: strategy.step()

- ``none``: one process, the plain module (bf16: accelerate's autocast around its forward).
- ``ddp``: accelerate's ``Accelerator.prepare_model`` places the replica and, for bf16, puts its
  autocast around the forward; the weights are broadcast from rank 0. The step's gradients are
  averaged with one bucketed, flat all-reduce after the last backward. No
  DistributedDataParallel wrapper: its reducer only fires inside a backward, and the
  memory-lean update does not know which of its backwards is the last (it would have to run
  every one under ``no_sync``), while the wrapper's gradient buckets would cost one more copy
  of the gradients.
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on each transformer block, then on the
  root, over a 1-D mesh (``shard = "full"``) or a 2-D one (``"hybrid"``: replicate across nodes,
  shard within a node). flowrl applies it itself: accelerate on a CPU turns an FSDP2 request
  into DDP without a word, and one code path serves CPUs and GPUs. Backwards run with
  ``set_requires_gradient_sync(False)``; FSDP2's end-of-backward routine then reduce-scatters
  the accumulated gradients once (``[distributed].gradient_sync = "step"``), or every backward
  reduce-scatters into sharded gradients (``"micro_batch"``: no full-size gradient, one
  reduce-scatter per backward). Every forward and backward all-gathers parameters: every
  process must run the same sequence of forwards and backwards (:attr:`Strategy.lockstep`).

Under ``fsdp2`` (:attr:`Strategy.sharded`) a run's checkpoints are sharded
(torch.distributed.checkpoint, every process writes its part; no process gathers the model):
:meth:`Strategy.state_dict` and :meth:`Strategy.load_state_dict` are what is saved and loaded; the
I/O, the checkpoint files and their atomic commit are in :mod:`flowrl.train.checkpoint`
(:func:`~flowrl.train.checkpoint.save_sharded_checkpoint`,
:func:`~flowrl.train.checkpoint.load_sharded_checkpoint`). Under ``none`` and ``ddp`` the main
process writes the single-process files (:func:`flowrl.train.state.save_training_checkpoint`). DCP
stores global tensors, so a checkpoint resumes with another number of processes or another
strategy. :meth:`Strategy.full_state_dict` gathers full tensors one at a time onto the main
process's CPU (for ``flowrl export``); :func:`flowrl.train.checkpoint.read_model_weights` reads
a sharded checkpoint in one process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
import os
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import DistContext, choose_strategy, flag_setting
from ..errors import FlowrlError
from ..interfaces import HasShardableBlocks
from ..recipe import DistributedConfig
from ..objectives.kl import OFFLOADED_WEIGHTS
from ..recipe.validation import QUANTISED_UNDER_FSDP2, QUANTISED_UNDER_FSDP2_HINT
from .context_parallel import apply_context_parallel

__all__ = [
    "Strategy",
    "Topology",
    "resolve_strategy",
    "mesh_layout",
    "transformer_blocks",
    "declared_blocks",
    "checkpoint_blocks",
    "autocast_like_accelerate",
    "holds_meta_tensors",
    "materialise_meta",
]

#: Gradient bytes per all-reduce bucket under DDP (DDP's own default bucket size).
BUCKET_BYTES = 25 * 2**20
#: The key of the optimizer's state in a sharded checkpoint.
OPTIM_KEY = "optim"
#: The key of the model's state in a sharded checkpoint (the optimizer's is ``OPTIM_KEY``).
SHARDED_MODEL_KEY = "model"


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where this process sits: ``world_size`` processes, ``local_world_size`` of them per node
    (torchrun and accelerate export ``LOCAL_WORLD_SIZE``)."""

    rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    @classmethod
    def from_context(cls, ctx: DistContext, env=None) -> Topology:
        env = os.environ if env is None else env
        local = int(env.get("LOCAL_WORLD_SIZE", ctx.process_count) or ctx.process_count)
        return cls(rank=ctx.process_rank, world_size=ctx.process_count, local_world_size=local)

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size


def resolve_strategy(config: DistributedConfig, world_size: int, env=None) -> str:
    """``"none"``, ``"ddp"`` or ``"fsdp2"`` for ``config.strategy`` (``"auto"``: fsdp2 when the
    launcher asks for FSDP, else ddp with several processes, else none;
    :func:`flowrl.distributed.choose_strategy`). The launcher's settings were checked against
    the recipe when the process group was joined (:func:`flowrl.distributed.setup`)."""
    env = os.environ if env is None else env
    return choose_strategy(config.strategy, world_size, bool(flag_setting(env, "ACCELERATE_USE_FSDP")))


def mesh_layout(shard: str, topology: Topology) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The FSDP2 device mesh: ``(world,)`` for full sharding, ``(nodes, per node)`` named
    ``("replicate", "shard")`` for hybrid sharding."""
    if shard == "full":
        return (topology.world_size,), ("shard",)
    if topology.world_size % topology.local_world_size:
        raise FlowrlError(
            f"hybrid sharding needs the same number of processes on every node: {topology.world_size} processes "
            f"with {topology.local_world_size} per node",
            where="[distributed].shard", hint="launch the same --nproc_per_node on every node, or use shard = 'full'",
        )
    return (topology.num_nodes, topology.local_world_size), ("replicate", "shard")


def transformer_blocks(module: nn.Module, declared: Sequence[nn.Module] | None = None) -> list[nn.Module]:
    """The blocks FSDP2 shards one by one: ``declared`` (from :class:`HasShardableBlocks`), or the
    modules of every ``nn.ModuleList`` whose attribute name ends in ``blocks``, outermost first
    (a block inside another block is not a block of its own)."""
    if declared is not None:
        blocks = list(declared)
        inside = {id(m) for m in module.modules()}
        nested = {id(m) for b in blocks for m in b.modules() if m is not b}
        if not blocks or any(id(b) not in inside or id(b) in nested for b in blocks):
            raise FlowrlError("the model adapter's shardable_blocks() must return submodules of its denoiser, "
                              "none inside another", where="model adapter (HasShardableBlocks)")
        return blocks
    blocks: list[nn.Module] = []
    taken: set[int] = set()
    for name, child in module.named_modules():
        if isinstance(child, nn.ModuleList) and name.rsplit(".", 1)[-1].endswith("blocks") and id(child) not in taken:
            for block in child:
                blocks.append(block)
                taken.update(id(m) for m in block.modules())
    return blocks


def declared_blocks(adapter) -> list[nn.Module] | None:
    """The blocks a model adapter names (:class:`HasShardableBlocks`), or None: then
    :func:`transformer_blocks` finds them. Pass the result to :meth:`Strategy.prepare`."""
    return list(adapter.shardable_blocks()) if isinstance(adapter, HasShardableBlocks) else None


def autocast_like_accelerate(module: nn.Module, device: torch.device) -> None:
    """``module``'s forward under bf16 autocast with float32 outputs, as accelerate's
    ``prepare_model`` wraps the learner's denoiser for ``mixed_precision = "bf16"`` (none/ddp), for a
    copy of the policy built where no Accelerator is (the rollout worker process): the same
    arithmetic, so that its rollouts' log-probs are the learner's."""
    from accelerate.utils import convert_outputs_to_fp32

    forward = module.forward.__func__ if hasattr(module.forward, "__func__") else module.forward
    autocast = torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    wrapped = convert_outputs_to_fp32(autocast(forward))
    module.forward = types.MethodType(wrapped, module) if hasattr(module.forward, "__func__") else wrapped


def _checkpointed_forward(block: nn.Module, forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(block, *args, **kwargs)
    return torch.utils.checkpoint.checkpoint(forward, block, *args, use_reentrant=False, **kwargs)


def checkpoint_blocks(blocks: Sequence[nn.Module]) -> None:
    """Activation checkpointing: each block's forward (with grad) keeps only its inputs and
    recomputes the rest in the backward (non-reentrant ``torch.utils.checkpoint``). Parameter
    names do not change. Applying it twice does nothing.

    The block is an argument of its new forward (a ``functools.partial``), not captured in a
    closure: a deep copy of the module (the rollout copy of ``[pipeline]``, FP8 rollouts) then
    runs its own weights. A closure over the original's bound ``forward`` made the copy run the
    original's weights, the ones being trained."""
    for block in blocks:
        if getattr(block, "flowrl_checkpointed", False):
            continue
        forward = block.forward
        if getattr(forward, "__self__", None) is not block:
            raise TypeError(f"activation checkpointing needs {type(block).__name__}'s own forward, found {forward!r}")
        block.forward = functools.partial(_checkpointed_forward, block, forward.__func__)
        block.flowrl_checkpointed = True


def _reduce_scatter_unused_params(module: nn.Module, world_size: int) -> None:
    """Make FSDP2 reduce-scatter a zero gradient for a parameter a rank did not use, so that every
    rank joins the same collectives (an expert or a chunk one rank never reaches would otherwise
    hang the others). ``FSDPModule.set_reduce_scatter_unused_params`` is newer than some torch
    builds (torch 2.11, the H200 image's, lacks it): alone a process has no one to disagree with,
    so it shards without; several processes are refused on such a torch rather than risk a hang."""
    if hasattr(module, "set_reduce_scatter_unused_params"):
        module.set_reduce_scatter_unused_params(True)
    elif world_size > 1:
        raise FlowrlError(
            f"strategy = 'fsdp2' over {world_size} processes needs FSDPModule.set_reduce_scatter_unused_params, "
            f"which torch {torch.__version__} lacks (without it a parameter one rank leaves unused hangs the others)",
            where="[distributed].strategy", hint="install a newer torch (flowrl's pin: torch==2.13.0), or use strategy = 'ddp'")


class Strategy:
    """The denoiser's layout over processes, and everything that depends on it (module
    docstring). Build it with :meth:`from_recipe`, then call :meth:`prepare` once."""

    def __init__(self, config: DistributedConfig, kind: str, device: torch.device, topology: Topology,
                 gradient_sync: str = "step"):
        self.config, self.kind, self.device, self.topology = config, kind, torch.device(device), topology
        if gradient_sync not in ("step", "micro_batch"):
            raise ValueError(f"gradient_sync must be resolved to 'step' or 'micro_batch', got {gradient_sync!r}")
        #: fsdp2: reduce-scatter once per optimizer step ("step") or after every backward
        #: ("micro_batch": gradients stay sharded); other strategies always reduce once per step
        self.gradient_sync = gradient_sync if kind == "fsdp2" else "step"
        self.module: nn.Module | None = None  # what the adapter calls: the denoiser, placed (and FSDP2-sharded)
        self.block_names: list[str] = []  # the sharded / checkpointed blocks' names in the denoiser
        self.optimizer: torch.optim.Optimizer | None = None
        self.params: list[nn.Parameter] = []  # the trainable parameters, as the optimizer holds them
        self.accelerator = None
        self.mesh = None
        self._accumulating = False

    @classmethod
    def from_recipe(cls, config: DistributedConfig, device: torch.device, ctx: DistContext, env=None,
                    gradient_sync: str = "step") -> Strategy:
        """Resolve ``"auto"`` for this run (the launcher was checked against ``config`` by
        :func:`flowrl.distributed.setup`). ``gradient_sync``: ``[distributed].gradient_sync``
        with ``"auto"`` already decided (:func:`flowrl.memory_plan.choose_gradient_sync`)."""
        topology = Topology.from_context(ctx, env)
        return cls(config, resolve_strategy(config, ctx.process_count, env), device, topology, gradient_sync)

    @property
    def context_parallel(self) -> int:
        """Processes that split each sequence and share their samples (flowrl.train.context_parallel)."""
        return self.config.context_parallel

    @property
    def lockstep(self) -> bool:
        """True when every forward and backward of the denoiser is a collective (FSDP2): every
        process must then call it the same number of times, in the same order."""
        return (self.kind == "fsdp2" and self.topology.world_size > 1) or self.context_parallel > 1

    @property
    def sharded(self) -> bool:
        return self.kind == "fsdp2"

    # ------------------------------------------------------------------------------- prepare

    def prepare(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                blocks: Sequence[nn.Module] | None = None, tokens: tuple[int | None, int | None] = (None, None),
                attention: str = "auto") -> nn.Module:
        """Wrap ``module`` (the denoiser, LoRA already attached, ``requires_grad`` set) and rebind
        ``optimizer`` (built over its trainable parameters, no step taken yet) to the wrapped
        parameters. Returns the module to call; the adapter's ``denoiser`` must be set to it.
        ``blocks``: the adapter's :class:`HasShardableBlocks` blocks, if it declares them.
        ``tokens``: (image or video, text) tokens per sample, which context parallelism must split;
        ``attention``: ``[train].attention_backend``, which a context-parallel ring must be able to use."""
        if self.module is not None:
            raise RuntimeError("Strategy.prepare() was already called")
        if any(optimizer.state.values()):
            raise RuntimeError("prepare() needs an optimizer that has not stepped yet (load its state after prepare)")
        if self.kind == "fsdp2" and any(not p.is_floating_point() for p in module.parameters()):
            # validation refuses it when the recipe names fsdp2; here when strategy 'auto' chose it
            raise FlowrlError(QUANTISED_UNDER_FSDP2, where="[distributed].strategy", hint=QUANTISED_UNDER_FSDP2_HINT)
        if self.context_parallel > 1:
            # what attention computes in: FSDP2's mixed precision casts the weights to bf16, DDP's
            # and a single process's run a float32 model under autocast
            half = any(p.dtype in (torch.bfloat16, torch.float16) for p in module.parameters())
            precision = ("half" if half or (self.config.mixed_precision == "bf16" and self.kind == "fsdp2") else
                         "autocast" if self.config.mixed_precision == "bf16" else "float32")
            # kept for the KL reference's frozen copy (prepare_frozen), which splits its sequences alike
            self._split = dict(image_tokens=tokens[0], text_tokens=tokens[1], ring=self.config.context_parallel_ring,
                               attention=attention, precision=precision)
            apply_context_parallel(module, self.context_parallel, self.device, **self._split)
        found = transformer_blocks(module, blocks)
        if self.config.activation_checkpointing:
            if not found:
                raise FlowrlError(
                    "activation checkpointing found no transformer blocks in the denoiser",
                    where="[distributed].activation_checkpointing",
                    hint="the model adapter can name them (flowrl.interfaces.HasShardableBlocks), or set it to false",
                )
            checkpoint_blocks(found)
        names = {id(p): n for n, p in module.named_parameters()}
        module_names = {id(m): n for n, m in module.named_modules()}
        self.block_names = [module_names[id(b)] for b in found]  # to lay out a frozen copy alike
        if self.kind == "fsdp2":
            self.module = self._shard(module, found)
        else:
            self.module = self._replicate(module)
        live = dict(unwrap_module(self.module).named_parameters())
        for group in optimizer.param_groups:
            group["params"] = [live[names[id(p)]] for p in group["params"]]
        self.optimizer = optimizer
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        return self.module

    def _replicate(self, module: nn.Module) -> nn.Module:
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState

        if holds_meta_tensors(module):
            raise FlowrlError(f"the denoiser was built without weights, which only fsdp2 fills in (strategy {self.kind!r})",
                              where="[distributed].strategy",
                              hint="only an fsdp2 run builds it empty on the processes other than rank 0")

        # accelerate keeps one mixed precision per process and refuses another: a second run in the
        # same interpreter (a notebook, flowrl's tests) with another setting starts it afresh
        # (the process group's part of its state is kept)
        AcceleratorState._reset_state()
        self.accelerator = Accelerator(cpu=self.device.type == "cpu", mixed_precision=self.config.mixed_precision)
        if self.kind == "ddp" and self.topology.world_size > 1 and self.accelerator.num_processes != self.topology.world_size:
            raise FlowrlError(f"accelerate sees {self.accelerator.num_processes} processes, torch.distributed "
                              f"{self.topology.world_size}", where="[distributed].strategy = 'ddp'",
                              hint="launch with torchrun, `flowrl train --num-processes N` or `accelerate launch --multi_gpu`")
        # evaluation_mode: placement and autocast without the DistributedDataParallel wrapper
        # (the module docstring says why); every replica starts from rank 0's weights
        prepared = self.accelerator.prepare_model(module, device_placement=True, evaluation_mode=True)
        _broadcast_module(prepared, self.topology.world_size)
        return prepared

    def _shard(self, module: nn.Module, blocks: list[nn.Module]) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise FlowrlError("strategy = 'fsdp2' needs a process group", where="[distributed].strategy",
                              hint="launch with `flowrl train --num-processes N`, torchrun or accelerate launch")
        shape, names = mesh_layout(self.config.shard, self.topology)
        self.mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=names)
        self._fully_shard(module, blocks, self.config.cpu_offload)
        # a trainable tensor without a gradient on one rank still joins its group's reduce-scatter
        _reduce_scatter_unused_params(module, self.topology.world_size)
        # FSDP2 warns on every process that diffusers' transformers return a view. Only an
        # in-place op on it would be harmful; flowrl's adapters and kernels use the velocity
        # out of place, and tests/train/test_engine_fsdp2.py checks the gradients equal one
        # process's.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        return module

    def _fully_shard(self, module: nn.Module, blocks: Sequence[nn.Module], cpu_offload: bool) -> None:
        """Shard before moving (torch's FSDP2 guidance): ``module`` may sit in CPU memory, whole;
        each block visits the device alone, gets rank 0's weights and is sharded, and the root's
        own parameters follow. At most one block's full weights are on the device at a time,
        instead of the whole model (47.6 GB for FLUX.1-dev in float32) before any sharding.
        With ``cpu_offload`` FSDP2 then keeps each shard in CPU memory. On a process other than
        rank 0 the module may hold no weights at all (built on the ``meta`` device,
        :func:`flowrl.distributed.receives_weights`): each block gets storage on the device just
        before rank 0's weights arrive, so only rank 0 ever loaded the model into host memory."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
        from torch.distributed.tensor import DTensor

        bf16 = self.config.mixed_precision == "bf16"
        # bf16 compute on float32 master weights, gradients reduced in float32; the blocks hand
        # bf16 activations to each other, the root returns float32 (the kernels' maths)
        inner = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
        root = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
                if bf16 else MixedPrecisionPolicy())
        offload = CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if cpu_offload else OffloadPolicy()
        world = self.topology.world_size
        if (self.topology.rank == 0 or world == 1) and holds_meta_tensors(module):
            raise FlowrlError("rank 0 must hold the denoiser's weights: the other processes receive them from it",
                              where="[distributed].strategy = 'fsdp2'",
                              hint="a model adapter builds its denoiser without weights only where "
                                   "flowrl.distributed.receives_weights() says so")
        for block in blocks:
            materialise_meta(block, self.device)  # a process that receives rank 0's weights built it empty
            block.to(self.device)
            _broadcast_module(block, world)  # every rank shards the same weights
            fully_shard(block, mesh=self.mesh, mp_policy=inner, offload_policy=offload, reshard_after_forward=True)
        with torch.no_grad():  # the root's own parameters and buffers (the blocks' are DTensor shards now)
            materialise_meta(module, self.device)
            rest = [t for t in [*module.parameters(), *module.buffers()] if not isinstance(t, DTensor)]
            for t in rest:
                t.data = t.data.to(self.device)
            for t in rest if world > 1 else ():
                dist.broadcast(t.data, src=0)
        fully_shard(module, mesh=self.mesh, mp_policy=root, offload_policy=offload, reshard_after_forward=False)

    def prepare_frozen(self, module: nn.Module, on_cpu: bool = False) -> nn.Module:
        """A frozen copy of the denoiser (the KL reference), laid out like the trained one after
        :meth:`prepare`: fsdp2 shards it over the same mesh, block by block (``on_cpu``: its
        shards stay in CPU memory, FSDP2's CPU offload); otherwise it is placed on the device
        (``on_cpu``: kept in CPU memory, each submodule visiting the device for its forward,
        accelerate's ``cpu_offload``). Every process holds rank 0's weights. Under context
        parallelism its sequences are split like the policy's: unsplit, every process of a group
        would run the whole reference forward (the group's compute and activations, each)."""
        module.requires_grad_(False).eval()
        if self.context_parallel > 1:
            apply_context_parallel(module, self.context_parallel, self.device, **self._split)
        if self.kind == "fsdp2":  # placed block by block as it is sharded (_fully_shard)
            self._fully_shard(module, [module.get_submodule(n) for n in self.block_names], on_cpu)
            return module
        _broadcast_module(module, self.topology.world_size)
        if not on_cpu:
            module = module.to(self.device)
        else:
            from accelerate import cpu_offload

            weights = {name: tensor.to("cpu") for name, tensor in module.state_dict().items()}
            module = cpu_offload(module.to("cpu"), execution_device=self.device, state_dict=weights)
            setattr(module, OFFLOADED_WEIGHTS, weights)  # its parameters are meta now: GARDO resets and saves these
        if self.accelerator is not None and self.accelerator.native_amp:
            # the policy computes under bf16 autocast: so must its reference, or the KL at equal
            # weights is the two precisions' difference (and is trained on)
            module = self.accelerator.prepare_model(module, device_placement=False, evaluation_mode=True)
        return module

    # ------------------------------------------------------------------------ one optimizer step

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """Every backward of one optimizer step goes inside: gradients accumulate locally, and
        leaving the block normally reduces them once (DDP: bucketed all-reduce, averaged; FSDP2:
        one reduce-scatter per sharded block, averaged, and an all-reduce across nodes for
        hybrid sharding). Leaving it by an exception reduces nothing. FSDP2 with
        ``gradient_sync = "micro_batch"`` instead reduce-scatters at the end of every backward,
        into sharded gradients that accumulate: the same sum, without a full-size gradient."""
        if self.module is None:
            raise RuntimeError("call Strategy.prepare() first")
        if self._accumulating:
            raise RuntimeError("Strategy.accumulate() does not nest")
        self._accumulating = True
        try:
            with self._no_sync():
                yield
        finally:
            self._accumulating = False
        self._reduce_gradients()

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        if self.kind == "fsdp2" and self.gradient_sync == "step":
            self.module.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.module.set_requires_gradient_sync(True)
        else:  # none, ddp: no wrapper, nothing communicates until _reduce_gradients
            yield

    def _reduce_gradients(self) -> None:
        if self.topology.world_size <= 1 and self.kind != "fsdp2":
            return
        if self.kind == "fsdp2":
            if self.gradient_sync == "step":  # "micro_batch": every backward reduce-scattered already
                _fsdp_reduce_accumulated(self.module)
            if self.context_parallel > 1:
                # FSDP2 averaged over every process; a context-parallel group's gradients are shares
                # of one, to be summed (its divide factor would need PREMUL_SUM, which gloo lacks)
                with torch.no_grad():
                    for p in self.params:
                        if p.grad is not None:
                            p.grad.mul_(self.context_parallel)
        else:  # a context-parallel group's gradients are shares of one: summed over it, averaged over the rest
            _all_reduce_mean(self.params, self.topology.world_size // self.context_parallel)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the gradients so that their global L2 norm is at most ``max_norm`` (``inf``: no
        clipping); returns the norm before clipping, the same on every process. Sharded
        gradients (DTensors) are reduced over the whole mesh."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return 0.0
        total = torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False)
        if hasattr(total, "full_tensor"):  # DTensor: the partial norms of every shard, reduced
            total = total.full_tensor()
        total = total.float()
        if max_norm != float("inf"):
            coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
            for g in grads:
                g.mul_(coef)
        return float(total)

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    # ----------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """``{"model": trainable weights, "optim": optimizer state}`` keyed by parameter name,
        each tensor as this process holds it (a shard under FSDP2): what DCP saves and loads."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model, optim = get_state_dict(self.module, self.optimizer, options=StateDictOptions(ignore_frozen_params=True))
        return {SHARDED_MODEL_KEY: model, OPTIM_KEY: optim}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        # strict=False: frozen weights (a LoRA's base) are not in the state; every trainable one is
        # (the state has exactly the keys of state_dict(), and dcp.load fails on a missing one)
        set_state_dict(self.module, self.optimizer, model_state_dict=state[SHARDED_MODEL_KEY],
                       optim_state_dict=state[OPTIM_KEY], options=StateDictOptions(ignore_frozen_params=True, strict=False))

    def iter_full_tensors(self, trainable_only: bool = True) -> Iterator[tuple[str, torch.Tensor | None]]:
        """``(name, full tensor on the CPU)`` one parameter at a time on the main process,
        ``(name, None)`` on the others; every process must iterate to the end (under FSDP2 each
        tensor is all-gathered in turn, so no process holds more than one full tensor)."""
        for name, p in unwrap_module(self.module).named_parameters():
            if trainable_only and not p.requires_grad:
                continue
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            yield name, (full.detach().to("cpu", copy=True) if self.topology.rank == 0 else None)
            del full

    def full_state_dict(self, trainable_only: bool = True) -> dict[str, torch.Tensor]:
        """The full (unsharded) weights on the main process's CPU, ``{}`` on the others (for
        ``flowrl export``). Collective: every process calls it."""
        return {n: t for n, t in self.iter_full_tensors(trainable_only) if t is not None}


# ----------------------------------------------------------------------------- gradient reduction


def unwrap_module(module: nn.Module) -> nn.Module:
    """The module whose parameter names are the checkpoint's (DDP's ``module``, not the wrapper)."""
    return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module


def _all_reduce_mean(params: Sequence[nn.Parameter], world_size: int, bucket_bytes: int = BUCKET_BYTES) -> int:
    """Average ``.grad`` over processes in place: gradients flattened into buckets of at most
    ``bucket_bytes`` (per dtype), one all-reduce per bucket. A parameter without a gradient
    contributes zeros (and then has a zero gradient, as under FSDP2 and the engine's earlier
    reduction), so every process issues the same collectives. Returns their number."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets: dict[tuple, list[list[torch.Tensor]]] = {}
    for p in params:
        key = (p.grad.dtype, p.grad.device)
        groups = buckets.setdefault(key, [[]])
        if groups[-1] and sum(g.numel() * g.element_size() for g in groups[-1]) + p.grad.numel() * p.grad.element_size() > bucket_bytes:
            groups.append([])
        groups[-1].append(p.grad)
    count = 0
    for groups in buckets.values():
        for grads in groups:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat.div_(world_size)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            count += 1
    return count


def _fsdp_reduce_accumulated(module: nn.Module) -> None:
    """Reduce the gradients FSDP2 accumulated while its gradient sync was off, without another
    backward: FSDP2's own end-of-backward routine runs every parameter group's post-backward
    (reduce-scatter, and the all-reduce across replicas for hybrid sharding) and then waits for
    them. torch 2.13 has no public call for this; the attributes used are checked."""
    state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
    finish = getattr(state, "_root_post_backward_final_callback", None)
    ctx = getattr(state, "_state_ctx", None)
    if finish is None or ctx is None or not hasattr(ctx, "is_last_backward"):
        raise FlowrlError(
            f"this torch ({torch.__version__}) lacks the FSDP2 end-of-backward routine flowrl reduces "
            "accumulated gradients with", where="[distributed].strategy = 'fsdp2'",
            hint="use torch 2.13 (constraints/cpu.txt), or strategy = 'ddp'",
        )
    ctx.is_last_backward = True
    finish()


def holds_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the ``meta`` device (built without weights)."""
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def materialise_meta(module: nn.Module, device: torch.device) -> int:
    """Give every ``meta`` parameter and buffer of ``module`` uninitialised storage on ``device``
    (its values then come from rank 0 by broadcast); a tensor shared by several submodules stays
    shared. Real tensors are left alone. Returns the bytes allocated."""
    made: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for store in (sub._parameters, sub._buffers):
            for key, t in store.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:
                    empty = torch.empty_like(t, device=device)
                    made[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
                store[key] = made[id(t)]
    return sum(t.numel() * t.element_size() for t in made.values())


def _broadcast_module(module: nn.Module, world_size: int) -> None:
    """Rank 0's parameters and buffers on every rank (as DDP does at construction)."""
    if world_size <= 1:
        return
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=0)
