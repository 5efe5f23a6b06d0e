"""Worker for tests/distributed/test_parallel.py, which forks it as torchrun would start it (never
mp.spawn: see docs/distributed.md, "Testing"); it also runs as
``python -m torch.distributed.run --standalone --nproc_per_node 2 parallel_worker.py MODE OUT``.

MODE ``train``: every strategy against one process on the same global batch, gradient
collectives counted, bf16 on-policy deviations, sharded checkpoints written after step 1.
MODE ``resume``: the checkpoints of ``train`` loaded into fresh processes, step 2 replayed.
MODE ``single`` (plain ``python``, no torchrun): the same in one process without a process group.

Each rank writes ``OUT/<mode>-rank<R>.json``; rank 0 also writes full weights as safetensors.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from flowrl.recipe import DistributedConfig
from flowrl.train.parallel import (
    Strategy,
    Topology,
    transformer_blocks,
)
from flowrl.train.checkpoint import load_sharded_checkpoint, save_sharded_checkpoint

from bf16_tolerance import bf16_on_policy_tolerance  # tests/distributed/bf16_tolerance.py, beside this script

N, D_IN, D, D_OUT = 8, 6, 16, 4  # global batch, widths
LR, MAX_NORM = 1e-2, 0.5


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, h):
        return h + self.b(torch.tanh(self.a(h)))


class Net(nn.Module):
    """A tiny transformer-shaped network: an input layer, three blocks, an output layer."""

    def __init__(self):
        super().__init__()
        self.inp, self.blocks, self.out = nn.Linear(D_IN, D), nn.ModuleList(Block() for _ in range(3)), nn.Linear(D, D_OUT)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def make_net(lora: bool = False) -> Net:
    torch.manual_seed(0)
    net = Net()
    if lora:
        from peft import LoraConfig, inject_adapter_in_model

        net.requires_grad_(False)
        inject_adapter_in_model(LoraConfig(r=2, lora_alpha=4, target_modules=["a", "b"], init_lora_weights="gaussian"), net)
    return net


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(N, D_IN, generator=g), torch.randn(N, D_OUT, generator=g)


def backwards(model, x, w, rows, scale: float, splits: int) -> int:
    """The lean update's shape: one backward per (sample, group of output columns)."""
    n = 0
    for i in rows:
        for cols in torch.arange(D_OUT).chunk(splits):
            out = model(x[i : i + 1])
            ((out[:, cols] * w[i : i + 1, cols]).sum() * scale).backward()
            n += 1
    return n


def reference(lora: bool, steps: int = 2, splits: int = 2) -> tuple[dict, list[float]]:
    """One process, the whole global batch, torch's own clip_grad_norm_ (a second route)."""
    net = make_net(lora)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.01)
    norms = []
    for step in range(steps):
        x, w = batch(step)
        opt.zero_grad(set_to_none=True)
        backwards(net, x, w, range(N), 1.0 / N, splits)
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM)))
        opt.step()
    return {n: p.detach().clone() for n, p in net.named_parameters() if p.requires_grad}, norms


