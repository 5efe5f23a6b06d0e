"""Engine overhead: one training iteration vs the pure model compute it needs.

    OMP_NUM_THREADS=1 python benchmarks/overhead.py [--rounds 5] [--iterations 3] [--steps 17]

The engine runs the quickstart geometry on the embedded model (random init: compute does not
depend on the weights): 4 prompts x 8 samples, 17 steps (16 trainable transitions in chunks
[2, 3, 4, 7]), half the chunks trained per sample, micro-batch 16 x 2 accumulation, one AdamW
step, the area reward, no evaluation, no image grids, no checkpoints inside the timed window.

The baseline replays the same network calls with nothing around them: every call the engine
made to the model in that iteration is recorded (batch size, grad on or off); the replay does a
forward under no_grad for each no-grad call (rollout, re-scoring) and a forward + backward for
each grad call (the chunk update back-propagates each once), then the AdamW step. Sampler
maths, log-probs, noise, selection, rewards, advantages and logging are all engine overhead.
Both run in this process, one after the other in each round, and the ratio is taken per round;
the median over rounds is reported.

An iteration's time is measured end to end between consecutive calls of a tracker, so it
includes everything the engine does (metrics, logging, progress), not only its phase timers.
A second, in-situ ratio divides each timed iteration by the time that same iteration spent
inside the network's forwards, the backward passes and the AdamW step (timed by wrapping them):
both sides share the same moment's load, which the replay cannot guarantee.
The replay ratio uses this process's CPU time (time.process_time, one thread): on a shared
machine wall time mostly measures the neighbours; both are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from flowrl import hookimpl
from flowrl.runlog import is_phase_seconds

RECIPE = """
[run]
name = "overhead"
seed = 3
device = "cpu"

[model]
use = "embedded"
random_init = true

[sampler]
steps = {steps}

[schedule]
use = "shift"
shift = 3.0

[kernel]
use = "flow"
a = 0.7

[chunker]
use = "explicit"
sizes = {sizes}

[selector]
use = "uniform"
fraction = 0.5

[advantage]
use = "group_zscore"

[loss]
use = "clipped"
eps_low = 5e-3
eps_high = 5e-3

[train]
iterations = {iterations}
prompts_per_iteration = 4
group_size = 8
micro_batch_size = 16
lr = 3e-4

[log]
progress = false
image_every = 0

[checkpoint]
every = 100000

[[rewards]]
use = "area"

[[trackers]]
use = "stopwatch"
"""


class Stopwatch:
    """Tracker plugin: wall-clock time at the end of every iteration, and the network calls
    made since the previous one."""

    def __init__(self, log: "CallLog"):
        self.marks: list[float] = []
        self.calls: list[list[tuple[int, bool]]] = []
        self.inside: list[tuple[float, float]] = []
        self.log = log

    @hookimpl
    def register_trackers(self, register):
        marks, calls, log, inside = self.marks, self.calls, self.log, self.inside

        class Tracker:
            def log_metrics(self, step, metrics):
                marks.append((time.perf_counter(), time.process_time()))
                calls.append(list(log.calls))
                inside.append(tuple(log.inside))
                log.calls.clear()
                log.inside[:] = [0.0, 0.0]

            def log_image(self, step, name, image):
                pass

            def close(self):
                pass

        register("stopwatch", lambda: Tracker())


def engine_round(recipe_path: Path, out: Path, stopwatch: Stopwatch):
    from rich.console import Console

    from flowrl.recipe import load_recipe
    from flowrl.runlog import read_metrics
    from flowrl.train import train

    stopwatch.marks.clear()
    stopwatch.calls.clear()
    stopwatch.inside.clear()
    recipe = load_recipe(recipe_path, [f"run.output_dir={str(out)!r}"])
    train(recipe, console=Console(file=open(os.devnull, "w")))
    records = [r for r in read_metrics(out) if "final" not in r]
    # iteration i's time = mark[i] - mark[i - 1]; the first (warm-up) and the last (it writes
    # the final checkpoint) iterations are not timed
    times = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(stopwatch.marks, stopwatch.marks[1:])][:-1]
    return times, records[1:-1], recipe, stopwatch.calls[1:-1], stopwatch.inside[1:-1]


class CallLog:
    """Records every network call the engine makes, (batch size, with grad?), and the time spent
    inside the network's forwards, the backward passes and the optimizer steps."""

    def __init__(self):
        self.calls: list[tuple[int, bool]] = []
        self.inside = [0.0, 0.0]  # wall, CPU seconds inside forwards / backwards / AdamW steps

    def _timed(self, fn):
        inside = self.inside

        def wrapped(*args, **kwargs):
            w, c = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                inside[0] += time.perf_counter() - w
                inside[1] += time.process_time() - c

        return wrapped

    def install(self):
        from flowrl_plugins.embedded.plugin import EmbeddedModel

        original = EmbeddedModel.velocity
        calls = self.calls

        def velocity(model, latents, sigma, text):
            calls.append((latents.shape[0], torch.is_grad_enabled()))
            return original(model, latents, sigma, text)

        EmbeddedModel.velocity = self._timed(velocity)
        torch.Tensor.backward = self._timed(torch.Tensor.backward)
        torch.optim.AdamW.step = self._timed(torch.optim.AdamW.step)


