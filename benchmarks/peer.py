"""Benchmark: flowrl against peers' published training code, side by side on one tiny FLUX.

The peers' code is NOT part of flowrl: give the path of a checkout (see docs/benchmarks.md,
"Against peers' code", for the commits). Nothing of theirs is copied here; their functions are
compiled from their files at run time.

Parts (run the part whose checkout you give; both if you give both):

``--flow-grpo PATH`` (flow_grpo_refactor, the commit that added FLUX): one step-level GRPO
iteration, the same on both sides: a rollout with log-probs (and the VAE decode) of the same
prompts, group size, initial noise and SDE noise, the same sigmas and kernel (Flow-GRPO's
"sde" kernel = flowrl's ``FlowKernel``), the same reward and advantages, then the clipped
update back-propagated over the same selected transitions (the first ``--fg-train-steps``).

- Flow-GRPO side: ``flow_grpo/diffusers_patch/flux_pipeline_with_logprob.py:pipeline_with_logprob``
  (its rollout, which calls ``sd3_sde_with_logprob.py:sde_step_with_logprob``), then for each
  selected step ``scripts/train_flux.py:compute_log_prob`` and the clipped loss and backward of
  that script's training loop.
- flowrl side: ``rollout``, the FLUX adapter's ``decode``, ``make_step_log_prob_fn`` and
  ``lean_chunk_backward`` with units of one step and ``ClippedObjective`` (``flowrl``), and the
  same with ``on_policy_chunk_backward`` (``flowrl_fast``: the on-policy fast path, which the
  engine takes for the first optimizer step after every rollout, as here: no step is taken).

``--gcpo PATH`` (GCPO, the paper's code): the Chunk-GRPO update on chunks [2, 3, 4, 7] of a
17-step rollout, 2 of the 4 chunks per sample (the same chunks on both sides), off-policy
(every weight perturbed by ``--perturb`` x its tensor's std after the rollout, so ratios are not
exactly 1).

- GCPO side: ``fastvideo/train_grpo_flux_hpsv3.py:grpo_one_step`` (one forward with grad over a
  chunk's steps of one sample, ``flow_grpo_step`` for the log-probs), then the clipped chunk loss
  and backward of that file's ``train_one_step``, sample by sample, chunk by chunk; its rollout
  ``run_sample_step`` is run once to compare log-probs.
- flowrl side: ``lean_chunk_backward`` with the same chunks and selection, on micro-batches of
  each size in ``--gc-micro-batches`` (1 is GCPO's batching, one sample at a time):
  ``flowrl_mbM``; and ``chunk_graph_backward`` (``[train].update_mode = "chunk_graph"``: each
  chunk's steps in one batched forward with grad, one backward, as GCPO does) on the same
  micro-batches: ``graph_mbM``. Both score the micro-batch's rows of the whole trajectory through
  the engine's ``TransitionScorer`` (``log_prob_fn``, ``many_fn``), as the engine's update does.
- Both updates train on one rollout made by flowrl's ``rollout``; GCPO's per-sample inputs are
  laid out as its ``train_one_step`` lays them out (steps split into chunks, chunk log-prob =
  mean of the rollout's step log-probs), outside the timed update.
- GCPO conditions the transformer on a truncated timestep ``int(sigma * 1000) / 1000`` while
  flowrl passes the exact sigma; for this comparison flowrl's velocity function is wrapped to
  truncate the same way (the kernel uses the exact sigmas on both sides).

What is the same on both sides: one tiny FLUX.1-dev-like pipeline
(``flowrl.testing.tiny_pipelines.build_tiny_flux``) loaded twice from one directory (identical
weights, checked), fp32, full fine-tuning of the transformer, CPU, embedded guidance 3.5, T5
prompt length 128, prompt embeddings encoded once by flowrl's adapter (Flow-GRPO's own
``encode_prompt`` is run once and compared), the same reward (mean brightness of each side's
own decoded images) and group-normalised advantages. No optimizer step is taken (it would be the
same code on both sides), so every round starts from the same weights and does the same work.
The reward of the random tiny model barely varies within a group (spread ~6e-4), so normalising
it turns the ~1e-7 image differences of the two sides into ~1e-4 advantage differences; the
Flow-GRPO gradient check therefore gives flowrl's advantages to both sides (the advantages are
compared on their own).

Peer code is run unmodified, with these adaptations made at run time (nothing in the checkout is
edited):

- Functions are compiled from the peer's source file with ``ast`` (their own line numbers and
  file name), together with only those of the file's import lines that bind a name the functions
  use. The rest of the module (argument parsing, wandb, reward models, accelerate setup) is not
  executed. ``pipeline_with_logprob`` is imported as a module (its package import works as is).
- ``compute_log_prob`` reads ``transformer.module.config`` (the model wrapped by DDP under
  accelerate); the transformer is given to it in a one-line ``torch.nn.Module`` wrapper with a
  ``module`` attribute and a forward that calls it.
- The training loops themselves are inline code in the peers' ``main`` / ``train_one_step``, not
  functions: the benchmark repeats their loss lines (clamped advantages, ratio, clipped surrogate,
  mean, backward) around the peer functions, without their logging (Flow-GRPO prints every
  ratio; both fill metric lists). accelerate's ``accumulate`` / ``backward`` are replaced by
  what they do here: the loss divided by the number of accumulated steps (Flow-GRPO: the
  selected steps; GCPO: ``gradient_accumulation_steps`` x chunks per sample, with one
  accumulation step per sample).
- GCPO's ``torch.autocast("cuda", bfloat16)`` is a no-op on a CPU (torch disables it with a
  warning, which is silenced), so both sides compute in fp32.
- The SDE noise of both peers comes from torch's global RNG (``randn_tensor`` without a
  generator); the global RNG is seeded before each peer rollout and flowrl gets one
  ``torch.Generator`` with the same seed, so both sides draw the same noise.

Measurements: correctness first (latents, log-probs and gradients of both sides), then memory
(``--gcpo`` only: the peak of the running sum of torch.profiler's CPU allocator events, i.e.
``profile(profile_memory=True)``, everything the update allocated at once, ``.grad`` buffers
allocated beforehand; each side's per-sample inputs, GCPO's split samples and flowrl's
micro-batch slices of old log-probs, advantages and chunk masks, laid out beforehand), then time: ``--rounds`` rounds, each running every variant once in a
seeded random order; wall time (``time.perf_counter``) and process CPU time
(``time.process_time``; one thread). Reported: per-variant medians and the median of the
per-round ratios flowrl / peer.

Needs diffusers and transformers in the venv (``pip install -c constraints/cpu.txt diffusers
transformers``); the peer functions used need nothing else (absl, ml_collections, wandb are
imported only by parts of the peers' files that are not run).

Run (one thread)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/peer.py --flow-grpo /tmp/peers/flow_grpo --gcpo /tmp/peers/gcpo
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def flowrl_api() -> SimpleNamespace:
    """Every flowrl import of this benchmark, in one place (module paths may move)."""
    from flowrl.interfaces import select_embeddings
    from flowrl.objectives.losses import ClippedObjective
    from flowrl.sampling.rollout import make_kernels, make_step_log_prob_fn, rollout
    from flowrl.sampling.schedules import shifted_sigmas
    from flowrl.sampling.kernels import FlowKernel
    from flowrl.testing.tiny_pipelines import TINY_PROMPTS, build_tiny_flux
    from flowrl.objectives.chunk_gradient import chunk_graph_backward, lean_chunk_backward, on_policy_chunk_backward
    from flowrl.objectives.policy_gradient import TransitionScorer
    from flowrl_plugins.diffusers_models.flux import FluxConfig, FluxModel

    return SimpleNamespace(
        lean_chunk_backward=lean_chunk_backward, on_policy_chunk_backward=on_policy_chunk_backward,
        chunk_graph_backward=chunk_graph_backward,
        select_embeddings=select_embeddings, TransitionScorer=TransitionScorer,
        ClippedObjective=ClippedObjective, make_kernels=make_kernels,
        make_step_log_prob_fn=make_step_log_prob_fn, rollout=rollout, shifted_sigmas=shifted_sigmas,
        FlowKernel=FlowKernel, TINY_PROMPTS=TINY_PROMPTS, build_tiny_flux=build_tiny_flux,
        FluxConfig=FluxConfig, FluxModel=FluxModel,
    )


# ------------------------------------------------------------------------------ peer code
# (file in the checkout, functions taken from it)
FLOW_GRPO_FILES = {
    "pipeline_with_logprob": "flow_grpo/diffusers_patch/flux_pipeline_with_logprob.py",
    "sde_step_with_logprob": "flow_grpo/diffusers_patch/sd3_sde_with_logprob.py",
    "compute_log_prob": "scripts/train_flux.py",
    "encode_prompt": "flow_grpo/diffusers_patch/train_dreambooth_lora_flux.py",
}
GCPO_FILES = {
    "grpo_one_step": "fastvideo/train_grpo_flux_hpsv3.py",
    "flow_grpo_step": "fastvideo/train_grpo_flux_hpsv3.py",
    "flux_step": "fastvideo/train_grpo_flux_hpsv3.py",
    "run_sample_step": "fastvideo/train_grpo_flux_hpsv3.py",
    "sd3_time_shift": "fastvideo/utils/common_utils.py",
}


def _fail(msg: str) -> None:
    print(f"peer.py: {msg}", file=sys.stderr)
    sys.exit(2)


#: every peer import line that compile_functions ran, per file (reported with the results)
IMPORTS_RUN: dict[str, list[str]] = {}


def compile_functions(path: Path, names: list[str]) -> dict:
    """Top-level functions ``names`` of the Python file ``path``, compiled from its source with
    only the import lines that bind a name they use (the rest of the module is not run)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    missing = [n for n in names if n not in defs]
    if missing:
        _fail(f"{path} has no top-level function {missing}; is this the checkout at the commit "
              "named in docs/benchmarks.md?")
    wanted = [defs[n] for n in names]
    used = {node.id for d in wanted for node in ast.walk(d) if isinstance(node, ast.Name)}
    imports = [
        node for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        and {(a.asname or a.name).split(".")[0] for a in node.names} & used
    ]
    ns: dict = {"__name__": f"peer:{path.name}", "__file__": str(path)}
    IMPORTS_RUN.setdefault(path.name, []).extend(ast.unparse(n) for n in imports)
    try:
        exec(compile(ast.Module(body=imports + wanted, type_ignores=[]), str(path), "exec"), ns)
    except ImportError as exc:
        _fail(f"importing what {path.name}:{names} needs failed: {exc}; install that package in this venv")
    return {n: ns[n] for n in names}


