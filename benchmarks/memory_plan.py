"""Benchmark: ``flowrl plan``'s memory estimate against torch's own memory accounting, no GPU.

torch's ``FSDPMemTracker`` / ``MemTracker`` (``torch.distributed._tools``) count, by category, the
bytes of every tensor a training step creates. Under ``FakeTensorMode`` no tensor holds data, so
a full-size model runs on this CPU: shapes, dtypes and lifetimes are real, arithmetic is skipped.
Models are built from their published configurations (the copies ``flowrl plan`` itself reads,
``flowrl_plugins.diffusers_models.memory``) on the ``meta`` device: nothing is downloaded. Each
configuration runs forward + backward + AdamW (foreach, a GPU's default) twice and measures the
second step (the first creates the optimizer state), at 512 x 512: 1024 image tokens + 512 text
tokens.

1. ``flux_full_fsdp8_*``: the FLUX.1-dev transformer at full size, fine-tuned as the flagship
   recipe (``recipes/chunk_grpo_flux.toml``) does: full fine-tuning, fp32 master weights, bf16
   compute, FSDP2 at world size 8 (a fake process group) with ``fully_shard`` on every
   transformer block and on the root, ``MixedPrecisionPolicy(param_dtype=bf16,
   reduce_dtype=fp32)``, the recipe's micro-batch; with activation checkpointing (the recipe's
   setting) and without; then two micro-batches per optimizer step, with a reduce-scatter after
   each or with the first one unsynchronised (``set_requires_gradient_sync(False)``). Per rank.
   Per-block constants come from reduced-depth runs (2x2, 3x2, 2x3 double x single blocks), so
   the full-size run also checks the per-block model.
2. ``flux_lora_*``: FLUX.1-dev, LoRA rank 64 on the attention projections (flowrl's ``ATTENTION``
   preset), bf16 frozen base, LoRA matrices in fp32 (as flowrl keeps them), one process. The
   plain ``MemTracker`` costs O(ops x modules) and is too slow on the full model, so it runs at
   reduced depth and is extrapolated per block to 19 + 38 blocks,
   ``A(depth) = A0 + sum_k depth_k a_k``; one deeper run (4x4) checks the fit.
3. ``qwen_lora_*``: Qwen-Image (60 dual-stream blocks) the same way (2 and 3 blocks, checked
   at 5), LoRA rank 64, micro-batch 1; its rollout row uses a group of 8.
4. ``klein_qlora_*``: FLUX.2 [klein] 4B, LoRA rank 64 over a frozen base quantised to NF4 with
   bitsandbytes: the quantised bytes are read off the tensors bitsandbytes' own
   ``quantize_4bit`` returns (packed 4-bit weights, absmax per block of 64, quantisation map).
   The tracked runs use bitsandbytes' ``Linear4bit`` layers (as diffusers' ``BitsAndBytesConfig``
   loads them) with fake packed weights (bitsandbytes registers fake kernels for its ops).
6. ``wan_lora_*`` and ``wan22_lora_*`` (``--items``, added to a saved result): Wan 2.1 T2V 1.3B
   and Wan 2.2 TI2V-5B (30 blocks each; the 5B with a timestep per video token, as its pipeline
   passes them, and one clip of ``recipes/wan22_5b_lora.toml``: 1280 x 704, 49 frames =
   13 x 22 x 40 = 11440 video tokens); ``ltx_lora_*``: LTX-Video 2B (28 blocks), one clip of
   ``recipes/ltx_lora.toml`` (704 x 480, 121 frames = 16 x 15 x 22 = 5280 packed tokens, 128 text
   tokens with their mask). Wan 2.1: LoRA rank
   64 on the attention projections, a bf16 base, micro-batch 1, one clip of the shipped recipe
   (``recipes/wan21_1p3b_lora.toml``: 832 x 480, 33 frames = 9 x 30 x 52 = 14040 video tokens,
   512 text tokens as cross-attention keys), one forward (no CFG pair), the same way as 2-3.
5. ``*_rollout_*``: a no-grad bf16 forward (the rollout), with LoRA attached and (FLUX.1) without:
   the peak of live activations, against the plan's constant of 12 widths per token.

For every configuration it prints, side by side: what ``flowrl plan`` says (its Python API,
``flowrl.commands.plan.estimate``, on the shipped flagship recipe at 512 x 512 with matching
overrides), what the tracker measured, and what a plan SHOULD say (closed forms from exact
parameter counts and per-block constants: :func:`should_fsdp`, :func:`should_lora`), each with
its relative difference to the tracker. ``--json PATH`` writes every number.

Rows (GiB per process): ``params``, ``grads`` (for FSDP: the shards), ``optimizer`` (AdamW
state after the step), ``opt_step_temp`` (what the foreach step holds on top: a copy of
sqrt(v)), ``activations`` (tensors made in forward and in the recompute of checkpointed
blocks), ``temporaries`` (backward: activation gradients, gradients not yet reduced),
``gathered`` and ``reduce_scatter`` (FSDP's all-gather buffers and unsharded parameters; its
reduce-scatter inputs and unsharded gradients), each the MAXIMUM over the step; ``peak`` is the
largest total at any moment (not the sum of the maxima). The plan's ``peak`` here is its
training-step part only (denoiser weights, gradients, AdamW state, update activations): its
CUDA overhead, trajectories, caches and rewards are outside what the tracker sees. Figures are
tensor bytes, a lower bound on a GPU's ``max_memory_allocated``: no CUDA context, cuBLAS
workspace, NCCL buffers or allocator fragmentation. Python's cyclic garbage collector is paused
during each tracked step, so that results do not depend on when it runs (:func:`_no_cyclic_gc`).

Needs the ``dev`` install plus bitsandbytes for the NF4 rows (skipped, with a message, without
it): ``.venv/bin/pip install -c constraints/cpu.txt bitsandbytes``. Run (one thread; 8 minutes of
wall time on 2 quiet cores, 20 on busy ones)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory_plan.py --json benchmarks/results/memory_plan.json
"""

from __future__ import annotations

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
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from flowrl.compat import ensure_torchvision_importable  # noqa: E402

ensure_torchvision_importable()  # diffusers imports transformers, which imports torchvision

from flowrl_plugins.diffusers_models.memory import flux as flux_memory  # noqa: E402
from flowrl_plugins.diffusers_models.memory import flux2 as flux2_memory  # noqa: E402
from flowrl_plugins.diffusers_models.memory import ltx as ltx_memory  # noqa: E402
from flowrl_plugins.diffusers_models.memory import qwen_image as qwen_image_memory  # noqa: E402
from flowrl_plugins.diffusers_models.memory import wan as wan_memory  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GiB = 1024**3

# ------------------------------------------------------------------------------ published configs
# The ``transformer/config.json`` of each hub repository: flowrl plan's own copies, each beside its
# adapter's memory facts (plugins/diffusers_models/memory/), as constructor keyword arguments.


def _constructor_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """A config of ``flowrl_plugins.diffusers_models.memory`` without its ``_class`` key."""
    return {k: v for k, v in config.items() if not k.startswith("_")}


#: black-forest-labs/FLUX.1-dev (11.9e9 parameters)
FLUX1_DEV = _constructor_kwargs(flux_memory.FLUX1_DEV)
#: Qwen/Qwen-Image (20.4e9 parameters)
QWEN_IMAGE = _constructor_kwargs(qwen_image_memory.QWEN_IMAGE)
#: black-forest-labs/FLUX.2-klein-4B (text encoder Qwen3-4B: joint_attention_dim = 3 layers x 2560)
FLUX2_KLEIN_4B = _constructor_kwargs(flux2_memory.FLUX2_KLEIN_4B)

