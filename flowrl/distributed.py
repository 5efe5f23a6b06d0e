"""Processes on plain torch.distributed (works under torchrun and `accelerate launch`).

Both launchers set RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR; :func:`setup` joins the process
group (gloo on CPU, nccl on CUDA) after checking the launcher's settings against the recipe's
``[distributed]`` table (:func:`check_launch_environment`). The small collectives of the loop
(rewards, metrics, flags) live here; how the model is replicated or sharded, and how its
gradients are reduced, is :mod:`flowrl.train.parallel`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import os
import signal
import subprocess
import sys

from typing import Any

import torch
import torch.distributed as dist

from .errors import FlowrlError


@dataclasses.dataclass(frozen=True)
class DistContext:
    """Where this process sits in the run's data: ``rank`` of ``world_size`` data-parallel ranks,
    each with its own share of the samples. With context parallelism (``[distributed]
    .context_parallel`` = C > 1) C processes share one rank's samples and split every sequence of
    the denoiser between them: ``cp_rank`` is this process's place among them. Data collectives
    (rewards, metrics) run over the data-parallel ranks; control (stopping, the main process's
    decisions) over every process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    context_parallel: int = 1
    cp_rank: int = 0
    #: the process group of the data-parallel ranks this process talks to (the processes with its
    #: ``cp_rank``); None: the default group (no context parallelism)
    data_group: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def process_rank(self) -> int:
        """This process's rank in the process group (a context-parallel group's ranks are consecutive)."""
        return self.rank * self.context_parallel + self.cp_rank

    @property
    def process_count(self) -> int:
        return self.world_size * self.context_parallel

    @property
    def is_main(self) -> bool:
        """The process that writes the run's files and speaks for it: process rank 0."""
        return self.process_rank == 0

    @property
    def enabled(self) -> bool:
        """Whether there are data-parallel ranks to gather samples, rewards and metrics from."""
        return self.world_size > 1


_TRUE = ("1", "true", "yes")
_FALSE = ("", "0", "false", "no")


def flag_setting(env, key: str) -> bool | None:
    """An accelerate boolean environment setting: True, False, or None when it is not set."""
    if key not in env:
        return None
    value = env[key].strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise FlowrlError(f"the launcher set {key}={env[key]!r}, which is neither true nor false", where="accelerate config")


def _disagree(launcher: str, recipe: str, fix: str) -> FlowrlError:
    return FlowrlError(
        f"the launcher asks for {launcher} but the recipe's [distributed] has {recipe}",
        where="accelerate config vs [distributed]",
        hint=f"make them agree: {fix}",
    )


def _check_fsdp_launch(settings, env) -> None:
    """FSDP settings exported by `accelerate launch` (an FSDP config) against [distributed]."""
    if settings.strategy not in ("auto", "fsdp2"):
        raise _disagree("FSDP (ACCELERATE_USE_FSDP=true)", f"strategy = {settings.strategy!r}",
                        "set [distributed].strategy = 'fsdp2', or launch without the FSDP config")
    version = env.get("FSDP_VERSION", "1").strip()
    if version != "2":
        raise FlowrlError(
            f"the launcher asks for FSDP version {version} (FSDP_VERSION); flowrl implements FSDP2 only",
            where="accelerate config", hint="set fsdp_version: 2 in the accelerate config (or drop the FSDP section)",
        )
    strategy = env.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").strip().upper()
    if strategy not in ("1", "FULL_SHARD"):  # FSDP2 replaces it: hybrid is a 2-D mesh (parallelism config)
        raise FlowrlError(
            f"the launcher asks for FSDP_SHARDING_STRATEGY={strategy}, an FSDP1 setting that FSDP2 does not have",
            where="accelerate config",
            hint="for shard-within-node / replicate-across-nodes set parallelism_config dp_replicate_size "
            "(= the number of nodes) and [distributed].shard = 'hybrid'",
        )
    if flag_setting(env, "ACCELERATE_USE_PARALLELISM_CONFIG"):
        for key in ("PARALLELISM_CONFIG_TP_SIZE", "PARALLELISM_CONFIG_CP_SIZE", "PARALLELISM_CONFIG_SP_SIZE"):
            if env.get(key, "1").strip() not in ("", "1"):
                raise FlowrlError(f"the launcher asks for {key}={env[key]}; flowrl shards data-parallel only",
                                  where="accelerate config", hint=f"remove {key.lower()} from the parallelism config")
        replicate = env.get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "1").strip() or "1"
        shard = "hybrid" if replicate != "1" else "full"
        if shard != settings.shard:
            raise _disagree(f"PARALLELISM_CONFIG_DP_REPLICATE_SIZE={replicate} ({shard} sharding)",
                            f"shard = {settings.shard!r}", f"set [distributed].shard = {shard!r}, or change dp_replicate_size")
    if flag_setting(env, "FSDP_RESHARD_AFTER_FORWARD") is False:
        raise FlowrlError("the launcher asks FSDP not to reshard after forward (FSDP_RESHARD_AFTER_FORWARD=false); "
                          "flowrl reshards every block after its forward", where="accelerate config",
                          hint="set fsdp_reshard_after_forward: true")
    for key, field in (("FSDP_OFFLOAD_PARAMS", "cpu_offload"), ("FSDP_ACTIVATION_CHECKPOINTING", "activation_checkpointing")):
        launcher = flag_setting(env, key)
        if launcher is not None and launcher != getattr(settings, field):
            raise _disagree(f"{key}={str(launcher).lower()}", f"{field} = {str(getattr(settings, field)).lower()}",
                            f"set [distributed].{field} = {str(launcher).lower()}, or change the accelerate config")
    # FSDP_SYNC_MODULE_STATES / FSDP_CPU_RAM_EFFICIENT_LOADING (accelerate's defaults: true) hold:
    # rank 0 loads the weights and broadcasts them block by block before sharding; a model adapter
    # that can builds the denoiser without weights on the other processes (weights_from_rank_zero)
    for key in ("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD",):
        if flag_setting(env, key):
            raise FlowrlError(f"the launcher asks for {key}=true, which flowrl does not implement",
                              where="accelerate config", hint="set it to false in the accelerate config")