def _checkout_info(root: Path, files: dict) -> dict:
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        head = "not a git checkout"
    def blob_id(data: bytes) -> str:  # what `git hash-object` prints: compare with `git ls-tree COMMIT`
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

    digests = {f: blob_id((root / f).read_bytes()) for f in sorted(set(files.values()))}
    return {"path": str(root), "git_head": head, "git_blob_ids": digests,
            "functions": {k: f"{v}:{k}" for k, v in files.items()},
            "import_lines_run": {f: IMPORTS_RUN.get(Path(f).name, []) for f in sorted(set(files.values()))}}


def _check_root(root: Path, files: dict, flag: str) -> Path:
    root = root.expanduser().resolve()
    for f in set(files.values()):
        if not (root / f).is_file():
            _fail(f"{flag} {root}: {f} not found; give the root of the peer's checkout "
                  "(see docs/benchmarks.md for the commit)")
    return root


def load_flow_grpo(root: Path) -> SimpleNamespace:
    import importlib

    root = _check_root(root, FLOW_GRPO_FILES, "--flow-grpo")
    sys.path.insert(0, str(root))
    pipe_mod = importlib.import_module("flow_grpo.diffusers_patch.flux_pipeline_with_logprob")
    if not str(Path(pipe_mod.__file__).resolve()).startswith(str(root)):
        _fail(f"flow_grpo was imported from {pipe_mod.__file__}, not from {root}")
    fns = compile_functions(root / FLOW_GRPO_FILES["compute_log_prob"], ["compute_log_prob"])
    enc = compile_functions(root / FLOW_GRPO_FILES["encode_prompt"],
                            ["_encode_prompt_with_t5", "_encode_prompt_with_clip", "encode_prompt"])
    info = _checkout_info(root, FLOW_GRPO_FILES)
    for f in ("pipeline_with_logprob", "sde_step_with_logprob"):
        info["import_lines_run"][FLOW_GRPO_FILES[f]] = "imported as a module (the whole file runs)"
    return SimpleNamespace(
        pipeline_with_logprob=pipe_mod.pipeline_with_logprob,
        sde_step_with_logprob=pipe_mod.sde_step_with_logprob,
        compute_log_prob=fns["compute_log_prob"],
        encode_prompt=enc["encode_prompt"],
        info=info,
    )


