"""Context (sequence) parallelism: every transformer forward's tokens split over a group of
processes, through diffusers' own engine (``ContextParallelConfig``, ``ModelMixin
.enable_parallelism`` and the ``_cp_plan`` its FLUX, Wan, LTX and Qwen-Image transformers carry).

Ulysses style: each process of the group holds a slice of the tokens through the blocks; inside
attention an all-to-all trades the token split for a head split, so each process attends over
every token with ``heads / C`` heads, and trades back. The plan's hooks split the sequence where
it enters the blocks and gather the output, so every process of the group gets the whole
velocity and the engine around the denoiser runs as on one process: the group's processes share
their samples and do identical work.

Gradients: each process back-propagates through its own slice of the tokens, so a weight's
gradient on one process is its slice's share; the group's sum is the gradient of the whole
sequence (:class:`flowrl.train.parallel.Strategy` sums over the group, and averages over
data-parallel ranks).

Ring style (``[distributed].context_parallel_ring`` = R > 1): the R processes of a ring keep
their slices of the tokens inside attention too, pass keys and values around the ring, and merge
the partial attentions by their log-sum-exp. A group of C processes may mix both: C / R processes
split the heads (Ulysses) in each of R ring positions. Only the kernels that return the log-sum-exp
can take part: on a GPU flowrl runs diffusers' ``_native_flash`` backend (``_native_cudnn`` when
``[train].attention_backend = "cudnn"``), both in bf16 or fp16; diffusers' native backend, the one a
CPU has, returns none, so on a CPU flowrl gives it torch's CPU flash kernel, which does
(:mod:`flowrl.train.cp_attention`, with two repairs of diffusers' Ulysses attention that
LTX-Video needs). diffusers looks for an accelerator to name the process's
device; on a CPU (tests over gloo) it finds none, and :func:`apply_context_parallel` gives it one
for that call.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
from torch import nn

from ..errors import FlowrlError
from .cp_attention import (install_cpu_ring_kernel, install_head_sharded_masks,
                           install_ulysses_cross_attention_backward)

WHERE = "[distributed].context_parallel"


def sequence_tokens(model) -> tuple[int | None, int | None]:
    """``(image or video tokens, text tokens)`` per sample of a model adapter, where it says them
    (``image_seq_len``, its config's ``max_sequence_length``)."""
    config = getattr(model, "config", None)
    return getattr(model, "image_seq_len", None), getattr(config, "max_sequence_length", None)


def parallel_transformers(denoiser: nn.Module) -> list[nn.Module]:
    """The outermost diffusers transformers in ``denoiser`` that carry a context-parallel plan
    (one for most models; both experts of Wan 2.2 A14B)."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in denoiser.modules():
        if id(module) in inside:
            continue
        if getattr(module, "_cp_plan", None) is not None and hasattr(module, "enable_parallelism"):
            found.append(module)
            inside.update(id(m) for m in module.modules())
    return found


def plan_inputs(transformer: nn.Module) -> set[str]:
    """The named inputs a transformer's context-parallel plan splits, wherever in the model (FLUX
    and LTX name them at the model's entry, Qwen-Image at its blocks)."""
    plan = getattr(transformer, "_cp_plan", None) or {}
    return {str(name) for entry in plan.values() if isinstance(entry, dict) for name in entry}


def split_sequences(transformer: nn.Module, image_tokens: int | None, text_tokens: int | None) -> dict[str, int]:
    """The token counts per sample that ``transformer``'s plan splits: the image or video tokens,
    and the text tokens where the text joins the sequence (FLUX's joint attention; Wan's text only
    enters cross-attention and is not split)."""
    out = {}
    if image_tokens:
        out["image or video tokens"] = int(image_tokens)
    if text_tokens and "encoder_hidden_states" in plan_inputs(transformer):
        out["text tokens"] = int(text_tokens)
    return out


def check_splittable(transformers: list[nn.Module], degree: int, tokens: dict[str, int], ring: int = 1) -> None:
    """What the split needs: heads divisible by the Ulysses share of the group (``degree / ring``
    processes attend with a share of them each) and every sequence the plans split (``tokens``:
    name -> count per sample) divisible by the whole group."""
    if not transformers:
        raise FlowrlError("the model's denoiser has no diffusers transformer with a context-parallel plan (_cp_plan)",
                          where=WHERE, hint="use a diffusers model (FLUX, Wan, LTX-Video, Qwen-Image), or set "
                                            "context_parallel = 1")
    ulysses = degree // ring
    for t in transformers:
        masks = sorted(name for name in plan_inputs(t) if "mask" in name)
        if ring > 1 and masks:
            raise FlowrlError(f"{type(t).__name__} attends with a mask ({', '.join(masks)}), and ring attention's "
                              "kernels (flash, cuDNN, the CPU flash kernel) take none",
                              where="[distributed].context_parallel_ring",
                              hint="set context_parallel_ring = 1: Ulysses splits this model's sequences")
        heads = int(t.config.get("num_attention_heads", 0) or 0)
        if heads and heads % ulysses:
            raise FlowrlError(f"{type(t).__name__} has {heads} attention heads, which do not split over {ulysses} "
                              "processes" + (f" (context_parallel {degree} / context_parallel_ring {ring})"
                                             if ring > 1 else ""), where=WHERE,
                              hint=f"use a divisor of {heads}" + (", or a larger context_parallel_ring: the ring "
                                                                 "splits no heads" if ring < degree else ""))
    for name, count in tokens.items():
        if count % degree:
            raise FlowrlError(f"{count} {name} per sample do not split over {degree} processes", where=WHERE,
                              hint="choose sizes (height, width, frames, max_sequence_length) whose token counts "
                                   f"divide by {degree}")


def apply_context_parallel(denoiser: nn.Module, degree: int, device: torch.device, image_tokens: int | None = None,
                           text_tokens: int | None = None, ring: int = 1, attention: str = "auto",
                           precision: str = "half") -> None:
    """Split every sequence of ``denoiser``'s transformers over groups of ``degree`` consecutive
    processes: ``ring`` of them in a ring, ``degree / ring`` splitting heads in each ring position.
    ``attention``: ``[train].attention_backend``; ``precision``: what attention computes in,
    ``"half"`` (bf16 or fp16 weights), ``"float32"`` or ``"autocast"`` (float32 weights under
    autocast), which decides whether a ring can run (:func:`ring_backend`)."""
    from diffusers import ContextParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    transformers = parallel_transformers(denoiser)
    check_splittable(transformers, degree, {k: v for t in transformers
                                            for k, v in split_sequences(t, image_tokens, text_tokens).items()},
                     ring=ring)
    backend = ring_backend(device, attention, precision) if ring > 1 else None
    install_head_sharded_masks()
    install_ulysses_cross_attention_backward()
    # groups of ``degree`` consecutive processes, one per data-parallel rank; inside a group the
    # Ulysses processes are the consecutive ones
    groups = torch.distributed.get_world_size() // degree
    mesh = init_device_mesh(device.type, (groups, ring, degree // ring), mesh_dim_names=("dp", "ring", "ulysses"))
    for t in transformers:
        if backend is not None:
            t.set_attention_backend(backend)
        with _an_accelerator_for_diffusers(device):
            t.enable_parallelism(config=ContextParallelConfig(ring_degree=ring, ulysses_degree=degree // ring,
                                                              mesh=mesh))


def ring_backend(device: torch.device, attention: str, precision: str) -> str:
    """The diffusers attention backend that runs ring attention on ``device``: one whose kernel
    returns the log-sum-exp the ring merges by. The ring calls its kernels directly, outside
    autocast's reach: under autocast a float32 model's queries and keys (normalised in float32)
    would reach them beside bf16 values, so autocast is refused."""
    where = "[distributed].context_parallel_ring"
    if attention not in ("auto", "flash", "cudnn"):
        raise FlowrlError(f"ring attention needs a kernel that returns its log-sum-exp, and attention_backend = "
                          f"{attention!r} does not", where="[train].attention_backend",
                          hint="use 'auto' or 'flash' (or 'cudnn' on a GPU), or set [distributed] "
                               "context_parallel_ring = 1 (Ulysses only)")
    if precision == "autocast":
        raise FlowrlError("ring attention calls its kernels outside autocast, and this run computes a float32 model "
                          "under autocast (mixed_precision = 'bf16' without FSDP2): its queries, keys and values "
                          "would reach them in different dtypes", where=where,
                          hint="use strategy = 'fsdp2' (its mixed precision casts the weights), or mixed_precision "
                               "= 'no', or context_parallel_ring = 1")
    if device.type == "cpu":
        install_cpu_ring_kernel()
        return "native"
    if device.type != "cuda":
        raise FlowrlError(f"ring attention runs on CUDA and CPU devices, not {device.type!r}", where=where,
                          hint="set context_parallel_ring = 1")
    if precision != "half":
        raise FlowrlError("ring attention on a GPU runs flash or cuDNN kernels, which take bf16 or fp16, and this run "
                          "attends in float32", where=where,
                          hint="use strategy = 'fsdp2' with mixed_precision = 'bf16', or LoRA on a bf16 model "
                               "([model] denoiser_dtype = 'auto'), or context_parallel_ring = 1")
    return "_native_cudnn" if attention == "cudnn" else "_native_flash"


@contextlib.contextmanager
def _an_accelerator_for_diffusers(device: torch.device):
    """diffusers names each process's device ``rank % torch.accelerator.device_count()``: on a
    CPU the count is 0. The device is only recorded there; the mesh passed in does the work."""
    if device.type != "cpu":
        yield
        return
    with mock.patch("torch.accelerator.device_count", lambda: 1):
        yield
