"""Compiled kernels: the ``[train]`` switches ``compile`` and ``attention_backend`` (the third
speed switch, ``adamw_impl``, is the optimizer's: :func:`flowrl.train.optimizer.adamw_options`).

- :func:`compile_denoiser`: ``torch.compile`` of the denoiser in place (``nn.Module.compile``:
  the module, its parameters and its ``state_dict`` keys stay what they were, so checkpoints,
  EMA and the strategy's hold on the parameters are unaffected). Called after the update has
  built the KL reference (an uncompiled copy) and the strategy has placed or sharded the
  denoiser (FSDP2 wants ``fully_shard`` before ``compile``);
- :func:`attention_backend`: a context manager that restricts scaled-dot-product attention to
  one backend (``torch.nn.attention.sdpa_kernel``; the probe, the self-test and doctor use it
  strictly). ``auto`` lets torch
  choose, on CUDA among flash, memory-efficient and math only: cuDNN attention runs only when
  named, because with torch 2.11 (CUDA 13.0) on an H100 it faulted on FLUX.1-dev's attention
  (24 heads of 128, bf16; an illegal memory access, then every later kernel failed), where the
  other three ran (``benchmarks/sdpa_backends.py``, docs/benchmarks.md);
- :func:`default_attention`: the same ``auto`` as the process's default, for what runs outside
  the loop's context (the session and the inference commands call it when they place a model);
- :func:`loop_attention`: the training loop's context: the named backend, and math for the
  calls it has no kernel for (T5's masked attention, an fp32 VAE, reward models);
- :func:`probe_attention_backend`: a named backend must run the denoiser's attention alone, and
  ``cudnn`` must agree with memory-efficient attention on the run's model;
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

from ..distributed import any_rank
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
def loop_attention(name: str, device: torch.device, source: str = "<recipe>") -> Iterator[None]:
    """The training loop's attention: ``name`` where it can run, math for the calls it cannot
    serve. The denoiser's attention runs on ``name`` (torch prefers any other allowed backend to
    math, and :func:`probe_attention_backend` has checked that ``name`` runs the denoiser alone);
    the text encoders, the VAE and the reward models fall back to math where ``name`` has no kernel
    (on an H200 a run naming ``flash`` died in T5's attention, whose position bias is a mask, with
    "No available kernel"; an fp32 VAE has no flash kernel either). One set for the whole process:
    torch's switches are global, so a set that changed per component would change under the
    rollout and reward threads too. ``auto`` and ``math``: as :func:`attention_backend`."""
    if name in ("auto", "math"):
        with attention_backend(name, device, source):
            yield
        return
    check_attention_backend(name, device, source)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([getattr(SDPBackend, _SDPA_NAMES[name]), SDPBackend.MATH]):
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


def exact_float32(device: torch.device, denoiser: torch.nn.Module, mixed_precision: str = "no",
                  compute_dtype: torch.dtype | None = None) -> bool:
    """An fp32 denoiser on CUDA computes its convolutions in fp32: torch lets cuDNN use TF32 for
    them by default (``torch.backends.cudnn.allow_tf32``; its matmuls already default to full fp32).
    With TF32, Wan's Conv3d patch embedding and the editing models' VAE-encoded condition images
    depended on the batch they came in: on an H200 a sample alone differed from it in a batch by
    3e-4 of |v|, and the on-policy log-ratio of a tiny Wan reached 4e-6 against the 1e-6 an fp32
    recipe allows, so re-scoring a rollout in another micro-batch would stop the run. Process-wide
    (cuDNN's switch has no narrower scope); left alone for bf16/fp16 denoisers and mixed precision,
    whose convolutions are not fp32, so a bf16 Wan keeps its fp32 VAE's TF32 speed; so too for fp32
    weights an adapter computes with in another ``compute_dtype`` (its own autocast: a diffusers
    model's ``dtype`` below its ``denoiser_dtype``). Returns whether it switched TF32 off."""
    floats = [p.dtype for p in denoiser.parameters() if p.dtype.is_floating_point]
    computes_fp32 = compute_dtype in (None, torch.float32)
    fp32 = bool(floats) and set(floats) == {torch.float32} and computes_fp32
    if device.type != "cuda" or mixed_precision != "no" or not fp32:
        return False
    torch.backends.cudnn.allow_tf32 = False
    return True


#: largest relative deviation from a reference kernel's velocity (and, for cuDNN, its gradient)
#: that a run naming a backend accepts (the self-test's bf16 bound)
PROBE_TOLERANCE = 5e-2


def _velocity_and_gradient(model, x: torch.Tensor, sigma: torch.Tensor, text, backward: bool):
    if not backward:
        with torch.no_grad():
            return (model.velocity(x, sigma, text).float(),)
    x = x.clone().requires_grad_(True)
    velocity = model.velocity(x, sigma, text)
    (gradient,) = torch.autograd.grad(velocity.float().square().mean(), x)
    return velocity.detach().float(), gradient.float()


def _probe_pass(model, name: str, device: torch.device, inputs, backward: bool, source: str):
    """One sample through the denoiser with ``name`` the only backend; a refusal naming the field
    when it has no kernel for the model (an out-of-memory error is left as it is)."""
    cuda = [device] if device.type == "cuda" else []
    try:
        with attention_backend(name, device, source), torch.random.fork_rng(devices=cuda):
            found = _velocity_and_gradient(model, *inputs, backward)
            if device.type == "cuda":  # a kernel's fault surfaces here, not later outside the try
                torch.cuda.synchronize(device)
            return found
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise FlowrlError(f"attention_backend = {name!r} cannot run this model's attention here: {reason}",
                          where=_where(source, "attention_backend"), hint="use 'auto'") from None


def probe_attention_backend(model, name: str, device: torch.device, text, source: str = "<recipe>") -> float | None:
    """A backend a recipe names must run the denoiser's attention by itself (the loop lets math
    serve only what it cannot: :func:`loop_attention`): one sample's velocity, without gradient,
    with that backend alone, else the run is refused by name before the first rollout. ``cudnn``
    must also agree with a reference kernel (memory-efficient attention on CUDA: no score matrix
    the size of the sequence squared), the velocity and its gradient with respect to the latents:
    with torch 2.11 cuDNN attention faulted at FLUX.1-dev's shapes on an H100 and returned
    non-finite values for a tiny FLUX on an H200. Returns cuDNN's deviation (None otherwise)."""
    if name in ("auto", "math"):
        return None
    x = torch.randn((1, *model.latent_shape), generator=torch.Generator().manual_seed(0)).to(device)
    inputs = (x, torch.full((1,), 0.5, device=device), text)
    if name != "cudnn":
        _probe_pass(model, name, device, inputs, False, source)
        return None
    reference = "efficient" if device.type == "cuda" else "math"
    found = {b: _probe_pass(model, b, device, inputs, True, source) for b in (reference, "cudnn")}
    for p in model.denoiser.parameters():  # FSDP2 leaves zeros on the parameters the backward passed
        p.grad = None
    deviation = max(float((a - b).norm() / b.norm().clamp_min(1e-12)) for a, b in zip(found["cudnn"], found[reference]))
    if not deviation <= PROBE_TOLERANCE:  # NaN fails too
        where = _where(source, "attention_backend")
        raise FlowrlError(f"attention_backend = 'cudnn' disagrees with {reference} attention on this model: relative "
                          f"deviation {deviation:.3g} > {PROBE_TOLERANCE:g} (torch {torch.__version__})", where=where,
                          hint="use 'auto' (flash, efficient or math; never cuDNN)")
    return deviation


def prepare_kernels(model, train, device: torch.device, source: str = "<recipe>", probe_text=None, counter=None,
                    ctx=None):
    """What the training loop calls once the update is built: check ``[train].attention_backend``
    against the device and probe a named one on the model (:func:`probe_attention_backend`, given
    ``probe_text()``, one prompt's embeddings on the device; not counted by ``counter``; a refusal
    on any of ``ctx``'s processes refuses on all, so none waits for the others in a collective),
    compile the denoiser as ``[train].compile`` says, and return the attention context
    (:func:`loop_attention`) for the loop to run in."""
    check_attention_backend(train.attention_backend, device, source)
    if train.attention_backend not in ("auto", "math") and probe_text is not None:
        refusal = None
        with counter.paused() if counter is not None else contextlib.nullcontext():
            try:
                probe_attention_backend(model, train.attention_backend, device, probe_text(), source)
            except FlowrlError as error:
                refusal = error
        if ctx is not None and any_rank(refusal is not None, ctx) and refusal is None:
            refusal = FlowrlError(f"attention_backend = {train.attention_backend!r} was refused by another process's "
                                  "probe (its message says why)", where=_where(source, "attention_backend"),
                                  hint="use 'auto'")
        if refusal is not None:
            raise refusal
    compile_denoiser(model, train.compile, device, source)
    return loop_attention(train.attention_backend, device, source)


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
