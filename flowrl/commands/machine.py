"""This machine, as ``flowrl validate`` and ``flowrl train`` check a recipe against it: where
``[run].device`` puts the run (``auto`` takes the CPU where PyTorch sees no CUDA GPU), its RAM,
its GPU's memory, and what ``flowrl plan`` says of the recipe's memory there.

- On the CPU (``device = "cpu"``, or ``"auto"`` without a GPU) everything lives in RAM, shared
  by every process of the run: weights, gradients and optimizer state (exact parameter counts)
  beyond this machine's RAM are an error, a planned peak beyond it a warning; a GPU-sized model
  that ``auto`` puts on the CPU is said (``flowrl validate`` warns, ``flowrl train`` says so in
  one line before anything loads).
- On a GPU, a planned peak beyond its memory is a warning naming the keys that make it fit.

A helper of both commands (one command module never imports another); the devices a recipe
names are checked by :func:`flowrl.recipe.check_devices`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

from rich.markup import escape

from ..errors import FlowrlError
from .base import DEFAULT_GPU_MEMORY_GB, console, err_console, load, registry

#: A denoiser with at least this many parameters is a GPU model: every diffusers model flowrl
#: ships has more than 1e9, the embedded models about 1e6. Where ``[run].device = "auto"`` finds
#: no GPU, validate and train say that it trains on the CPU.
GPU_MODEL_PARAMS = 100_000_000


def host_memory_bytes() -> int | None:
    """This machine's RAM in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def visible_gpu_memory_gb() -> float | None:
    """The memory of this machine's first CUDA device in GB, when torch sees one."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / 2**30


def has_cuda() -> bool:
    """Whether PyTorch sees a CUDA GPU here (what ``[run].device = "auto"`` decides by), as the
    recipe's device check sees it (:func:`flowrl.recipe.startable.cuda_device_count`)."""
    from ..recipe import startable

    return startable.cuda_device_count() > 0


def runs_on_cpu(resolved) -> bool:
    """Whether the run trains on this machine's CPU: ``[run].device = "cpu"``, or ``"auto"``
    where PyTorch sees no CUDA GPU (:func:`flowrl.distributed.resolve_device`)."""
    return resolved.run.device == "cpu" or (resolved.run.device == "auto" and not has_cuda())


@dataclasses.dataclass
class Planned:
    """What the plan says of a recipe, per process."""

    total: float  # the GPU peak (on the CPU: what the same tensors take there)
    phase: str  # the phase of the peak
    exact: float  # the bytes known exactly: weights, LoRA, gradients, AdamW state, a reference, encoders, VAE
    host: float  # the bytes kept in CPU memory whatever the device (offloaded state, the prompt cache)
    params: int  # the denoiser's parameters


def plan(recipe, processes: int, gpu_memory_gb: float | None = None) -> Planned:
    """The plan of ``recipe`` at ``processes`` processes (from configs: no weights). fsdp2's
    gradient_sync ``"auto"`` decides against ``gpu_memory_gb``, as at start-up."""
    from ..memory_plan import GB, PROMPT_CACHE, TEXT_EMBEDDINGS, cpu_bytes, estimate, peak

    gpu = None if gpu_memory_gb is None else gpu_memory_gb * GB
    _, mm, lines = estimate(recipe, registry(), processes, gpu_memory=gpu)
    total, phase = peak(lines)
    # From exact parameter counts: weights, LoRA, gradients, AdamW state, a reference copy, encoders
    # and VAE (not the activations, trajectories, text embeddings, reward sizes or slack).
    inexact = ("CUDA context + allocator slack", "trajectories", TEXT_EMBEDDINGS, PROMPT_CACHE)
    exact = sum(l.bytes for l in lines if l.phase in ("persistent", "cpu") and l.item not in inexact
                and not l.item.startswith("reward "))
    return Planned(total, phase, exact, cpu_bytes(lines), mm.denoiser_params)


def _processes(n: int) -> str:
    return f"{n} process{'es' if n > 1 else ''}"


def warn(text: str) -> None:
    """One warning line on stderr (never wrapped: a log reader greps it whole)."""
    err_console.print("[yellow]warning:[/yellow] " + escape(text), highlight=False, soft_wrap=True)


