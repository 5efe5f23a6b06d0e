"""``flowrl plan``'s peak GPU memory against ``torch.cuda.max_memory_allocated`` of the real run,
for three LoRA recipes at full model size on one GPU.

What it does, per configuration:

- ``flux``: FLUX.1-dev, ``recipes/chunk_grpo_flux_lora.toml`` (720 x 720, 17 -> 3 steps);
- ``sd3``: Stable Diffusion 3.5 Medium, ``recipes/lora_single_gpu_sd3.toml`` (the recipe that targets
  ``stabilityai/stable-diffusion-3.5-medium``; 512 x 512, true CFG, KL to the LoRA-disabled base);
- ``wan``: Wan 2.1 T2V 1.3B, ``recipes/wan21_1p3b_lora.toml`` (832 x 480, 33 frames, true CFG).

1. The pipeline is built in memory, nothing is downloaded: the transformer from its published
   configuration (FLUX.1-dev's and Wan 2.1 1.3B's from ``benchmarks/memory_plan.py``, SD3.5
   Medium's from the plan's own copy, ``flowrl_plugins.diffusers_models.memory.KNOWN``) with random
   bf16 weights, directly on the GPU; the VAE at its published configuration (random weights); the
   text encoders tiny (one layer) but of the right output widths (T5 / UMT5 4096, CLIP-L 768,
   CLIP-G 1280). FLUX.1-dev is ``benchmarks/gpu_flux_iteration.py``'s ``flux_dev_random``; SD3.5-M
   and Wan are built here the same way. The recipe's adapter (``flux``, ``sd3``, ``wan``) takes
   the pipeline in place of ``from_pretrained`` (its ``_load``).
2. ``flowrl.train.train`` runs the recipe for 2 iterations with the overrides below (the second
   update runs on top of the AdamW state the first optimizer step made, as every later one does).
   ``torch.cuda.reset_peak_memory_stats()`` is called before, ``max_memory_allocated()`` read after;
   the run's own phases (``encode``, ``rollout``, ``decode``, ``reward``, ``update``: the phase
   timer of ``flowrl.train``) each get their peak too (the stats are read and reset as a phase
   starts and ends; the run's peak is the largest of them, exactly what one reset and one read
   would give). Between configurations the GPU is freed (``del``, ``gc``, ``empty_cache``) and
   what is still allocated is subtracted (``baseline_gib``, normally 0).
3. The plan: ``flowrl.memory_plan.estimate`` (what ``flowrl plan RECIPE --set ...`` prints) on the
   SAME recipe and overrides, with ``model.path`` pointing at a directory holding the built
   pipeline's configuration files (no weights): the plan of the pipeline that really ran, tiny text
   encoders included. ``planned_published_gib`` is the plan of the recipe's own hub model
   (real T5-XXL / CLIP-G / UMT5-XXL, 9-11 GB that visit the GPU to encode when offloaded) with the
   same overrides, for reference only: the run never holds those encoders.

Overrides, all three (beside ``model.path``, ``run.device`` and ``run.output_dir``)::

    rewards.0.use="brightness"   a free reward instead of HPSv3 / PickScore (no reward model to load;
                                 the plan then counts none either)
    train.iterations=2  train.prompts_per_iteration=1  train.optimizer_steps_per_update=1
    sampler.steps=3              (17 or 10 in the recipes: memory does not depend on the count,
                                  beyond the trajectories' few MB)
    prompts.num_eval=0  log.image_every=0  checkpoint.every=2  log.progress=false

and per configuration: ``flux`` and ``wan``: ``train.group_size=2``, ``chunker.use="step"`` (the
recipe's explicit chunk sizes sum to 16 transitions); ``sd3``: ``train.group_size=4`` (keeps the
recipe's micro-batch of 4), ``sampler.sde_window=[0, 2]`` (the recipe's ``[0, 9]`` of 10 steps
scaled to 3: the last step plain Euler, untrained). Everything else is the recipe's:
resolution, frames, text length, CFG, LoRA rank and targets, micro-batch, gradient checkpointing,
offloaded encoders, the VAE batch, the KL term.

What the numbers mean. ``max_memory_allocated`` counts the bytes of live tensors only: not the
CUDA context (about 0.5 GB), not what the caching allocator holds unused (fragmentation), not
cuBLAS workspaces outside the allocator. The plan's peak includes ``CUDA_OVERHEAD`` (1.5 GiB,
"CUDA context + allocator slack", :data:`flowrl.memory_plan.CUDA_OVERHEAD`), so like is compared
with like: ``planned_tensors_gib = planned_gib - 1.5`` and ``ratio = measured_gib /
planned_tensors_gib`` (1.0: the plan is exact; below 1: it over-estimates). ``ratio_with_overhead
= measured_gib / planned_gib`` is beside it, and ``measured_reserved_gib``
(``max_memory_reserved``: the allocator's pool, fragmentation included) and ``outside_torch_gib``
(the device's used memory minus the pool: context, workspaces, other processes) are what the
overhead constant stands for. Per phase: ``planned_phases_gib[p]`` is the plan's persistent
tensors plus phase ``p``'s transient (its ``update`` includes the optimizer ``step``), overhead
excluded; ``measured_phases_gib[p]`` is the peak measured while the run's phase ``p`` ran
(``start-up``: building and placing the model; ``advantage``; ``other``: between phases, the
final checkpoint).

GPU (one H100 / H200; ``--budget-s`` stops starting configurations when the next one's estimated
seconds would not fit, and records it as skipped)::

    python benchmarks/gpu_memory_check.py --json OUT.json

Estimated GPU seconds (not yet measured), from benchmarks/results/gpu_flux_iteration_h200.json
(full-size FLUX.1-dev LoRA, 512 x 512, 8 samples x 9 steps: 22.7 s per iteration, 0.077 s per
sample forward in the rollout, 0.26 s per trained transition; a process's first variant reached
its first metrics row about 30 s later than its iterations alone take, the next ones about 10 s:
building 12e9 random parameters, LoRA, and once per process CUDA's warm-up), scaled by tokens:

- ``flux`` about 40 s: 2 iterations of 2 samples x 3 steps at 2537 tokens (about 0.14 s per
  sample forward, 0.46 s per trained transition: about 3 s each), the build and the plan
  (about 15 s), and the process's one-time CUDA warm-up (about 20 s, paid by whichever
  configuration runs first);
- ``sd3`` about 12 s: 4 samples of 2 rows (CFG) of 1357 tokens through 2.5e9 parameters, the KL
  reference forwards beside the update;
- ``wan`` about 25 s: 2 clips of 14040 tokens x 2 rows (about 0.35 s per sample forward, half of
  it attention), and the Wan VAE decoding 4 clips of 33 frames at 832 x 480 in float32;

with imports about 80 s in all, under the 100 s that ``flowrl selftest --gpu`` gives it
(``--budget-s 100``: the configurations run in the order above, each started only if its estimate
still fits). Each configuration's measured ``seconds`` (and ``plan_seconds``, ``train_seconds``,
``phase_seconds``) are in the JSON, to correct these estimates.

The script on the CPU (measured figures are null there; the plans are computed), the whole logic at
one or two blocks of 2 or 3 heads, small VAEs, 64 x 64, 16 text tokens, 5 frames, SD3's group of
2 (micro-batch 2), in float32
(``model.dtype="fp32"``: bf16 matrix products run at about 0.1 GFLOP/s on a CPU); about 15 s of
configurations after 15 s of imports on 2 quiet cores::

    OMP_NUM_THREADS=1 python benchmarks/gpu_memory_check.py --device cpu --reduced --json OUT.json

``--only flux,sd3,wan`` chooses configurations. ``--json`` is rewritten after every configuration;
one that fails is recorded with its error and the next runs; the exit status is 0 whenever the
script itself ran (the caller reads the JSON: ``status`` is ``ok``, ``failed``, ``skipped``, or
``running`` when the script was stopped from outside while that configuration ran).
"""