def check_launch_environment(settings=None, env=None) -> None:
    """The settings a launcher exports (``accelerate launch --config_file``) must agree with the
    recipe's ``[distributed]`` table (``settings``: an object with ``strategy``, ``shard``,
    ``cpu_offload``, ``activation_checkpointing`` and ``mixed_precision``): a disagreement is an
    error naming both values, never ignored. ``settings=None`` means an engine that has no
    strategy wired in: it refuses every launcher setting it would otherwise ignore.
    """
    env = os.environ if env is None else env
    for key, name in (("ACCELERATE_USE_DEEPSPEED", "DeepSpeed"), ("ACCELERATE_USE_MEGATRON_LM", "Megatron-LM")):
        if flag_setting(env, key):
            raise FlowrlError(
                f"the launcher asks for {name} ({key}={env[key]}), which flowrl does not implement",
                where="accelerate config",
                hint="use [distributed].strategy = 'fsdp2' (sharded weights, gradients and optimizer state) or 'ddp'; "
                "docs/distributed.md says why DeepSpeed is not offered",
            )
    precision = env.get("ACCELERATE_MIXED_PRECISION", "").strip().lower()
    fsdp = flag_setting(env, "ACCELERATE_USE_FSDP")
    if settings is None:
        if fsdp or precision not in ("", "no"):
            key, name = ("ACCELERATE_USE_FSDP", "FSDP") if fsdp else ("ACCELERATE_MIXED_PRECISION", "mixed precision")
            raise FlowrlError(f"the launcher asks for {name} ({key}={env[key]}), but no [distributed] strategy was "
                              "given to the engine", where="accelerate config", hint="launch with plain data parallelism")
        return
    if precision and precision not in ("no", "bf16"):
        raise FlowrlError(f"the launcher asks for {precision} mixed precision (ACCELERATE_MIXED_PRECISION); flowrl "
                          "offers bf16 only", where="accelerate config", hint="use --mixed_precision bf16 or no")
    if precision and precision != settings.mixed_precision:
        raise _disagree(f"mixed precision ACCELERATE_MIXED_PRECISION={precision}",
                        f"mixed_precision = {settings.mixed_precision!r}",
                        f"set [distributed].mixed_precision = {precision!r}, or launch with "
                        f"--mixed_precision {settings.mixed_precision}")
    if fsdp:
        _check_fsdp_launch(settings, env)


_WEIGHTS_FROM_RANK_ZERO = contextvars.ContextVar("flowrl_weights_from_rank_zero", default=False)


