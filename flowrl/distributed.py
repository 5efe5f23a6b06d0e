"""Data parallelism on plain torch.distributed (works under torchrun and `accelerate launch`).

Both launchers set RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR; :func:`setup` joins the process
group (gloo on CPU, nccl on CUDA). Gradients are averaged explicitly with one coalesced
all-reduce per optimizer step (:func:`average_gradients`), which is what DDP does, but lets the
memory-lean chunk update call backward many times per micro-batch without a sync each time.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import torch
import torch.distributed as dist

from .errors import FlowrlError


@dataclasses.dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


#: accelerate settings the engine does not implement: refused rather than silently ignored.
_UNSUPPORTED_LAUNCH = {
    "ACCELERATE_MIXED_PRECISION": "accelerate's mixed precision (set the model's dtype in the recipe instead)",
    "ACCELERATE_USE_FSDP": "FSDP",
    "ACCELERATE_USE_DEEPSPEED": "DeepSpeed",
    "ACCELERATE_USE_MEGATRON_LM": "Megatron-LM",
}


def check_launch_environment(env=None) -> None:
    """Refuse launcher settings that the engine would otherwise ignore."""
    env = os.environ if env is None else env
    for key, name in _UNSUPPORTED_LAUNCH.items():
        value = env.get(key, "").lower()
        if value and value not in ("0", "false", "no"):
            raise FlowrlError(
                f"the launcher asks for {name} ({key}={env[key]}), which flowrl's engine does not implement",
                where="accelerate config",
                hint="use data parallelism (`accelerate launch --multi_gpu ...` or `flowrl train --num-processes N`); "
                "for models that do not fit, use LoRA, gradient checkpointing and `flowrl plan` to size the run",
            )


def resolve_device(name: str) -> torch.device:
    """``auto`` (CUDA when available, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(name)
    except RuntimeError as exc:
        raise FlowrlError(f"invalid device '{name}'", where="[run].device", hint="'auto', 'cpu', 'cuda' or 'cuda:N'") from exc


def start(device_name: str) -> tuple[torch.device, DistContext]:
    """This process's device and the process group: under torchrun or accelerate, one process
    per GPU (``cuda`` then means ``cuda:LOCAL_RANK``)."""
    device = resolve_device(device_name)
    ctx = setup(device)
    return process_device(device, ctx), ctx


def process_device(device: torch.device, ctx: DistContext) -> torch.device:
    """``cuda`` without an index means this process's GPU, ``cuda:LOCAL_RANK``."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", ctx.local_rank)
    return device


def setup(device: torch.device) -> DistContext:
    check_launch_environment()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
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
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_gather_cat(tensor: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Concatenate equal-shaped tensors from every rank along dim 0, in rank order."""
    if not ctx.enabled:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(ctx.world_size)]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts, dim=0)


def average_gradients(params: list[torch.nn.Parameter], ctx: DistContext) -> None:
    """Average .grad over ranks, in place, one tensor at a time (no extra gradient copy)."""
    if not ctx.enabled:
        return
    for p in params:
        if p.grad is None:  # every rank must join every all-reduce
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad.div_(ctx.world_size)


def all_reduce_scalar(value: float, ctx: DistContext, op: str = "sum") -> float:
    """``op`` in ``"sum"``, ``"max"``, ``"min"`` over ranks (the value itself on one process)."""
    if not ctx.enabled:
        return value
    sign = -1.0 if op == "min" else 1.0
    t = torch.tensor([sign * value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return sign * float(t.item())


def any_rank(flag: bool, ctx: DistContext) -> bool:
    """True on every rank when it is true on any (e.g. a Ctrl-C seen by one process first)."""
    return all_reduce_scalar(1.0 if flag else 0.0, ctx, "max") > 0.5


def reduce_metrics(metrics: dict[str, float], how: dict[str, str], ctx: DistContext) -> dict[str, float]:
    """Combine per-rank metrics with two collectives: ``how[key]`` is ``"mean"``, ``"sum"``,
    ``"min"`` or ``"max"``. Every rank must pass the same keys (the loop runs the same code on
    each)."""
    if not ctx.enabled or not metrics:
        return dict(metrics)
    keys = sorted(metrics)
    sums = [k for k in keys if how[k] in ("mean", "sum")]
    extremes = [k for k in keys if how[k] in ("min", "max")]
    out: dict[str, float] = {}
    if sums:
        t = torch.tensor([metrics[k] for k in sums], dtype=torch.float64)
        dist.all_reduce(t)
        out.update({k: float(v) / (ctx.world_size if how[k] == "mean" else 1) for k, v in zip(sums, t.tolist())})
    if extremes:
        signs = [-1.0 if how[k] == "min" else 1.0 for k in extremes]
        t = torch.tensor([s * metrics[k] for s, k in zip(signs, extremes)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out.update({k: s * float(v) for s, k, v in zip(signs, extremes, t.tolist())})
    return out


def broadcast_object(obj, ctx: DistContext):
    if not ctx.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def launch(num_processes: int, argv: list[str]) -> int:
    """Re-run this command under torchrun with ``num_processes`` local processes."""
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
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={num_processes}", "-m", "flowrl", *args]
    return subprocess.call(cmd, env=env)