from __future__ import annotations

import time

START = time.monotonic()  # --budget-s counts from here: imports are part of a GPU session's time

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flowrl.compat import ensure_torchvision_importable

ensure_torchvision_importable()  # before diffusers / transformers / peft (flowrl.compat)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_flux_iteration  # FLUX.1-dev's builder: flux_dev_random
import memory_plan as bench_plan  # the published transformer configs

GiB = 2**30

#: Overrides every configuration gets (see the module docstring).
COMMON = [
    'rewards.0.use="brightness"', "train.iterations=2", "train.prompts_per_iteration=1",
    "train.optimizer_steps_per_update=1", "sampler.steps=3", "prompts.num_eval=0", "log.image_every=0",
    "checkpoint.every=2", "log.progress=false",
]
#: ``--reduced``: the whole logic in seconds (with --device cpu, float32: see the docstring)
REDUCED_IMAGE = ["model.height=64", "model.width=64", "model.max_sequence_length=16"]

#: SD3.5 Medium's vae/config.json (FLUX.1's VAE architecture, its own scaling and shift)
SD35_VAE = dict(gpu_flux_iteration.FLUX_VAE, scaling_factor=1.5305, shift_factor=0.0609)
#: the reduced runs' image VAE: the same four levels (factor 8), 32 channels, one layer per block
SMALL_VAE = dict(gpu_flux_iteration.FLUX_VAE, block_out_channels=(32, 32, 32, 32), layers_per_block=1)


