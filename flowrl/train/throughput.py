"""Throughput: images per second, the time to finish, model FLOPs and their utilisation (MFU).

At the start of a run the FLOPs of ONE velocity evaluation for one sample are counted once with
:class:`torch.utils.flop_counter.FlopCounterMode` (matrix multiplications, convolutions and
attention, as PyTorch counts them): ``F_f`` for a forward, ``F_fb`` for a forward and backward,
and ``F_fb+r`` for a forward and backward with the forwards that activation checkpointing
recomputes in the backward (``[distributed].activation_checkpointing``, a model's
``gradient_checkpointing``). They are run constants, written to ``RUN_DIR/run_info.json``
(``flops``: ``velocity_forward``, ``velocity_forward_backward``,
``velocity_forward_backward_with_recompute``). The count runs the model on fake latents
(:class:`torch._subclasses.fake_tensor.FakeTensorMode`: shapes, dtypes and devices without data),
which the counter counts as it counts real ones (its formulas read shapes): no activation takes
memory and nothing is computed but the model's small tensors made without the latents (the
timestep embedding, the text tokens' own layers). A real forward and
backward of one sample at the run's resolution was the run's memory peak on an H200 (Wan 2.1
1.3B LoRA at 832 x 480 x 33: 74.7 GiB, against 13.1 GiB in training; FLUX.1-dev LoRA 37.2 against
27.1), so a run ``flowrl plan`` fitted could run out of memory before training. A model that
cannot run on fake tensors (one that reads an activation's value into Python) is counted on real
ones, with a warning. Per iteration, on each process::

    images/s per process = S / t_train
    model FLOPs          = S * N * F_f  +  P * sum_s(t_s) * F_fb
    MFU                  = model FLOPs / (t_train * peak FLOP/s of the device)
    HFU                  = (S * N * F_f  +  P * sum_s(t_s) * F_fb+r) / (t_train * peak FLOP/s)
    ETA                  = iterations left * mean wall seconds per iteration so far

with ``S`` the process's samples per iteration, ``N`` the sampling steps (one velocity forward
each in the rollout), ``P`` the passes over the rollout (``updates_per_rollout``), ``t_s`` the
transitions sample ``s`` trains in the first pass (the sizes of its selected chunks; later passes
are assumed to train as many), and ``t_train`` the seconds of the iteration's training phases
(encode, rollout, decode, reward, advantage, update; not evaluation, re-profiling or the
checkpoint). An offline run (SFT or DPO on a ``[data]`` table) has no rollout: its model FLOPs
are ``P * S * p * F_fb`` (plus ``P * S * p * F_f`` for DPO's reference), with ``S`` the table rows
and ``p`` the points a row forwards (sides times ``[loss].timesteps``), the FLOPs counted on the
conditional velocity the offline objectives train.

MFU counts the model's FLOPs, not recomputation (the PaLM paper's definition, Chowdhery et al.
2022, appendix B); HFU ("hardware FLOPs utilisation") counts the checkpointed forwards again,
as the device runs them. The count tells them apart as it goes: an operation counted inside the
backward while autograd records (grad mode on) is a recomputed forward (torch.utils.checkpoint
recomputes under ``torch.enable_grad()``; the backward's own operations run with grad mode off).
So ``F_fb+r - F_fb`` is exactly what was recomputed, whichever way the blocks were checkpointed
(flowrl's wrapper, diffusers' ``enable_gradient_checkpointing``, reentrant or not, and whatever
non-reentrant checkpointing's early stop leaves out); without checkpointing the two are equal.
FLUX.1-dev with LoRA at 512 x 512: ``F_fb`` 46.4 TFLOP, ``F_fb+r`` 68.2 (every block's forward
once more, 21.8); MFU from ``F_fb+r`` would read 47% high.

Not counted, so MFU errs low: the KL pass, the lean chunk update's recomputation, text encoding,
decoding and reward models. Counted although no model FLOPs, so MFU errs high: the fused
attention kernels' recomputation of QK^T (torch's formula counts their backward as 2.5 forwards,
the model's is 2). On a CPU the counter sees no attention at all (torch has no formula for the
CPU kernel). :mod:`flowrl.train.flux_flops` counts FLUX.1 by hand, term by term, with and without
the recomputation, and agrees with both counts exactly (tests/test_flux_flop_count.py).

The peak is the device's dense (not 2:4 sparse) bf16 tensor-core rate from :data:`PEAK_TFLOPS`,
the vendors' figures (:data:`PEAK_SOURCES`), by the device's name (``FLOWRL_PEAK_TFLOPS``
overrides it); without a known peak (every CPU) neither MFU nor HFU is reported. These numbers go
to the trackers (``speed/*``) and the progress bar (MFU), not into ``metrics.jsonl``, whose rows
stay those of the run's results.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from ..interfaces import NeedsReferencePolicy, TrainsOnData
from ..objectives.offline import conditional_velocity
from .accel import loop_attention
from .run import Run

_log = logging.getLogger(__name__)

#: Dense bf16 tensor-core peaks in TFLOP/s (bf16 inputs, fp32 accumulation, no 2:4 sparsity), by
#: the model in the device's name as torch reports it (``torch.cuda.get_device_name``: "NVIDIA H100
#: 80GB HBM3" is the SXM5 board, "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB"). A key matches as
#: whole words and the longest match wins: "H100 PCIe" and "H100 NVL" before "H100". Vendor data
#: sheets print the sparse rate, footnoted "with sparsity"; the dense rate is half of it.
PEAK_TFLOPS = {
    "H100": 989.4, "H100 PCIe": 756.0, "H100 NVL": 835.5, "H200": 989.4, "H200 NVL": 835.5,
    "B200": 2250.0, "GB200": 2500.0, "A100": 312.0, "A10": 125.0, "A10G": 70.0, "L40S": 362.05, "L4": 121.0,
    "RTX 4090": 165.2, "RTX 3090": 71.0,
}
#: Where each peak comes from (the document, and its figure's footnote).
PEAK_SOURCES = {
    "H100": "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: BFLOAT16 Tensor Core 1,979 TFLOPS, footnoted "
            "'with sparsity'; 'NVIDIA H100 Tensor Core GPU Architecture' whitepaper, H100 SXM5: peak BF16 "
            "Tensor TFLOPS with FP32 accumulate 989.4 / 1978.9 (sparse)",
    "H100 PCIe": "NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe: BFLOAT16 Tensor Core 1,513 TFLOPS with "
                 "sparsity (756.5 dense); the architecture whitepaper's H100 PCIe column: 756 / 1513",
    "H100 NVL": "NVIDIA H100 NVL datasheet (one board): BFLOAT16 Tensor Core 1,671 TFLOPS with sparsity. "
                "Uncertain: the 2023 launch material quoted a pair of boards (3,958 TFLOPS sparse)",
    "H200": "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: BFLOAT16 Tensor Core 1,979 TFLOPS with "
            "sparsity (the H100 SXM's GH100 compute; more and faster memory)",
    "H200 NVL": "NVIDIA H200 Tensor Core GPU datasheet, H200 NVL: BFLOAT16 Tensor Core 1,671 TFLOPS with sparsity",
    "B200": "NVIDIA HGX B200 / DGX B200 datasheet, per GPU (1,000 W): FP16/BF16 Tensor Core 4.5 PFLOPS, "
            "footnoted 'with sparsity'",
    "GB200": "NVIDIA GB200 NVL72 datasheet: FP16/BF16 Tensor Core 10 PFLOPS per GB200 superchip (two B200 "
             "GPUs at up to 1,200 W), with sparsity: 5 sparse, 2.5 dense per GPU",
    "A100": "NVIDIA A100 Tensor Core GPU datasheet (40 and 80 GB, SXM4 and PCIe): BFLOAT16 Tensor Core "
            "312 TFLOPS | 624 TFLOPS, the second footnoted 'with sparsity'",
    "A10": "NVIDIA A10 Tensor Core GPU datasheet: BF16 Tensor Core 125 TF | 250 TF, the second with sparsity",
    "A10G": "No NVIDIA datasheet (an AWS part, EC2 G5). Uncertain: 70 TFLOPS dense bf16 as third parties "
            "list it (e.g. Baseten, 'NVIDIA A10 vs A10G for ML model inference')",
    "L40S": "NVIDIA L40S datasheet: BF16 Tensor Core 362.05 | 733 TFLOPS, the second with sparsity",
    "L4": "NVIDIA L4 Tensor Core GPU datasheet: BFLOAT16 Tensor Core 242 TFLOPS, footnoted 'with sparsity'",
    "RTX 4090": "'NVIDIA Ada GPU Architecture' whitepaper, GeForce RTX 4090: peak BF16 Tensor TFLOPS with "
                "FP32 accumulate 165.2 / 330.4 (sparse)",
    "RTX 3090": "'NVIDIA Ampere GA102 GPU Architecture' whitepaper, GeForce RTX 3090: peak BF16 Tensor TFLOPS "
                "with FP32 accumulate 71 / 142 (sparse)",
}


def peak_for(name: str) -> float | None:
    """The dense bf16 peak of the device called ``name`` (see :data:`PEAK_TFLOPS`); None if unknown."""
    found = [k for k in PEAK_TFLOPS if re.search(rf"(?<![A-Za-z0-9]){re.escape(k)}(?![A-Za-z0-9])", name)]
    return PEAK_TFLOPS[max(found, key=len)] if found else None


def peak_tflops(device: torch.device) -> float | None:
    """The device's dense bf16 peak in TFLOP/s (``FLOWRL_PEAK_TFLOPS`` overrides); None if unknown."""
    if os.environ.get("FLOWRL_PEAK_TFLOPS"):
        return float(os.environ["FLOWRL_PEAK_TFLOPS"])
    if device.type != "cuda":
        return None
    return peak_for(torch.cuda.get_device_name(device))


