"""Benchmark: one chunk of 7 transitions (memory-lean) vs a step-level update of the same 7.

docs/api.md §5: the gradient of a chunk is ``sum_i (dL/dz / |c|) grad l_i``, so once the
chunk ratio is known the chunk can be back-propagated one step at a time
(:func:`flowrl.objectives.chunk_gradient.lean_chunk_backward`). This script checks what that costs against
the cheapest possible step-level update (chunk size 1: each step's forward + backward, nothing
else) on the embedded tiny FLUX model, on one batch, in an off-policy state (weights perturbed
after the rollout so that ratios are not 1):

- ``step``   hand-written step-level GRPO: for each of the 7 steps, forward with grad, clipped
             loss of that step, backward. The baseline.
- ``lean7``  ``lean_chunk_backward`` with one chunk of 7.
- ``lean1``  ``lean_chunk_backward`` with 7 chunks of 1 (how the engine runs step-level GRPO).
- ``full7``  ``full_graph_backward`` with one chunk of 7 (all 7 graphs alive; for contrast).
- ``fast7``  ``on_policy_chunk_backward`` (the on-policy fast path) with one chunk of 7, on an
             on-policy copy of the model (the same weights as the rollout; the fast path is only
             taken there). Its gradient is checked against ``full7`` on that copy.
- ``graph7`` ``chunk_graph_backward`` with one chunk of 7, the 7 steps batched into one forward
             (as the engine's ``update_mode = "chunk_graph"`` does), off-policy like ``lean7``.

All variants do the same model work per call whatever the weights (no data-dependent branches;
nothing clips), so the on-policy copy costs what the perturbed model costs: ``step`` stays the
baseline of every ratio, and ``step_on`` (the same step-level update on the on-policy copy) is
timed beside it to show that.

Memory (peak bytes above the level at the start of the update), two independent meters:

- ``saved``: a ``torch.autograd.graph.saved_tensors_hooks`` meter summing the distinct storages
  saved for backward that are alive at the same time (parameters excluded: they exist anyway).
  This is exactly the activation memory the lean update is designed to bound.
- ``alloc``: torch.profiler's CPU allocator events (every allocation and free, in time order);
  the peak of their running sum is everything the update allocated at once: saved activations,
  no-grad forward temporaries, backward temporaries and gradient buffers.

RSS is not used: the process's resident set (torch, diffusers, the model) is hundreds of MB
against a few MB of activations here, and glibc keeps freed pages, so an RSS ratio would be ~1
whatever the update did.

Time: ``--rounds`` rounds; each round runs every variant once, in a seeded random order (the
machine is shared, so load drifts: interleaving puts every variant under the same drift, and a
random order keeps one variant from always following the memory-hungry full graph).
Each run is timed twice: process CPU time (``time.process_time``; with one thread it counts the
cycles the update itself used, not the time spent waiting for a core that other processes hold)
and wall time. Reported: the median per variant and the median of the per-round ratios, for
both clocks. Gradients are checked for equality (lean7 == full7 == graph7 off-policy, fast7 ==
full7 on-policy, lean1 == step) before timing.

Run (one thread, as everywhere on this machine)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/chunk_update.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import weakref
from types import SimpleNamespace

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from flowrl.interfaces import select_embeddings  # noqa: E402
from flowrl.objectives.losses import ClippedObjective, reduce_units  # noqa: E402
from flowrl.sampling.rollout import make_kernels, make_step_log_prob_fn, rescore_transitions, rollout  # noqa: E402
from flowrl.sampling.schedules import shifted_sigmas  # noqa: E402
from flowrl.sampling.kernels import FlowKernel  # noqa: E402
from flowrl.objectives.chunk_gradient import (  # noqa: E402
    chunk_graph_backward,
    full_graph_backward,
    lean_chunk_backward,
    on_policy_chunk_backward,
)

CHUNK = 7
# The paper's layout [2, 3, 4, 7] for N = 17 steps (16 trainable): its last and largest chunk.
CHUNK_START = 9


# ------------------------------------------------------------------------------ memory meters
class SavedTensorMeter:
    """Peak bytes of distinct storages saved for backward and alive at once.

    Each packed tensor is wrapped in a handle whose finaliser runs when autograd frees the saved
    variable (after backward, or when the graph is dropped), so the running total follows the
    real lifetime of the saved activations. Storages are counted once however many ops save
    them; ``exclude`` holds storages that exist anyway (the parameters).
    """

    def __init__(self, exclude: set[int]):
        self.exclude = exclude
        self.live: dict[int, list[int]] = {}  # storage ptr -> [bytes, refcount]
        self.current = 0
        self.peak = 0

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]

    def pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self.exclude or st.nbytes() == 0:
            return t
        entry = self.live.get(key)
        if entry is None:
            self.live[key] = [st.nbytes(), 1]
            self.current += st.nbytes()
            self.peak = max(self.peak, self.current)
        else:
            entry[1] += 1
        handle = _Handle(t)
        weakref.finalize(handle, self._release, key)
        return handle

    @staticmethod
    def unpack(h):
        return h.t if isinstance(h, _Handle) else h

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


class _Handle:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


def alloc_peak(fn) -> int:
    """Peak of the running sum of CPU allocator events while ``fn()`` runs (bytes)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