def load_gcpo(root: Path) -> SimpleNamespace:
    root = _check_root(root, GCPO_FILES, "--gcpo")
    sys.path.insert(0, str(root))  # its files import fastvideo.* from the checkout root
    fns = compile_functions(root / GCPO_FILES["grpo_one_step"],
                            ["flow_grpo_step", "flux_step", "grpo_one_step", "run_sample_step"])
    fns.update(compile_functions(root / GCPO_FILES["sd3_time_shift"], ["sd3_time_shift"]))
    return SimpleNamespace(**fns, info=_checkout_info(root, GCPO_FILES))


class _WrappedModule(torch.nn.Module):
    """What accelerate's DDP wrapping looks like to Flow-GRPO's code: ``.module`` + forward."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


# ------------------------------------------------------------------------------ shared pieces
def load_models(api, path: Path, size: int, batch: int):
    """flowrl's FLUX adapter and a plain diffusers FluxPipeline, from the same directory."""
    from diffusers import FluxPipeline

    model = api.FluxModel(api.FluxConfig(
        path=str(path), dtype="fp32", height=size, width=size, guidance=3.5, max_sequence_length=128,
        offload_encoders=False, vae_batch_size=batch,
    ))
    pipe = FluxPipeline.from_pretrained(str(path), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    mine, theirs = model.denoiser.state_dict(), pipe.transformer.state_dict()
    if mine.keys() != theirs.keys() or any(not torch.equal(mine[k], theirs[k]) for k in mine):
        _fail("the two loads of the tiny FLUX transformer differ")
    for m in (model.denoiser, pipe.transformer):
        m.requires_grad_(True)  # full fine-tuning of the transformer, both sides
    return model, pipe


def rewards_of(images: torch.Tensor) -> torch.Tensor:
    """A cheap deterministic reward (mean brightness), the same function on both sides."""
    return images.float().mean(dim=(1, 2, 3))


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    g = rewards.reshape(-1, group)
    return ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).reshape(-1)


def named_grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def zero_grads(module: torch.nn.Module) -> None:
    # keep the .grad buffers allocated so that no run pays for creating them
    for p in module.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()