#: Wan-AI/Wan2.1-T2V-1.3B-Diffusers (1.42e9 parameters)
WAN21_1P3B = _constructor_kwargs(wan_memory.WAN21_1P3B)
#: Wan latents of one clip of recipes/wan21_1p3b_lora.toml: 33 frames -> 9 latent frames, 480 x 832 / 8
WAN_LATENT = (9, 60, 104)
WAN_TOKENS = WAN_LATENT[0] * (WAN_LATENT[1] // 2) * (WAN_LATENT[2] // 2)  # patch (1, 2, 2): 14040
#: Wan-AI/Wan2.2-TI2V-5B-Diffusers (5.00e9 parameters)
WAN22_5B = _constructor_kwargs(wan_memory.WAN22_5B)
#: Wan 2.2 latents of one clip of recipes/wan22_5b_lora.toml: 49 frames -> 13 latent frames, 704 x 1280 / 16
WAN22_LATENT = (13, 44, 80)
WAN22_TOKENS = WAN22_LATENT[0] * (WAN22_LATENT[1] // 2) * (WAN22_LATENT[2] // 2)  # patch (1, 2, 2): 11440
#: Lightricks/LTX-Video (0.9.x, 2B; diffusers' LTXVideoTransformer3DModel defaults, 1.923e9 parameters)
LTX_2B = _constructor_kwargs(ltx_memory.LTX_2B)
#: LTX token grid of one clip of recipes/ltx_lora.toml: 121 frames -> 16 latent frames, 480 x 704 / 32
LTX_GRID = (16, 15, 22)
LTX_TOKENS = LTX_GRID[0] * LTX_GRID[1] * LTX_GRID[2]  # 5280
LTX_TEXT_TOKENS = 128  # the recipe's (and LTXPipeline's) max_sequence_length

IMAGE_TOKENS = 1024  # 512 x 512: VAE factor 8, then 2 x 2 patches
TEXT_TOKENS = 512  # max_sequence_length of all three pipelines (an upper bound for Qwen-Image)
LORA_RANK = 64
LORA_ALPHA = 128


@dataclasses.dataclass(frozen=True)
class Family:
    """How to build, feed and LoRA-target one diffusers transformer class."""

    name: str
    cls_name: str
    config: dict[str, Any]
    depth_keys: tuple[str, ...]  # config keys of the block counts
    block_attrs: tuple[str, ...]  # module attributes holding the block lists, same order
    kinds: tuple[str, ...]  # a name per block kind, same order
    latent: tuple[int, int, int] | None = None  # video latents (F_lat, H, W) of the tracked clip (Wan)
    per_token_timesteps: bool = False  # Wan 2.2 TI2V: a timestep per video token, as its pipeline passes them

    def depth(self) -> tuple[int, ...]:
        return tuple(int(self.config[k]) for k in self.depth_keys)

    def build(self, depth: tuple[int, ...] | None = None, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        """The model on the ``meta`` device (no memory), cast to ``dtype`` (outside any fake mode)."""
        import diffusers

        cfg = dict(self.config)
        if depth is not None:
            cfg.update(dict(zip(self.depth_keys, depth)))
        with torch.device("meta"):
            model = getattr(diffusers, self.cls_name)(**cfg)
        model.to(dtype)
        if self.name == "qwen_image":
            # QwenEmbedRope precomputes its frequency tables as plain attributes (not buffers), so
            # the meta build leaves them without data: rebuild that one small module for real.
            from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

            model.pos_embed = QwenEmbedRope(theta=10000, axes_dim=list(cfg["axes_dims_rope"]), scale_rope=True)
        return model

    def blocks(self, model) -> list[torch.nn.Module]:
        return [b for attr in self.block_attrs for b in getattr(model, attr)]

    def inputs(self, batch: int, img: int, txt: int, dtype: torch.dtype) -> dict[str, Any]:
        """Call inside the fake mode: keyword arguments of one forward."""
        c = self.config
        if self.latent is not None:  # Wan video latents [B, C, F_lat, h, w]; the text is cross-attention only
            f, h, w = self.latent
            assert img == f * (h // 2) * (w // 2), f"Wan runs its recipe's clip ({f * (h // 2) * (w // 2)} tokens), not {img}"
            shape = (batch, img) if self.per_token_timesteps else (batch,)
            return {"hidden_states": torch.randn(batch, c["in_channels"], f, h, w, dtype=dtype),
                    "encoder_hidden_states": torch.randn(batch, txt, c["text_dim"], dtype=dtype),
                    "timestep": torch.full(shape, 500.0, dtype=dtype), "return_dict": False}
        if self.name == "ltx":  # packed video tokens; the text is cross-attention only, with its mask
            f, h, w = LTX_GRID
            assert img == f * h * w, f"LTX runs its recipe's clip ({LTX_TOKENS} tokens), not {img}"
            return {"hidden_states": torch.randn(batch, img, c["in_channels"], dtype=dtype),
                    "encoder_hidden_states": torch.randn(batch, txt, c["caption_channels"], dtype=dtype),
                    "encoder_attention_mask": torch.ones(batch, txt, dtype=torch.bool),
                    "timestep": torch.full((batch,), 500.0, dtype=dtype), "num_frames": f, "height": h, "width": w,
                    "rope_interpolation_scale": (8 / 25, 32, 32), "return_dict": False}
        kw: dict[str, Any] = {
            "hidden_states": torch.randn(batch, img, c["in_channels"], dtype=dtype),
            "encoder_hidden_states": torch.randn(batch, txt, c["joint_attention_dim"], dtype=dtype),
            "timestep": torch.full((batch,), 0.5, dtype=dtype),
            "return_dict": False,
        }
        if self.name == "flux1":
            kw.update(pooled_projections=torch.randn(batch, c["pooled_projection_dim"], dtype=dtype),
                      img_ids=torch.zeros(img, 3), txt_ids=torch.zeros(txt, 3))
            if c["guidance_embeds"]:
                kw["guidance"] = torch.full((batch,), 3.5, dtype=dtype)
        elif self.name == "qwen_image":
            side = int(math.isqrt(img))
            kw.update(img_shapes=[[(1, side, side)]] * batch)
        elif self.name == "flux2_klein":
            kw.update(img_ids=torch.zeros(img, 4), txt_ids=torch.zeros(txt, 4))
        return kw


FLUX1 = Family("flux1", "FluxTransformer2DModel", FLUX1_DEV, ("num_layers", "num_single_layers"),
               ("transformer_blocks", "single_transformer_blocks"), ("double", "single"))
QWEN = Family("qwen_image", "QwenImageTransformer2DModel", QWEN_IMAGE, ("num_layers",), ("transformer_blocks",),
              ("block",))
KLEIN = Family("flux2_klein", "Flux2Transformer2DModel", FLUX2_KLEIN_4B, ("num_layers", "num_single_layers"),
               ("transformer_blocks", "single_transformer_blocks"), ("double", "single"))
WAN = Family("wan21", "WanTransformer3DModel", WAN21_1P3B, ("num_layers",), ("blocks",), ("block",), WAN_LATENT)
LTX = Family("ltx", "LTXVideoTransformer3DModel", LTX_2B, ("num_layers",), ("transformer_blocks",), ("block",))
WAN22 = Family("wan22", "WanTransformer3DModel", WAN22_5B, ("num_layers",), ("blocks",), ("block",), WAN22_LATENT,
               per_token_timesteps=True)


def lora_targets(family: Family) -> list[str]:
    """flowrl's ``ATTENTION`` preset; klein's single blocks fuse q, k, v (and the MLP input) into
    ``to_qkv_mlp_proj`` and name their output ``attn.to_out`` (no ``.0``), which the preset does
    not match, so they are added for klein."""
    from flowrl_plugins.diffusers_models.common import ATTENTION
    from flowrl_plugins.diffusers_models.wan import WAN_ATTENTION

    if family.latent is not None or family.name == "ltx":  # Wan, LTX: to_q, to_k, to_v, to_out.0 of attn1 / attn2
        return list(WAN_ATTENTION)
    targets = list(ATTENTION)
    if family.name == "flux2_klein":
        targets += ["to_qkv_mlp_proj", r"single_transformer_blocks.\d+.attn.to_out"]
    return targets


def _peft_targets(targets: list[str]):
    """peft takes a list of suffixes or one regular expression; klein's extra entry is a regex."""
    if not any("\\" in t for t in targets):
        return targets
    import re

    parts = [re.escape(t) if "\\" not in t else t for t in targets]
    return r"(.*\.)?(" + "|".join(parts) + r")$"


# ------------------------------------------------------------------------------ trackers


def _category_name(key) -> str:
    return str(getattr(key, "value", key))


class _CategoryPeaks:
    """Mixin: besides the tracker's peak (the breakdown at the moment of the largest total), keep
    the maximum over the run of each category and of each group of categories in ``groups``.

    FSDPMemTracker labels a tensor by the phase that creates it and relabels FSDP's own tensors
    only when its hook returns: while FSDP unshards (pre-forward, pre-backward) the gathered
    parameters count as activations or temporaries, and while it reduces (post-backward) the new
    gradient shards count as temporaries. Activation and temporary maxima therefore skip those
    three phases (their tensors are counted once relabelled; the total is never affected)."""

    groups: dict[str, tuple[str, ...]] = {}
    _UNSETTLED = ("PRE_FW", "PRE_BW", "POST_BW")
    _PHASE_LABELS = ("Activation", "Temp")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.category_peaks: dict[str, int] = {}
        self.group_peaks: dict[str, int] = {}

    def _update_peak_stats(self, peak_state) -> None:
        super()._update_peak_stats(peak_state)
        state = getattr(getattr(self, "_fsdp_state", None), "name", None)
        settled = state not in self._UNSETTLED
        for snap in self._curr_mem_snap.values():
            named = {_category_name(k): v for k, v in snap.items()}
            for name, value in named.items():
                if (settled or name not in self._PHASE_LABELS) and value > self.category_peaks.get(name, 0):
                    self.category_peaks[name] = value
            for group, keys in self.groups.items():
                if not settled and any(k in self._PHASE_LABELS for k in keys):
                    continue
                value = sum(named.get(k, 0) for k in keys)
                if value > self.group_peaks.get(group, 0):
                    self.group_peaks[group] = value

    def reset_peaks(self) -> None:
        """Forget every peak so far (the tracker's own too): the next ones start from now."""
        from copy import deepcopy

        self.category_peaks, self.group_peaks = {}, {}
        self._peak_mem_snap = deepcopy(self._curr_mem_snap)
        self._peak_mem = {dev: snap.get("Total", 0) for dev, snap in self._curr_mem_snap.items()}


def _fsdp_tracker_class():
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    class Tracker(_CategoryPeaks, FSDPMemTracker):
        groups = FSDP_CATEGORIES

    return Tracker


def _lora_tracker_class():
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    class Tracker(_CategoryPeaks, MemTracker):
        groups = PLAIN_CATEGORIES
        """MemTracker registers a gradient hook on every parameter it meets, which raises on a
        frozen one: hooks go on trainable parameters only (frozen ones are still counted)."""

        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
            sizes = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
            if install_grad_hooks:
                for p in module.parameters():
                    if p.requires_grad and self._param_to_grad_hook_handles.get(p, None) is None:
                        def hook(grad, _self=self):
                            _self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

                        self._param_to_grad_hook_handles[p] = (
                            p.register_hook(hook), p.register_post_accumulate_grad_hook(lambda q, h=hook: h(q.grad)),
                        )
            return sizes

    return Tracker


#: the benchmark's categories -> the tracker's (summed at each moment; the maximum over the step)
FSDP_CATEGORIES = {
    "params": ("Sharded Param", "Buffer"),  # the fp32 master shards
    "grads": ("Sharded Grad",),  # fp32 gradient shards
    "optimizer_max": ("OptState",),  # AdamW state, plus the step's own temporaries
    "activations": ("Activation",),
    "temporaries": ("Temp",),
    "gathered": ("Unsharded Param", "All Gather"),  # bf16 all-gather buffers and unsharded parameters
    "reduce_scatter": ("Unsharded Grad", "Reduce Scatter"),  # bf16 unsharded grads, fp32 reduce-scatter input
    "inputs": ("Inputs",),
}
PLAIN_CATEGORIES = {
    "params": ("Parameter", "Buffer"),
    "grads": ("Gradient",),
    "optimizer_max": ("Optstate",),
    "activations": ("Activation",),
    "temporaries": ("Temp",),
    "inputs": ("Other",),
}


def _summarise(tracker) -> dict[str, Any]:
    """The maxima by category, the peak total and its breakdown; ``optimizer`` is the AdamW state
    after the step and ``opt_step_temp`` what the step itself held on top of it."""
    peak_snap = {_category_name(k): v for snap in tracker.get_tracker_snapshot("peak").values() for k, v in snap.items()}
    now = {_category_name(k): v for snap in tracker.get_tracker_snapshot("current").values() for k, v in snap.items()}
    out: dict[str, Any] = dict(tracker.group_peaks)
    state = now.get("OptState", now.get("Optstate", 0))
    out.update(optimizer=state, opt_step_temp=out.get("optimizer_max", 0) - state, peak=peak_snap.get("Total", 0),
               raw_max=dict(tracker.category_peaks), at_peak=peak_snap)
    return out


# ------------------------------------------------------------------------------ process group


@contextlib.contextmanager
def fake_process_group(world_size: int):
    """A fake process group of ``world_size`` ranks in this one process (rank 0), and its mesh."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised; the benchmark needs its own fake one")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        # The fake device must be "cpu": fully_shard asks CUDA for its device otherwise, and the
        # mesh is made outside FakeTensorMode (inside it, .tolist() fails).
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def _quiet():
    from diffusers.utils import logging as diffusers_logging

    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    diffusers_logging.set_verbosity_error()  # "modules ... should be kept in float32: []" on every cast


@contextlib.contextmanager
def _no_cyclic_gc():
    """Pause Python's cyclic garbage collector: a tensor that only a reference cycle holds is
    freed whenever the collector happens to run, which made repeated runs differ by tens of MB
    (Qwen-Image; FLUX has no such tensors). Paused, such tensors count until the step ends:
    deterministic, and an upper bound."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _step(model, inputs, optimizer, tracker, *, iterations: int = 2, accumulate: int = 1,
          sync_each: bool = True, grad: bool = True, reference=None) -> None:
    """``iterations`` optimizer steps of ``accumulate`` forward + backward each (FSDP2 without a
    gradient sync on all but the last when ``sync_each`` is false); or one no-grad forward.
    ``reference``: a frozen copy run without grad before each forward (a KL term's reference)."""
    with _no_cyclic_gc(), tracker:
        if not grad:
            with torch.no_grad():
                model(**inputs)
            return
        for i in range(iterations):
            for micro in range(accumulate):
                if micro:
                    tracker.reset_mod_stats()  # the tracker refuses a second forward of the root otherwise
                if not sync_each:
                    model.set_requires_gradient_sync(micro == accumulate - 1)
                if reference is not None:
                    with torch.no_grad():
                        reference(**inputs)
                out = model(**inputs)[0]
                out.float().square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if i == 0 and iterations > 1:
                # The first iteration creates the optimizer state and fills process-wide caches
                # (DTensor sharding propagation runs once per op and shape, and some of its fake
                # tensors get counted): measure the second one.
                tracker.reset_mod_stats()
                tracker.reset_peaks()


# ------------------------------------------------------------------------------ measurements


def track_fsdp(family: Family, world_size: int, *, depth: tuple[int, ...] | None = None, batch: int = 1,
               img: int = IMAGE_TOKENS, txt: int = TEXT_TOKENS, checkpointing: bool = True,
               accumulate: int = 1, sync_each: bool = True, iterations: int = 2,
               reference: bool = False) -> dict[str, Any]:
    """Full fine-tuning under FSDP2 at ``world_size`` (a fake process group): fp32 master weights,
    bf16 compute, ``fully_shard`` per block and at the root, AdamW. Bytes per rank by category,
    the peak, and proof of sharding (every parameter a ``DTensor`` with ``Shard(0)``).
    ``reference``: a KL term's frozen copy as the diffusers adapters take it (flowrl's own
    :func:`flowrl.objectives.kl.frozen_copy` of the float32 model into the bf16 compute dtype,
    ``DiffusersAdapter.snapshot_reference``), before the model is sharded, then sharded like the
    model (as flowrl's ``Strategy.prepare_frozen`` does) and run without grad before each forward."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor, Shard

    from flowrl.objectives.kl import frozen_copy

    _quiet()
    model = family.build(depth, torch.float32)  # cast outside the fake mode (inside, .to() fails)
    full_param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    n_params = sum(p.numel() for p in model.parameters())
    blocks = family.blocks(model)
    block_params = [sum(p.numel() for p in b.parameters()) for b in blocks]
    if checkpointing:
        model.enable_gradient_checkpointing()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ref = frozen_copy(model, torch.bfloat16) if reference else None  # taken before sharding, as flowrl does
    t0 = time.process_time()
    with fake_process_group(world_size) as mesh, FakeTensorMode(allow_non_fake_inputs=True):
        for b in blocks:
            fully_shard(b, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        model.to_empty(device="cpu")
        if ref is not None:
            for b in family.blocks(ref):
                fully_shard(b, mesh=mesh, mp_policy=mp)
            fully_shard(ref, mesh=mesh, mp_policy=mp)
            ref.to_empty(device="cpu")
        params = list(model.parameters())
        sharded = all(isinstance(p, DTensor) and tuple(p.placements) == (Shard(0),) for p in params)
        local_bytes = sum(p.to_local().numel() * p.element_size() for p in params if isinstance(p, DTensor))
        optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=1e-4, foreach=True)  # a GPU's default
        inputs = family.inputs(batch, img, txt, torch.float32)
        tracker = _fsdp_tracker_class()(model, optimizer)
        tracker.track_inputs(tuple(v for v in inputs.values() if torch.is_tensor(v)))
        if ref is not None:
            tracker.track_external(ref)
            local = [p.to_local() if isinstance(p, DTensor) else p for p in ref.parameters()]
            ref_bytes, ref_sharded = sum(t.numel() * t.element_size() for t in local), all(
                isinstance(p, DTensor) for p in ref.parameters())
        _step(model, inputs, optimizer, tracker, iterations=iterations, accumulate=accumulate, sync_each=sync_each,
              reference=ref)
        result = _summarise(tracker)
        if ref is not None:
            # before the step; after a forward FSDP2's root keeps its own parameters gathered (bf16)
            result["reference_bytes"], result["reference_sharded"] = ref_bytes, ref_sharded
    result.update(with_reference=reference, 
        world_size=world_size, depth=list(depth or family.depth()), batch=batch, tokens=img + txt,
        checkpointing=checkpointing, accumulate=accumulate, sync_each=sync_each, n_params=n_params,
        full_param_bytes=full_param_bytes, local_param_bytes=local_bytes, all_dtensor_shard0=sharded,
        largest_block_params=max(block_params), root_params=n_params - sum(block_params),
        cpu_seconds=round(time.process_time() - t0, 1),
    )
    return result


def track_startup(family: Family, world_size: int, *, depth: tuple[int, ...] | None = None,
                  reference: bool = False) -> dict[str, Any]:
    """The device memory of FSDP2's start-up as flowrl places the denoiser (shard before moving,
    ``flowrl.train.parallel.Strategy._fully_shard``): each block arrives whole on the device
    (materialised from ``meta`` by flowrl's own :func:`flowrl.train.parallel.materialise_meta`, as on
    a process that receives rank 0's weights) and is sharded, then the root's own parameters; with
    ``reference``, the KL reference's copy after it, the same way (taken before any sharding
    by :func:`flowrl.objectives.kl.frozen_copy` in the bf16 compute dtype, as the diffusers
    adapters keep it). torch's ``MemTracker`` counts
    every byte allocated on the (fake) device; the peak is the start-up transient the plan's
    ``start-up`` line and :func:`flowrl.memory_plan.startup_peak` estimate."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from flowrl.objectives.kl import frozen_copy
    from flowrl.train.parallel import materialise_meta

    _quiet()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    models = [family.build(depth, torch.float32)]
    if reference:  # the reference's copy, taken before the denoiser is placed
        models.append(frozen_copy(models[0], torch.bfloat16))
    t0 = time.process_time()
    with fake_process_group(world_size) as mesh, FakeTensorMode(allow_non_fake_inputs=True):
        tracker = MemTracker()
        with _no_cyclic_gc(), tracker:
            for model in models:
                for b in family.blocks(model):
                    materialise_meta(b, torch.device("cpu"))  # the block arrives on the device, whole
                    fully_shard(b, mesh=mesh, mp_policy=mp)
                materialise_meta(model, torch.device("cpu"))  # the root's own parameters and buffers arrive
                fully_shard(model, mesh=mesh, mp_policy=mp)
            peak_snap = {_category_name(k): v for snap in tracker.get_tracker_snapshot("peak").values()
                         for k, v in snap.items()}
            now = {_category_name(k): v for snap in tracker.get_tracker_snapshot("current").values()
                   for k, v in snap.items()}
        # the reference's shards on this rank, as placed (every parameter a DTensor by now)
        ref_bytes = sum(p.to_local().numel() * p.element_size() for p in models[1].parameters()) if reference else None
    blocks = family.blocks(models[0])
    block_params = [sum(p.numel() for p in b.parameters()) for b in blocks]
    return {"peak": peak_snap.get("Total", 0), "after": now.get("Total", 0), "reference": reference,
            "reference_bytes": ref_bytes, "largest_block_params": max(block_params), "world_size": world_size,
            "cpu_seconds": round(time.process_time() - t0, 1)}


def _replace_nf4(model: torch.nn.Module) -> torch.nn.Module:
    """Every ``nn.Linear`` of a meta-built model becomes bitsandbytes' ``Linear4bit``, as diffusers'
    ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
    bnb_4bit_compute_dtype=bf16)`` loads it (no double quantisation, blocksize 64)."""
    from diffusers import BitsAndBytesConfig
    from diffusers.quantizers.bitsandbytes.utils import replace_with_bnb_linear

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    return replace_with_bnb_linear(model, modules_to_not_convert=[], quantization_config=config)


def _materialise_nf4(model: torch.nn.Module) -> torch.nn.Module:
    """Call inside ``FakeTensorMode`` on a meta model from :func:`_replace_nf4`: each ``Linear4bit``
    gets the packed weight and statistics that bitsandbytes' own ``quantize_4bit`` makes (fake
    tensors: bitsandbytes registers fake kernels for its ops), the other parameters (LoRA
    included) fake tensors of their dtype. ``Params4bit`` cannot wrap a fake tensor, so the weight is a plain parameter that
    carries Params4bit's attributes (what ``Linear4bit.forward`` and peft read). A REAL packed
    weight would not do: each op would copy it into a new fake tensor, counted again."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbF

    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            w = torch.empty(m.out_features, m.in_features, dtype=torch.bfloat16)
            packed, state = bnbF.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False,
                                               quant_storage=torch.uint8)
            weight = torch.nn.Parameter(packed, requires_grad=False)
            for name, value in {"quant_state": state, "blocksize": 64, "compress_statistics": False, "quant_type": "nf4",
                                "quant_storage": torch.uint8, "bnb_quantized": True, "module": m}.items():
                setattr(weight, name, value)
            m.weight = weight
    for mod in model.modules():
        for name, t in list(mod._parameters.items()):
            if t is not None and t.is_meta:
                mod._parameters[name] = torch.nn.Parameter(torch.ones(t.shape, dtype=t.dtype), requires_grad=t.requires_grad)
        for name, t in list(mod._buffers.items()):
            if t is not None and t.is_meta:
                mod._buffers[name] = torch.zeros(t.shape, dtype=t.dtype)
    return model


def _lora_model(family: Family, depth: tuple[int, ...] | None, checkpointing: bool = False, lora: bool = True,
                quant: str | None = None):
    """On the meta device: the base in bf16 (``quant="nf4"``: its Linear layers swapped for 4-bit
    ones, :func:`_replace_nf4`), frozen, and a rank-64 LoRA in fp32 (flowrl's
    ``prepare_trainable`` does the same)."""
    from peft import LoraConfig

    model = family.build(depth, torch.bfloat16)
    if quant == "nf4":
        model = _replace_nf4(model)
    elif quant is not None:
        raise ValueError(f"unknown quantisation {quant!r}")
    model.requires_grad_(False)
    if lora:
        targets = _peft_targets(lora_targets(family))
        model.add_adapter(LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=targets))
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    if checkpointing:
        model.enable_gradient_checkpointing()
    return model


def track_lora(family: Family, *, depth: tuple[int, ...], batch: int = 1, img: int = IMAGE_TOKENS,
               txt: int = TEXT_TOKENS, checkpointing: bool = True, iterations: int = 2,
               grad: bool = True, lora: bool = True, quant: str | None = None) -> dict[str, Any]:
    """LoRA on one process (plain ``MemTracker``), AdamW on the LoRA matrices; or, with
    ``grad=False``, one no-grad forward (with ``lora=False``: of the bare base model)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _quiet()
    t0 = time.process_time()
    # Built on meta outside the fake mode (inside, casting a meta model fails).
    model = _lora_model(family, depth, checkpointing, lora=lora, quant=quant)
    with FakeTensorMode(allow_non_fake_inputs=True):
        if quant is None:
            model.to_empty(device="cpu")
        else:
            _materialise_nf4(model)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=1e-4, foreach=True) if grad else None
        inputs = family.inputs(batch, img, txt, torch.bfloat16)
        tracker = _lora_tracker_class()()
        tracker.track_external(model, *([optimizer] if optimizer else []),
                               *[v for v in inputs.values() if torch.is_tensor(v)])
        _step(model, inputs, optimizer, tracker, iterations=iterations, grad=grad)
        result = _summarise(tracker)
    result.update(depth=list(depth), batch=batch, tokens=img + txt, checkpointing=checkpointing, quant=quant,
                  trainable=trainable, cpu_seconds=round(time.process_time() - t0, 1))
    return result


KEYS = ("params", "grads", "optimizer", "opt_step_temp", "activations", "temporaries", "peak")
BASE_DEPTH = 2  # reduced-depth runs at 2 blocks of each kind and one more of each (1 block has edge effects)


def reduced_depths(family: Family) -> list[tuple[int, ...]]:
    base = tuple(BASE_DEPTH for _ in family.kinds)
    return [base] + [tuple(d + (j == i) for j, d in enumerate(base)) for i in range(len(base))]


def extrapolate(family: Family, runs: dict[tuple[int, ...], dict[str, Any]], keys=KEYS,
                at: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Fit ``A(depth) = A0 + sum_k depth_k a_k`` on the runs of :func:`reduced_depths` (one block
    of each kind added to the base) and evaluate it at ``at`` (default: the full depth)."""
    depths = reduced_depths(family)
    base = depths[0]
    at = at or family.depth()
    out: dict[str, Any] = {"per_block": {}, "outside": {}, "value": {}, "at": list(at)}
    for key in keys:
        per = {kind: runs[more][key] - runs[base][key] for kind, more in zip(family.kinds, depths[1:])}
        a0 = runs[base][key] - sum(per[k] * n for k, n in zip(family.kinds, base))
        out["per_block"][key], out["outside"][key] = per, a0
        out["value"][key] = a0 + sum(per[k] * n for k, n in zip(family.kinds, at))
    return out


_WARM: set[tuple[str, str | None]] = set()


def warm_up(family: Family, quant: str | None = None, tokens: tuple[int, int] = (IMAGE_TOKENS, TEXT_TOKENS)) -> None:
    """One throwaway run per model class: the first one in a process also counts tensors that
    process-wide caches keep (e.g. rotary tables), a few MB that would skew a per-block fit."""
    if (family.name, quant) not in _WARM:
        track_lora(family, depth=reduced_depths(family)[0], checkpointing=False, iterations=1, quant=quant,
                   img=tokens[0], txt=tokens[1])
        _WARM.add((family.name, quant))


def lora_item(family: Family, checkpointing: bool, validate_at: tuple[int, ...] | None,
              quant: str | None = None, tokens: tuple[int, int] = (IMAGE_TOKENS, TEXT_TOKENS)) -> dict[str, Any]:
    """Reduced-depth runs, the per-block fit, its check at a deeper model, and exact counts
    (``tokens``: image or video tokens, and text tokens, of one sample)."""
    warm_up(family, quant, tokens)
    img, txt = tokens
    runs = {d: track_lora(family, depth=d, checkpointing=checkpointing, quant=quant, img=img, txt=txt)
            for d in reduced_depths(family)}
    ext = extrapolate(family, runs)
    check = None
    if validate_at:
        measured = track_lora(family, depth=validate_at, checkpointing=checkpointing, quant=quant, img=img, txt=txt)
        predicted = extrapolate(family, runs, at=validate_at)["value"]
        check = {"depth": list(validate_at), "measured": {k: measured[k] for k in KEYS}, "predicted": predicted,
                 "cpu_seconds": measured["cpu_seconds"]}
    model = _lora_model(family, None)  # the full model on meta: exact counts
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    base = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return {
        "runs": {"x".join(map(str, d)): r for d, r in runs.items()}, "extrapolation": ext, "validation": check,
        "tracker": dict(ext["value"]), "trainable_params": trainable, "base_params": base,
        "checkpointing": checkpointing,
        "cpu_seconds": round(sum(r["cpu_seconds"] for r in runs.values()) + (check["cpu_seconds"] if check else 0), 1),
    }


def rollout_item(family: Family, batch: int, lora: bool = True, quant: str | None = None) -> dict[str, Any]:
    """One no-grad forward of ``batch`` samples (the rollout), bf16, with LoRA attached or not:
    the peak of live activations. It does not grow with depth (a block's tensors die in the
    next); two depths show it."""
    warm_up(family, quant)
    depths = reduced_depths(family)[:1] + [tuple(d + 1 for d in reduced_depths(family)[0])]
    runs = [track_lora(family, depth=d, batch=batch, checkpointing=False, grad=False, lora=lora, quant=quant)
            for d in depths]
    return {"batch": batch, "lora": lora, "quant": quant, "activations": max(r["activations"] for r in runs),
            "by_depth": {"x".join(map(str, d)): r["activations"] for d, r in zip(depths, runs)},
            "cpu_seconds": round(sum(r["cpu_seconds"] for r in runs), 1)}


# ------------------------------------------------------------------------------ NF4 storage


def nf4_weight_bytes(family: Family, double_quant: bool) -> dict[str, Any]:
    """Bytes of the transformer with every ``nn.Linear`` weight quantised as diffusers'
    ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`` does (bitsandbytes'
    ``quantize_4bit``: blocksize 64, uint8 storage), read off the tensors bitsandbytes returns for
    each distinct weight size; everything else (biases, norms) stays bf16."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbF

    model = family.build(None, torch.bfloat16)
    sizes: dict[int, int] = {}
    linear_ids = set()
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            sizes[m.weight.numel()] = sizes.get(m.weight.numel(), 0) + 1
            linear_ids.add(id(m.weight))
    other = sum(p.numel() * 2 for p in model.parameters() if id(p) not in linear_ids)
    per_size: dict[int, int] = {}
    packed_size: dict[int, int] = {}
    for numel in sorted(sizes):
        w = torch.ones(numel, 1, dtype=torch.bfloat16)
        packed, state = bnbF.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=double_quant,
                                           quant_storage=torch.uint8)
        tensors = [packed] + [v for v in state.as_dict(packed=True).values() if torch.is_tensor(v)]
        per_size[numel] = sum(t.numel() * t.element_size() for t in tensors)
        packed_size[numel] = packed.numel() * packed.element_size()
        del w, packed, state
    linear_bytes = sum(per_size[n] * c for n, c in sizes.items())
    n_linear = sum(n * c for n, c in sizes.items())
    return {
        "bitsandbytes": bnb.__version__, "double_quant": double_quant, "linear_params": n_linear,
        "linear_bytes": linear_bytes, "bits_per_linear_param": 8 * linear_bytes / n_linear,
        "packed_bytes": sum(packed_size[n] * c for n, c in sizes.items()),
        "state_bytes": linear_bytes - sum(packed_size[n] * c for n, c in sizes.items()),
        "other_bf16_bytes": other, "total_bytes": linear_bytes + other, "largest_linear": max(sizes),
    }


# ------------------------------------------------------------------------------ flowrl plan


def plan_numbers(overrides: list[str], world_size: int, recipe_name: str = "chunk_grpo_flux.toml") -> dict[str, Any]:
    """What ``flowrl plan`` says for the flagship recipe with ``overrides`` (its Python API),
    in the tracker's categories."""
    from flowrl.memory_plan import Line, estimate, peak, saved_widths
    from flowrl.plugins import get_registry
    from flowrl.recipe import load_recipe

    registry = get_registry()
    recipe = load_recipe(REPO / "recipes" / recipe_name, overrides, registry=registry)
    geometry, mm, lines = estimate(recipe, registry, world_size)
    by = {line.item: line.bytes for line in lines}
    adam = next(k for k in by if k.startswith("AdamW state"))
    out = {
        "params": by["denoiser weights"] + by.get("LoRA weights", 0.0),
        "grads": by.get("gradients", by.get("gradients (sharded)", 0.0)),
        "optimizer": by[adam],
        "opt_step_temp": by.get("AdamW step temporary", 0.0),
        "activations": by["activations, forward with grad"],
        "gathered": by.get("FSDP2 gathered parameters"),
        "reduce_scatter": by.get("FSDP2 reduce-scatter buffers"),
        # the tracker files FSDP2's unsharded accumulated gradients under temporaries
        "temporaries": (by.get("temporaries", 0.0) + by.get("gradients (unsharded, accumulating)", 0.0)) or None,
        "reference": by.get("reference copy (KL)"),
        "rollout_activations": by["activations, no grad"],
        "rollout_samples": geometry.samples_per_process,
        "micro_batch": recipe.train.micro_batch_size,
        "tokens": mm.tokens, "width": mm.width,
        **dict(zip(("per_block_widths", "outside_widths"), saved_widths(recipe, mm))),  # the ones this plan used
        "overrides": overrides,
    }
    # The training step as the plan models it: the denoiser's state and the update and step
    # phases, without what the tracker does not see (CUDA overhead, trajectories, caches, rewards).
    denoiser = {"denoiser weights", "LoRA weights", "gradients", "gradients (sharded)", "gradients (sharded, accumulating)",
                "reference copy (KL)", adam, "AdamW step temporary",
                "activations, forward with grad", "FSDP2 gathered parameters", "FSDP2 reduce-scatter buffers",
                "temporaries", "gradients (unsharded, accumulating)"}
    out["peak"], _ = peak([line for line in lines if line.item in denoiser and line.phase in ("persistent", "update", "step")]
                          or [Line("persistent", "none", 0.0)])
    # start-up (flowrl.memory_plan.startup_peak) without what the tracker does not see: the CUDA
    # context and the encoders (offloaded by the flagship anyway)
    out["startup"] = sum(by.get(k, 0.0) for k in ("denoiser weights", "LoRA weights", "reference copy (KL)",
                                                  "one block placed whole while sharding"))
    out["startup_block"] = by.get("one block placed whole while sharding")
    return out


PLAN_512 = ["model.height=512", "model.width=512"]
FSDP_OVERRIDES = ["distributed.strategy=fsdp2", "distributed.mixed_precision=bf16"]
# one process without FSDP, as the tracker's LoRA runs (the flagship recipe itself shards with fsdp2)
LORA_OVERRIDES = ["distributed.strategy=none", "train.finetune=lora", f"train.lora_rank={LORA_RANK}", f"train.lora_alpha={LORA_ALPHA}",
                  "model.denoiser_dtype=auto", "model.lora_preset=attention"]


# ------------------------------------------------------------------------------ what a plan should say


def _activations(tw: float, depth: dict[str, int], widths: dict[str, float], outside: float, checkpointing: bool) -> float:
    """Saved activations from per-block constants (bf16 elements per token per unit of width):
    checkpointed, one input per block plus the outside part, which then includes the recompute
    of one block; otherwise every block's constant."""
    if checkpointing:
        return tw * (sum(depth.values()) + outside)
    return tw * (sum(widths[k] * n for k, n in depth.items()) + outside)


def should_fsdp(r: dict[str, Any], consts: dict[str, Any], width: int) -> dict[str, float]:
    """Closed-form figures per rank for FSDP2 full fine-tuning (fp32 master, bf16 compute, fp32
    reduce), P parameters, N ranks, B the largest block's parameters, R the root's:

    - params    = 4 P / N                      fp32 master shards
    - grads     = 4 P / N                      fp32 gradient shards
    - optimizer = 8 P / N                      AdamW moments
    - opt_step_temp = 4 P / N                  foreach AdamW's sqrt(v) copy during the step
    - gathered  = 2 (R + 3 B)                  bf16: the root stays gathered, the current block's
                                               unsharded parameters, two all-gather buffers (prefetch)
    - reduce_scatter = 6 B                     fp32 reduce-scatter input of one block + the bf16
                                               unsharded gradients of the next
    - activations, temporaries: per-block constants (reduced-depth runs) x tokens x width x 2
    - accumulation without sync adds 4 P to the temporaries (fp32 unsharded gradients held
      between micro-batches: FSDP2 upcasts them to the reduce dtype)
    - peak = max(step: params + grads + optimizer + opt_step_temp,
                 backward: params + optimizer + activations + gathered + reduce_scatter + temporaries
                           (+ grads when earlier micro-batches were reduce-scattered))
    """
    n, p, big, root = r["world_size"], r["n_params"], r["largest_block_params"], r["root_params"]
    tw = r["batch"] * r["tokens"] * width * 2
    depth = dict(zip(consts["widths"], r["depth"]))
    out = {
        "params": 4 * p / n, "grads": 4 * p / n, "optimizer": 8 * p / n, "opt_step_temp": 4 * p / n,
        "gathered": 2 * (root + 3 * big), "reduce_scatter": 6 * big,
        "activations": _activations(tw, depth, consts["widths"], consts["outside"], r["checkpointing"]),
        "temporaries": 2 * big + tw * (consts["temp_outside"] + sum(consts["temp_widths"][k] * c for k, c in depth.items())),
        "unsynced_grads": 4 * p if (r["accumulate"] > 1 and not r["sync_each"]) else 0.0,
    }
    out["temporaries"] += out["unsynced_grads"]  # the tracker files them under temporaries
    step = out["params"] + out["grads"] + out["optimizer"] + out["opt_step_temp"]
    backward = (out["params"] + out["optimizer"] + out["activations"] + out["gathered"] + out["reduce_scatter"]
                + out["temporaries"] + (out["grads"] if r["accumulate"] > 1 and r["sync_each"] else 0.0))
    out["peak"] = max(step, backward)
    return out


def should_lora(base_params: int, base_bytes: float, trainable: int, *, tw: float, depth: dict[str, int],
                consts: dict[str, Any], checkpointing: bool, dequant: float = 0.0) -> dict[str, float]:
    """Closed-form one-process LoRA figures: base x its bytes + 4 x LoRA; gradients 4 x LoRA;
    AdamW 8 x LoRA (+ 4 x LoRA during a foreach step); activations and temporaries from
    per-block constants (bf16 elements per token per unit of width);
    peak = max(step, backward: params + optimizer + activations + temporaries + ``dequant``, the
    bf16 copy of the largest 4-bit weight that bitsandbytes' matmul makes inside its op)."""
    out = {"params": base_params * base_bytes + trainable * 4, "grads": trainable * 4.0,
           "optimizer": trainable * 8.0, "opt_step_temp": trainable * 4.0,
           "activations": _activations(tw, depth, consts["widths"], consts["outside"], checkpointing),
           "temporaries": tw * consts["temp_outside"]}
    step = out["params"] + out["grads"] + out["optimizer"] + out["opt_step_temp"]
    out["peak"] = max(step, out["params"] + out["optimizer"] + out["activations"] + out["temporaries"] + dequant)
    return out


def constants(ext: dict[str, Any], tw: float, *, temp_offset: float = 0.0, temp_fit: bool = True) -> dict[str, Any]:
    """Per-block constants in bf16 elements per token per unit of width from a reduced-depth fit:
    activations, and temporaries (less ``temp_offset`` bytes) either fitted per block too
    (``temp_fit``) or, where they do not grow with depth, the largest reduced-depth figure."""
    widths = {k: v / tw for k, v in ext["per_block"]["activations"].items()}
    out = {"widths": widths, "outside": ext["outside"]["activations"] / tw}
    if temp_fit:
        out["temp_widths"] = {k: v / tw for k, v in ext["per_block"]["temporaries"].items()}
        out["temp_outside"] = (ext["outside"]["temporaries"] - temp_offset) / tw
    else:
        out["temp_widths"] = {k: 0.0 for k in widths}
        out["temp_outside"] = (ext["max_temporaries"] - temp_offset) / tw
    return out


# ------------------------------------------------------------------------------ report


ROWS = ("params", "reference", "grads", "optimizer", "opt_step_temp", "activations", "temporaries", "gathered",
        "reduce_scatter", "unsynced_grads", "startup_block", "peak")


def rel(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return (a - b) / b


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / GiB:.2f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.0f}%"


def table_rows(item: dict[str, Any]) -> list[list[str]]:
    plan, tracker, should = item.get("plan") or {}, item["tracker"], item.get("should") or {}
    rows = []
    for k in ROWS:
        if k not in tracker and k not in plan and k not in should:
            continue
        p, t, s = plan.get(k), tracker.get(k), should.get(k)
        if k == "unsynced_grads" and not s:
            continue
        rows.append([k, _gib(p), _gib(t), _pct(rel(p, t)), _gib(s), _pct(rel(s, t))])
    return rows


def print_item(name: str, item: dict[str, Any]) -> None:
    print(f"\n== {name}: {item['title']}")
    head = ["GiB per process", "plan", "tracker", "plan vs trk", "should", "should vs trk"]
    rows = [head] + table_rows(item)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        print("   " + "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)))
    for note in item.get("notes", []):
        print(f"   - {note}")


def markdown(result: dict[str, Any]) -> str:
    """The results as Markdown tables (for notes and docs)."""
    lines = []
    for name, item in result["items"].items():
        if "tracker" not in item:
            continue
        lines += [f"**{name}**: {item['title']}", "",
                  "| GiB per process | plan | tracker | plan vs tracker | should | should vs tracker |",
                  "|---|---:|---:|---:|---:|---:|"]
        lines += ["| " + " | ".join(r) + " |" for r in table_rows(item)]
        lines += [""] + [f"- {n}" for n in item.get("notes", [])] + [""]
    return "\n".join(lines)


def _fsdp_item(key: str, title: str, small: dict, full: dict, plan: dict | None, width: int) -> dict[str, Any]:
    ext = extrapolate(FLUX1, small, keys=("activations", "temporaries"))
    tw = full["batch"] * full["tokens"] * width * 2
    consts = constants(ext, tw, temp_offset=2 * full["largest_block_params"])
    should = should_fsdp(full, consts, width)
    notes = [
        f"sharded: every parameter a DTensor with Shard(0): {full['all_dtensor_shard0']}; local parameter bytes "
        f"{full['local_param_bytes'] / GiB:.3f} GiB = full {full['full_param_bytes'] / GiB:.3f} GiB / "
        f"{full['full_param_bytes'] / full['local_param_bytes']:.3f}",
        "activation constants (bf16 elements per token per width, from depths "
        + ", ".join("x".join(map(str, d)) for d in small) + "): "
        + ", ".join(f"{k} {v:.2f}" for k, v in consts["widths"].items())
        + f", outside {consts['outside']:.2f}; temporaries: 2 x largest block + ("
        + " + ".join(f"{v:.2f} x {k}" for k, v in consts["temp_widths"].items()) + f" + {consts['temp_outside']:.2f}) widths"
        + (("; plan's per-block widths: " + ", ".join(f"{k} {v:.1f}" for k, v in plan["per_block_widths"].items()))
           if plan else ""),
        f"largest block {full['largest_block_params'] / 1e6:.1f}e6 parameters, root {full['root_params'] / 1e6:.1f}e6",
        f"tracker CPU time {full['cpu_seconds']} s (full size) + "
        f"{sum(r['cpu_seconds'] for r in small.values()):.0f} s (reduced depth)",
    ]
    if plan and full["accumulate"] == 1:
        notes.insert(1, "one backward per optimizer step, planned as gradient_sync = 'micro_batch' (the same "
                        "collectives); flowrl's update runs several backwards per step: with 'step' they accumulate "
                        "unsynchronised (the *_nosync row), with 'micro_batch' each reduce-scatters (the *_sync rows)")
    return {"title": title, "plan": plan, "tracker": full, "should": should, "constants": consts,
            "reduced_depth": {"x".join(map(str, d)): r for d, r in small.items()}, "notes": notes}


#: FSDP2 items beside the main ones (``--items`` runs a subset and adds it to a saved result): a
#: KL term's reference copy, the start-up, and the flagship's own 720 x 720 geometry with
#: gradients reduce-scattered after every backward (the 8 x 40 GB configuration).
KL_ITEMS = ("flux_full_fsdp8_ac_kl", "flux_full_fsdp8_startup_kl", "flux_full_fsdp8_720_ac_accum2_sync")
#: tokens of one 720 x 720 FLUX sample (45 x 45 latent patches) and its text
FLAGSHIP_TOKENS = (2025, 512)
#: Wan LoRA items (``--items``): checkpointing on (the recipes') and off; Wan 2.1 1.3B and Wan 2.2 TI2V-5B
WAN_ITEMS = ("wan_lora_ac", "wan_lora_noac", "wan22_lora_ac", "wan22_lora_noac", "ltx_lora_ac", "ltx_lora_noac")
ADDED_ITEMS = KL_ITEMS + WAN_ITEMS
#: item prefix -> (family, video and text tokens of its recipe's clip, title)
_WAN_KINDS = {"wan_lora": (WAN, (WAN_TOKENS, TEXT_TOKENS), "Wan 2.1 T2V 1.3B"),
              "wan22_lora": (WAN22, (WAN22_TOKENS, TEXT_TOKENS), "Wan 2.2 TI2V-5B (per-token timesteps)"),
              "ltx_lora": (LTX, (LTX_TOKENS, LTX_TEXT_TOKENS), "LTX-Video 2B")}


def run_wan_items(keys=WAN_ITEMS) -> dict[str, Any]:
    """Wan 2.1 T2V 1.3B or Wan 2.2 TI2V-5B, LoRA r64 on a bf16 base, one clip of the shipped recipe,
    one process: the reduced-depth runs (2 and 3 blocks) fitted per block and checked at 5, as the
    other LoRA items."""
    items: dict[str, Any] = {}
    for key in keys:
        family, (tokens, text), name = _WAN_KINDS[key.rsplit("_", 1)[0]]
        width = family.config["num_attention_heads"] * family.config["attention_head_dim"]
        tw = tokens * width * 2  # per video token: the text enters only as cross-attention keys
        ac = key.endswith("_ac")
        item = lora_item(family, ac, (5,), tokens=(tokens, text))
        ext = item["extrapolation"]
        ext["max_temporaries"] = max(r["temporaries"] for r in item["runs"].values())
        consts = constants(ext, tw, temp_fit=False)
        item["tracker"]["temporaries"] = ext["max_temporaries"]
        v = item["validation"]
        item["should"] = should_lora(item["base_params"], 2.0, item["trainable_params"], tw=tw,
                                     depth={"block": family.depth()[0]}, consts=consts, checkpointing=ac)
        item["plan"] = plan_for(key, item)
        item["constants"] = consts
        item["title"] = (f"{name} LoRA r64 (attention) on a bf16 base, one clip of {tokens} video + "
                         f"{text} text tokens, one process, checkpointing {'on' if ac else 'off'}")
        item["notes"] = [
            "activation constants (bf16 elements per video token per width): "
            + ", ".join(f"{k} {x:.2f}" for k, x in consts["widths"].items())
            + f", outside {consts['outside']:.2f}; temporaries {consts['temp_outside']:.2f} widths"
            + (("; the plan's: " + ", ".join(f"{k} {x:.1f}" for k, x in item["plan"]["per_block_widths"].items()))
               if item["plan"] else ""),
            f"trainable {item['trainable_params'] / 1e6:.1f}e6 (LoRA), base {item['base_params'] / 1e9:.3f}e9",
            f"check of the per-block fit at depth {'x'.join(map(str, v['depth']))}: " + ", ".join(
                f"{k} measured {v['measured'][k] / GiB:.3f} vs fit {v['predicted'][k] / GiB:.3f} GiB"
                for k in ("activations", "temporaries", "peak")),
            f"tracker CPU time {item['cpu_seconds']} s at reduced depth",
        ]
        items[key] = item
        print_item(key, item)
    return items


def run_kl_items(keys=KL_ITEMS) -> dict[str, Any]:
    """The flagship with ``loss.beta > 0`` at full size: one optimizer step with the sharded
    bf16 reference (the compute dtype, as the diffusers adapters keep it) run before each forward (steady state), and the start-up that places the
    denoiser and then the reference a block at a time (flowrl's shard-before-moving); and the
    flagship's geometry with ``gradient_sync = "micro_batch"``."""
    items: dict[str, Any] = {}
    width = FLUX1_DEV["num_attention_heads"] * FLUX1_DEV["attention_head_dim"]
    mb = plan_numbers(PLAN_512, 8)["micro_batch"]
    if "flux_full_fsdp8_720_ac_accum2_sync" in keys:
        img, txt = FLAGSHIP_TOKENS
        small = {d: track_fsdp(FLUX1, 8, depth=d, batch=mb, img=img, txt=txt) for d in reduced_depths(FLUX1)}
        full = track_fsdp(FLUX1, 8, batch=mb, img=img, txt=txt, accumulate=2, sync_each=True)
        title = (f"FLUX.1-dev full fine-tuning at the flagship's 720 x 720 ({img} + {txt} tokens), FSDP2 x 8, "
                 f"micro-batch {mb}, checkpointing on, 2 micro-batches per step, a reduce-scatter after each "
                 "(gradient_sync = 'micro_batch')")
        item = _fsdp_item("flux_full_fsdp8_720_ac_accum2_sync", title, small, full,
                          plan_for("flux_full_fsdp8_720_ac_accum2_sync", {}), width)
        items["flux_full_fsdp8_720_ac_accum2_sync"] = item
        print_item("flux_full_fsdp8_720_ac_accum2_sync", item)
    if "flux_full_fsdp8_ac_kl" in keys:
        small = {d: track_fsdp(FLUX1, 8, depth=d, batch=mb, checkpointing=True) for d in reduced_depths(FLUX1)}
        full = track_fsdp(FLUX1, 8, batch=mb, checkpointing=True, reference=True)
        full["reference"] = full["reference_bytes"]
        title = (f"FLUX.1-dev full fine-tuning with a KL term (loss.beta > 0): FSDP2 x 8, the bf16 reference (the "
                 f"compute dtype, as the adapter keeps it) sharded like the model and run before each forward, micro-batch {mb}, checkpointing on")
        item = _fsdp_item("flux_full_fsdp8_ac_kl", title, small, full, plan_for("flux_full_fsdp8_ac_kl", {}), width)
        item["notes"].insert(0, f"reference sharded (every parameter a DTensor before the step): "
                                f"{full['reference_sharded']}; its shards {full['reference_bytes'] / GiB:.3f} GiB")
        items["flux_full_fsdp8_ac_kl"] = item
        print_item("flux_full_fsdp8_ac_kl", item)
    if "flux_full_fsdp8_startup_kl" in keys:
        r = track_startup(FLUX1, 8, reference=True)
        tracker = {"peak": r["peak"], "after": r["after"], "reference": r["reference_bytes"]}
        item = {"title": "FLUX.1-dev start-up with a KL term, FSDP2 x 8: each block of the model, then of the "
                         "bf16 reference, placed whole and sharded (flowrl's shard before moving)",
                "plan": plan_for("flux_full_fsdp8_startup_kl", {}), "tracker": tracker, "raw": r,
                "notes": [f"held after start-up (all shards of the model and the reference): {r['after'] / GiB:.2f} GiB; "
                          f"largest block {r['largest_block_params'] / 1e6:.1f}e6 parameters; tracker CPU time "
                          f"{r['cpu_seconds']} s",
                          "the plan's start-up here is the shards of the model and of the reference plus one whole "
                          "block (flowrl.memory_plan.startup_peak without the CUDA context)"]}
        items["flux_full_fsdp8_startup_kl"] = item
        print_item("flux_full_fsdp8_startup_kl", item)
    return items


def run_fsdp_items(mb: int, stamp) -> dict[str, Any]:
    """1. FLUX.1-dev full fine-tuning, FSDP2 x 8, as the flagship recipe (micro-batch ``mb``,
    checkpointing on), and without checkpointing; then two micro-batches per optimizer step, with a
    reduce-scatter after each or with the first unsynchronised (``set_requires_gradient_sync(False)``)."""
    items: dict[str, Any] = {}
    width = FLUX1_DEV["num_attention_heads"] * FLUX1_DEV["attention_head_dim"]
    small_by_ac: dict[bool, dict] = {}
    fsdp_cases = [("flux_full_fsdp8_ac", True, 1, True), ("flux_full_fsdp8_noac", False, 1, True),
                  ("flux_full_fsdp8_ac_accum2_sync", True, 2, True), ("flux_full_fsdp8_ac_accum2_nosync", True, 2, False)]
    for key, ac, accumulate, sync_each in fsdp_cases:
        stamp(key)
        if ac not in small_by_ac:
            small_by_ac[ac] = {d: track_fsdp(FLUX1, 8, depth=d, batch=mb, checkpointing=ac) for d in reduced_depths(FLUX1)}
        full = track_fsdp(FLUX1, 8, batch=mb, checkpointing=ac, accumulate=accumulate, sync_each=sync_each)
        plan = plan_for(key, {})
        title = (f"FLUX.1-dev full fine-tuning, FSDP2 x 8, fp32 master / bf16 compute, micro-batch {mb}, "
                 f"checkpointing {'on' if ac else 'off'}"
                 + (f", {accumulate} micro-batches per step ({'reduce-scatter each' if sync_each else 'first unsynced'})"
                    if accumulate > 1 else ""))
        items[key] = _fsdp_item(key, title, small_by_ac[ac], full, plan, width)
        print_item(key, items[key])
    return items


def klein_nf4_storage() -> dict[bool, dict[str, Any]] | None:
    """FLUX.2 [klein]'s NF4 bytes (:func:`nf4_weight_bytes`) without and with double quantisation;
    None, and a message, without bitsandbytes (its rows are then skipped)."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        print("bitsandbytes is not installed: the FLUX.2 [klein] NF4 rows are skipped "
              "(pip install -c constraints/cpu.txt bitsandbytes)", flush=True)
        return None
    return {dq: nf4_weight_bytes(KLEIN, dq) for dq in (False, True)}


def lora_image_item(family: Family, key: str, title: str, checkpointing: bool, check_at: tuple[int, ...],
                    nf4: dict[bool, dict[str, Any]] | None = None) -> dict[str, Any]:
    """One image model's LoRA item at 512 x 512 (:func:`lora_item`), with its constants, notes, what a
    plan should say and what it says; ``nf4`` (:func:`klein_nf4_storage`): over an NF4 base."""
    tokens = IMAGE_TOKENS + TEXT_TOKENS
    width_f = family.config["num_attention_heads"] * family.config["attention_head_dim"]
    tw = 1 * tokens * width_f * 2
    depth = dict(zip(family.kinds, family.depth()))
    item = lora_item(family, checkpointing, check_at, quant="nf4" if nf4 is not None else None)
    ext = item["extrapolation"]
    # Backward temporaries are one block's at a time: they do not grow with depth (the check
    # at a deeper model shows it), so the full-size figure is the largest reduced-depth one.
    ext["max_temporaries"] = max(r["temporaries"] for r in item["runs"].values())
    consts = constants(ext, tw, temp_fit=False)
    item["tracker"]["temporaries"] = ext["max_temporaries"]
    v = item["validation"]
    notes = [
        "per block (GiB): " + "; ".join(
            f"{k} " + ", ".join(f"{kind} {x / GiB:.4f}" for kind, x in ext["per_block"][k].items())
            for k in ("params", "grads", "activations", "peak")),
        "outside the blocks (GiB): " + ", ".join(f"{k} {ext['outside'][k] / GiB:.4f}"
                                                 for k in ("params", "activations", "peak")),
        "activation constants (bf16 elements per token per width): "
        + ", ".join(f"{k} {x:.2f}" for k, x in consts["widths"].items())
        + f", outside {consts['outside']:.2f}; temporaries {consts['temp_outside']:.2f} widths",
        f"trainable {item['trainable_params'] / 1e6:.1f}e6 (LoRA), base {item['base_params'] / 1e9:.3f}e9; the "
        f"fit gives params {ext['value']['params'] / GiB:.3f} GiB, the exact count "
        + (f"{(item['base_params'] * 2 + item['trainable_params'] * 4) / GiB:.3f} GiB" if nf4 is None else
           f"{(nf4[False]['packed_bytes'] + nf4[False]['other_bf16_bytes'] + item['trainable_params'] * 4) / GiB:.3f}"
           " GiB (packed NF4 + bf16 rest + fp32 LoRA)"),
    ]
    if v:
        notes.append(f"check of the per-block fit at depth {'x'.join(map(str, v['depth']))}: " + ", ".join(
            f"{k} measured {v['measured'][k] / GiB:.3f} vs fit {v['predicted'][k] / GiB:.3f} GiB"
            for k in ("activations", "temporaries", "peak")))
    notes.append(f"tracker CPU time {item['cpu_seconds']} s at reduced depth")
    base_bytes = 2.0
    dequant = 0.0
    if nf4 is not None:
        q = nf4[False]
        # The tracker counts parameters, and bitsandbytes keeps its per-block statistics
        # (absmax, quantisation map) outside them, in each weight's quant_state; and the
        # forward's 4-bit matmul dequantises the weight to bf16 inside its own op (on a
        # GPU for this many tokens), where no tracker sees it: add both.
        dequant = q["largest_linear"] * 2.0
        item["tracker_as_measured"] = dict(item["tracker"])
        t = item["tracker"]
        t["params"] += q["state_bytes"]
        t["peak"] += q["state_bytes"] + dequant
        item["nf4"] = nf4
        base_bytes = q["total_bytes"] / item["base_params"]
        notes.append(
            f"NF4 storage (bitsandbytes {q['bitsandbytes']}, blocksize 64): {q['bits_per_linear_param']:.3f} bits "
            f"per Linear weight = {q['packed_bytes'] / GiB:.3f} GiB packed + {q['state_bytes'] / GiB:.3f} GiB "
            f"absmax and maps + {q['other_bf16_bytes'] / GiB:.4f} GiB of bf16 non-Linear parameters = "
            f"{q['total_bytes'] / GiB:.3f} GiB (bf16: {item['base_params'] * 2 / GiB:.3f} GiB); with double "
            f"quantisation {nf4[True]['bits_per_linear_param']:.3f} bits, {nf4[True]['total_bytes'] / GiB:.3f} GiB")
        notes.append("tracked with bitsandbytes' Linear4bit layers and fake packed weights from its own "
                     "quantize_4bit; the tracker does not see the absmax/maps (quant_state, added to params "
                     "and peak) nor the forward matmul's internal bf16 dequantised weight (the largest, "
                     f"{dequant / GiB:.3f} GiB, added to the peak); the backward's dequantisation it sees")
    item["should"] = should_lora(item["base_params"], base_bytes, item["trainable_params"], tw=tw, depth=depth,
                                 consts=consts, checkpointing=checkpointing, dequant=dequant)
    item["plan"] = plan_for(key, item)
    item["constants"] = consts
    item["title"] = f"{title}, one process, micro-batch 1, checkpointing {'on' if checkpointing else 'off'}"
    item["notes"] = notes
    return item


def run_lora_items(nf4: dict[bool, dict[str, Any]] | None, stamp) -> dict[str, Any]:
    """2-4. LoRA on one process, FLUX.1-dev, Qwen-Image and (with ``nf4``, bitsandbytes' bytes)
    FLUX.2 [klein] over an NF4 base: reduced depth, extrapolated per block, checked at a deeper model."""
    items: dict[str, Any] = {}
    lora_cases = [(FLUX1, "flux_lora", "FLUX.1-dev LoRA r64 (attention) on a bf16 base", (4, 4)),
                  (QWEN, "qwen_lora", "Qwen-Image LoRA r64 (attention) on a bf16 base", (5,)),
                  (KLEIN, "klein_qlora", "FLUX.2 [klein] 4B LoRA r64 on an NF4 base (bitsandbytes)", (4, 4))]
    for family, stem, title, check_at in lora_cases:
        if family is KLEIN and nf4 is None:
            continue
        for ac in (True, False):
            key = f"{stem}_{'ac' if ac else 'noac'}"
            stamp(key)
            items[key] = lora_image_item(family, key, title, ac, check_at, nf4 if family is KLEIN else None)
            print_item(key, items[key])
    return items


def run_rollout_items(with_klein: bool, stamp) -> dict[str, Any]:
    """5. The rollout (no grad) of FLUX.1-dev, Qwen-Image and (``with_klein``) FLUX.2 [klein] over
    an NF4 base: the plan's INFERENCE_WIDTHS against the tracker."""
    from flowrl.memory_plan import INFERENCE_WIDTHS

    items: dict[str, Any] = {}
    tokens = IMAGE_TOKENS + TEXT_TOKENS
    plan_flux = plan_numbers(PLAN_512 + LORA_OVERRIDES, 1)
    for family, batch, lora in ((FLUX1, 1, True), (FLUX1, 1, False), (QWEN, 8, True), (KLEIN, 1, True)):
        if family is KLEIN and not with_klein:
            continue
        key = f"{family.name}_rollout_b{batch}{'_lora' if lora else '_bare'}"
        stamp(key)
        r = rollout_item(family, batch, lora=lora, quant="nf4" if family is KLEIN else None)
        width_f = family.config["num_attention_heads"] * family.config["attention_head_dim"]
        r["widths"] = r["activations"] / (batch * tokens * width_f * 2)
        if family is FLUX1:
            r["plan_per_sample"] = plan_flux["rollout_activations"] / plan_flux["rollout_samples"]
        items[key] = r
        print(f"   no-grad bf16 forward of {batch} sample(s) {'with' if lora else 'without'} LoRA: live activations "
              f"peak {r['activations'] / GiB:.3f} GiB = {r['widths']:.2f} widths per token (the plan assumes "
              f"{INFERENCE_WIDTHS:g} unless the model says otherwise)")
        r["plan_widths"] = INFERENCE_WIDTHS
    return items


def run_all() -> dict[str, Any]:
    """The full run: the FSDP2 items (1), the KL and start-up items, the LoRA items (2-4), the
    rollout items (5); the Wan and LTX items run only with ``--items``."""
    import diffusers

    started = time.time()

    def stamp(key: str) -> None:
        print(f"[{time.time() - started:5.0f} s] {key} ...", flush=True)

    mb = plan_numbers(PLAN_512, 8)["micro_batch"]
    items = run_fsdp_items(mb, stamp)
    stamp("KL term and start-up")
    items.update(run_kl_items())
    nf4 = klein_nf4_storage()
    items.update(run_lora_items(nf4, stamp))
    items.update(run_rollout_items(nf4 is not None, stamp))

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "OMP_NUM_THREADS=1 python " + " ".join(["benchmarks/memory_plan.py", *sys.argv[1:]]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, no GPU",
        "versions": {"torch": torch.__version__, "diffusers": diffusers.__version__, "python": platform.python_version()},
        "resolution": "512x512", "image_tokens": IMAGE_TOKENS, "text_tokens": TEXT_TOKENS,
        "configs": {"flux1_dev": FLUX1_DEV, "qwen_image": QWEN_IMAGE, "flux2_klein_4b": FLUX2_KLEIN_4B},
        "items": items, "wall_seconds": round(time.time() - started, 1),
    }


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float):
        return round(x, 6)
    return x


def plan_for(key: str, item: dict[str, Any]) -> dict[str, Any] | None:
    """The plan column of one tracked configuration (None where flowrl has no adapter)."""
    ac = ["model.gradient_checkpointing=" + ("false" if "noac" in key else "true")]
    if key.startswith("flux_full_fsdp8"):
        # the tracker's runs reduce-scatter after every backward ([distributed].gradient_sync =
        # "micro_batch"; with one backward per step also what "step" does), except *_nosync: its
        # backwards accumulate unsynchronised, then one reduce-scatter ("step" with several)
        sync = ["distributed.gradient_sync=" + ("step" if key.endswith("_nosync") else "micro_batch")]
        kl = ["loss.beta=0.01"] if key.endswith("_kl") else []  # a KL term: the reference copy, sharded
        geometry = [] if "_720_" in key else PLAN_512  # the flagship recipe is 720 x 720
        plan = plan_numbers(geometry + FSDP_OVERRIDES + ac + sync + kl, 8)
        if "startup" in key:  # the start-up figure, in the tracker's terms
            plan = {"peak": plan["startup"], "startup_block": plan["startup_block"], "params": plan["params"],
                    "reference": plan["reference"], "overrides": plan["overrides"]}
        return plan
    if key.startswith("flux_lora"):
        return plan_numbers(PLAN_512 + LORA_OVERRIDES + ac, 1)
    # the shipped recipes of the other models, set to the tracked configuration: 512 x 512,
    # 512 text tokens, micro-batch 1, LoRA r64 on the attention projections, one process
    other = PLAN_512 + ac + ["model.max_sequence_length=512", "model.lora_preset=attention", "train.micro_batch_size=1",
                             "model.cfg_scale=1.0",  # the tracker runs one forward (no true-CFG pair)
                             f"train.lora_rank={LORA_RANK}", f"train.lora_alpha={LORA_ALPHA}", "distributed.strategy=none"]
    if key.startswith("qwen_lora"):
        return plan_numbers(other, 1, "qwen_image_lora.toml")
    if key.startswith("klein_qlora"):
        return plan_numbers(other + ["model.quantize=nf4"], 1, "flux2_klein_nf4_24gb.toml")
    if key.startswith(("wan_lora", "wan22_lora")):  # the recipe's own clip, one forward
        return plan_numbers(ac + ["model.max_sequence_length=512", "model.lora_preset=attention", "model.cfg_scale=1.0",
                                  "train.micro_batch_size=1", f"train.lora_rank={LORA_RANK}",
                                  f"train.lora_alpha={LORA_ALPHA}", "distributed.strategy=none"], 1,
                            "wan22_5b_lora.toml" if key.startswith("wan22") else "wan21_1p3b_lora.toml")
    if key.startswith("ltx_lora"):  # the recipe's own clip (704 x 480, 121 frames, 128 text tokens), one forward
        return plan_numbers(ac + ["model.lora_preset=attention", "model.cfg_scale=1.0", "train.micro_batch_size=1",
                                  f"train.lora_rank={LORA_RANK}", f"train.lora_alpha={LORA_ALPHA}",
                                  "distributed.strategy=none"], 1, "ltx_lora.toml")
    return None


def replan(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` (a saved run) with every plan column recomputed by the current ``flowrl plan``:
    the tracker is the slow part and does not depend on flowrl."""
    for key, item in result["items"].items():
        if "tracker" in item:
            item["plan"] = plan_for(key, item)
            # notes written before flowrl offered [distributed].gradient_sync = "micro_batch"
            item["notes"] = [n for n in item.get("notes", []) if not n.startswith(("flowrl never runs this pattern",
                                                                                    "one backward per optimizer step"))]
            if item["plan"] and item["plan"].get("per_block_widths"):  # the plan's constants as now recomputed
                ours = "; the plan's: " + ", ".join(f"{k} {x:.1f}" for k, x in item["plan"]["per_block_widths"].items())
                item["notes"] = [n.split("; the plan's: ")[0] + ours if "; the plan's: " in n else n
                                 for n in item["notes"]]
            print_item(key, item)
    result["replanned"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--json", type=Path, help="write every number to this JSON file")
    parser.add_argument("--markdown", type=Path, help="write the tables as Markdown to this file")
    parser.add_argument("--replan", type=Path, help="recompute only the plan columns of this saved --json result")
    parser.add_argument("--items", help="comma-separated: run only these of " + ", ".join(ADDED_ITEMS)
                        + " and add them to the --json file's saved result")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.items:
        keys = [k.strip() for k in args.items.split(",")]
        if unknown := [k for k in keys if k not in ADDED_ITEMS]:
            parser.error(f"unknown item(s) {unknown}; choose from {', '.join(ADDED_ITEMS)}")
        if not (args.json and args.json.exists()):
            parser.error("--items adds to a saved result: give --json PATH of an earlier full run")
        result = json.loads(args.json.read_text())
        started = time.time()
        if kl := [k for k in keys if k in KL_ITEMS]:
            result["items"].update(run_kl_items(kl))
        if wan := [k for k in keys if k in WAN_ITEMS]:
            result["items"].update(run_wan_items(wan))
        result.setdefault("added", {})[",".join(keys)] = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "wall_seconds": round(time.time() - started, 1)}
    else:
        result = replan(json.loads(args.replan.read_text())) if args.replan else run_all()
    print(f"\ntotal wall time {result['wall_seconds']} s" + (" (the tracker run; plan columns recomputed)" if args.replan else ""))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(_jsonable(result), indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(result))
        print(f"wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
