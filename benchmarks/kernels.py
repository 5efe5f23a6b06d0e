"""Benchmark: the kernel switches of ``[train]`` (``compile``, ``attention_backend``,
``adamw_impl``; flowrl/train/accel.py), each against the same run without it, on this CPU.

Two measurements, both on the embedded tiny FLUX model (diffusers' FluxTransformer2DModel, whose
attention is ``F.scaled_dot_product_attention``):

1. **iteration**: one training iteration as the engine runs it (``collect``: rollout, decode,
   rewards; advantages; ``PolicyUpdate.run``: the on-policy fast-path step, AdamW), for each
   variant on its own session built from the same recipe with one switch changed:

   - ``base``        compile = "off", attention_backend = "auto", adamw_impl = "auto"
   - ``compile``     compile = "default" (inductor; its warm-up, the first iterations that
                     compile, is timed separately and not in the ratio)
   - ``attn_math``   attention_backend = "math"
   - ``attn_flash``  attention_backend = "flash"
   - ``adamw_fused`` adamw_impl = "fused"
   - ``adamw_foreach`` adamw_impl = "foreach"

   ``--rounds`` rounds; each runs every variant once, in a seeded random order (interleaved, so
   every variant sees the same load drift on the shared cores). Reported: the median per-round
   ratio variant / base, of wall time and of process CPU time (one thread: the cycles the
   iteration used, less sensitive to other processes holding the cores). Each variant's first
   on-policy check (``max |log pi_new - log pi_old|`` before any update) is reported: with
   ``compile`` the rollout runs the inference graph and the update the training graph.

2. **optimizer step**: ``AdamW.step()`` alone over the embedded denoiser's parameters (with fixed
   random gradients), for-loop vs foreach vs fused, interleaved, ``--opt-steps`` steps per round;
   the iteration's optimizer step is a small part of it, so this shows the switch's own effect.
   The three implementations' parameters after the same steps are compared (max abs difference).

Run (one thread)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/kernels.py --rounds 7
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

RECIPE = """
[run]
name = "kernels-bench"
seed = 5
device = "cpu"

[model]
use = "embedded"

[sampler]
steps = {steps}

[schedule]
use = "shift"
shift = 3.0

[kernel]
use = "flow"
a = 0.7

[chunker]
use = "step"

[train]
prompts_per_iteration = {prompts}
group_size = {group}
micro_batch_size = {micro}
lr = 1e-4
compile = "{compile}"
attention_backend = "{attention}"
adamw_impl = "{adamw}"

[log]
progress = false

