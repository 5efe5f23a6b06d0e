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
  the loop's context (the session and the inference commands call it when they place a model);
- :func:`auxiliary_attention`: ``auto``'s backends for the text encoders and the VAE inside the
  loop: the recipe's backend is the denoiser's alone;
- :func:`probe_cudnn_attention`: a recipe naming ``cudnn`` trains only if cuDNN agrees with math
  attention on its model;
- :func:`exact_float32`: an fp32 denoiser on CUDA gets fp32 (not TF32) convolutions.

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


@contextlib.contextmanager
def auxiliary_attention() -> Iterator[None]:
    """Text encoders and the VAE attend as ``auto`` would (every backend but cuDNN), whatever
    ``[train].attention_backend`` names: the recipe's backend is the denoiser's. On an H200 a run
    naming ``flash`` or ``efficient`` failed in T5's attention ("No available kernel": its position
    bias is an attention mask, which flash takes no more than an fp32 VAE takes flash), and
    ``cudnn`` faulted there too. The training loop encodes prompts and decodes images inside its
    attention context; those calls go through this."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
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


def exact_float32(device: torch.device, denoiser: torch.nn.Module, mixed_precision: str = "no") -> bool:
    """An fp32 denoiser on CUDA computes its convolutions in fp32: torch lets cuDNN use TF32 for
    them by default (``torch.backends.cudnn.allow_tf32``; its matmuls already default to full fp32).
    With TF32, Wan's Conv3d patch embedding and the editing models' VAE-encoded condition images
    depended on the batch they came in: on an H200 a sample alone differed from it in a batch by
    3e-4 of |v|, and the on-policy log-ratio of a tiny Wan reached 4e-6 against the 1e-6 an fp32
    recipe allows, so re-scoring a rollout in another micro-batch would stop the run. Process-wide
    (cuDNN's switch has no narrower scope); left alone for bf16/fp16 denoisers and mixed precision,
    whose convolutions are not fp32, so a bf16 Wan keeps its fp32 VAE's TF32 speed. Returns
    whether it switched TF32 off."""
    floats = [p.dtype for p in denoiser.parameters() if p.dtype.is_floating_point]
    if device.type != "cuda" or mixed_precision != "no" or not floats or any(d != torch.float32 for d in floats):
        return False
    torch.backends.cudnn.allow_tf32 = False
    return True


#: largest relative deviation of cuDNN attention's velocity and input gradient from math's that a
#: run naming ``cudnn`` accepts (the self-test's bf16 bound; cuDNN attention has no fp32 kernel)
CUDNN_TOLERANCE = 5e-2


def _velocity_and_gradient(model, x: torch.Tensor, sigma: torch.Tensor, text) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    velocity = model.velocity(x, sigma, text)
    (gradient,) = torch.autograd.grad(velocity.float().square().mean(), x)
    return velocity.detach().float(), gradient.float()


def probe_cudnn_attention(model, device: torch.device, text, source: str = "<recipe>") -> float:
    """A recipe naming ``cudnn`` on CUDA trains only if cuDNN attention agrees with math attention
    on this model: one sample's velocity and its gradient with respect to the latents (no weight
    gradient is kept), under each backend. With torch 2.11 cuDNN attention faulted at FLUX.1-dev's
    shapes on an H100 and returned non-finite values for a tiny FLUX on an H200, so it is checked on
    the run's own model before the first rollout rather than trusted. Returns the deviation."""
    where = _where(source, "attention_backend")
    x = torch.randn((1, *model.latent_shape), generator=torch.Generator().manual_seed(0)).to(device)
    sigma = torch.full((1,), 0.5, device=device)
    found, cuda = {}, [device] if device.type == "cuda" else []
    for name in ("math", "cudnn"):
        try:
            with attention_backend(name, device, source), torch.random.fork_rng(devices=cuda):
                found[name] = _velocity_and_gradient(model, x, sigma, text)
        except RuntimeError as exc:  # no cuDNN kernel for this dtype or shape
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise FlowrlError(f"attention_backend = 'cudnn' cannot run this model here: {reason}", where=where,
                              hint="use 'auto' (flash, efficient or math; never cuDNN)") from None
    deviation = max(float((a - b).norm() / b.norm().clamp_min(1e-12)) for a, b in zip(found["cudnn"], found["math"]))
    if not deviation <= CUDNN_TOLERANCE:  # NaN fails too
        raise FlowrlError(f"attention_backend = 'cudnn' disagrees with math attention on this model: relative "
                          f"deviation {deviation:.3g} > {CUDNN_TOLERANCE:g} (torch {torch.__version__}, "
                          f"{torch.cuda.get_device_name(device)})", where=where,
                          hint="use 'auto' (flash, efficient or math; never cuDNN)")
    return deviation


def prepare_kernels(model, train, device: torch.device, source: str = "<recipe>", probe_text=None):
    """What the training loop calls once the update is built: check ``[train].attention_backend``
    against the device (``cudnn`` is probed on the model: :func:`probe_cudnn_attention`, given
    ``probe_text()``, one prompt's embeddings on the device), compile the denoiser as
    ``[train].compile`` says, and return the attention context (:func:`attention_backend`) for the
    loop to run in."""
    check_attention_backend(train.attention_backend, device, source)
    if train.attention_backend == "cudnn" and device.type == "cuda" and probe_text is not None:
        probe_cudnn_attention(model, device, probe_text(), source)
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