def grad_agreement(a: dict, b: dict) -> dict:
    if a.keys() != b.keys():
        _fail("the two sides trained different parameters")
    va = torch.cat([a[k].flatten().double() for k in sorted(a)])
    vb = torch.cat([b[k].flatten().double() for k in sorted(b)])
    cos = float(va @ vb / (va.norm() * vb.norm()))
    return {"cosine": cos, "max_rel_diff": float((va - vb).abs().max() / vb.abs().max()),
            "norm_ratio": float(va.norm() / vb.norm())}


def alloc_peak(fn) -> int:
    """Peak of the running sum of torch.profiler's CPU allocator events while ``fn()`` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def time_rounds(variants: dict, before: dict, rounds: int, seed: int, base: str) -> dict:
    """Run every variant once per round, in a seeded random order; medians and paired ratios."""
    names = list(variants)
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}
    rng = torch.Generator().manual_seed(seed)
    for _ in range(rounds):
        for i in torch.randperm(len(names), generator=rng).tolist():
            n = names[i]
            before[n]()
            c0, t0 = time.process_time(), time.perf_counter()
            variants[n]()
            wall[n].append(time.perf_counter() - t0)
            cpu[n].append(time.process_time() - c0)

    def summary(samples):
        med = {n: statistics.median(v) for n, v in samples.items()}
        ratios = {n: [a / b for a, b in zip(samples[n], samples[base])] for n in names}
        out = {"median_s": med, "ratio_of_medians": {n: med[n] / med[base] for n in names},
               "paired_ratio_median": {n: statistics.median(r) for n, r in ratios.items()}}
        if rounds >= 2:
            out["paired_ratio_quartiles"] = {n: statistics.quantiles(r, n=4) for n, r in ratios.items() if n != base}
        return out

    return {"wall": summary(wall), "cpu": summary(cpu), "wall_s": wall, "cpu_s": cpu}


# ------------------------------------------------------------------------------ Flow-GRPO part
def run_flow_grpo(api, peer, tiny: Path, args) -> dict:
    prompts = [p for p in api.TINY_PROMPTS for _ in range(args.fg_group)]
    B, N, T_sel, a = len(prompts), args.fg_steps, args.fg_train_steps, args.fg_noise
    model, pipe = load_models(api, tiny, args.size, B)
    text = model.encode_prompts(prompts)
    emb, pooled = text["prompt_embeds"], text["pooled"]
    with torch.no_grad():
        fg_emb, fg_pooled, _ = peer.encode_prompt([pipe.text_encoder, pipe.text_encoder_2],
                                                  [pipe.tokenizer, pipe.tokenizer_2], prompts, 128)
    enc_diff = max(float((fg_emb - emb).abs().max()), float((fg_pooled - pooled).abs().max()))
    noise = torch.randn(B, *model.latent_shape, generator=torch.Generator().manual_seed(args.seed))
    sigmas = model.sigmas(N)
    kernels = api.make_kernels(N, api.FlowKernel(a))
    eps, adv_clip = args.fg_clip, 5.0
    config = SimpleNamespace(sample=SimpleNamespace(guidance_scale=3.5, noise_level=a))
    wrapped = _WrappedModule(pipe.transformer)
    record: dict = {}
    # (rollout + decode + advantages, update) wall s
    phases: dict = {"flow_grpo": [], "flowrl": [], "flowrl_fast": []}

    def flow_grpo_iteration(keep=False, adv_override=None):
        t0 = time.perf_counter()
        torch.manual_seed(args.seed + 1)  # the SDE noise of sde_step_with_logprob (global RNG)
        with torch.no_grad():
            images, latents, image_ids, _, log_probs = peer.pipeline_with_logprob(
                pipe, prompt_embeds=emb, pooled_prompt_embeds=pooled, num_inference_steps=N,
                guidance_scale=3.5, output_type="pt", height=args.size, width=args.size,
                noise_level=a, latents=noise.clone(),
            )
        latents, log_probs = torch.stack(latents, dim=1), torch.stack(log_probs, dim=1)
        adv = group_advantages(rewards_of(images), args.fg_group)
        if adv_override is not None:
            adv = adv_override
        sample = {
            "prompt_embeds": emb, "pooled_prompt_embeds": pooled,
            "image_ids": image_ids.unsqueeze(0).repeat(B, 1, 1),
            "timesteps": pipe.scheduler.timesteps.repeat(B, 1),
            "latents": latents[:, :-1], "next_latents": latents[:, 1:], "log_probs": log_probs,
            "advantages": adv.unsqueeze(1).repeat(1, N),
        }
        t1 = time.perf_counter()
        pipe.transformer.train()
        new = []
        for j in range(T_sel):  # Flow-GRPO trains the first int(N * timestep_fraction) steps
            _, log_prob, _, _ = peer.compute_log_prob(wrapped, pipe, sample, j, config)
            adv_j = torch.clamp(sample["advantages"][:, j], -adv_clip, adv_clip)
            ratio = torch.exp(log_prob - sample["log_probs"][:, j])
            loss = torch.mean(torch.maximum(-adv_j * ratio, -adv_j * torch.clamp(ratio, 1 - eps, 1 + eps)))
            (loss / T_sel).backward()  # accelerator.backward with T_sel accumulation steps
            if keep:
                new.append(log_prob.detach())
        phases["flow_grpo"].append((t1 - t0, time.perf_counter() - t1))
        if keep:
            record["peer"] = {"latents": latents, "log_probs": log_probs, "new": torch.stack(new, 1),
                              "images": images, "adv": adv}

    def velocity_for(idx):
        sub = api.select_embeddings(text, idx)
        return lambda x, s: model.velocity(x, s, sub)

    def flowrl_iteration(keep=False, adv_override=None, fast=False):
        t0 = time.perf_counter()
        traj = api.rollout(lambda x, s: model.velocity(x, s, text), noise, sigmas, kernels,
                           generators=torch.Generator().manual_seed(args.seed + 1),
                           image_from="final", prompts=prompts)
        images = model.decode(traj.image_latents)
        adv = group_advantages(rewards_of(images), args.fg_group)
        if adv_override is not None:
            adv = adv_override
        step = api.make_step_log_prob_fn(velocity_for, traj)
        new = {}
        if keep:  # record the update's log-probs (check run only)
            inner = step

            def step(t, idx, grad):
                lp = inner(t, idx, grad)
                new[t] = lp.detach()
                return lp
        t1 = time.perf_counter()
        T = traj.num_trainable
        mask = torch.zeros(B, T, dtype=torch.bool)
        mask[:, :T_sel] = True
        backward = api.on_policy_chunk_backward if fast else api.lean_chunk_backward
        backward(step, traj.trainable_log_probs, adv, (1,) * T, mask, api.ClippedObjective(eps, eps),
                 normaliser=float(B))
        phases["flowrl_fast" if fast else "flowrl"].append((t1 - t0, time.perf_counter() - t1))
        if keep:
            record["flowrl"] = {"latents": traj.latents, "log_probs": traj.log_probs,
                                "new": torch.stack([new[t] for t in range(T_sel)], 1), "images": images,
                                "adv": adv, "trainable": T}

    # correctness (also the warm-up). The reward barely varies on the random tiny model (its spread
    # within a group is ~5e-4), so normalising it amplifies the ~1e-7 image differences of the two
    # sides into ~1e-4 advantage differences: the gradients are compared with flowrl's advantages
    # given to both sides, so that they compare the updates (the advantages are compared apart).
    zero_grads(model.denoiser)
    flowrl_iteration(keep=True, fast=True)
    g_flowrl_fast = named_grads(model.denoiser)
    zero_grads(model.denoiser)
    flowrl_iteration(keep=True)
    g_flowrl = named_grads(model.denoiser)
    zero_grads(pipe.transformer)
    flow_grpo_iteration(keep=True)
    adv_own = record["peer"]["adv"]
    zero_grads(pipe.transformer)
    flow_grpo_iteration(keep=True, adv_override=record["flowrl"]["adv"])
    g_peer = named_grads(pipe.transformer)
    rp, rf = record["peer"], record["flowrl"]
    if rf["trainable"] != N:
        _fail(f"flowrl found {rf['trainable']} trainable transitions, expected {N}")
    checks = {
        "prompt_embeds_max_abs_diff": enc_diff,
        "latents_max_abs_diff": float((rp["latents"] - rf["latents"]).abs().max()),
        "images_max_abs_diff": float((rp["images"] - rf["images"]).abs().max()),
        "rollout_log_probs_max_abs_diff": float((rp["log_probs"] - rf["log_probs"]).abs().max()),
        "update_log_probs_max_abs_diff": float((rp["new"] - rf["new"]).abs().max()),
        "advantages_max_abs_diff": float((adv_own - rf["adv"]).abs().max()),
        "reward_std_within_groups": float(rewards_of(rf["images"]).reshape(-1, args.fg_group).std(1).mean()),
        "log_prob_range": [float(rf["log_probs"].min()), float(rf["log_probs"].max())],
        "grad_same_advantages": grad_agreement(g_flowrl, g_peer),
        "grad_same_advantages_fast_path": grad_agreement(g_flowrl_fast, g_peer),
    }
    for v in phases.values():
        v.clear()
    timing = time_rounds(
        {"flow_grpo": flow_grpo_iteration, "flowrl": flowrl_iteration,
         "flowrl_fast": lambda: flowrl_iteration(fast=True)},
        {"flow_grpo": lambda: zero_grads(pipe.transformer), "flowrl": lambda: zero_grads(model.denoiser),
         "flowrl_fast": lambda: zero_grads(model.denoiser)},
        args.rounds, args.seed, base="flow_grpo",
    )
    timing["wall_phases_median_s"] = {
        n: {"rollout_decode_advantages": statistics.median(r for r, _ in v),
            "update": statistics.median(u for _, u in v)} for n, v in phases.items()}
    timing["wall_phase_paired_ratio_median"] = {
        name: {ph: statistics.median(f[k] / g[k] for f, g in zip(phases[name], phases["flow_grpo"]))
               for k, ph in enumerate(("rollout_decode_advantages", "update"))}
        for name in ("flowrl", "flowrl_fast")}
    return {
        "what": "one step-level GRPO iteration: rollout with log-probs + VAE decode + reward + "
                "advantages + clipped update back-propagated over the selected steps (no optimizer step)",
        "geometry": {"prompts": len(api.TINY_PROMPTS), "group": args.fg_group, "batch": B, "steps": N,
                     "kernel": f"flow (Flow-GRPO sde), noise_level a = {a}", "selected_steps": list(range(T_sel)),
                     "clip_range": eps, "image": f"{args.size}x{args.size}",
                     "sigmas": [round(float(s), 5) for s in sigmas]},
        "peer_functions": peer.info,
        "checks": checks,
        "timing": timing,
    }


# ------------------------------------------------------------------------------ GCPO part
def run_gcpo(api, peer, tiny: Path, args) -> dict:
    prompts = [p for p in api.TINY_PROMPTS for _ in range(args.gc_group)]
    B, N = len(prompts), args.gc_steps
    chunks = [int(c) for c in args.gc_chunks.split(",")]
    K, K_sel = len(chunks), args.gc_train_chunks
    micro = [int(m) for m in args.gc_micro_batches.split(",")]
    if sum(chunks) != N - 1:
        _fail(f"--gc-chunks {chunks} must sum to --gc-steps - 1 = {N - 1} (GCPO drops the last transition)")
    for m in micro:
        if m < 1 or B % m:
            _fail(f"--gc-micro-batches: {m} does not divide the batch {B}")
    model, pipe = load_models(api, tiny, args.size, B)
    transformer = pipe.transformer
    text = model.encode_prompts(prompts)
    emb, pooled = text["prompt_embeds"], text["pooled"]
    img_ids = model.image_ids()
    sigmas = api.shifted_sigmas(N, args.gc_shift).to(torch.float32)
    gcpo_sigmas = peer.sd3_time_shift(args.gc_shift, torch.linspace(1, 0, N + 1))
    noise = torch.randn(B, *model.latent_shape, generator=torch.Generator().manual_seed(args.seed))
    eta, eps = args.gc_eta, args.gc_clip

    def truncated(s):  # GCPO: timestep = int(sigma * 1000), the transformer gets timestep / 1000
        return torch.trunc(s * 1000) / 1000

    def velocity_for(idx):
        sub = api.select_embeddings(text, idx)
        return lambda x, s: model.velocity(x, truncated(s), sub)

    # rollout (flowrl, truncated conditioning) and GCPO's own sampler on the same noise
    traj = api.rollout(lambda x, s: model.velocity(x, truncated(s), text), noise, sigmas,
                       api.make_kernels(N, api.FlowKernel(eta)),
                       generators=torch.Generator().manual_seed(args.seed + 1), prompts=prompts)
    gargs = SimpleNamespace(debug=False, use_sto_step=False, step_end_idx=100, grpo_step_mode="flow", eta=eta)
    torch.manual_seed(args.seed + 1)  # flow_grpo_step draws its noise from the global RNG
    with torch.no_grad():
        _, _, g_latents, g_log_probs = peer.run_sample_step(
            gargs, noise.clone(), range(N), sigmas, transformer, emb, pooled, torch.zeros(1, 3), img_ids, True)
    T = traj.num_trainable
    if T != N - 1:
        _fail(f"flowrl found {T} trainable transitions, expected {N - 1}")
    old = traj.trainable_log_probs
    rewards = rewards_of(model.decode(traj.image_latents))
    adv = group_advantages(rewards, args.gc_group)
    rng = torch.Generator().manual_seed(args.seed + 2)
    perms = torch.stack([torch.randperm(K, generator=rng) for _ in range(B)])[:, :K_sel]
    mask = torch.zeros(B, K, dtype=torch.bool)
    mask[torch.arange(B)[:, None], perms] = True

    # off-policy: the same relative perturbation of every weight, both models
    for m in (model.denoiser, transformer):
        g = torch.Generator().manual_seed(args.seed + 1000)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(args.perturb * (p.std() if p.numel() > 1 else p.abs()) * torch.randn(p.shape, generator=g))

    # GCPO's per-sample data, laid out as its train_one_step lays it out (split along the steps)
    timesteps = torch.tensor([int(s * 1000) for s in sigmas][:N], dtype=torch.long)[:-1]
    starts = [sum(chunks[:u]) for u in range(K)]
    per_sample = []
    for b in range(B):
        lat, nxt = traj.latents[b, :-1][:-1], traj.latents[b, 1:][:-1]
        per_sample.append({
            "latents": torch.split(lat, chunks), "next_latents": torch.split(nxt, chunks),
            "timesteps": torch.split(timesteps, chunks),
            "chunk_log_probs": torch.stack([c.mean() for c in torch.split(old[b], chunks)]),
            "advantages": adv[b], "encoder_hidden_states": emb[b], "pooled_prompt_embeds": pooled[b],
            "text_ids": torch.zeros(3), "image_ids": img_ids,
        })
    gargs_train = SimpleNamespace(debug=False, grpo_step_mode="flow", eta=eta, adv_clip_max=5.0, clip_range=eps,
                                  right_clip_range=eps, kl_coeff=0.0, gradient_accumulation_steps=B)

    def gcpo_update():
        for b in range(B):
            sample = per_sample[b]
            for u in perms[b].tolist():
                log_prob = peer.grpo_one_step(
                    gargs_train, sample["latents"][u], sample["next_latents"][u],
                    sample["encoder_hidden_states"].unsqueeze(0), sample["pooled_prompt_embeds"].unsqueeze(0),
                    sample["text_ids"].unsqueeze(0), sample["image_ids"].unsqueeze(0), transformer,
                    sample["timesteps"][u], [starts[u] + k for k in range(chunks[u])], sigmas,
                )
                a_b = torch.clamp(sample["advantages"], -5.0, 5.0)
                ratio = torch.exp(log_prob - sample["chunk_log_probs"][u])
                policy = torch.mean(torch.maximum(-a_b * ratio, -a_b * torch.clamp(ratio, 1 - eps, 1 + eps)))
                (policy / (B * K_sel)).backward()  # GCPO: / (gradient_accumulation_steps * train_chunks)

    objective = api.ClippedObjective(eps, eps)

    # flowrl's side scores the micro-batch's rows of the whole trajectory through the engine's
    # TransitionScorer (as the engine's update does: no per-micro-batch copy of the trajectory);
    # only the velocity is wrapped, for GCPO's truncated timestep conditioning
    truncating = SimpleNamespace(velocity=lambda x, s, t: model.velocity(x, truncated(s), t))
    scorer = api.TransitionScorer(truncating, traj, text)

    def micro_batches(m):
        """Each micro-batch's rows and inputs (old log-probs, advantages, chunk mask), laid out
        before the measured update, as GCPO's per-sample data is above."""
        out = []
        for start in range(0, B, m):
            rows = torch.arange(start, start + m)
            out.append((rows, old[rows], adv[rows], mask[rows]))
        return out

    def flowrl_update(m):
        batches = micro_batches(m)

        def run():
            for rows, old_mb, adv_mb, mask_mb in batches:
                api.lean_chunk_backward(scorer.log_prob_fn(rows), old_mb, adv_mb, chunks, mask_mb,
                                        objective, normaliser=float(B))
        return run

    def flowrl_graph_update(m):
        """chunk_graph_backward (update_mode = "chunk_graph"): each chunk's steps in one batched
        forward with grad (the engine's TransitionScorer.many_fn) and one backward."""
        batches = micro_batches(m)

        def run():
            for rows, old_mb, adv_mb, mask_mb in batches:
                api.chunk_graph_backward(scorer.log_prob_fn(rows), old_mb, adv_mb, chunks, mask_mb,
                                         objective, normaliser=float(B), many=scorer.many_fn(rows))
        return run

    flowrl_names = [f"flowrl_mb{m}" for m in micro] + [f"graph_mb{m}" for m in micro]
    variants = {"gcpo": gcpo_update, **{f"flowrl_mb{m}": flowrl_update(m) for m in micro},
                **{f"graph_mb{m}": flowrl_graph_update(m) for m in micro}}
    zero_for = {"gcpo": lambda: zero_grads(transformer), **{n: (lambda: zero_grads(model.denoiser))
                                                             for n in flowrl_names}}
    owner = {"gcpo": transformer, **{n: model.denoiser for n in flowrl_names}}

    # correctness (also the warm-up)
    grads = {}
    for name, run in variants.items():
        zero_for[name]()
        run()
        grads[name] = named_grads(owner[name])
    with torch.no_grad():
        new = torch.stack([api.make_step_log_prob_fn(velocity_for, traj)(t, torch.arange(B), False)
                           for t in range(T)], 1)
    z = torch.stack([c.mean(1) for c in torch.split(new - old, chunks, dim=1)], 1)[mask]
    checks = {
        "sigmas_vs_gcpo_sd3_time_shift_max_abs_diff": float((sigmas - gcpo_sigmas).abs().max()),
        "rollout_latents_max_abs_diff": float((g_latents - traj.latents).abs().max()),
        "rollout_log_probs_max_abs_diff": float((g_log_probs - traj.log_probs).abs().max()),
        "log_prob_range": [float(traj.log_probs.min()), float(traj.log_probs.max())],
        "selected_chunk_ratio_range": [float(z.exp().min()), float(z.exp().max())],
        "grad_vs_gcpo": {n: grad_agreement(grads[n], grads["gcpo"]) for n in variants if n != "gcpo"},
    }

    # memory
    memory = {}
    for name, run in variants.items():
        zero_for[name]()
        memory[name] = alloc_peak(run)

    timing = time_rounds(variants, zero_for, args.rounds, args.seed, base="gcpo")
    return {
        "what": "the Chunk-GRPO update alone (rollout done beforehand): clipped chunk objective, "
                "selected chunks back-propagated, off-policy (no optimizer step)",
        "geometry": {"prompts": len(api.TINY_PROMPTS), "group": args.gc_group, "batch": B, "steps": N,
                     "trainable": T, "chunks": chunks, "chunks_per_sample": K_sel,
                     "kernel": f"flow (GCPO grpo_step_mode 'flow'), eta = {eta}", "shift": args.gc_shift,
                     "clip_range": eps, "perturb": args.perturb, "image": f"{args.size}x{args.size}",
                     "flowrl_micro_batches": micro,
                     "timestep_conditioning": "truncated int(sigma*1000)/1000 on BOTH sides (flowrl's "
                                              "velocity wrapped for this comparison); kernels use exact sigmas"},
        "peer_functions": peer.info,
        "checks": checks,
        "memory_peak_bytes": memory,
        "memory_ratio_vs_gcpo": {n: memory[n] / memory["gcpo"] for n in memory},
        "memory_meter": "torch.profiler profile(profile_memory=True): peak of the running sum of the CPU "
                        "allocator events during the update (.grad buffers allocated beforehand)",
        "timing": timing,
    }