class CollectiveCounter(TorchDispatchMode):
    """Counts c10d collectives at the dispatcher (whatever Python API issued them)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


GRADIENT_OPS = ("allreduce_", "reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_",
                "allreduce_coalesced_")


def gradient_ops(counts) -> int:
    return sum(v for k, v in counts.items() if k in GRADIENT_OPS)


def reset_accelerate():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()  # one Accelerator per scenario (its mixed precision is global state)


def build(kind: str, lora=False, topology=None, **cfg) -> Strategy:
    reset_accelerate()
    rank, world = dist.get_rank(), dist.get_world_size()
    strategy = Strategy(DistributedConfig(strategy=kind, **cfg), kind, torch.device("cpu"),
                        topology or Topology(rank=rank, world_size=world, local_world_size=world),
                        gradient_sync=cfg.get("gradient_sync", "step"))
    net = make_net(lora)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    strategy.prepare(net, opt)
    return strategy


def local_rows():
    rank, world = dist.get_rank(), dist.get_world_size()
    per = N // world
    return range(rank * per, (rank + 1) * per)


def train_step(strategy: Strategy, step: int, splits: int = 2, rows=None) -> dict:
    """One optimizer step; collectives counted inside the accumulate block and on leaving it."""
    world = dist.get_world_size()
    x, w = batch(step)
    rows = local_rows() if rows is None else rows
    strategy.zero_grad()
    inside, leaving = CollectiveCounter(), CollectiveCounter()
    with leaving:
        with strategy.accumulate():
            with inside:
                n = backwards(strategy.module, x, w, rows, world / N, splits)
    norm = strategy.clip_grad_norm_(MAX_NORM)
    strategy.step()
    exit_counts = leaving.counts - inside.counts
    return {"backwards": n, "inside": dict(inside.counts), "on_exit": dict(exit_counts), "norm": norm,
            "grad_collectives_inside": gradient_ops(inside.counts), "grad_collectives_on_exit": gradient_ops(exit_counts)}


def max_diff(full: dict, ref: dict) -> float:
    assert set(full) == set(ref), (sorted(full)[:3], sorted(ref)[:3])
    return max(float((full[k] - ref[k]).abs().max()) for k in ref)


def shard_report(strategy: Strategy) -> dict:
    from torch.distributed.tensor import DTensor

    out = {"all_dtensor": True, "placements": set(), "local_numel": 0, "full_numel": 0, "frozen_sharded": 0}
    for p in strategy.module.parameters():
        if not isinstance(p, DTensor):
            out["all_dtensor"] = False
            continue
        out["placements"].add(str(tuple(p.placements)))
        out["local_numel"] += p.to_local().numel()
        out["full_numel"] += p.numel()
        out["frozen_sharded"] += int(not p.requires_grad)
    out["placements"] = sorted(out["placements"])
    return out


def scenario_equal(name, kind, results, tensors, lora=False, ckpt=None, topology=None, **cfg):
    strategy = build(kind, lora=lora, topology=topology, **cfg)
    ref, ref_norms = reference(lora)
    steps = []
    for step in range(2):
        steps.append(train_step(strategy, step))
        if step == 0 and ckpt is not None:
            save_sharded_checkpoint(Path(ckpt), "iter_000001", strategy, state={"iteration": 1}, recipe_toml="")
            step1 = strategy.full_state_dict()
            if dist.get_rank() == 0:
                tensors[f"{name}_step1"] = step1
    full = strategy.full_state_dict()
    out = {"steps": steps, "ref_norms": ref_norms, "trainable": len(strategy.params)}
    if kind == "fsdp2":
        out["shards"] = shard_report(strategy)
    if dist.get_rank() == 0:
        out["max_diff"] = max_diff(full, ref)
        tensors[f"{name}_step2"] = full
    results[name] = out


def scenario_counts(name, kind, results, **cfg):
    """Gradient collectives per optimizer step for 4, 8 and 16 backwards per step."""
    strategy = build(kind, **cfg)
    results[name] = [train_step(strategy, 0, splits=s) for s in (1, 2, 4)]
    if kind == "fsdp2":
        results[name + "_groups"] = 1 + len(strategy.module.blocks)  # one FSDP group per block, plus the root


def scenario_empty_rank(name, results):
    """FSDP2 lockstep with uneven work: rank 1 runs its forwards and backwards on 0 samples."""
    strategy = build("fsdp2")
    x, w = batch(0)
    strategy.zero_grad()
    with strategy.accumulate():
        rows = [0, 1] if dist.get_rank() == 0 else []
        for i in range(2):
            sel = torch.tensor(rows[i : i + 1], dtype=torch.long)
            out = strategy.module(x[sel])
            ((out * w[sel]).sum() * dist.get_world_size() / 2).backward()
    full_grads = {n: p.grad.full_tensor() for n, p in strategy.module.named_parameters()}
    net = make_net()
    for i in (0, 1):
        ((net(x[i : i + 1]) * w[i : i + 1]).sum() / 2).backward()
    results[name] = max(float((full_grads[n] - p.grad).abs().max()) for n, p in net.named_parameters())


def embedded_on_policy(kind, results):
    """bf16 compute (autocast for ddp, MixedPrecisionPolicy for fsdp2) with fp32 master weights:
    rollout log-probs re-scored on the same batch and on sub-batches, as the update does."""
    from flowrl.sampling.kernels import FlowKernel
    from flowrl_plugins.embedded.plugin import EmbeddedConfig, EmbeddedModel

    reset_accelerate()
    rank, world = dist.get_rank(), dist.get_world_size()
    adapter = EmbeddedModel(EmbeddedConfig(random_init=True, seed=0))
    fp32 = EmbeddedModel(EmbeddedConfig(random_init=True, seed=0))
    adapter.denoiser.requires_grad_(True)
    strategy = Strategy(DistributedConfig(strategy=kind, mixed_precision="bf16"), kind, torch.device("cpu"),
                        Topology(rank=rank, world_size=world, local_world_size=world))
    opt = torch.optim.AdamW(adapter.denoiser.parameters(), lr=1e-4)
    adapter.denoiser = strategy.prepare(adapter.denoiser, opt)
    g = torch.Generator().manual_seed(7 + rank)
    B = 4
    x = torch.randn(B, 64, 48, generator=g)
    text = adapter.encode_prompts(["a red circle on a blue background"] * B)
    kernel, sig, sig_n = FlowKernel(a=0.7), 0.5, 0.4375
    s = torch.full((B,), sig)
    with torch.no_grad():
        v = adapter.velocity(x, s, text)
        v32 = fp32.velocity(x, s, text)
        roll = kernel.step(v, x, sig, sig_n, generator=g)
        again = kernel.step(adapter.velocity(x, s, text), x, sig, sig_n, next_sample=roll.next_sample)
        sub_dev = 0.0
        for rows in ([1, 3], [2], [0, 1, 2]):
            idx = torch.tensor(rows)
            t = {k: e[idx] for k, e in text.items()}
            re = kernel.step(adapter.velocity(x[idx], s[idx], t), x[idx], sig, sig_n, next_sample=roll.next_sample[idx])
            sub_dev = max(sub_dev, float((re.log_prob - roll.log_prob[idx]).abs().max()))
    eps = (roll.next_sample - roll.mean) / roll.std.view(B, 1, 1)
    tol = bf16_on_policy_tolerance([kernel], torch.tensor([sig, sig_n]), torch.tensor([True]),
                                   velocity_rms=float(v.pow(2).mean().sqrt()), latent_numel=64 * 48,
                                   noise_rms=float(eps.pow(2).mean(dim=(1, 2)).sqrt().max()))
    # one optimizer step in bf16: master weights and gradients stay float32
    strategy.zero_grad()
    with strategy.accumulate():
        for rows in ([0, 1], [2, 3]):
            idx = torch.tensor(rows)
            t = {k: e[idx] for k, e in text.items()}
            out = kernel.step(adapter.velocity(x[idx], s[idx], t), x[idx], sig, sig_n, next_sample=roll.next_sample[idx])
            out.log_prob.sum().backward()
    norm = strategy.clip_grad_norm_(1.0)
    strategy.step()
    dtypes = sorted({str(p.dtype) for p in strategy.params} | {str(p.grad.dtype) for p in strategy.params if p.grad is not None})
    results[f"bf16_{kind}"] = {
        "same_batch": float((again.log_prob - roll.log_prob).abs().max()), "sub_batch": sub_dev, "tolerance": tol,
        "bf16_vs_fp32_velocity": float((v - v32).abs().max()), "v_dtype": str(v.dtype), "norm": norm,
        "dtypes": dtypes, "blocks": len(transformer_blocks(fp32.denoiser)),
        "shards": shard_report(strategy) if kind == "fsdp2" else None,
    }


def scenario_placement(name, results):
    """What FSDP2's preparation moves to the device: every ``Module.to`` call, with the
    parameters not yet sharded under the module it was called on (shard before moving)."""
    from torch.distributed.tensor import DTensor

    moved, original = [], torch.nn.Module.to

    def recording(self, *args, **kwargs):
        moved.append(sum(p.numel() for p in self.parameters() if not isinstance(p, DTensor)))
        return original(self, *args, **kwargs)

    torch.nn.Module.to = recording
    try:
        build("fsdp2")
    finally:
        torch.nn.Module.to = original
    net = make_net()
    results[name] = {"moved": moved, "largest_block": max(sum(p.numel() for p in b.parameters()) for b in net.blocks),
                     "whole": sum(p.numel() for p in net.parameters()), "blocks": len(net.blocks)}


def scenario_received(name, results, lora=False):
    """A process other than rank 0 builds the model on the meta device (no weights, as the diffusers
    adapters do under fsdp2): FSDP2's preparation gives it rank 0's weights block by block, for
    the trained model and for a frozen copy of it (the KL reference)."""
    import copy

    from flowrl.train.parallel import holds_meta_tensors

    reset_accelerate()
    rank, world = dist.get_rank(), dist.get_world_size()
    strategy = Strategy(DistributedConfig(strategy="fsdp2"), "fsdp2", torch.device("cpu"),
                        Topology(rank=rank, world_size=world, local_world_size=world))
    if rank == 0:
        net = make_net(lora)
    else:
        with torch.device("meta"):
            net = make_net(lora)
    frozen = copy.deepcopy(net)
    held = {"net": sum(p.numel() for p in net.parameters() if not p.is_meta), "meta": holds_meta_tensors(net)}
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=LR)
    strategy.prepare(net, opt)
    placed = strategy.prepare_frozen(frozen)
    full = strategy.full_state_dict(trainable_only=False)
    frozen_full = {n: p.full_tensor() for n, p in placed.named_parameters()}
    want = make_net(lora).state_dict()
    results[name] = {"held_before": held, "meta_after": holds_meta_tensors(strategy.module) or holds_meta_tensors(placed),
                     "frozen_equal": all(torch.equal(frozen_full[n], want[n]) for n in want) and sorted(frozen_full) == sorted(want)}
    if rank == 0:
        results[name]["equal"] = sorted(full) == sorted(want) and all(torch.equal(full[n], want[n]) for n in want)


def mode_train(out: Path) -> tuple[dict, dict]:
    results, tensors = {}, {}
    t0 = time.perf_counter()
    scenario_equal("ddp", "ddp", results, tensors, ckpt=out / "ckpt_ddp")
    scenario_equal("fsdp2", "fsdp2", results, tensors, ckpt=out / "ckpt_fsdp2")
    world = dist.get_world_size()
    scenario_equal("hybrid", "fsdp2", results, tensors, shard="hybrid",
                   topology=Topology(rank=dist.get_rank(), world_size=world, local_world_size=1))
    scenario_equal("fsdp2_ckpt_offload", "fsdp2", results, tensors, activation_checkpointing=True, cpu_offload=True)
    scenario_equal("ddp_ckpt", "ddp", results, tensors, activation_checkpointing=True)
    scenario_equal("fsdp2_lora", "fsdp2", results, tensors, lora=True, ckpt=out / "ckpt_fsdp2_lora")
    scenario_equal("fsdp2_sync_each", "fsdp2", results, tensors, gradient_sync="micro_batch")
    scenario_counts("counts_ddp", "ddp", results)
    scenario_counts("counts_fsdp2", "fsdp2", results)
    scenario_counts("counts_fsdp2_sync_each", "fsdp2", results, gradient_sync="micro_batch")
    scenario_empty_rank("empty_rank", results)
    scenario_placement("placement", results)
    scenario_received("received", results)
    scenario_received("received_lora", results, lora=True)
    results["seconds_tiny"] = time.perf_counter() - t0
    embedded_on_policy("ddp", results)
    embedded_on_policy("fsdp2", results)
    results["seconds"] = time.perf_counter() - t0
    return results, tensors


def mode_resume(out: Path) -> tuple[dict, dict]:
    """Step 2 after loading the step-1 checkpoints into fresh processes (the 'kill' was the end
    of the train processes), and the fsdp2 checkpoint loaded by ddp (another strategy)."""
    results, tensors = {}, {}
    for name, kind, lora in (("ddp", "ddp", False), ("fsdp2", "fsdp2", False), ("fsdp2_lora", "fsdp2", True)):
        strategy = build(kind, lora=lora)
        state = load_sharded_checkpoint(out / f"ckpt_{name}" / "iter_000001", strategy)
        loaded = strategy.full_state_dict()
        train_step(strategy, 1)
        full = strategy.full_state_dict()
        results[name] = {"state": state}
        if dist.get_rank() == 0:
            tensors[f"{name}_loaded"], tensors[f"{name}_step2"] = loaded, full
    strategy = build("ddp")
    load_sharded_checkpoint(out / "ckpt_fsdp2" / "iter_000001", strategy)
    loaded = strategy.full_state_dict()
    if dist.get_rank() == 0:
        tensors["fsdp2_into_ddp_loaded"] = loaded
    return results, tensors


def mode_single(out: Path) -> tuple[dict, dict]:
    """One process, no process group: the 2-process checkpoints loaded (DCP reshards), step 2
    replayed on the whole global batch; and the weights read offline (``flowrl export``)."""
    from flowrl.train.checkpoint import read_model_weights

    results, tensors = {}, {}
    for name, lora in (("ddp", False), ("fsdp2", False), ("fsdp2_lora", True)):
        reset_accelerate()
        strategy = Strategy(DistributedConfig(strategy="none"), "none", torch.device("cpu"), Topology())
        net = make_net(lora)
        strategy.prepare(net, torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=LR, weight_decay=0.01))
        path = out / f"ckpt_{name}" / "iter_000001"
        load_sharded_checkpoint(path, strategy)
        tensors[f"{name}_loaded"] = strategy.full_state_dict()
        tensors[f"{name}_offline"] = read_model_weights(path)
        x, w = batch(1)
        strategy.zero_grad()
        with strategy.accumulate():
            backwards(strategy.module, x, w, range(N), 1.0 / N, 2)
        strategy.clip_grad_norm_(MAX_NORM)
        strategy.step()
        tensors[f"{name}_step2"] = strategy.full_state_dict()
    return results, tensors


def mode_collectives(out: Path):
    """The metric reductions with tables that differ by process (what one process with nothing to
    do in a phase hands them): they must agree, not abort or hang."""
    from flowrl.distributed import DistContext, all_reduce_sum, reduce_metrics
    from flowrl.train.compute import ComputeCounter

    rank = dist.get_rank()
    ctx = DistContext(rank=rank, world_size=2, local_rank=rank)
    table = {"both": 1.0 + rank, "low": 3.0 - rank, "high": 3.0 - rank}
    if rank == 0:
        table["only_rank0"] = 5.0  # e.g. what the main process's evaluation alone reports
    how = {"both": "mean", "low": "min", "high": "max", "only_rank0": "sum"}
    reduced = reduce_metrics(table, {k: how[k] for k in table}, ctx)
    empty = reduce_metrics({} if rank == 0 else {"late": 2.0}, {} if rank == 0 else {"late": "mean"}, ctx)
    counter = ComputeCounter()  # its tables only: no model watched
    counter.forward["rollout"] = 10
    counter.minimum["rollout"] = 10
    if rank == 0:
        counter.forward["eval"] = 4  # ddp: only the main process evaluates
    compute = counter.take(ctx)
    summed = all_reduce_sum(torch.tensor([1.0, float(rank)], dtype=torch.float64), ctx).tolist()
    return {"reduced": reduced, "empty": empty, "compute": compute, "summed": summed}, {}


def mode_grouped(out: Path):
    """The on-policy fast path under FSDP2 with ``[train].update_group``: one unit of 4 steps
    forwarded one step at a time, then 4 at once. Each forward gathers every FSDP2 group's
    weights (and the backward gathers the resharded ones again), so grouping divides the
    all-gathers by the group size; the gradients agree."""
    from torch.distributed.tensor import DTensor

    from flowrl.objectives.chunk_gradient import on_policy_chunk_backward
    from flowrl.objectives.losses import ClippedObjective

    steps, rows = 4, 3
    g = torch.Generator().manual_seed(5 + dist.get_rank())  # each process its own samples
    xs, ws = torch.randn(steps, rows, D_IN, generator=g), torch.randn(steps, rows, D_OUT, generator=g)

    def log_probs(net, ts, b):  # a differentiable stand-in for a step's log-prob: [len(ts), len(b)]
        return (net(torch.cat([xs[t, b] for t in ts])).view(len(ts), len(b), D_OUT) * ws[list(ts)][:, b]).sum(-1)

    every = torch.arange(rows)
    adv, mask = torch.tensor([1.0, -0.5, 2.0]), torch.ones(rows, 1, dtype=torch.bool)
    results = {"gathers": {}, "forwards": {}}
    grads = {}
    for group in (1, 4):
        strategy = build("fsdp2")
        net, calls = strategy.module, []
        with torch.no_grad():
            old = log_probs(net, range(steps), every).T.contiguous()

        def one(t, b, grad, net=net, calls=calls):
            calls.append(1)
            with torch.set_grad_enabled(grad):
                return log_probs(net, [t], b)[0]

        def many(ts, b, net=net, calls=calls):
            calls.append(len(ts))
            return log_probs(net, ts, every if b is None else b)

        counter = CollectiveCounter()
        strategy.zero_grad()
        with strategy.accumulate():
            with counter:
                on_policy_chunk_backward(one, old, adv, [steps], mask, ClippedObjective(0.2, 0.2), normaliser=rows,
                                         many=many if group > 1 else None, group=group)
        results["gathers"][group] = sum(v for k, v in counter.counts.items() if "gather" in k)
        results["forwards"][group] = len(calls)
        grads[group] = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in net.named_parameters()}
    results["grad_max_diff"] = max(float((grads[4][n] - grads[1][n]).abs().max()) for n in grads[1])
    results["grad_max"] = max(float(grads[1][n].abs().max()) for n in grads[1])
    return results, {}


def main() -> int:
    mode, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    if mode != "single":
        dist.init_process_group("gloo")
    rank = dist.get_rank() if mode != "single" else 0
    try:
        results, tensors = {"train": mode_train, "resume": mode_resume, "single": mode_single,
                              "collectives": mode_collectives, "grouped": mode_grouped}[mode](out)
        results["ok"] = True
    except Exception:  # reported to the test, which shows it
        results, tensors = {"ok": False, "error": traceback.format_exc()}, {}
    (out / f"{mode}-rank{rank}.json").write_text(json.dumps(results, indent=1, default=str))
    for name, state in tensors.items():
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / f"{mode}-{name}.safetensors"))
    sys.stdout.flush()
    sys.stderr.flush()
    if results["ok"] and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    os._exit(0 if results["ok"] else 1)  # no interpreter teardown with live gloo threads


if __name__ == "__main__":
    sys.exit(main())