@contextlib.contextmanager
def weights_from_rank_zero(active: bool = True):
    """Inside the block, a model adapter that can builds its denoiser without weights (on the
    ``meta`` device: shapes and dtypes, no storage, nothing read from disk): this process will
    receive rank 0's weights block by block while FSDP2 shards the denoiser
    (:meth:`flowrl.train.parallel.Strategy.prepare`). The training loop opens it on every process
    but rank 0 of an fsdp2 run, so that a node's host memory holds one loaded copy of the denoiser
    instead of one per process. An adapter that ignores it loads real weights, which are then
    overwritten by rank 0's: correct, only costlier. Query it with :func:`receives_weights`."""
    token = _WEIGHTS_FROM_RANK_ZERO.set(bool(active))
    try:
        yield
    finally:
        _WEIGHTS_FROM_RANK_ZERO.reset(token)


def receives_weights() -> bool:
    """True inside :func:`weights_from_rank_zero`: a model adapter may build its denoiser on the
    ``meta`` device instead of loading its weights (every other component loads as usual)."""
    return _WEIGHTS_FROM_RANK_ZERO.get()


def choose_strategy(requested: str, world_size: int, launcher_fsdp: bool = False, *, hint: str | None = None) -> str:
    """``"none"``, ``"ddp"`` or ``"fsdp2"``: ``requested``, or for ``"auto"`` fsdp2 when the
    launcher asks for FSDP, else ddp with several processes, else none. The one rule for a run
    (:func:`flowrl.train.parallel.resolve_strategy`) and its memory plan (``flowrl plan``)."""
    strategy = requested
    if strategy == "auto":
        strategy = "fsdp2" if launcher_fsdp else ("ddp" if world_size > 1 else "none")
    if strategy == "none" and world_size > 1:
        raise FlowrlError(f"strategy = 'none' runs one process, not {world_size}", where="[distributed].strategy",
                          hint=hint or "use 'ddp' or 'fsdp2' (or 'auto'), or launch one process")
    return strategy


def resolve_device(name: str, where: str = "[run].device") -> torch.device:
    """``auto`` (CUDA when available, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``; a CUDA device
    this machine lacks is one message here, not torch's assertion once a tensor is placed."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise FlowrlError(f"invalid device '{name}'", where=where, hint="'auto', 'cpu', 'cuda' or 'cuda:N'") from exc
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            raise FlowrlError(f"device '{name}' names a CUDA GPU, and torch {torch.__version__} sees none", where=where,
                              hint="use 'cpu' or 'auto' (the GPU where there is one); `flowrl doctor` says why no GPU is seen")
        if device.index is not None and device.index >= count:
            raise FlowrlError(f"device '{name}': this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}",
                              where=where, hint="name one of them")
    return device


def start(device_name: str, settings=None) -> tuple[torch.device, DistContext]:
    """This process's device and the process group: under torchrun or accelerate, one process
    per GPU (``cuda`` then means ``cuda:LOCAL_RANK``). ``settings``: the recipe's
    ``[distributed]`` table (see :func:`setup`)."""
    device = resolve_device(device_name)
    ctx = setup(device, settings)
    return process_device(device, ctx), ctx


def process_device(device: torch.device, ctx: DistContext) -> torch.device:
    """``cuda`` without an index means this process's GPU, ``cuda:LOCAL_RANK``."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", ctx.local_rank)
    return device


def setup(device: torch.device, settings=None) -> DistContext:
    """Join the process group. ``settings`` is the recipe's ``[distributed]`` table, checked
    against the launcher's settings (:func:`check_launch_environment`)."""
    check_launch_environment(settings)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        if settings is not None and getattr(settings, "context_parallel", 1) > 1:
            raise FlowrlError(f"context_parallel = {settings.context_parallel} splits each sequence over that many "
                              "processes; this run has one", where="[distributed].context_parallel",
                              hint=f"launch with `flowrl train --num-processes {settings.context_parallel}`, or set "
                                   "context_parallel = 1")
        if settings is not None and settings.strategy == "fsdp2" and not dist.is_initialized():
            # FSDP2 needs a process group even alone (one GPU with cpu_offload, or a test): a
            # one-process group over an in-memory store, no launcher, no port
            dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
                                    store=dist.HashStore(), rank=0, world_size=1)
        return DistContext()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        if device.type == "cuda":
            # Each process owns one GPU ("cuda" then means that GPU, for the model and for
            # rewards alike); small CPU collectives (rewards, flags, metrics) go over gloo.
            torch.cuda.set_device(local_rank)
            dist.init_process_group(backend="cpu:gloo,cuda:nccl")
        else:
            dist.init_process_group(backend="gloo")
    return _data_context(dist.get_rank(), dist.get_world_size(), local_rank, settings)


