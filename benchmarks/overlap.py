"""Benchmark: rollout and rewards overlapped (``[sampler].overlap_rewards``) vs one after the other.

Each variant runs the engine's own collect phase (:func:`flowrl.train.collect.collect`: prompts,
rollout in ``[sampler].batch_size`` sub-batches, VAE decode, rewards) on the embedded model, with
one reward that is deliberately slow and runs in ANOTHER process: flowrl's own reward server
(:func:`flowrl.serving.simple.make_server`, what ``flowrl reward serve`` runs), started by this
script, reached through the ``http`` reward. The server's reward returns the mean brightness of
each image after a fixed cost per image, calibrated so that scoring every image costs about what
the rollout costs (``--reward-cost`` x the CPU time of this process's collect phase with a
cheap reward, measured first):

- ``--reward-kind cpu`` (default): the cost is the server process's own CPU time (small matmuls
  until ``time.process_time`` has advanced by that much), so it does not depend on how busy the
  machine is, and it needs a core of its own: on this 2-core machine, shared with other jobs,
  the overlap gains only while one core is free for it;
- ``--reward-kind wait``: the server sleeps for the cost (a reward model on its own device, a GPU
  or another machine, whose server process waits for it). Load from other processes on the
  shared cores stretches the rollout's wall time but not a sleep, so before every round the
  cost is matched again to the wall time of one collect with the cheap reward, run just then
  (``reward_s_total_per_round``); both variants of the round see the same cost.

- ``sequential``: ``overlap_rewards = false``: the rollout (all sub-batches), then the decode,
  then the rewards (one request per ``http`` batch).
- ``overlapped``: ``overlap_rewards = true``: sub-batch i is decoded and sent to the server while
  sub-batch i + 1 samples; at the end the main thread waits for the last sub-batch's scores.

Both variants sample the same iteration (same noise, same sub-batches); the script checks that
their images and rewards are equal bit for bit before timing. Time: ``--rounds`` rounds, each
running both variants in a seeded random order (interleaved, so both share the machine's load
drift); wall time (``time.perf_counter``) of the whole collect phase. Reported: per-variant
medians, the ratio of medians and the median (and quartiles) of the per-round ratios
overlapped / sequential, and the load average before and after.

The ideal ratio with ``n`` sub-batches and a reward as slow as the rollout is about
``(1 + 1/n) / 2`` (the last sub-batch's scoring cannot overlap anything); it needs two free
cores, one for the sampler and one for the reward server.

Run (one thread per process)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overlap.py --rounds 9
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

RECIPE = """
[run]
name = "overlap-bench"
seed = 3
device = "cpu"

[model]
use = "embedded"

[sampler]
steps = {steps}
batch_size = {batch_size}

[schedule]
use = "shift"
shift = 3.0

[kernel]
use = "flow"
a = 0.7

[chunker]
use = "explicit"
sizes = [2, 3, 4, 7]

[train]
prompts_per_iteration = {prompts}
group_size = {group}
micro_batch_size = 8

[log]
progress = false