#: A planned peak beyond this many times the RAM is refused (between 1x and this, a warning): the
#: plan's activation estimates are measured per sample and agree with autograd's saved tensors
#: within about 30%, so a peak this far beyond the RAM cannot be an overestimate.
REFUSE_ABOVE = 1.5
#: The keys that shrink each phase's peak, for the refusal's hint.
LOWER = {
    "rollout": "[sampler].batch_size (roll out in parts), [train].group_size or [train].prompts_per_iteration",
    "update": "[train].micro_batch_size, or [train].group_size and prompts_per_iteration",
    "decode": "[sampler].batch_size, or [train].group_size and prompts_per_iteration",
}


def check_cpu_memory(resolved, planned: Planned, processes: int, say=warn, *, training: bool = False) -> None:
    """The run trains on the CPU (:func:`runs_on_cpu`): everything is in RAM (no CUDA context), and
    every process of the run shares it. Weights and optimizer state beyond the RAM are an error, and
    so is a planned peak beyond :data:`REFUSE_ABOVE` times it; a GPU-sized model that ``auto`` put
    here, and a planned peak beyond the RAM, are ``say``-ed (``training``: by ``flowrl train``, as it
    starts)."""
    from ..memory_plan import CUDA_OVERHEAD, GB

    auto, recipe = resolved.run.device == "auto", resolved.source
    model = resolved.components["model"].use
    ram = host_memory_bytes()
    if ram is None:
        return
    total = (planned.total - CUDA_OVERHEAD + planned.host) * processes
    exact = planned.exact * processes
    what = (f"this machine's {ram / GB:.1f} GB of RAM "
            + ("([run].device = 'auto', and PyTorch sees no CUDA GPU here: the run trains on the CPU)" if auto
               else "([run].device = 'cpu')"))
    if exact > ram:
        raise FlowrlError(
            f"the model's weights, gradients and optimizer state alone need {exact / GB:.1f} GB "
            f"({_processes(processes)}; from exact parameter counts, as `flowrl plan` adds them), more than {what}",
            where=f"{resolved.source}: [run].device",
            hint=(f"train on a machine with a GPU (`flowrl validate {recipe} --gpu-memory 80` checks the recipe for "
                  "one), " if auto else "train on a GPU (device = 'auto' or 'cuda'), ")
                 + f"or a smaller model; `flowrl plan {recipe}` prints every line")
    if auto and planned.params >= GPU_MODEL_PARAMS:
        tail = (" (--set run.device=cpu says the CPU is meant)" if training else
                f"; `flowrl validate {recipe} --gpu-memory 80` checks the recipe for a GPU instead, and "
                "--set run.device=cpu says the CPU is meant")
        say(f"{recipe}: PyTorch sees no CUDA GPU here, so [run].device = 'auto' trains model '{model}' "
            f"({planned.params / 1e9:.1f}e9 parameters) on the CPU{tail}")
    if total > REFUSE_ABOVE * ram:
        raise FlowrlError(
            f"`flowrl plan` estimates a peak of {total / GB:.1f} GB in all (persistent + the {planned.phase} phase, "
            f"at {_processes(processes)}), more than {REFUSE_ABOVE:g} x {what}: the kernel would kill the run",
            where=f"{resolved.source}: [train]",
            hint=f"lower {LOWER[planned.phase] if planned.phase in LOWER else LOWER['rollout']}; "
                 f"`flowrl plan {recipe}` prints every line")
    if total > ram:
        say(f"{recipe}: `flowrl plan` estimates a peak of {total / GB:.1f} GB in all (persistent + the "
            f"{planned.phase} phase, at {_processes(processes)}), more than {what}; see `flowrl plan`'s suggestions "
            f"(`flowrl plan {recipe}` prints every line)")


