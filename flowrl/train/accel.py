"""Compiled kernels: the ``[train]`` switches ``compile`` and ``attention_backend`` (the third
speed switch, ``adamw_impl``, is the optimizer's: :func:`flowrl.train.optimizer.adamw_options`).

- :func:`compile_denoiser`: ``torch.compile`` of the denoiser in place (``nn.Module.compile``:
  the module, its parameters and its ``state_dict`` keys stay what they were, so checkpoints,
  EMA and the strategy's hold on the parameters are unaffected). Called after the update has
  built the KL reference (an uncompiled copy) and the strategy has placed or sharded the
  denoiser (FSDP2 wants ``fully_shard`` before ``compile``);
- :func:`attention_backend`: a context manager that restricts scaled-dot-product attention to
  one backend (``torch.nn.attention.sdpa_kernel``) for the training loop. ``auto`` lets torch
  choose, on CUDA among flash, memory-efficient and math only: cuDNN attention runs only when
  named, because with torch 2.11 (CUDA 13.0) on an H100 it faulted on FLUX.1-dev's attention
  (24 heads of 128, bf16; an illegal memory access, then every later kernel failed), where the
  other three ran (``benchmarks/sdpa_backends.py``, docs/benchmarks.md);
- :func:`default_attention`: the same ``auto`` as the process's default, for what runs outside
  the loop's context (the session and the inference commands call it when they place a model).

Each checks the device first and raises a :class:`~flowrl.errors.FlowrlError` naming the recipe
field when the switch cannot work there (an attention backend the device lacks, compile without a
C++ compiler on a CPU).

Which backends exist (torch 2.13): on a CPU, ``math`` and ``flash`` (a CPU flash-attention
kernel, any float dtype); on CUDA, ``math``, ``flash`` and ``efficient`` (memory-efficient) and
``cudnn`` (flash and cudnn need fp16/bf16 and an sm80+ GPU; efficient also takes fp32).
docs/recipes.md describes the switches; docs/benchmarks.md has what each measured on the CPU
(benchmarks/kernels.py).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator

import torch

from ..errors import FlowrlError

#: attention backends that exist per device type (``auto`` is always allowed)
SDPA_BACKENDS = {
    "cpu": ("math", "flash"),
    "cuda": ("math", "flash", "efficient", "cudnn"),
}
_SDPA_NAMES = {"math": "MATH", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
               "cudnn": "CUDNN_ATTENTION"}
#: what ``auto`` allows per device type (torch chooses among them); None: everything torch has
AUTO_BACKENDS = {"cuda": ("flash", "efficient", "math")}


def _where(source: str, field: str) -> str:
    return f"{source}: [train].{field}"


def check_attention_backend(name: str, device: torch.device, source: str = "<recipe>") -> None:
    """Raise when ``name`` is not an attention backend of ``device``'s type."""
    if name == "auto":
        return
    allowed = SDPA_BACKENDS.get(device.type, ("math",))
    if name not in allowed:
        raise FlowrlError(
            f"attention_backend = {name!r} does not exist on device {device.type!r} (it has: {', '.join(allowed)})",
            where=_where(source, "attention_backend"),
            hint=f"use 'auto' or one of {', '.join(repr(a) for a in allowed)}",
        )


@contextlib.contextmanager
def attention_backend(name: str, device: torch.device, source: str = "<recipe>") -> Iterator[None]:
    """Within the block, scaled-dot-product attention may only use backend ``name`` (``auto``:
    torch chooses among :data:`AUTO_BACKENDS` of the device type, or among all it has)."""
    check_attention_backend(name, device, source)
    allowed = AUTO_BACKENDS.get(device.type) if name == "auto" else (name,)
    if allowed is None:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([getattr(SDPBackend, _SDPA_NAMES[a]) for a in allowed]):
        yield


_SDPA_SWITCHES = {"math": "enable_math_sdp", "flash": "enable_flash_sdp", "efficient": "enable_mem_efficient_sdp",
                  "cudnn": "enable_cudnn_sdp"}


def default_attention(device: torch.device) -> None:
    """Make ``auto``'s choice this process's default on ``device`` outside the training loop's
    context too (sampling, evaluation, export, the dynamics profile before the loop): on CUDA the
    backends :data:`AUTO_BACKENDS` leaves out (cuDNN) are switched off. A backend a recipe names
    still runs inside :func:`attention_backend`, which enables it for its block."""
    allowed = AUTO_BACKENDS.get(device.type)
    if allowed is None:
        return
    for name, switch in _SDPA_SWITCHES.items():
        if name not in allowed:
            getattr(torch.backends.cuda, switch)(False)


def prepare_kernels(model, train, device: torch.device, source: str = "<recipe>"):
    """What the training loop calls once the update is built: check ``[train].attention_backend``
    against the device, compile the denoiser as ``[train].compile`` says, and return the
    attention context (:func:`attention_backend`) for the loop to run in."""
    check_attention_backend(train.attention_backend, device, source)
    compile_denoiser(model, train.compile, device, source)
    return attention_backend(train.attention_backend, device, source)


def compile_denoiser(model, mode: str, device: torch.device, source: str = "<recipe>") -> bool:
    """``torch.compile`` ``model.denoiser`` in place with ``mode`` (``off``: nothing). Returns
    whether it compiled. Compilation itself happens lazily, on the first forward of each shape."""
    if mode == "off":
        return False
    if mode not in ("default", "max-autotune-no-cudagraphs"):
        raise FlowrlError(f"unknown compile mode {mode!r}", where=_where(source, "compile"),
                          hint="one of 'off', 'default', 'max-autotune-no-cudagraphs'")
    if device.type == "cpu" and not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
        raise FlowrlError("compile needs a C++ compiler on a CPU (torch inductor generates C++), and none is on PATH",
                          where=_where(source, "compile"),
                          hint="install g++ (apt-get install g++) or set compile = 'off'")
    denoiser = model.denoiser
    if not isinstance(denoiser, torch.nn.Module):
        raise FlowrlError(f"compile needs the model's denoiser to be a torch module (it is {type(denoiser).__name__})",
                          where=_where(source, "compile"), hint="set compile = 'off' for this model")
    denoiser.compile(mode=mode)
    return True