[[rewards]]
use = "http"
url = "{url}"
timeout = 600.0
retries = 0
"""


class SlowBrightness:
    """Mean brightness, after ``cost`` seconds per image: of this process's CPU time (``cpu``: a
    reward computed on the CPU cores the sampler also needs) or of waiting (``wait``: a reward
    whose model runs on another device, e.g. a GPU of its own, while its server process sleeps)."""

    name = "slow_brightness"

    def __init__(self, cost: float, kind: str, cost_file: str = ""):
        self.cost = cost
        self.kind = kind
        self.cost_file = cost_file  # when set, the cost per image is re-read from it at each call
        self.a = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))

    def __call__(self, images, prompts, metadata=None):
        if self.cost_file:
            with open(self.cost_file) as f:
                self.cost = float(f.read())
        if self.kind == "wait":
            time.sleep(self.cost * len(prompts))
        else:
            end = time.process_time() + self.cost * len(prompts)
            x = self.a
            while time.process_time() < end:
                x = torch.tanh(x @ self.a)
        return images.float().mean((1, 2, 3))


def serve(spec: str) -> int:
    """The reward server process: print its URL, serve until killed."""
    torch.set_num_threads(1)
    from flowrl.serving.simple import make_server

    kind, cost, cost_file = spec.split(":", 2)
    server = make_server(SlowBrightness(float(cost), kind, cost_file), name="slow_brightness", port=0)
    print(server.url, flush=True)
    server.serve_forever()
    return 0


def load_recipe_text(text: str):
    from flowrl.recipe import validate

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    return validate(tomllib.loads(text), source="<benchmarks/overlap.py>")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--steps", type=int, default=17)
    ap.add_argument("--batch-size", type=int, default=4, help="[sampler].batch_size: samples per rollout sub-batch")
    ap.add_argument("--reward-cost", type=float, default=1.0,
                    help="the reward's cost for all images, as a multiple of the rollout's (CPU time for "
                         "--reward-kind cpu, wall time for wait)")
    ap.add_argument("--reward-kind", choices=["cpu", "wait"], default="cpu",
                    help="cpu: the reward burns its server process's CPU time (needs a free core); wait: it sleeps "
                         "(a reward model on another device)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="")
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)  # internal: the server, "KIND:COST"
    args = ap.parse_args(argv)
    if args.serve is not None:
        return serve(args.serve)
    torch.set_num_threads(1)

    from flowrl.distributed import DistContext
    from flowrl.geometry import resolve_geometry
    from flowrl.train.collect import collect
    from flowrl.train.progress import PhaseTimer
    from flowrl.train.run import Run
    from flowrl.train.session import Session

    load_before = os.getloadavg()
    n = args.prompts * args.group
    fmt = {"steps": args.steps, "batch_size": args.batch_size, "prompts": args.prompts, "group": args.group}

    # calibrate: the rollout's CPU time in this process (a stand-in reward, no server yet)
    probe = load_recipe_text(RECIPE.format(url="http://127.0.0.1:1", **fmt).replace(
        '[[rewards]]\nuse = "http"\nurl = "http://127.0.0.1:1"\ntimeout = 600.0\nretries = 0',
        '[[rewards]]\nuse = "brightness"'))
    session = Session.open(probe, device="cpu")
    ctx = DistContext()
    geometry = resolve_geometry(probe.train, 1, probe.source)
    prompts = list(session.model.prompt_source())
    collect(Run(session, geometry, ctx), prompts, 0, PhaseTimer(torch.device("cpu")))  # warm-up
    rollout_cpu, rollout_wall = [], []
    for _ in range(3):
        timer = PhaseTimer(torch.device("cpu"))
        c0, t0 = time.process_time(), time.perf_counter()
        collect(Run(session, geometry, ctx), prompts, 0, timer)
        rollout_cpu.append(time.process_time() - c0)
        rollout_wall.append(time.perf_counter() - t0)
    # a CPU-bound reward costs CPU time like the rollout; a reward on another device costs wall
    # time, so it is matched to the rollout's wall time (which load on the shared cores stretches)
    base = statistics.median(rollout_cpu if args.reward_kind == "cpu" else rollout_wall)
    cost = args.reward_cost * base / n

    cost_file = ""
    if args.reward_kind == "wait":  # re-calibrated before every round (below)
        import tempfile

        fd, cost_file = tempfile.mkstemp(prefix="overlap-bench-cost-")
        os.close(fd)
        with open(cost_file, "w") as f:
            f.write(repr(cost))

    def recalibrate():
        """wait: match the reward to the rollout's wall time now (load on the shared cores
        stretches the rollout, not a sleep), from one collect with the cheap reward."""
        t0 = time.perf_counter()
        collect(Run(probe_session, geometry, ctx), prompts, 0, PhaseTimer(torch.device("cpu")))
        wall_now = time.perf_counter() - t0
        with open(cost_file, "w") as f:
            f.write(repr(args.reward_cost * wall_now / n))
        return wall_now

    probe_session = session
    server = subprocess.Popen([sys.executable, __file__, "--serve", f"{args.reward_kind}:{cost!r}:{cost_file}"],
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url = server.stdout.readline().strip()
        if not url.startswith("http://"):
            print(f"the reward server did not start (said {url!r})", file=sys.stderr)
            return 1
        recipe = load_recipe_text(RECIPE.format(url=url, **fmt))
        session = Session.open(recipe, device="cpu")
        geometry = resolve_geometry(recipe.train, 1, recipe.source)

        def run(overlap: bool):
            session.recipe.sampler.overlap_rewards = overlap
            timer = PhaseTimer(torch.device("cpu"))
            t0 = time.perf_counter()
            batch = collect(Run(session, geometry, ctx), prompts, 0, timer)
            return time.perf_counter() - t0, dict(timer.seconds), batch

        # correctness: the same images and rewards, bit for bit
        _, _, seq = run(False)
        _, _, ovl = run(True)
        label = recipe.rewards[0].label
        same_images = torch.equal(seq.images, ovl.images)
        same_rewards = torch.equal(seq.rewards[label], ovl.rewards[label])
        if not (same_images and same_rewards):
            print(f"overlap changed the result: images equal {same_images}, rewards equal {same_rewards}",
                  file=sys.stderr)
            return 1

        names = ["sequential", "overlapped"]
        wall = {k: [] for k in names}
        phases = {k: [] for k in names}
        rng = torch.Generator().manual_seed(args.seed)
        calibrations = []
        for _ in range(args.rounds):
            if cost_file:
                calibrations.append(recalibrate())
            order = [names[int(i)] for i in torch.randperm(2, generator=rng)]
            for name in order:
                t, sec, _ = run(name == "overlapped")
                wall[name].append(t)
                phases[name].append(sec)
    finally:
        server.kill()
        server.wait()
        if cost_file:
            os.unlink(cost_file)

    per_round = [o / s for o, s in zip(wall["overlapped"], wall["sequential"])]
    med = {k: statistics.median(v) for k, v in wall.items()}
    phase_med = {k: {p: statistics.median(r[p] for r in phases[k]) for p in phases[k][0]} for k in names}
    res = {
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overlap.py " + " ".join(argv or sys.argv[1:]),
        "device": f"{platform.machine()} CPU, os.cpu_count() = {os.cpu_count()}, torch threads = "
                  f"{torch.get_num_threads()} per process, torch {torch.__version__}",
        "reward_kind": args.reward_kind, "samples": n, "steps": args.steps, "sub_batch": args.batch_size,
        "sub_batches": -(-n // args.batch_size), "rounds": args.rounds,
        "rollout_cpu_s": statistics.median(rollout_cpu),
        "rollout_wall_s": statistics.median(rollout_wall),
        "reward_s_per_image": cost, "reward_s_total": cost * n,
        "reward_s_total_per_round": [args.reward_cost * c for c in calibrations] if cost_file else None,
        "images_and_rewards_bit_equal": True,
        "wall_median_s": med,
        "phase_median_s": phase_med,
        "ratio_of_medians": med["overlapped"] / med["sequential"],
        "ratio_paired_median": statistics.median(per_round),
        "ratio_paired_quartiles": ([round(q, 3) for q in statistics.quantiles(per_round, n=4)]
                                   if len(per_round) > 1 else per_round),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "wall_s": wall,
    }
    print(json.dumps({k: v for k, v in res.items() if k != "wall_s"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