# ------------------------------------------------------------------------------ setup
def build(batch: int, perturb: float, seed: int):
    from flowrl_plugins.embedded.network import WEIGHTS_PATH
    from flowrl_plugins.embedded.plugin import EmbeddedConfig, EmbeddedModel

    pretrained = WEIGHTS_PATH.exists()
    model = EmbeddedModel(EmbeddedConfig(random_init=not pretrained, seed=seed))
    model.denoiser.requires_grad_(True)  # full fine-tuning of the transformer
    params = [p for p in model.denoiser.parameters() if p.requires_grad]

    prompts = ["a red circle on a blue background", "a white triangle on a black background"]
    prompts = [prompts[b * len(prompts) // batch] for b in range(batch)]  # two groups
    text = model.encode_prompts(prompts)

    def velocity_fn_for(idx):
        sub = select_embeddings(text, idx)
        return lambda x, s: model.velocity(x, s, sub)

    n_steps = 17
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(batch, *model.latent_shape, generator=gen)
    gens = [torch.Generator().manual_seed(seed + 1 + b) for b in range(batch)]
    traj = rollout(velocity_fn_for(torch.arange(batch)), noise, shifted_sigmas(n_steps, 3.0),
                   make_kernels(n_steps, FlowKernel(0.7)), generators=gens, prompts=prompts)
    assert traj.num_trainable == 16

    # the on-policy copy: the rollout's weights (the fast path's state)
    import copy

    on_model = copy.deepcopy(model)

    # off-policy: a small relative perturbation of every weight after the rollout
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1000)
        for p in params:
            p.add_(perturb * (p.std() if p.numel() > 1 else p.abs()) * torch.randn(p.shape, generator=g))

    def fns_for(m):
        """(fn(t, idx, grad), many(ts, idx)) over the 7 positions of the chunk, for model ``m``."""

        def vel_for(idx):
            sub = select_embeddings(text, idx)
            return lambda x, s: m.velocity(x, s, sub)

        step16 = make_step_log_prob_fn(vel_for, traj)
        positions = traj.trainable_indices.tolist()

        def fn(t, idx, grad):
            return step16(CHUNK_START + t, idx, grad)

        def many(ts, idx):  # the chunk's steps in ONE forward (the engine's TransitionScorer.many_fn)
            idx = torch.arange(batch) if idx is None else idx  # None: every row
            return rescore_transitions(vel_for(idx.repeat(len(ts))), traj,
                                       [positions[CHUNK_START + t] for t in ts], idx)

        return fn, many

    old = traj.trainable_log_probs[:, CHUNK_START:CHUNK_START + CHUNK].clone()
    adv = torch.linspace(-1.5, 1.5, batch)
    on_params = [p for p in on_model.denoiser.parameters() if p.requires_grad]
    return SimpleNamespace(model=model, params=params, on_model=on_model, on_params=on_params,
                           off=fns_for(model), on=fns_for(on_model), old=old, adv=adv, pretrained=pretrained)


def step_level_update(fn, old, adv, objective, normaliser):
    """Step-level GRPO over the 7 steps, the cheapest way: forward + backward per step.

    Loss = (1 / normaliser) sum_b mean_t objective(l_t - l_t^old, A) (every step selected)."""
    B, T = old.shape
    idx = torch.arange(B)
    mask = torch.ones(B, 1, dtype=torch.bool)
    total = 0.0
    for t in range(T):
        lp = fn(t, idx, True)
        z = (lp - old[:, t]).unsqueeze(1)
        loss_t = reduce_units(objective(z, adv), mask, normaliser) / T
        loss_t.backward()
        total += float(loss_t.detach())
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--perturb", type=float, default=1e-3,
                    help="relative std of the weight perturbation after the rollout")
    ap.add_argument("--eps", type=float, default=1e-2,
                    help="clip range; large enough that no unit clips (both variants do all the work)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    setup = build(args.batch, args.perturb, args.seed)
    model, pretrained, old, adv = setup.model, setup.pretrained, setup.old, setup.adv
    params, on_params = setup.params, setup.on_params
    (fn, many), (fn_on, _) = setup.off, setup.on
    B = args.batch
    obj = ClippedObjective(args.eps, args.eps)
    mask = torch.ones(B, 1, dtype=torch.bool)
    norm = float(B)

    variants = {
        "step": lambda: step_level_update(fn, old, adv, obj, norm),
        "lean7": lambda: lean_chunk_backward(fn, old, adv, (CHUNK,), mask, obj, norm),
        "full7": lambda: full_graph_backward(fn, old, adv, (CHUNK,), mask, obj, norm),
        "lean1": lambda: lean_chunk_backward(fn, old, adv, (1,) * CHUNK, torch.ones(B, CHUNK, dtype=torch.bool),
                                             obj, norm),
        "fast7": lambda: on_policy_chunk_backward(fn_on, old, adv, (CHUNK,), mask, obj, norm),
        "graph7": lambda: chunk_graph_backward(fn, old, adv, (CHUNK,), mask, obj, norm, many=many),
        "step_on": lambda: step_level_update(fn_on, old, adv, obj, norm),
    }

    def zero():
        # keep the .grad buffers allocated so that no variant pays for creating them
        for p in params + on_params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.zero_()

    # off-policy state and correctness: lean7 == full7
    with torch.no_grad():
        new = torch.stack([fn(t, torch.arange(B), False) for t in range(CHUNK)], 1)
    step_log_ratio = new - old
    zero()
    _, met_lean = variants["lean7"]()
    g_lean = [p.grad.clone() for p in params]
    zero()
    _, met_full = variants["full7"]()
    g_full = [p.grad.clone() for p in params]
    zero()
    variants["step"]()
    g_step = [p.grad.clone() for p in params]
    zero()
    variants["lean1"]()
    g_lean1 = [p.grad.clone() for p in params]
    zero()
    _, met_graph = variants["graph7"]()
    g_graph = [p.grad.clone() for p in params]
    # on-policy: the fast path against the full graph on the rollout's weights
    zero()
    _, met_fast = variants["fast7"]()
    g_fast = [p.grad.clone() for p in on_params]
    zero()
    full_graph_backward(fn_on, old, adv, (CHUNK,), mask, obj, norm)
    g_full_on = [p.grad.clone() for p in on_params]
    with torch.no_grad():
        on_dev = max(float((fn_on(t, torch.arange(B), False) - old[:, t]).abs().max()) for t in range(CHUNK))

    def rel_err(ga, gb):
        scale = max(float(b.abs().max()) for b in gb)
        return max(float((a - b).abs().max()) for a, b in zip(ga, gb)) / scale

    errors = {
        "lean7_vs_full7": rel_err(g_lean, g_full),
        "graph7_vs_full7": rel_err(g_graph, g_full),
        "lean1_vs_step": rel_err(g_lean1, g_step),
        "fast7_vs_full7_on_policy": rel_err(g_fast, g_full_on),
    }
    grad_err, grad_err_steps = errors["lean7_vs_full7"], errors["lean1_vs_step"]
    if max(errors.values()) > 1e-4:
        print(f"gradients differ: {errors}", file=sys.stderr)
        return 1

    # memory
    exclude = {p.untyped_storage().data_ptr() for p in model.network.parameters()}
    exclude |= {p.untyped_storage().data_ptr() for p in setup.on_model.network.parameters()}
    exclude |= {p.grad.untyped_storage().data_ptr() for p in params + on_params}
    memory = {}
    for name, run in variants.items():
        zero()
        with SavedTensorMeter(exclude) as meter:
            run()
        zero()
        memory[name] = {"saved": meter.peak, "alloc": alloc_peak(run)}

    # time: rotated order per round
    names = list(variants)
    times = {n: [] for n in names}
    cpu = {n: [] for n in names}
    zero()
    for n in names:  # warm-up
        variants[n]()
    rng = torch.Generator().manual_seed(args.seed)
    for r in range(args.rounds):
        order = [names[int(i)] for i in torch.randperm(len(names), generator=rng)]
        for n in order:
            zero()
            c0, t0 = time.process_time(), time.perf_counter()
            variants[n]()
            times[n].append(time.perf_counter() - t0)
            cpu[n].append(time.process_time() - c0)

    med = {n: statistics.median(v) for n, v in times.items()}
    paired = {n: statistics.median(a / b for a, b in zip(times[n], times["step"])) for n in names}
    cmed = {n: statistics.median(v) for n, v in cpu.items()}
    cpaired = {n: statistics.median(a / b for a, b in zip(cpu[n], cpu["step"])) for n in names}
    cquart = {n: [round(q, 3) for q in statistics.quantiles([a / b for a, b in zip(cpu[n], cpu["step"])], n=4)]
              for n in names}
    res = {
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/chunk_update.py " + " ".join(argv or sys.argv[1:]),
        "device": f"{platform.machine()} CPU, os.cpu_count() = {os.cpu_count()}, torch threads = "
                  f"{torch.get_num_threads()}, torch {torch.__version__}",
        "weights": "shipped embedded.safetensors" if pretrained else "random_init=True (no shipped weights yet)",
        "batch": B, "chunk": CHUNK, "rounds": args.rounds, "eps": args.eps, "perturb": args.perturb,
        "step_log_ratio_abs_max": float(step_log_ratio.abs().max()),
        "step_log_ratio_abs_mean": float(step_log_ratio.abs().mean()),
        "chunk_ratio_range": [met_lean["ratio_min"], met_lean["ratio_max"]],
        "clip_fraction": met_lean["clip_fraction"],
        "recompute_mismatch": met_lean["recompute_mismatch"],
        "lean7_vs_full7_grad_rel_err": grad_err,
        "lean1_vs_step_grad_rel_err": grad_err_steps,
        "grad_rel_err": errors,
        "on_policy_max_abs_log_ratio": on_dev,
        "fast7_ratio_range": [met_fast["ratio_min"], met_fast["ratio_max"]],
        "graph7_ratio_range": [met_graph["ratio_min"], met_graph["ratio_max"]],
        "memory_bytes": memory,
        "memory_ratio_vs_step": {n: {k: memory[n][k] / memory["step"][k] for k in memory[n]} for n in names},
        "cpu_median_s": cmed,
        "cpu_ratio_vs_step": {n: cmed[n] / cmed["step"] for n in names},
        "cpu_ratio_vs_step_paired": cpaired,
        "cpu_ratio_vs_step_paired_quartiles": cquart,
        "wall_median_s": med,
        "wall_ratio_vs_step": {n: med[n] / med["step"] for n in names},
        "wall_ratio_vs_step_paired": paired,
        "load_average": os.getloadavg(),
        "wall_s": times,
        "cpu_s": cpu,
    }
    print(json.dumps({k: v for k, v in res.items() if k not in ("wall_s", "cpu_s")}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