def baseline_iteration(model, opt, calls, optimizer_steps: int) -> tuple[float, float]:
    """Replay one iteration's network calls with nothing around them: the same batch sizes, a
    forward under no_grad where the engine had no grad, forward + backward where it had grad
    (every grad forward of the chunk update is back-propagated once), then the AdamW steps."""
    B = max(n for n, _ in calls)
    x = torch.randn(B, *model.latent_shape)
    sigma = torch.full((B,), 0.5)
    text = model.encode_prompts(["a red circle on a blue background"] * B)
    start = time.perf_counter(), time.process_time()
    opt.zero_grad(set_to_none=True)
    for n, grad in calls:
        sub = {k: v[:n] for k, v in text.items()}
        if grad:
            model.velocity(x[:n], sigma[:n], sub).square().mean().backward()
        else:
            with torch.no_grad():
                model.velocity(x[:n], sigma[:n], sub)
    for _ in range(optimizer_steps):
        opt.step()
    return time.perf_counter() - start[0], time.process_time() - start[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iterations", type=int, default=3, help="timed iterations per round (plus a warm-up one and a final one)")
    ap.add_argument("--steps", type=int, default=17)
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    args = ap.parse_args()

    from flowrl.plugins import temporary_plugin
    from flowrl_plugins.embedded.plugin import EmbeddedConfig, EmbeddedModel

    T = args.steps - 1
    sizes = [2, 3, 4, 7] if T == 16 else [T]
    tmp = Path(tempfile.mkdtemp(prefix="flowrl-overhead-"))
    recipe_path = tmp / "overhead.toml"
    recipe_path.write_text(RECIPE.format(steps=args.steps, sizes=sizes, iterations=args.iterations + 2))

    log = CallLog()
    stopwatch = Stopwatch(log)
    log.install()
    model = EmbeddedModel(EmbeddedConfig(random_init=True))
    model.denoiser.requires_grad_(True)
    # lr = 0: the same AdamW arithmetic, but the replay's weights never drift (after many random
    # steps they would, and drifting float32 weights can slow CPU maths down, e.g. denormals)
    opt = torch.optim.AdamW(list(model.denoiser.parameters()), lr=0.0)
    rows = []
    with temporary_plugin(stopwatch, name="stopwatch"):
        for r in range(args.rounds):
            times, records, recipe, per_iteration_calls, inside = engine_round(recipe_path, tmp / f"run{r}", stopwatch)
            # (log.inside also counts the replay below; it is reset at the next engine iteration)
            steps = recipe.train.updates_per_rollout * recipe.train.optimizer_steps_per_update
            base = [baseline_iteration(model, opt, calls, steps) for calls in per_iteration_calls]
            phases = {k[5:]: statistics.mean(r[k] for r in records) for k in records[0] if is_phase_seconds(k)}
            row = {
                "engine_wall_s": statistics.mean(t[0] for t in times), "engine_cpu_s": statistics.mean(t[1] for t in times),
                "baseline_wall_s": statistics.mean(t[0] for t in base), "baseline_cpu_s": statistics.mean(t[1] for t in base),
                "phases_wall_s": phases, "network_calls": len(per_iteration_calls[0]),
            }
            row["ratio"] = row["engine_cpu_s"] / row["baseline_cpu_s"]
            row["wall_ratio"] = row["engine_wall_s"] / row["baseline_wall_s"]
            # in situ: the same iterations, divided by their own time inside the network and AdamW
            row["in_situ_ratio"] = statistics.mean(t[1] / i[1] for t, i in zip(times, inside))
            row["in_situ_wall_ratio"] = statistics.mean(t[0] / i[0] for t, i in zip(times, inside))
            rows.append(row)
            print(f"round {r}: engine {row['engine_cpu_s']:.3f} s/iter CPU ({row['engine_wall_s']:.3f} wall), "
                  f"pure compute {row['baseline_cpu_s']:.3f} s/iter CPU ({row['baseline_wall_s']:.3f} wall), "
                  f"ratio {row['ratio']:.3f} CPU, {row['wall_ratio']:.3f} wall; in situ {row['in_situ_ratio']:.3f} CPU, "
                  f"{row['in_situ_wall_ratio']:.3f} wall ({row['network_calls']} network calls/iter); "
                  "phases (wall) " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()), flush=True)
    ratios = [r["ratio"] for r in rows]
    walls = [r["wall_ratio"] for r in rows]
    summary = {
        "median_ratio_cpu": statistics.median(ratios), "min_ratio_cpu": min(ratios), "max_ratio_cpu": max(ratios),
        "median_ratio_wall": statistics.median(walls),
        "median_in_situ_ratio_cpu": statistics.median(r["in_situ_ratio"] for r in rows),
        "median_in_situ_ratio_wall": statistics.median(r["in_situ_wall_ratio"] for r in rows),
        "median_engine_cpu_s": statistics.median(r["engine_cpu_s"] for r in rows),
        "median_baseline_cpu_s": statistics.median(r["baseline_cpu_s"] for r in rows),
        "rounds": rows, "threads": torch.get_num_threads(), "argv": sys.argv[1:],
    }
    print(f"median ratio engine / pure compute: {summary['median_ratio_cpu']:.3f} in CPU time "
          f"(range {summary['min_ratio_cpu']:.3f}-{summary['max_ratio_cpu']:.3f}), {summary['median_ratio_wall']:.3f} in wall time; "
          f"{args.rounds} rounds x {args.iterations} iterations, {torch.get_num_threads()} thread(s)")
    print(f"median in-situ ratio (iteration / its own time inside network forwards, backwards and AdamW): "
          f"{summary['median_in_situ_ratio_cpu']:.3f} CPU, {summary['median_in_situ_ratio_wall']:.3f} wall")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