[[rewards]]
use = "brightness"
"""

VARIANTS = {
    "base": {},
    "compile": {"compile": "default"},
    "attn_math": {"attention": "math"},
    "attn_flash": {"attention": "flash"},
    "adamw_fused": {"adamw": "fused"},
    "adamw_foreach": {"adamw": "foreach"},
}


def load_recipe_text(text: str):
    from flowrl.recipe import validate

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    return validate(tomllib.loads(text), source="<benchmarks/kernels.py>")


class Runner:
    """One variant: its own session, update and chunk layout, as the training loop builds them."""

    def __init__(self, args, **switches):
        from flowrl.distributed import DistContext
        from flowrl.geometry import resolve_geometry
        from flowrl.train.accel import prepare_kernels
        from flowrl.train.run import Run
        from flowrl.train.session import Session
        from flowrl.train.update import PolicyUpdate

        fmt = {"steps": args.steps, "prompts": args.prompts, "group": args.group, "micro": args.prompts * args.group,
               "compile": "off", "attention": "auto", "adamw": "auto", **switches}
        recipe = load_recipe_text(RECIPE.format(**fmt))
        self.session = Session.open(recipe, device="cpu")
        self.ctx = DistContext()
        self.geometry = resolve_geometry(recipe.train, 1, recipe.source)
        self.run_parts = Run(self.session, self.geometry, self.ctx)
        self.update = PolicyUpdate(self.run_parts)
        prepare_kernels(self.session.model, recipe.train, torch.device("cpu"), recipe.source)
        self.prompts = list(self.session.model.prompt_source())
        self.sizes = tuple(self.session.components.chunker.sizes(self.session.sampler.num_trainable))
        self.train = recipe.train
        self.iteration = 0
        self.on_policy: list[float] = []

    def run(self) -> tuple[float, float]:
        from flowrl.train.accel import attention_backend
        from flowrl.train.collect import assign_advantages, collect
        from flowrl.train.progress import PhaseTimer

        c0, t0 = time.process_time(), time.perf_counter()
        with attention_backend(self.train.attention_backend, torch.device("cpu")):
            batch = collect(self.run_parts, self.prompts, self.iteration, PhaseTimer(torch.device("cpu")))
            assign_advantages(self.run_parts, batch, len(self.sizes), {})
            outcome = self.update.run(batch, self.sizes)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if outcome.on_policy is not None:
            self.on_policy.append(float(outcome.on_policy))
        self.iteration += 1
        return wall, cpu


def optimizer_steps(args, rng_seed: int = 0) -> dict:
    """AdamW.step() alone: for-loop vs foreach vs fused over the embedded denoiser's parameters."""
    from flowrl.train.accel import adamw_options
    from flowrl_plugins.embedded.plugin import EmbeddedConfig, EmbeddedModel

    model = EmbeddedModel(EmbeddedConfig())
    base = [p.detach().clone() for p in model.denoiser.parameters()]
    g = torch.Generator().manual_seed(rng_seed)
    grads = [torch.randn(p.shape, generator=g) * 1e-3 for p in base]
    # the keyword arguments [train].adamw_impl gives torch's AdamW
    impls = {name: adamw_options(name, torch.device("cpu")) for name in ("for-loop", "foreach", "fused")}
    params = {}
    opts = {}
    for name, kw in impls.items():
        ps = [torch.nn.Parameter(b.clone()) for b in base]
        for p, gr in zip(ps, grads):
            p.grad = gr.clone()
        params[name] = ps
        opts[name] = torch.optim.AdamW(ps, lr=1e-4, weight_decay=1e-4, **kw)
    for opt in opts.values():  # warm-up: allocate the state
        opt.step()
    times = {k: [] for k in impls}
    order_rng = torch.Generator().manual_seed(rng_seed + 1)
    names = list(impls)
    for _ in range(args.rounds):
        for i in torch.randperm(len(names), generator=order_rng).tolist():
            name = names[i]
            c0 = time.process_time()
            for _ in range(args.opt_steps):
                opts[name].step()
            times[name].append((time.process_time() - c0) / args.opt_steps)
    ref = params["for-loop"]
    diff = {k: max(float((a - b).abs().max()) for a, b in zip(v, ref)) for k, v in params.items()}
    return {
        "params": sum(p.numel() for p in base), "tensors": len(base), "steps_per_round": args.opt_steps,
        "cpu_median_s": {k: statistics.median(v) for k, v in times.items()},
        "cpu_ratio_vs_for_loop_paired": {k: statistics.median(a / b for a, b in zip(v, times["for-loop"]))
                                         for k, v in times.items()},
        "max_abs_param_diff_vs_for_loop": diff,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3, help="untimed iterations per variant (compile warms up here)")
    ap.add_argument("--opt-steps", type=int, default=20, help="optimizer steps per round in the optimizer benchmark")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    names = [v for v in args.variants.split(",") if v]
    if "base" not in names:
        names.insert(0, "base")
    runners, warmup_s = {}, {}
    for name in names:
        runners[name] = Runner(args, **VARIANTS[name])
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            runners[name].run()
        warmup_s[name] = time.perf_counter() - t0
    wall = {k: [] for k in names}
    cpu = {k: [] for k in names}
    rng = torch.Generator().manual_seed(args.seed)
    for _ in range(args.rounds):
        for i in torch.randperm(len(names), generator=rng).tolist():
            w, c = runners[names[i]].run()
            wall[names[i]].append(w)
            cpu[names[i]].append(c)

    def paired(d):
        return {k: statistics.median(a / b for a, b in zip(v, d["base"])) for k, v in d.items()}

    res = {
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/kernels.py " + " ".join(argv or sys.argv[1:]),
        "device": f"{platform.machine()} CPU, os.cpu_count() = {os.cpu_count()}, torch threads = "
                  f"{torch.get_num_threads()}, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "samples": args.prompts * args.group, "steps": args.steps, "rounds": args.rounds,
        "warmup_iterations": args.warmup, "warmup_wall_s": warmup_s,
        "iteration_wall_median_s": {k: statistics.median(v) for k, v in wall.items()},
        "iteration_wall_ratio_vs_base_paired": paired(wall),
        "iteration_cpu_ratio_vs_base_paired": paired(cpu),
        "on_policy_max_abs_log_ratio": {k: max(r.on_policy) if r.on_policy else None for k, r in runners.items()},
        "optimizer_step": optimizer_steps(args) if args.opt_steps > 0 else None,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