# ------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flow-grpo", type=Path, help="root of a flow_grpo_refactor checkout (the FLUX commit)")
    ap.add_argument("--gcpo", type=Path, help="root of a GCPO checkout")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--size", type=int, default=32, help="image size in pixels (tiny FLUX: 2 px per latent)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fg-group", type=int, default=8, help="Flow-GRPO part: samples per prompt (4 prompts)")
    ap.add_argument("--fg-steps", type=int, default=6, help="Flow-GRPO FLUX config: sample.num_steps = 6")
    ap.add_argument("--fg-train-steps", type=int, default=5,
                    help="selected (first) steps; Flow-GRPO FLUX: int(6 * timestep_fraction 0.99) = 5")
    ap.add_argument("--fg-noise", type=float, default=0.9, help="Flow-GRPO FLUX: sample.noise_level = 0.9")
    ap.add_argument("--fg-clip", type=float, default=1e-4, help="Flow-GRPO: train.clip_range = 1e-4")
    ap.add_argument("--gc-group", type=int, default=8, help="GCPO part: samples per prompt (4 prompts)")
    ap.add_argument("--gc-steps", type=int, default=17, help="GCPO: sampling_steps 17")
    ap.add_argument("--gc-chunks", default="2,3,4,7", help="GCPO: new_chunk_list")
    ap.add_argument("--gc-train-chunks", type=int, default=2,
                    help="chunks per sample (GCPO: 4 x timestep_fraction 0.5)")
    ap.add_argument("--gc-eta", type=float, default=0.7, help="GCPO: eta 0.7")
    ap.add_argument("--gc-shift", type=float, default=3.0, help="GCPO: shift 3")
    ap.add_argument("--gc-clip", type=float, default=5e-5, help="GCPO: clip_range = right_clip_range = 5e-5")
    ap.add_argument("--gc-micro-batches", default="1,8,16,32",
                    help="flowrl micro-batch sizes to run (1 = GCPO's batching, one sample at a time)")
    ap.add_argument("--perturb", type=float, default=1e-3,
                    help="GCPO part: relative weight perturbation after the rollout")
    ap.add_argument("--json", default="", help="also write the full results (with per-round times) here")
    args = ap.parse_args(argv)
    if args.flow_grpo is None and args.gcpo is None:
        ap.error("give --flow-grpo PATH and/or --gcpo PATH (peer checkouts; see docs/benchmarks.md)")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*CUDA is not available.*Disabling autocast.*")
    warnings.filterwarnings("ignore", message=".*requires torchvision.*")

    api = flowrl_api()
    peers = {}
    if args.flow_grpo is not None:
        peers["flow_grpo"] = load_flow_grpo(args.flow_grpo)
    if args.gcpo is not None:
        peers["gcpo"] = load_gcpo(args.gcpo)

    res = {
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/peer.py " + " ".join(argv or sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average_start": os.getloadavg(),
        "device": f"{platform.machine()} CPU ({platform.processor() or 'unknown'}), os.cpu_count() = "
                  f"{os.cpu_count()}, torch threads = {torch.get_num_threads()}, torch {torch.__version__}",
        "rounds": args.rounds,
    }
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tiny = api.build_tiny_flux(Path(tmp) / "tiny_flux")
        if "flow_grpo" in peers:
            res["flow_grpo"] = run_flow_grpo(api, peers["flow_grpo"], tiny, args)
        if "gcpo" in peers:
            res["gcpo"] = run_gcpo(api, peers["gcpo"], tiny, args)
    res["load_average_end"] = os.getloadavg()
    res["total_wall_s"] = time.perf_counter() - t0

    def strip(d):
        return {k: (strip(v) if isinstance(v, dict) else v) for k, v in d.items() if k not in ("wall_s", "cpu_s")}

    print(json.dumps(strip(res), indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
