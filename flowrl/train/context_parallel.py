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

Ring attention (``ring_degree``) needs an attention backend that returns log-sum-exp values
(flash, cuDNN); PyTorch's native attention, the one a CPU has, does not, so flowrl offers
Ulysses only. diffusers looks for an accelerator to name the process's device; on a CPU (tests
over gloo) it finds none, and :func:`apply_context_parallel` gives it one for that call.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
from torch import nn

from ..errors import FlowrlError

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


def split_sequences(transformer: nn.Module, image_tokens: int | None, text_tokens: int | None) -> dict[str, int]:
    """The token counts per sample that ``transformer``'s plan splits: the image or video tokens,
    and the text tokens where the text joins the sequence (FLUX's joint attention; Wan's text only
    enters cross-attention and is not split)."""
    plan = getattr(transformer, "_cp_plan", None) or {}
    out = {}
    if image_tokens:
        out["image or video tokens"] = int(image_tokens)
    if text_tokens and "encoder_hidden_states" in (plan.get("") or {}):
        out["text tokens"] = int(text_tokens)
    return out


def check_splittable(transformers: list[nn.Module], degree: int, tokens: dict[str, int]) -> None:
    """What Ulysses needs: heads divisible by ``degree`` (each process attends with a share of
    them) and every sequence the plans split (``tokens``: name -> count per sample) divisible too."""
    if not transformers:
        raise FlowrlError("the model's denoiser has no diffusers transformer with a context-parallel plan (_cp_plan)",
                          where=WHERE, hint="use a diffusers model (FLUX, Wan, LTX-Video, Qwen-Image), or set "
                                            "context_parallel = 1")
    for t in transformers:
        heads = int(t.config.get("num_attention_heads", 0) or 0)
        if heads and heads % degree:
            raise FlowrlError(f"{type(t).__name__} has {heads} attention heads, which do not split over {degree} "
                              "processes", where=WHERE, hint=f"use a divisor of {heads}")
    for name, count in tokens.items():
        if count % degree:
            raise FlowrlError(f"{count} {name} per sample do not split over {degree} processes", where=WHERE,
                              hint="choose sizes (height, width, frames, max_sequence_length) whose token counts "
                                   f"divide by {degree}")


def apply_context_parallel(denoiser: nn.Module, degree: int, device: torch.device, image_tokens: int | None = None,
                           text_tokens: int | None = None) -> None:
    """Split every sequence of ``denoiser``'s transformers over groups of ``degree`` consecutive
    processes, Ulysses style."""
    from diffusers import ContextParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    transformers = parallel_transformers(denoiser)
    check_splittable(transformers, degree, {k: v for t in transformers
                                            for k, v in split_sequences(t, image_tokens, text_tokens).items()})
    # groups of ``degree`` consecutive processes, one per data-parallel rank
    groups = torch.distributed.get_world_size() // degree
    mesh = init_device_mesh(device.type, (groups, 1, degree), mesh_dim_names=("dp", "ring", "ulysses"))
    for t in transformers:
        with _an_accelerator_for_diffusers(device):
            t.enable_parallelism(config=ContextParallelConfig(ulysses_degree=degree, mesh=mesh))


@contextlib.contextmanager
def _an_accelerator_for_diffusers(device: torch.device):
    """diffusers names each process's device ``rank % torch.accelerator.device_count()``: on a
    CPU the count is 0. The device is only recorded there; the mesh passed in does the work."""
    if device.type != "cpu":
        yield
        return
    with mock.patch("torch.accelerator.device_count", lambda: 1):
        yield