def check_memory(path: Path, overrides: list[str], resolved, gpu_memory: float | None) -> None:
    """``flowrl validate``: what `flowrl plan` knows before any model loads. A run on the CPU
    (``device = "cpu"``, or ``"auto"`` where PyTorch sees no GPU and ``--gpu-memory`` names none)
    is checked against this machine's RAM (:func:`check_cpu_memory`); on a GPU (--gpu-memory,
    else this machine's GPU, else the plan's 80 GB), a peak beyond it is a warning naming the
    keys that would make it fit. The plan works from configs (no weights), at the recipe's
    [distributed].num_processes."""
    from ..memory_plan import GB

    processes = resolved.distributed.num_processes
    on_cpu = resolved.run.device == "cpu" or (gpu_memory is None and runs_on_cpu(resolved))
    memory = None if on_cpu else gpu_memory or visible_gpu_memory_gb() or DEFAULT_GPU_MEMORY_GB
    try:
        planned = plan(resolved, processes, memory)
    except FlowrlError:
        return  # `flowrl plan` reports what keeps it from planning; validation stays as it was
    if on_cpu:
        check_cpu_memory(resolved, planned, processes)
        return
    limit = memory * GB
    if planned.total <= limit:
        return

    def fits(fixes: list[str]) -> bool:
        try:
            return plan(load(path, overrides + fixes), processes, memory).total <= limit
        except FlowrlError:
            return False

    candidates = _memory_fixes(resolved)  # the keys that make it fit, each alone, else all of them together
    alone = [fix for fix in candidates if fits([fix])]
    if alone:
        said = f"each of these makes it fit: {', '.join(_set_flag(f) for f in alone)}"
    elif len(candidates) > 1 and fits(candidates):
        said = f"these together make it fit: {' '.join(_set_flag(f) for f in candidates)}"
    else:
        said = f"no change of these keys makes it fit at {_processes(processes)}: see `flowrl plan`'s suggestions"
    warn(f"{resolved.source}: `flowrl plan` estimates a peak of {planned.total / GB:.1f} GB per process "
         f"(persistent + the {planned.phase} phase, at {_processes(processes)}), more than the {memory:g} GB of one "
         f"GPU; {said} (`flowrl plan {path} --gpu-memory {memory:g}` prints every line)")


def check_training_machine(resolved, processes: int, local_processes: int | None = None) -> None:
    """``flowrl train``, before anything loads: on the CPU (:func:`runs_on_cpu`), the RAM check of
    ``flowrl validate`` at this run's ``processes`` (``local_processes`` of them on this machine),
    with its warnings as one line each on the run's console. On a GPU nothing is checked here
    (the run's own out-of-memory message names `flowrl plan`). The plan is advice here: a recipe
    it cannot plan trains as before."""
    if not runs_on_cpu(resolved):
        return
    try:
        with random_state_kept():  # a model the plan builds to measure it draws no number the run would draw
            planned = plan(resolved, processes)
    except Exception:  # noqa: BLE001 - the plan's own failure is not the run's
        return
    check_cpu_memory(resolved, planned, local_processes or processes, training=True,
                     say=lambda text: console.print("[yellow]warning:[/yellow] " + escape(text), highlight=False,
                                                    soft_wrap=True))


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """The global random generators (torch's CPU one, Python's, NumPy's) as they were before the
    block: what runs in it (a small model built and measured by the plan, its weights initialised
    at random first) leaves the run's own draws as they would have been without it."""
    import random

    import numpy as np
    import torch

    python, legacy = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(legacy)


def _set_flag(override: str) -> str:
    return f"--set '{override}'" if '"' in override else f"--set {override}"


def _memory_fixes(resolved) -> list[str]:
    """``--set`` overrides that lower the planned peak, each one the recipe does not use yet."""
    t, d, model = resolved.train, resolved.distributed, resolved.components["model"].params
    fixes = []
    if t.micro_batch_size > 1:
        fixes.append("train.micro_batch_size=1")
    if getattr(model, "gradient_checkpointing", True) is False:
        fixes.append("model.gradient_checkpointing=true")
    elif not d.activation_checkpointing and not hasattr(model, "gradient_checkpointing"):
        fixes.append("distributed.activation_checkpointing=true")
    if getattr(model, "offload_encoders", True) is False:
        fixes.append("model.offload_encoders=true")
    if t.finetune == "full":
        fixes.append('train.finetune="lora"')
    if d.num_processes > 1 and d.strategy != "fsdp2":
        fixes.append('distributed.strategy="fsdp2"')
    for i, reward in enumerate(resolved.rewards):
        if getattr(reward.params, "offload", True) is False:
            fixes.append(f"rewards.{i}.offload=true")
    return fixes