def _data_context(rank: int, world: int, local_rank: int, settings) -> DistContext:
    """The data-parallel layout of ``world`` processes: groups of ``context_parallel`` consecutive
    processes share their samples and split every sequence; the data-parallel ranks are the
    groups, and each process gathers samples, rewards and metrics with the processes of the same
    place in the other groups (one process group per place, every process creating all of them)."""
    cp = getattr(settings, "context_parallel", 1) if settings is not None else 1
    if cp > 1 and world % cp:
        raise FlowrlError(
            f"context_parallel = {cp} does not divide the {world} processes into groups",
            where="[distributed].context_parallel", hint=f"launch a multiple of {cp} processes",
        )
    dp, data_group = world // cp, None
    if cp > 1 and dp > 1:
        groups = [dist.new_group([place + d * cp for d in range(dp)]) for place in range(cp)]
        data_group = groups[rank % cp]
    return DistContext(rank=rank // cp, world_size=dp, local_rank=local_rank, context_parallel=cp,
                       cp_rank=rank % cp, data_group=data_group)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_gather_cat(tensor: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Concatenate equal-shaped tensors from every rank along dim 0, in rank order."""
    if not ctx.enabled:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(ctx.world_size)]
    dist.all_gather(parts, tensor.contiguous(), group=ctx.data_group)
    return torch.cat(parts, dim=0)


def all_reduce_scalar(value: float, ctx: DistContext, op: str = "sum") -> float:
    """``op`` in ``"sum"``, ``"max"``, ``"min"`` over ranks (the value itself on one process)."""
    if not ctx.enabled:
        return value
    sign = -1.0 if op == "min" else 1.0
    t = torch.tensor([sign * value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=ctx.data_group)
    return sign * float(t.item())


def all_reduce_sum(tensor: torch.Tensor, ctx: DistContext, every_process: bool = False) -> torch.Tensor:
    """The element-wise sum over ranks of equal-shaped CPU tensors (a new tensor; ``tensor`` itself
    on one process). ``every_process``: over every process, context-parallel ones included (a
    decision for all of them, as :func:`any_rank`), not over the data-parallel ranks."""
    if (ctx.process_count if every_process else ctx.world_size) == 1:
        return tensor
    out = tensor.detach().clone()
    dist.all_reduce(out, group=None if every_process else ctx.data_group)
    return out


def any_rank(flag: bool, ctx: DistContext) -> bool:
    """True on every process when it is true on any (e.g. a Ctrl-C seen by one process first): a
    decision for all processes, context-parallel ones included."""
    if ctx.process_count == 1:
        return bool(flag)
    t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item()) > 0.5


class AnyRank:
    """``any(flag)``: :func:`any_rank` as an object (the update's lockstep agreement under FSDP2,
    :class:`flowrl.objectives.chunk_gradient.Lockstep`)."""

    def __init__(self, ctx: DistContext):
        self.ctx = ctx

    def any(self, flag: bool) -> bool:
        return any_rank(flag, self.ctx)


def reduce_metrics(metrics: dict[str, float], how: dict[str, str], ctx: DistContext) -> dict[str, float]:
    """Combine per-rank metrics in one collective: ``how[key]`` is ``"mean"``, ``"sum"``, ``"min"``
    or ``"max"``.

    Ranks may hold different keys: a process that evaluated nothing, re-scored nothing or whose
    groups all tied has fewer metrics than the others, and a reduction that assumed equal keys would
    hand the backend tensors of different lengths (gloo aborts, NCCL hangs). So every rank sends its
    whole table (one ``all_gather_object`` of a few hundred numbers) and each combines the union
    alike, in rank order, in float64: a key counts only on the ranks that have it (a mean is over
    those ranks). Every rank must call it at the same point; the tables themselves may differ.
    """
    if not ctx.enabled:
        return dict(metrics)
    tables: list = [None] * ctx.world_size
    dist.all_gather_object(tables, {k: (how[k], float(v)) for k, v in metrics.items()}, group=ctx.data_group)
    seen: dict[str, list[float]] = {}
    kinds: dict[str, str] = {}
    for table in tables:  # rank order: the same sums on every rank
        for key, (kind, value) in table.items():
            if kinds.setdefault(key, kind) != kind:
                raise ValueError(f"metric {key!r} is reduced as {kinds[key]!r} on one process and {kind!r} on another")
            seen.setdefault(key, []).append(value)
    combine = {"sum": math.fsum, "mean": lambda xs: math.fsum(xs) / len(xs), "min": min, "max": max}
    return {key: float(combine[kinds[key]](values)) for key, values in seen.items()}  # rank 0's key order first


def gather_objects(obj, ctx: DistContext) -> list:
    """Every data rank's ``obj``, in rank order, on every rank (``[obj]`` on one). Picklable
    objects this run made itself (never a user's file). Every rank must call it at the same point."""
    if not ctx.enabled:
        return [obj]
    out: list = [None] * ctx.world_size
    dist.all_gather_object(out, obj, group=ctx.data_group)
    return out


def drop_gathered_weights(module: torch.nn.Module) -> None:
    """Free the all-gathered weights FSDP2 still holds for ``module`` and its sharded parts.

    The root is sharded with ``reshard_after_forward=False``, so after a forward without a
    backward (sampling, evaluation) its gathered weights stay and the next forward reuses them.
    A change made to the shards in place meanwhile (the EMA swapped in or out, a reference reset)
    would go unseen: call this before and after such a change. Nothing to do without FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    for part in module.modules():
        if isinstance(part, FSDPModule):
            part.reshard()


def default_store():
    """The key-value store of the default process group (torchrun's TCPStore), which every process
    reaches without a collective; None without a process group."""
    if not dist.is_initialized():
        return None
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def broadcast_object(obj, ctx: DistContext):
    """The main process's ``obj`` on every process (its decisions, which every process follows)."""
    if ctx.process_count == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


#: The torchrun agent, started by :func:`launch` through this wrapper: it dies with the launcher.
_AGENT = "import sys; from flowrl.launch_agent import run_launch_agent; run_launch_agent(sys.argv[1:])"


def launch(num_processes: int, argv: list[str], env: dict[str, str] | None = None) -> int:
    """Re-run this command under torchrun with ``num_processes`` local processes (``env``: more
    environment for them). Returns the exit status; 130 after a forwarded Ctrl-C or SIGTERM.

    The workers live exactly as long as this launcher. Linux's parent-death signal ties each link
    of launcher -> torchrun agent -> fork server -> worker: the agent is started through
    :data:`_AGENT` (:func:`flowrl.launch_agent.run_launch_agent`), the fork server that forks the
    workers after importing the training stack once asks for it on import
    (:mod:`flowrl.fork_server`), and so does every worker at startup
    (:func:`flowrl.launch_agent.run_launched_worker`), each checking that its parent had not died
    before it asked. A per-link death signal was chosen over
    workers watching the launcher's pid: it needs no polling thread, fires the moment the parent
    dies (SIGKILL and the OOM killer included, which no handler sees), cannot be fooled by a
    reused pid, and torchrun starts every worker in a session of its own, out of reach of a
    process-group kill. The death signal is SIGKILL: the graceful stops (Ctrl-C, SIGTERM, SIGHUP)
    reach this launcher, which forwards them and waits, so a parent dies without stopping its
    children first only when it was itself killed; a run is written to survive a kill at any
    moment (atomic checkpoints) and resumes from its last checkpoint.

    torchrun runs in a session (process group) of its own, so a Ctrl-C at the terminal reaches it once,
    through this launcher, not twice (a second Ctrl-C aborts a run without its checkpoint).
    """
    args = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--num-processes":
            skip = True
            continue
        if a.startswith("--num-processes="):
            continue
        args.append(a)
    child_env = dict(os.environ, **(env or {}), FLOWRL_LAUNCHER_PID=str(os.getpid()))
    child_env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-c", _AGENT, "--standalone", f"--nproc_per_node={num_processes}", "-m", "flowrl", *args]
    forwarded: list[int] = []
    agent = subprocess.Popen(cmd, env=child_env, start_new_session=True)

    def forward(signum, frame):
        forwarded.append(signum)
        if len(forwarded) >= 3:  # the third: stop waiting for anything (the workers die with the agent)
            agent.kill()
        else:  # the first stops after a checkpoint, the second aborts (flowrl.train.progress)
            agent.send_signal(signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, forward) for sig in handled}
    try:
        code = agent.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if agent.poll() is None:  # an exception here (not a signal): leave no agent behind
            agent.kill()
            agent.wait()
    return 130 if forwarded else code
