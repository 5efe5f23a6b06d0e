"""Rollouts in lower precision (``[sampler].rollout_precision = "fp8"``) and the update's
correction for them (``[sampler].rollout_correction``).

The rollout's denoiser forwards run on a copy of the trained denoiser whose linear layers are
quantised to FP8 (torchao: float8 activations and weights, scaled per row, so the matmuls run in
FP8 on GPUs of compute capability 8.9 or higher). The copy is made again before every rollout, from
the weights the last update left, so it never lags them; the trained weights stay in their own
precision. The samples are then drawn by a policy ``mu`` a little off the trained ``pi_theta``, and
the rollout's log-probs are ``mu``'s. The update corrects for it in one of two ways:

- ``rescore`` (the default): before the update, each trained transition's log-prob is computed
  again with the trained weights, in the training precision (one forward without grad per
  trained transition, counted as the ``rescore`` phase). The ratio's denominator is then
  ``pi_theta_old``, exactly as if the rollout had run in full precision, and the on-policy fast
  path stays exact; what remains is that the samples are ``mu``'s, not ``pi_theta_old``'s.
- ``importance``: no extra forward. The rollout's own log-probs stay the denominator, so the
  first optimizer step's ratio ``pi_theta / mu = exp(log pi_theta - log mu)`` is the importance
  weight of ``mu``'s samples under the trained policy, clipped by the loss like any ratio. The
  ratios are not 1 at the first step, so the update takes its exact off-policy path there (the
  fast path is off).

FP8 needs the hardware: any other device is refused with one message before the model loads, and
so is more than one process (the copy is of a whole, unsharded denoiser). The pure parts
(:func:`copy_for_rollout`, :func:`rescore_log_probs`) take the quantiser as an argument, so the
tests run them on the CPU with torchao's weight-only FP8 as the simulated quantisation error.
"""

from __future__ import annotations

import contextlib
import copy
import types
from collections.abc import Callable, Iterator

import torch

from ..errors import FlowrlError, require
from .rollout import rescore_transition

#: Compute capability FP8 matmuls need (Ada, Hopper, Blackwell).
FP8_CAPABILITY = (8, 9)

Quantiser = Callable[[torch.nn.Module], torch.nn.Module]


def fp8_support(device: torch.device) -> str | None:
    """Why ``device`` cannot run FP8 rollouts, or None when it can."""
    if device.type != "cuda":
        return f"this run's device is {device.type}, and FP8 matmuls need a CUDA GPU"
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (f"{name} has compute capability {capability[0]}.{capability[1]}, and FP8 matmuls need "
                f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or higher (Ada, Hopper, Blackwell)")
    return None


#: peft's adapter matrices inside a LoRA layer (``...to_q.lora_A.default``): left out of FP8
LORA_PARTS = frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"})


def fp8_layers(module: torch.nn.Module) -> set[str]:
    """The qualified names of the Linear layers an FP8 rollout copy quantises: every one but a LoRA
    adapter's own matrices, which are small, trained in float32, and which torchao's per-row FP8
    would refuse (it takes bfloat16 weights only); the LoRA's base layer is quantised."""
    return {name for name, sub in module.named_modules()
            if isinstance(sub, torch.nn.Linear) and not LORA_PARTS.intersection(name.split("."))}


def fp8_quantiser(config=None) -> Quantiser:
    """torchao's FP8 quantisation of a module's linear layers (:func:`fp8_layers`), in place:
    float8 activations and weights, scaled per row (``pip install "flowrl-diffusion[fp8]"``);
    ``config``: another torchao config (the tests' weight-only FP8 on the CPU). A layer stored in
    float32 (full fine-tuning's master weights) is cast to bfloat16 first, in the copy: per-row FP8
    takes bfloat16 weights, and the run computes in bfloat16 (validation requires it)."""
    require("torchao", extra="fp8", purpose="FP8 rollouts ([sampler].rollout_precision = 'fp8')")
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    config = config if config is not None else Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())

    def quantise(module: torch.nn.Module) -> torch.nn.Module:
        names = fp8_layers(module)
        for name in names:
            module.get_submodule(name).to(torch.bfloat16)
        quantize_(module, config, filter_fn=lambda layer, fqn: fqn in names)
        return module

    return quantise


def copy_for_rollout(denoiser: torch.nn.Module, quantise: Quantiser) -> torch.nn.Module:
    """A quantised copy of ``denoiser`` for sampling: no grad, eval mode, ``quantise`` applied.
    Forward hooks are kept and their owners shared, not copied (the compute counter that watches
    the denoiser counts the copy's rollout forwards)."""
    memo: dict[int, object] = {}
    for hook in denoiser._forward_hooks.values():
        if isinstance(hook, types.MethodType):  # the owner is shared, not deep-copied
            memo[id(hook.__self__)] = hook.__self__
    with torch.no_grad():
        made = copy.deepcopy(denoiser, memo).requires_grad_(False).eval()
        return quantise(made)


@contextlib.contextmanager
def sampling_with(model, quantise: Quantiser) -> Iterator[None]:
    """Inside, ``model.denoiser`` is a quantised copy of itself (:func:`copy_for_rollout`); the
    trained module is put back on leaving, and the copy dropped."""
    trained = model.denoiser
    model.denoiser = copy_for_rollout(trained, quantise)
    try:
        yield
    finally:
        model.denoiser = trained


def rescore_log_probs(velocity: Callable, trajectory, batch_size: int = 0) -> None:
    """Replace ``trajectory.log_probs`` at its trainable transitions by ``velocity``'s (the trained
    policy, without grad), one transition at a time in sub-batches of ``batch_size`` samples (0:
    all): the ``rescore`` correction. The samples and the other fields are left as they are."""
    n = trajectory.latents.shape[0]
    size = batch_size or n
    steps = torch.nonzero(trajectory.trainable.cpu(), as_tuple=False).flatten().tolist()
    with torch.no_grad():
        for lo in range(0, n, size):
            rows = torch.arange(lo, min(lo + size, n))
            fn, at = velocity(rows), rows.to(trajectory.log_probs.device)
            for i in steps:
                trajectory.log_probs[at, i] = rescore_transition(fn, trajectory, i, rows).log_prob.to(trajectory.log_probs.dtype)


def check_rollout_precision(precision: str, device: torch.device, world_size: int, where: str) -> None:
    """One message when FP8 rollouts cannot run here (a device without FP8, several processes)."""
    if precision == "train":
        return
    why = fp8_support(device)
    if why is not None:
        raise FlowrlError(f"rollout_precision = 'fp8': {why}", where=where,
                          hint="remove it (rollouts then run in the training precision), or train on an FP8 GPU")
    if world_size > 1:
        raise FlowrlError(f"rollout_precision = 'fp8' runs on one process for now; this run has {world_size}",
                          where=where, hint="remove it, or train on one process")
    fp8_quantiser()  # torchao installed (flowrl-diffusion[fp8]): one message now, not after the model loads