@dataclasses.dataclass(frozen=True)
class Configuration:
    name: str
    title: str
    recipe: str  # under recipes/
    adapter: str  # "module:Class" whose _load takes the built pipeline
    build: Callable[[str, bool, torch.dtype], Any]  # (device, reduced, dtype) -> pipeline
    overrides: tuple[str, ...]  # beside COMMON
    reduced: tuple[str, ...] = ()  # beside REDUCED_IMAGE
    estimate_s: float = 30.0  # GPU seconds (docstring); the budget's guess


# ------------------------------------------------------------------------------------ builders


@contextlib.contextmanager
def _swapped(module, name: str, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def as_loaded(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast ``model`` as ``from_pretrained(..., dtype=dtype)`` leaves it: everything in ``dtype``
    (SD3's 0.23e9-element positional table too, which its constructor makes in float32) except
    the tensors the class keeps in float32 (Wan: time embedder, norms, modulation tables, rope)."""
    from diffusers.utils import logging as diffusers_logging

    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # its warning about the float32 modules: put back below
    try:
        model.to(dtype)
    finally:
        diffusers_logging.set_verbosity(verbosity)
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    if dtype != torch.float32 and keep:
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if any(k in name.split(".") for k in keep):
                tensor.data = tensor.data.float()
    return model


def _frozen_device(device: str) -> str:
    """Text encoders and VAE are made on the CPU, as ``from_pretrained`` loads them (the adapter
    moves them, or leaves them there when offloaded); on ``meta`` too for a configuration-only build."""
    return "meta" if device == "meta" else "cpu"


def build_flux(device: str, reduced: bool, dtype: torch.dtype):
    """FLUX.1-dev: ``gpu_flux_iteration.flux_dev_random`` (full size: 19 + 38 blocks of width
    3072, FLUX.1's VAE). Reduced: one block of each kind, 2 heads (width 256), a small VAE, by
    handing that builder smaller configurations."""
    if not reduced:
        pipe = gpu_flux_iteration.flux_dev_random(device, None)
    else:
        config = dict(bench_plan.FLUX1_DEV, num_attention_heads=2)
        with _swapped(bench_plan, "FLUX1_DEV", config), _swapped(gpu_flux_iteration, "FLUX_VAE", SMALL_VAE):
            pipe = gpu_flux_iteration.flux_dev_random(device, (1, 1))
    return pipe if dtype == torch.bfloat16 or device == "meta" else pipe.to(dtype=dtype)


def _clip(tok, hidden: int, with_projection: bool):
    """A one-layer CLIP text encoder of ``hidden`` width (and projection), 64-wide heads."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    return cls(CLIPTextConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=hidden // 64, max_position_embeddings=77, projection_dim=hidden,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))


def sd35_medium_config(reduced: bool) -> dict[str, Any]:
    """SD3.5 Medium's transformer/config.json (the plan's copy); reduced: 2 layers (the first
    with the dual attention, as the first 13 of 24 are), 2 heads (width 128)."""
    from flowrl_plugins.diffusers_models.memory import KNOWN

    config = {k: v for k, v in KNOWN["stabilityai/stable-diffusion-3.5-medium"]["transformer"].items()
              if not k.startswith("_")}
    if reduced:
        config.update(num_layers=2, num_attention_heads=2, dual_attention_layers=[0],
                      caption_projection_dim=2 * config["attention_head_dim"])
    return config


def build_sd3(device: str, reduced: bool, dtype: torch.dtype):
    """A StableDiffusion3Pipeline with SD3.5 Medium's transformer (2.5e9 parameters) and VAE, and
    one-layer CLIP-L (768), CLIP-G (1280) and T5 (4096) encoders: SD3 joins the CLIPs' hidden
    states (2048 wide, zero-padded to 4096) to the T5's, and their pooled outputs (2048)."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import T5Config, T5EncoderModel

    from flowrl.testing.tiny_pipelines import clip_tokenizer, t5_tokenizer

    tok, tok_2, tok_3 = clip_tokenizer(), clip_tokenizer(), t5_tokenizer()
    with _default_dtype(dtype):
        with torch.device(device):  # the transformer where it runs: its weights never pass through the CPU
            transformer = as_loaded(SD3Transformer2DModel(**sd35_medium_config(reduced)), dtype)
        with torch.device(_frozen_device(device)):
            vae = AutoencoderKL(**(SMALL_VAE if reduced else SD35_VAE))
            text_encoder = _clip(tok, 768, True)
            text_encoder_2 = _clip(tok_2, 1280, True)
            text_encoder_3 = T5EncoderModel(T5Config(
                vocab_size=len(tok_3), d_model=4096, d_ff=256, d_kv=64, num_layers=1, num_heads=2,
                relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=tok_3.pad_token_id,
                eos_token_id=tok_3.eos_token_id))
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=text_encoder, tokenizer=tok, text_encoder_2=text_encoder_2, tokenizer_2=tok_2,
        text_encoder_3=text_encoder_3, tokenizer_3=tok_3)


def wan21_config(reduced: bool) -> dict[str, Any]:
    """Wan 2.1 T2V 1.3B's transformer/config.json (``benchmarks/memory_plan.py``); reduced: one
    block of 3 heads (width 384), the feed-forward at the same ratio."""
    config = dict(bench_plan.WAN21_1P3B)
    if reduced:
        heads = 3  # 3 of 12: the feed-forward keeps its ratio exactly (2240 / 384 = 8960 / 1536)
        config.update(num_layers=1, num_attention_heads=heads,
                      ffn_dim=config["ffn_dim"] * heads // config["num_attention_heads"])
    return config


def wan21_vae_config(reduced: bool) -> dict[str, Any]:
    """Wan 2.1's vae/config.json (the plan's copy; diffusers' defaults hold its latent statistics);
    reduced: base width 8, one residual block per level (same factors 8 and 4)."""
    from flowrl_plugins.diffusers_models.memory import KNOWN

    config = {k: v for k, v in KNOWN["Wan-AI/Wan2.1-T2V-1.3B-Diffusers"]["vae"].items() if not k.startswith("_")}
    if reduced:
        config.update(base_dim=8, num_res_blocks=1)
    return config


def build_wan(device: str, reduced: bool, dtype: torch.dtype):
    """A WanPipeline with Wan 2.1 T2V 1.3B's transformer (1.42e9 parameters) and VAE, and a
    one-layer UMT5 of width 4096 (the text enters every block's cross-attention)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from flowrl.testing.tiny_pipelines import t5_tokenizer

    tok = t5_tokenizer()
    with _default_dtype(dtype):
        with torch.device(device):
            transformer = as_loaded(WanTransformer3DModel(**wan21_config(reduced)), dtype)
        with torch.device(_frozen_device(device)):
            vae = AutoencoderKLWan(**wan21_vae_config(reduced))
            text_encoder = UMT5EncoderModel(UMT5Config(
                vocab_size=len(tok), d_model=4096, d_ff=256, d_kv=64, num_layers=1, num_heads=2,
                relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id))
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                        num_train_timesteps=1000)
    return WanPipeline(tokenizer=tok, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler)


CONFIGURATIONS = {
    "flux": Configuration(
        "flux", "FLUX.1-dev LoRA r64 (720 x 720)", "chunk_grpo_flux_lora.toml",
        "flowrl_plugins.diffusers_models.flux:FluxModel", build_flux,
        ("train.group_size=2", 'chunker.use="step"'), estimate_s=40.0),
    "sd3": Configuration(
        "sd3", "SD3.5 Medium LoRA r32 (512 x 512, CFG, KL)", "lora_single_gpu_sd3.toml",
        "flowrl_plugins.diffusers_models.sd3:SD3Model", build_sd3,
        ("train.group_size=4", "sampler.sde_window=[0, 2]"),
        reduced=("train.group_size=2", "train.micro_batch_size=2"), estimate_s=12.0),
    "wan": Configuration(
        "wan", "Wan 2.1 T2V 1.3B LoRA r64 (832 x 480 x 33 frames, CFG)", "wan21_1p3b_lora.toml",
        "flowrl_plugins.diffusers_models.wan:WanModel", build_wan,
        ("train.group_size=2", 'chunker.use="step"'), reduced=("model.num_frames=5",), estimate_s=25.0),
}


# ------------------------------------------------------------------------------------ plumbing


def adapter_class(spec: str):
    import importlib

    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


@contextlib.contextmanager
def built_in_memory(cls, make: Callable[[], Any]):
    """The adapter ``cls`` takes ``make()`` instead of loading ``model.path`` (its ``_load``), as
    ``gpu_flux_iteration.built_in_memory`` does for FLUX."""
    had = "_load" in cls.__dict__
    old = cls.__dict__.get("_load")
    cls._load = lambda self: make()
    try:
        yield
    finally:
        if had:
            cls._load = old
        else:
            del cls._load


def write_configs(pipe, out: Path) -> Path:
    """The pipeline's ``model_index.json`` and each model's ``config.json`` (no weights): a
    directory ``flowrl plan`` reads as a local pipeline."""
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_config(out)
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module):
            if hasattr(component, "save_config"):  # diffusers
                component.save_config(out / name)
            else:  # transformers
                component.config.save_pretrained(out / name)
        elif component is not None and hasattr(component, "save_config"):  # the scheduler
            component.save_config(out / name)
    return out


class PhasePeaks:
    """Peak allocated (and reserved) bytes per phase of the run: the stats are read and reset as
    ``flowrl.train``'s phase timer enters and leaves a phase (see the module docstring)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.allocated: dict[str, int] = {}
        self.reserved: dict[str, int] = {}
        self.stack = ["start-up"]

    def _close(self) -> None:
        if not self.cuda:
            return
        name = self.stack[-1]
        self.allocated[name] = max(self.allocated.get(name, 0), torch.cuda.max_memory_allocated())
        self.reserved[name] = max(self.reserved.get(name, 0), torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()

    def enter(self, phase: str) -> None:
        self._close()
        self.stack.append(phase)

    def leave(self) -> None:
        self._close()
        self.stack.pop()
        if len(self.stack) == 1:
            self.stack[0] = "other"  # after the first phase, the gaps are not the start-up

    def finish(self) -> None:
        self._close()

    @contextlib.contextmanager
    def watching(self):
        from flowrl.train import progress

        original = progress.PhaseTimer.__call__
        peaks = self

        @contextlib.contextmanager
        def call(timer, phase):
            peaks.enter(phase)
            try:
                with original(timer, phase):
                    yield
            finally:
                peaks.leave()

        progress.PhaseTimer.__call__ = call
        try:
            yield self
        finally:
            progress.PhaseTimer.__call__ = original


def measuring(device: str) -> bool:
    """Whether the run's memory is read (CUDA's allocator statistics); a test fakes them on the CPU."""
    return device.startswith("cuda")


def gib(x: float | None) -> float | None:
    return None if x is None else x / GiB


def plan(recipe_path: Path, overrides: list[str]) -> dict[str, Any]:
    """``flowrl plan``'s estimate (its Python API) for one process: the peak, its phase, the lines,
    and per phase persistent + that phase's transient, without the CUDA overhead."""
    from flowrl.memory_plan import CUDA_OVERHEAD, estimate, peak
    from flowrl.plugins import get_registry
    from flowrl.recipe import load_recipe

    registry = get_registry()
    recipe = load_recipe(recipe_path, overrides, registry=registry)
    _, _, lines = estimate(recipe, registry, 1)
    total, worst = peak(lines)
    persistent = sum(l.bytes for l in lines if l.phase == "persistent") - CUDA_OVERHEAD
    phases: dict[str, float] = {}
    for l in lines:
        if l.phase not in ("persistent", "cpu", "start-up", "held", "loading"):
            phases[l.phase] = phases.get(l.phase, 0.0) + l.bytes
    # the run's update phase holds the optimizer step too: the larger of the plan's two
    step = phases.pop("step", 0.0)
    transient = {**phases, "update": max(phases.get("update", 0.0), step)}
    return {
        "planned_gib": total / GiB, "planned_tensors_gib": (total - CUDA_OVERHEAD) / GiB, "planned_phase": worst,
        "planned_phases_gib": {k: (persistent + v) / GiB for k, v in transient.items()},
        "plan_lines": [{"phase": l.phase, "item": l.item, "gib": l.bytes / GiB, "note": l.note} for l in lines],
    }


def quiet_console():
    from rich.console import Console

    return Console(file=open(os.devnull, "w"))  # the run's console, for its whole length


def run_configuration(cfg: Configuration, args, work: Path) -> dict[str, Any]:
    """Plan, build, train, measure one configuration; raises on failure (the caller records it)."""
    from flowrl.recipe import load_recipe
    from flowrl.runlog import is_phase_seconds, read_metrics
    from flowrl.train import train

    cuda = measuring(args.device)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    overrides = [*COMMON, *cfg.overrides]
    if args.reduced:
        overrides += [*REDUCED_IMAGE, *cfg.reduced]
    if dtype == torch.float32:
        overrides.append('model.dtype="fp32"')
    entry: dict[str, Any] = {"recipe": f"recipes/{cfg.recipe}", "title": cfg.title, "overrides": overrides}
    recipe_path = REPO / "recipes" / cfg.recipe

    # the plan of the pipeline that will run (its configs, no weights), and of the recipe's hub model;
    # a plan that fails is recorded (the configuration then counts as failed), the run still measured
    start = time.monotonic()
    configs = write_configs(cfg.build("meta", args.reduced, dtype), work / cfg.name / "pipeline")
    planned: dict[str, Any] = {}
    try:
        planned = plan(recipe_path, [*overrides, f"model.path={str(configs)!r}"])
        entry.update(planned)
        entry["plan_seconds"] = time.monotonic() - start
        entry["planned_published_gib"] = plan(recipe_path, overrides)["planned_gib"]
        entry["published_plan_seconds"] = time.monotonic() - start - entry["plan_seconds"]
    except Exception as exc:  # noqa: BLE001
        entry["error"] = f"the plan failed: {type(exc).__name__}: {exc}"
        entry["traceback"] = "".join(traceback.format_exception(exc))[-4000:]

    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        baseline = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    sets = [*overrides, f"model.path={str(configs)!r}", f"run.device={args.device!r}",
            f"run.output_dir={str(work / cfg.name / 'run')!r}"]
    peaks = PhasePeaks(cuda)
    start = time.monotonic()
    with built_in_memory(adapter_class(cfg.adapter), lambda: cfg.build(args.device, args.reduced, dtype)), \
            peaks.watching():
        run_dir = train(load_recipe(recipe_path, sets), console=quiet_console())
    peaks.finish()
    entry["train_seconds"] = time.monotonic() - start
    rows = [r for r in read_metrics(run_dir) if "lr" in r]
    entry["iterations"] = len(rows)
    if rows:
        entry["phase_seconds"] = {k: v for k, v in rows[-1].items() if is_phase_seconds(k)}
        entry["update_seconds"] = {k: v for k, v in rows[-1].items() if k.startswith("time/update/")}
        entry["compute"] = {k: v for k, v in rows[-1].items() if k.startswith("compute/")}
    if cuda:
        measured = max(peaks.allocated.values()) - baseline
        entry.update(
            baseline_gib=gib(baseline), measured_gib=gib(measured),
            measured_phases_gib={k: gib(v - baseline) for k, v in peaks.allocated.items()},
            measured_reserved_gib=gib(max(peaks.reserved.values())),
        )
        if planned:
            entry.update(ratio=measured / (planned["planned_tensors_gib"] * GiB),
                         ratio_with_overhead=measured / (planned["planned_gib"] * GiB))
        free, total = torch.cuda.mem_get_info()
        entry["outside_torch_gib"] = gib(total - free - torch.cuda.memory_reserved())
    else:
        entry.update(measured_gib=None, measured_phases_gib=None, ratio=None, ratio_with_overhead=None)
    return entry


def free_device(cuda: bool) -> float | None:
    gc.collect()
    if not cuda:
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return gib(torch.cuda.memory_allocated())


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def summary(result: dict[str, Any]) -> str:
    head = f"{'config':6} {'status':8} {'planned':>8} {'plan-1.5':>8} {'measured':>8} {'ratio':>6} {'seconds':>8}"
    lines = [head + "  (GiB; ratio = measured / (planned - CUDA overhead))"]
    for name, e in result["configurations"].items():
        lines.append(f"{name:6} {e.get('status', '?'):8} {_fmt(e.get('planned_gib')):>8} "
                     f"{_fmt(e.get('planned_tensors_gib')):>8} {_fmt(e.get('measured_gib')):>8} "
                     f"{_fmt(e.get('ratio'), '.3f'):>6} {_fmt(e.get('seconds'), '.1f'):>8}"
                     + (f"  {e['error'].splitlines()[0][:120]}" if e.get("error") else ""))
        planned, measured = e.get("planned_phases_gib") or {}, e.get("measured_phases_gib") or {}
        for phase in sorted(set(planned) | set(measured)):
            lines.append(f"{'':6} {phase:>8} plan {_fmt(planned.get(phase)):>6}  measured {_fmt(measured.get(phase)):>6}")
    return "\n".join(lines)


def versions() -> dict[str, str]:
    import diffusers
    import peft
    import transformers

    import flowrl

    return {"torch": torch.__version__, "cuda": str(torch.version.cuda), "diffusers": diffusers.__version__,
            "transformers": transformers.__version__, "peft": peft.__version__, "flowrl": flowrl.__version__,
            "python": platform.python_version()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (needs --reduced)")
    ap.add_argument("--reduced", action="store_true",
                    help="one or two blocks of 2 heads, small VAEs, 64 x 64, 16 text tokens, 5 frames: the logic in seconds")
    ap.add_argument("--only", default=",".join(CONFIGURATIONS), help="comma-separated: flux,sd3,wan")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="start no configuration whose estimated GPU seconds would end past this many seconds "
                         "since the script started (0: no limit)")
    ap.add_argument("--json", default="", help="write every number here (after each configuration)")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGURATIONS]
    if unknown:
        ap.error(f"unknown configuration(s) {unknown}; choose from {', '.join(CONFIGURATIONS)}")
    cuda = args.device.startswith("cuda")
    if not cuda and not args.reduced:
        ap.error("--device cpu runs the reduced sizes only: add --reduced (full size needs a GPU)")
    if cuda and not torch.cuda.is_available():
        ap.error("no CUDA device: run with --device cpu --reduced")

    from flowrl.memory_plan import CUDA_OVERHEAD

    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else (platform.processor() or platform.machine()),
        "device_memory_gib": gib(torch.cuda.get_device_properties(0).total_memory) if cuda else None,
        **versions(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "args": vars(args), "cuda_overhead_gib": CUDA_OVERHEAD / GiB, "common_overrides": COMMON,
        "configurations": {},
    }

    def save() -> None:
        result["seconds"] = time.monotonic() - START
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=1))

    with tempfile.TemporaryDirectory(prefix="gpu_memory_check_") as tmp:
        for name in names:
            cfg = CONFIGURATIONS[name]
            elapsed = time.monotonic() - START
            if args.budget_s and elapsed + (cfg.estimate_s if cuda else 0.0) > args.budget_s:
                result["configurations"][name] = {
                    "recipe": f"recipes/{cfg.recipe}", "title": cfg.title, "status": "skipped", "error": None,
                    "skipped": f"{elapsed:.0f} s elapsed + about {cfg.estimate_s:.0f} s for this one > "
                               f"--budget-s {args.budget_s:g}"}
                print(f"{name}: skipped (budget)", flush=True)
                save()
                continue
            # a run killed from outside (a caller's time limit) leaves this in the JSON
            result["configurations"][name] = {"recipe": f"recipes/{cfg.recipe}", "title": cfg.title,
                                              "status": "running", "error": None}
            save()
            start = time.monotonic()
            try:
                entry = run_configuration(cfg, args, Path(tmp))
                entry.setdefault("error", None)
                entry["status"] = "failed" if entry["error"] else "ok"
            except Exception as exc:  # noqa: BLE001 (recorded; the next configuration runs)
                entry = {"recipe": f"recipes/{cfg.recipe}", "title": cfg.title, "status": "failed",
                         "error": f"{type(exc).__name__}: {exc}",
                         "traceback": "".join(traceback.format_exception(exc))[-4000:]}
                del exc  # its frames hold the run's tensors
            entry["seconds"] = time.monotonic() - start
            entry["allocated_after_gib"] = free_device(measuring(args.device))
            result["configurations"][name] = entry
            print(f"{name}: {entry['status']} in {entry['seconds']:.1f} s: planned {_fmt(entry.get('planned_gib'))} GiB, "
                  f"measured {_fmt(entry.get('measured_gib'))} GiB, ratio {_fmt(entry.get('ratio'), '.3f')}"
                  + (f" ({entry['error']})" if entry.get("error") else ""), flush=True)
            save()
    save()
    print(summary(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
