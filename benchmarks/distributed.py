"""Benchmark: optimizer-step time of 2 processes (DDP, FSDP2) against 1 process doing the same
global work (flowrl.train.parallel; docs/distributed.md, docs/benchmarks.md).

Workload, the same in every configuration: the embedded FLUX denoiser (random init, 1.2 M
parameters), a global batch of ``--batch`` latents; per optimizer step every sample is
re-scored at ``--positions`` noise levels, one forward with grad and one backward each, in
micro-batches of 2 (the memory-lean update's shape: many backwards per optimizer step), then
one gradient reduction (``Strategy.accumulate``), clipping and AdamW. One process runs the whole
batch; two processes run half each (gloo on this CPU).

Side by side: ``--rounds`` rounds, each launching the three configurations in a seeded random
order (the machine is shared and its load drifts). Each launch times ``--steps`` steps after
one warm-up step; rank 0 reports the median wall time of a step (between barriers) and the
process CPU time. Scaling efficiency = T(1 process) / (2 x T(2 processes)): 1.0 is perfect.
On a machine whose cores are busy with other work (load above the core count) wall time
measures the scheduler more than the strategy; the CPU-time efficiency, T_cpu(1 process) /
(2 x T_cpu(rank 0 of 2)), then says how much work each process added to its half.

Run (one thread per process, as everywhere on this machine)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/distributed.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from flowrl.processes import exits_with_parent  # noqa: E402  (no benchmark child outlives this script)

os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"1 process": ("none", 1), "2 processes, ddp": ("ddp", 2), "2 processes, fsdp2": ("fsdp2", 2)}


def worker(kind: str, batch: int, positions: int, steps: int, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from flowrl.distributed import DistContext
    from flowrl.recipe import DistributedConfig
    from flowrl.train.parallel import Strategy, Topology
    from flowrl_plugins.embedded.plugin import EmbeddedConfig, EmbeddedModel

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    adapter = EmbeddedModel(EmbeddedConfig(random_init=True, seed=0))
    adapter.denoiser.requires_grad_(True)
    strategy = Strategy(DistributedConfig(strategy=kind), kind, torch.device("cpu"),
                        Topology.from_context(DistContext(rank=rank, world_size=world)))
    opt = torch.optim.AdamW(adapter.denoiser.parameters(), lr=1e-5)
    adapter.denoiser = strategy.prepare(adapter.denoiser, opt)
    g = torch.Generator().manual_seed(rank)
    local = batch // world
    x = torch.randn(local, 64, 48, generator=g)
    text = adapter.encode_prompts(["a red circle on a blue background"] * local)
    sigmas = torch.linspace(0.9, 0.2, positions)

    def step():
        strategy.zero_grad()
        with strategy.accumulate():
            for sigma in sigmas:
                for start in range(0, local, 2):
                    rows = torch.arange(start, min(start + 2, local))
                    t = {k: v[rows] for k, v in text.items()}
                    v = adapter.velocity(x[rows], sigma.expand(len(rows)), t)
                    (v.square().mean() / (batch // 2)).backward()
        strategy.clip_grad_norm_(1.0)
        strategy.step()

    step()  # warm-up
    wall, cpu = [], []
    for _ in range(steps):
        if world > 1:
            dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        if world > 1:
            dist.barrier()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    if rank == 0:
        out.write_text(json.dumps({"wall": statistics.median(wall), "cpu": statistics.median(cpu)}))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown with live gloo threads


def launch(kind: str, procs: int, args, out: Path) -> dict:
    script = [str(Path(__file__).resolve()), "--worker", kind, "--out", str(out), "--batch", str(args.batch),
              "--positions", str(args.positions), "--steps", str(args.steps)]
    cmd = [sys.executable, *script] if procs == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}", *script]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    subprocess.run(cmd, env=env, check=True, timeout=600, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=exits_with_parent())
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--positions", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.batch, args.positions, args.steps, args.out)
    import torch

    rng = random.Random(args.seed)
    times: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = list(CONFIGS)
            rng.shuffle(order)
            for name in order:
                kind, procs = CONFIGS[name]
                times[name].append(launch(kind, procs, args, Path(tmp) / f"{r}-{kind}.json"))
                print(f"round {r + 1}: {name:20s} {times[name][-1]['wall']:.3f} s/step", flush=True)
    print(f"\ntorch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}; global batch {args.batch}, {args.positions} positions, "
          f"{args.batch * args.positions // 2} forward+backward calls of 2 samples per step over all processes, "
          f"{args.rounds} rounds x {args.steps} steps")
    base = statistics.median(t["wall"] for t in times["1 process"])
    base_cpu = statistics.median(t["cpu"] for t in times["1 process"])
    print(f"{'configuration':22s} {'wall s/step':>12s} {'speed-up':>9s} {'efficiency':>11s} "
          f"{'cpu s/step (rank 0)':>20s} {'cpu efficiency':>15s}")
    for name, (_, procs) in CONFIGS.items():
        wall = statistics.median(t["wall"] for t in times[name])
        cpu = statistics.median(t["cpu"] for t in times[name])
        print(f"{name:22s} {wall:12.3f} {base / wall:9.2f} {base / (procs * wall):11.2f} "
              f"{cpu:20.3f} {base_cpu / (procs * cpu):15.2f}")


if __name__ == "__main__":
    main()