class VelocityFlops(NamedTuple):
    """FLOPs of one velocity evaluation for one sample (the module docstring)."""

    forward: int  # F_f
    forward_backward: int  # F_fb: the model's FLOPs, recomputation excluded (MFU)
    forward_backward_with_recompute: int  # F_fb+r: and the forwards checkpointing recomputes (HFU)


class _Recomputed:
    """torch's FLOP formulas (``flop_registry``), each wrapped to add what it counts inside the
    backward with grad mode on (a recomputed forward) to :attr:`flops`: pass :attr:`formulas` as
    ``FlopCounterMode(custom_mapping=...)`` and set :attr:`in_backward` around ``backward()``."""

    def __init__(self):
        self.in_backward = False
        self.flops = 0
        self.formulas = {op: self._tallied(formula) for op, formula in flop_registry.items()}

    def _tallied(self, formula):
        def counted(*args, **kwargs):
            flops = formula(*args, **kwargs)
            if self.in_backward and torch.is_grad_enabled():
                self.flops += flops
            return flops

        counted._get_raw = True  # takes the op's arguments as they come, as ``formula`` does
        return counted


def count_flops(velocity: Callable[[], torch.Tensor]) -> VelocityFlops:
    """:class:`VelocityFlops` of ``velocity()`` (one sample's velocity): a forward without grad,
    then a forward and the backward of a scalar of its output. Leaves its gradients behind."""
    with FlopCounterMode(display=False) as forward, torch.no_grad():
        velocity()
    recomputed = _Recomputed()
    with FlopCounterMode(display=False, custom_mapping=recomputed.formulas) as both:
        loss = velocity().float().square().mean()
        recomputed.in_backward = True
        try:
            loss.backward()
        finally:
            recomputed.in_backward = False
    total = int(both.get_total_flops())
    return VelocityFlops(int(forward.get_total_flops()), total - recomputed.flops, total)


