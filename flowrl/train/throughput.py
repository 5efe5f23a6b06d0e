"""Throughput: images per second, the time to finish, model FLOPs and their utilisation (MFU).

At the start of a run the model FLOPs of ONE velocity evaluation for one sample are counted once
with :class:`torch.utils.flop_counter.FlopCounterMode` (matrix multiplications, convolutions and
attention, as PyTorch counts them): ``F_f`` for a forward, ``F_fb`` for a forward and backward.
They are run constants, written to ``RUN_DIR/run_info.json``. Per iteration, on each process::

    images/s per process = S / t_train
    model FLOPs          = S * N * F_f  +  P * sum_s(t_s) * F_fb
    MFU                  = model FLOPs / (t_train * peak FLOP/s of the device)
    ETA                  = iterations left * mean wall seconds per iteration so far

with ``S`` the process's samples per iteration, ``N`` the sampling steps (one velocity forward
each in the rollout), ``P`` the passes over the rollout (``updates_per_rollout``), ``t_s`` the
transitions sample ``s`` trains in the first pass (the sizes of its selected chunks; later passes
are assumed to train as many), and ``t_train`` the seconds of the iteration's training phases
(encode, rollout, decode, reward, advantage, update; not evaluation, re-profiling or the
checkpoint). Not counted, so MFU errs low: the KL pass, the lean chunk update's recomputation,
text encoding, decoding and reward models. The peak is the device's dense bf16 tensor-core
rate from a table of common GPUs (``FLOWRL_PEAK_TFLOPS`` overrides it); without a known peak
(every CPU) MFU is not reported. These numbers go to the trackers (``speed/*``) and the progress
bar, not into ``metrics.jsonl``, whose rows stay those of the run's results.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from .accel import attention_backend
from .run import Run

#: Dense bf16 tensor-core peaks in TFLOP/s (vendor data sheets), by a substring of the device name.
PEAK_TFLOPS = {"H200": 989.4, "H100 PCIe": 756.0, "H100": 989.4, "B200": 2250.0, "A100": 312.0,
               "L40S": 362.05, "A10G": 70.0, "RTX 4090": 165.2, "RTX 3090": 71.0}


def peak_tflops(device: torch.device) -> float | None:
    """The device's dense bf16 peak in TFLOP/s (``FLOWRL_PEAK_TFLOPS`` overrides); None if unknown."""
    if os.environ.get("FLOWRL_PEAK_TFLOPS"):
        return float(os.environ["FLOWRL_PEAK_TFLOPS"])
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def velocity_flops(session, prompt: str) -> tuple[int, int]:
    """``(F_f, F_fb)``: model FLOPs of one velocity forward, and of a forward and backward, for one
    sample. Draws no random numbers and leaves no gradient behind."""
    model, device = session.model, session.device
    x = torch.zeros((1, *model.latent_shape), device=device)
    sigma = torch.full((1,), 0.5, device=device)
    text = session.cache.get([prompt], device)
    params = [p for p in model.denoiser.parameters() if p.requires_grad]
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):  # a model that draws random numbers leaves the run's RNG as it was
        with FlopCounterMode(display=False) as forward:
            with torch.no_grad():
                model.velocity(x, sigma, text)
        with FlopCounterMode(display=False) as both:
            model.velocity(x, sigma, text).float().square().mean().backward()
    for p in params:
        p.grad = None
    return int(forward.get_total_flops()), int(both.get_total_flops())


class Throughput:
    """Per-iteration speed and the run constants behind it (see the module docstring)."""

    #: Phases that are measurement or upkeep, not training.
    NOT_TRAINING = ("eval", "profile", "checkpoint")

    def __init__(self, run: Run, prompt: str, start_iteration: int, counter=None):
        session, geometry = run.session, run.geometry
        recipe = session.recipe
        self.samples = geometry.samples_per_process
        self.steps = recipe.sampler.steps
        self.passes = geometry.updates_per_rollout
        # measuring, not training; on the loop's attention kernels (what torch would pick otherwise may fault)
        with counter.paused() if counter is not None else contextlib.nullcontext(), \
                attention_backend(recipe.train.attention_backend, session.device, recipe.source):
            self.forward, self.forward_backward = velocity_flops(session, prompt)
        self.peak = peak_tflops(session.device)
        self.total = recipe.train.iterations
        self.first = start_iteration
        self.started = time.monotonic()
        self.device = str(session.device)

    def constants(self) -> dict:
        return {
            "device": self.device, "peak_tflops": self.peak, "samples_per_process": self.samples,
            "sampling_steps": self.steps, "passes_per_rollout": self.passes,
            "flops": {"velocity_forward": self.forward, "velocity_forward_backward": self.forward_backward,
                      "rollout_per_iteration": self.samples * self.steps * self.forward,
                      "counted_with": "torch.utils.flop_counter.FlopCounterMode, one sample"},
        }

    def measure(self, seconds: dict[str, float], trained: torch.Tensor, sizes, done: int) -> dict[str, float]:
        """``speed/*`` of an iteration: ``seconds`` per phase, ``trained [S, K]`` the chunks each
        sample trained, ``done`` the iterations completed so far."""
        t_train = sum(v for k, v in seconds.items() if k not in self.NOT_TRAINING)
        transitions = float((trained.float() * torch.tensor(sizes, dtype=torch.float32)).sum())
        flops = self.samples * self.steps * self.forward + self.passes * transitions * self.forward_backward
        elapsed = time.monotonic() - self.started
        left = self.total - done
        out = {
            "speed/images_per_second": self.samples / t_train if t_train > 0 else 0.0,
            "speed/eta_seconds": elapsed / max(1, done - self.first) * left,
            "speed/model_tflops_per_second": flops / t_train / 1e12 if t_train > 0 else 0.0,
        }
        if self.peak:
            out["speed/mfu"] = out["speed/model_tflops_per_second"] / self.peak
        return out
