"""Batched group rollout vs generating the samples one at a time (the anchors' way).

    OMP_NUM_THREADS=1 python benchmarks/rollout.py [--rounds 5] [--steps 17] [--prompts 4] [--group 8]

Same model (the embedded one, random init: compute does not depend on the weights), same
schedule, kernel and per-sample generators. "batched" is what the engine does: all
prompts x group samples in one trajectory, one network call per step. "one at a time" loops over
the samples and runs a batch-of-1 trajectory for each, as DanceGRPO / Flow-GRPO's sample loops
do. Both run in this process, alternating, and the ratio is taken per round; the median over
rounds is reported, in this process's CPU time (one thread; wall time on a shared machine mostly
measures the neighbours) and in wall time. The two produce the same samples (checked, float tolerance).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=17)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    args = ap.parse_args()

    from flowrl.plugins import get_registry
    from flowrl.prompts import prompts_for_iteration, read_prompts
    from flowrl.sampling.rollout import make_kernels, rollout
    from flowrl.seeding import sample_generators
    from flowrl.train.collect import initial_noise
    from flowrl_plugins.embedded.plugin import EmbeddedConfig, EmbeddedModel

    registry = get_registry()
    model = EmbeddedModel(EmbeddedConfig(random_init=True))
    schedule = registry.get("schedule", "shift").build(registry.get("schedule", "shift").params(shift=3.0))
    kernel = registry.get("kernel", "flow").build(registry.get("kernel", "flow").params(a=0.7))
    sigmas = schedule.sigmas(args.steps, model).float()
    kernels = make_kernels(args.steps, kernel)
    G, B = args.group, args.prompts * args.group
    prompts = prompts_for_iteration(read_prompts("model", model, ""), 0, 0, args.prompts)
    sample_prompts = [prompts[j // G] for j in range(B)]
    text = {k: v for k, v in model.encode_prompts(sample_prompts).items()}

    def batched():
        noise = initial_noise(0, 0, range(B), G, model.latent_shape, False)
        gens = sample_generators(0, "rollout", 0, range(B))
        return rollout(lambda x, s: model.velocity(x, s, text), noise, sigmas, kernels, generators=gens,
                       prompts=sample_prompts).image_latents

    def one_at_a_time():
        out = []
        for j in range(B):
            t_j = {k: v[j : j + 1] for k, v in text.items()}
            noise = initial_noise(0, 0, [j], G, model.latent_shape, False)
            gens = sample_generators(0, "rollout", 0, [j])
            out.append(rollout(lambda x, s: model.velocity(x, s, t_j), noise, sigmas, kernels, generators=gens,
                               prompts=[sample_prompts[j]]).image_latents)
        return torch.cat(out)

    torch.testing.assert_close(batched(), one_at_a_time(), rtol=1e-4, atol=1e-4)  # also warms up
    rows = []
    for r in range(args.rounds):
        row = {}
        for name, fn in (("batched", batched), ("one_at_a_time", one_at_a_time)):
            w, c = time.perf_counter(), time.process_time()
            fn()
            row[f"{name}_wall_s"], row[f"{name}_cpu_s"] = time.perf_counter() - w, time.process_time() - c
        row["speedup"] = row["one_at_a_time_cpu_s"] / row["batched_cpu_s"]
        row["wall_speedup"] = row["one_at_a_time_wall_s"] / row["batched_wall_s"]
        rows.append(row)
        print(f"round {r}: batched {row['batched_cpu_s']:.3f} s CPU ({row['batched_wall_s']:.3f} wall), one at a time "
              f"{row['one_at_a_time_cpu_s']:.3f} s CPU ({row['one_at_a_time_wall_s']:.3f} wall), "
              f"speedup {row['speedup']:.2f}x CPU, {row['wall_speedup']:.2f}x wall", flush=True)
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    summary = {
        "median_speedup_cpu": med("speedup"), "median_speedup_wall": med("wall_speedup"),
        "median_batched_cpu_s": med("batched_cpu_s"), "median_one_at_a_time_cpu_s": med("one_at_a_time_cpu_s"),
        "rounds": rows, "threads": torch.get_num_threads(), "argv": sys.argv[1:],
    }
    print(f"median for {B} samples x {args.steps} steps: batched {summary['median_batched_cpu_s']:.3f} s CPU, one at a time "
          f"{summary['median_one_at_a_time_cpu_s']:.3f} s CPU -> batched is {summary['median_speedup_cpu']:.2f}x faster "
          f"in CPU time ({summary['median_speedup_wall']:.2f}x wall; {torch.get_num_threads()} thread(s))")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