def count_velocity_flops(session, prompt: str, *, fake: bool = True) -> VelocityFlops:
    """:class:`VelocityFlops` of the session's model, for one sample of ``prompt``, on fake tensors
    (shapes without data: no activation memory, no arithmetic; ``fake=False``: on real ones, as
    the count ran before, a run's memory peak). Leaves the run's random numbers as they were and no
    gradient behind."""
    model, device = session.model, session.device
    text = session.cache.get([prompt], device)
    params = [p for p in model.denoiser.parameters() if p.requires_grad]
    cuda = [device] if device.type == "cuda" else []
    # a model that draws random numbers leaves the run's RNG as it was; and a compiled denoiser runs
    # eagerly here: a first call under FlopCounterMode would leave torch.compile never compiling it
    try:
        with torch.random.fork_rng(devices=cuda), torch.compiler.set_stance("force_eager"):
            counted = _count_on_fake_tensors(model, device, text) if fake else None
            if counted is None:
                _forget_gradients(params)  # what a fake count that failed half-way left
                counted = count_flops(_one_sample(model, device, text, None))
        return counted
    finally:
        _forget_gradients(params)


def _forget_gradients(params: list[torch.nn.Parameter]) -> None:
    """Drop the counting backward's gradients: real ones, or fake ones left on real parameters
    (the run's first real backward would accumulate into them)."""
    for p in params:
        p.grad = None


def _count_on_fake_tensors(model, device: torch.device, text) -> VelocityFlops | None:
    """:func:`count_flops` on fake inputs; None (and a warning) where the model cannot run on them.
    FlopCounterMode counts from the operators' shapes, which fake tensors carry: the same count."""
    try:
        return count_flops(_one_sample(model, device, text, FakeTensorMode(allow_non_fake_inputs=True)))
    except Exception as error:  # any: an error of the model's own comes back from the real count
        # a value read into Python (.item(), a branch on a tensor), an output shape that depends on
        # values, a kernel outside torch's operators that reads the data: the caller counts on real
        # tensors, as before, at the cost of a real forward and backward (and their memory)
        _log.warning("flowrl: the model's FLOPs could not be counted on fake tensors (%s: %s); counting "
                     "them on real ones, one forward and backward of one sample", type(error).__name__, error)
        return None


def _one_sample(model, device: torch.device, text, mode: FakeTensorMode | None) -> Callable[[], torch.Tensor]:
    """``velocity()`` of one sample at the middle of the path, on latents that ``mode`` fakes
    (None: real ones).

    Only the latents are fake, and the mode is not entered for the forward. Every activation of the
    latent tokens (the memory: the image or video sequence through every block, kept for the
    backward) derives from them and so is fake too: a real parameter, or a real tensor, meets a fake
    one as a fake (the mode allows non-fake inputs), and the backward of a fake is fake. What a model
    computes without the latents stays real and small: the timestep embedding, the text tokens' own
    layers (until they join the image tokens; cross-attention's keys and values of the text), position
    ids, rotary tables. Real because models read them into Python (Qwen-Image trims the text padding
    by its mask, Z-Image cuts captions at their lengths and reads sigma for CFG: ``.item()`` on a
    fake raises), and because models keep such tensors across calls (the diffusers adapters'
    ``_device_constant``, Qwen-Image's ``lru_cache``d rotary frequencies): made inside a fake mode
    they would be kept fake (FLUX's ids and guidance: its next forward on real latents returned a
    fake velocity)."""
    with mode if mode is not None else contextlib.nullcontext():
        x = torch.zeros((1, *model.latent_shape), device=device)
    sigma = torch.full((1,), 0.5, device=device)
    return lambda: model.velocity(x, sigma, text)


def velocity_flops(session, prompt: str) -> tuple[int, int]:
    """``(F_f, F_fb)``: model FLOPs of one velocity forward, and of a forward and backward (no
    recomputation), for one sample (:func:`count_velocity_flops`)."""
    counted = count_velocity_flops(session, prompt)
    return counted.forward, counted.forward_backward


class Throughput:
    """Per-iteration speed and the run constants behind it (see the module docstring)."""

    #: Phases that are measurement or upkeep, not training.
    NOT_TRAINING = ("eval", "profile", "checkpoint", "kl_monitor")
    #: an offline objective's points per table row (0: an online run), and whether a reference forwards them too
    points, reference = 0, False

    def __init__(self, run: Run, prompt: str, start_iteration: int, counter=None):
        session, geometry = run.session, run.geometry
        recipe = session.recipe
        self.samples = geometry.samples_per_process
        self.steps = recipe.sampler.steps
        self.passes = geometry.updates_per_rollout
        # an offline objective (a [data] table): no rollout; each row's points (sides x timesteps) go
        # through the conditional velocity once with gradient, and once more through the reference
        loss = session.components.loss
        self.points = loss.sides * loss.K if isinstance(loss, TrainsOnData) else 0
        self.reference = bool(self.points) and isinstance(loss, NeedsReferencePolicy) and loss.needs_reference()
        # measuring, not training; on the loop's attention kernels (what torch would pick otherwise may fault)
        with counter.paused() if counter is not None else contextlib.nullcontext(), \
                conditional_velocity(session.model) if self.points else contextlib.nullcontext(), \
                loop_attention(recipe.train.attention_backend, session.device, recipe.source):
            self.forward, self.forward_backward, self.forward_backward_with_recompute = \
                count_velocity_flops(session, prompt)
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
                      "velocity_forward_backward_with_recompute": self.forward_backward_with_recompute,
                      "rollout_per_iteration": 0 if self.points else self.samples * self.steps * self.forward,
                      "offline_points_per_row": self.points,
                      "counted_with": "torch.utils.flop_counter.FlopCounterMode, one sample; "
                                      "velocity_forward_backward without the forwards activation "
                                      "checkpointing recomputes (MFU), _with_recompute with them (HFU)"},
        }

    def measure(self, seconds: dict[str, float], trained: torch.Tensor, sizes, done: int) -> dict[str, float]:
        """``speed/*`` of an iteration: ``seconds`` per phase, ``trained [S, K]`` the chunks each
        sample trained, ``done`` the iterations completed so far."""
        t_train = sum(v for k, v in seconds.items() if k not in self.NOT_TRAINING)
        if self.points:  # offline: the table's rows, every point forwarded with gradient (and by the reference)
            points = self.passes * self.samples * self.points
            extra = points * self.forward if self.reference else 0
            flops = points * self.forward_backward + extra
            hardware = points * self.forward_backward_with_recompute + extra
        else:
            transitions = float((trained.float() * torch.tensor(sizes, dtype=torch.float32)).sum())
            rollout = self.samples * self.steps * self.forward
            flops = rollout + self.passes * transitions * self.forward_backward
            hardware = rollout + self.passes * transitions * self.forward_backward_with_recompute
        elapsed = time.monotonic() - self.started
        left = self.total - done
        out = {
            "speed/images_per_second": self.samples / t_train if t_train > 0 else 0.0,
            "speed/eta_seconds": elapsed / max(1, done - self.first) * left,
            "speed/model_tflops_per_second": flops / t_train / 1e12 if t_train > 0 else 0.0,
        }
        if self.peak:
            out["speed/mfu"] = out["speed/model_tflops_per_second"] / self.peak
            out["speed/hfu"] = hardware / t_train / 1e12 / self.peak if t_train > 0 else 0.0
        return out
