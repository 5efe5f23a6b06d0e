"""Conformance suite for model adapters: the properties the GRPO engine relies on.

Run it on any :class:`flowrl.interfaces.ModelAdapter` (built-in or third-party)::

    from flowrl.testing.conformance import check_adapter
    report = check_adapter(MyAdapter(...))      # raises AssertionError listing every failure
    print(report.summary())

or one pytest test per check::

    import pytest
    from flowrl.testing import conformance

    @pytest.mark.parametrize("check", conformance.CHECK_NAMES)
    def test_conformance(my_adapter, check):
        conformance.run_check(my_adapter, check)

The checks (each documented on its function):

- ``interface``: attributes and methods exist; ``encode_prompts`` returns tensors with the
  batch on dim 0; ``sigmas`` is None or a valid schedule.
- ``velocity_calls_denoiser``: ``velocity`` goes through ``adapter.denoiser`` (so LoRA, DDP
  and FSDP wrappers are used).
- ``sde_noise0_equals_ode``: an SDE kernel with noise 0 reproduces ODE sampling.
- ``on_policy_ratio``: re-scoring a rollout's transitions (in a different batch composition)
  gives ratio 1 within ``ratio_tol``.
- ``batch_independence``: a sample's velocity does not depend on the rest of the batch.
- ``sigma_direction``: sigma = 1 is noise; the denoiser's timestep grows with sigma in
  proportion (FLUX: t = sigma, SD3: t = 1000 sigma), or is exactly the adapter's declared
  ``timestep_from_sigma(sigma)`` for a model whose time runs the other way (Z-Image:
  t = 1 - sigma); the model's own schedule runs 1 -> 0.
- ``decode``: ``decode`` returns float32 ``[B, 3, H, W]`` in [0, 1] (a video model: clips
  ``[B, F, 3, H, W]``).
- ``lora_noop``: attaching LoRA (the engine's own code path) leaves the velocity unchanged,
  trains only LoRA matrices, and a non-zero LoRA does change the velocity.
- ``reference_model``: when the adapter offers ``reference_velocity``, it is the base model's
  velocity after the policy has changed (LoRA disabled, or a frozen copy for full fine-tuning).
- ``shardable_blocks``: FSDP2 and activation checkpointing find the denoiser's blocks (the
  adapter's ``shardable_blocks()``, which must name submodules none inside another, or the
  ``*blocks`` module lists); the note says what share of the parameters they hold.
- ``condition``: an image-editing adapter (:class:`flowrl.interfaces.TakesConditionImage`) gives
  different velocities for the same prompt with different condition images. Such an adapter gets
  prompts that carry condition images in every check (:func:`conditioned_prompts`, unless
  ``prompts`` already carry their own), so batch independence and the on-policy check cover the
  condition too.

Checks that modify the model (``lora_noop``, ``reference_model``) work on a deep copy.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from flowrl.errors import FlowrlError
from flowrl.interfaces import (
    DeclaresTimestep,
    EncodesImages,
    HasLoraTargets,
    HasReferencePolicy,
    HasShardableBlocks,
    ModelAdapter,
    TakesConditionImage,
    select_embeddings,
)
from flowrl.prompts import PromptRow, condition_of
from flowrl.recipe import TrainConfig
from flowrl.sampling.rollout import rollout, transition_log_prob
from flowrl.sampling.schedules import shifted_sigmas, validate_sigmas
from flowrl.sampling.kernels import DanceKernel, FlowKernel, ODEKernel
from flowrl.train.finetune import prepare_trainable
from flowrl.train.parallel import declared_blocks, transformer_blocks

__all__ = ["ConformanceOptions", "ConformanceReport", "CHECKS", "CHECK_NAMES", "check_adapter", "run_check"]

DEFAULT_PROMPTS = ("a red cat", "the blue dog", "a dog on the red mat", "a cat")


@dataclasses.dataclass
class ConformanceOptions:
    """Knobs of the suite. Tolerances suit float32 models; loosen them for bf16 adapters."""

    prompts: Sequence[str] | None = None  #: None: the adapter's prompt_source(), else DEFAULT_PROMPTS
    num_steps: int = 4
    seed: int = 0
    ratio_tol: float = 1e-6  #: max |log ratio| on-policy (the engine's on_policy_tolerance default)
    rtol: float = 1e-4  #: batch independence: |dv| <= rtol * max|v| + atol
    atol: float = 1e-5
    lora_rank: int = 4


@dataclasses.dataclass
class CheckResult:
    name: str
    passed: bool
    message: str
    seconds: float


@dataclasses.dataclass
class ConformanceReport:
    results: list[CheckResult]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if not r.passed]

    def summary(self) -> str:
        lines = []
        for r in self.results:
            mark = "ok  " if r.passed else "FAIL"
            lines.append(f"{mark} {r.name:<26} {r.seconds:6.2f}s  {r.message}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------ helpers


def _device(adapter) -> torch.device:
    try:
        return next(adapter.denoiser.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def _prompts(adapter, opts: ConformanceOptions, count: int = 4) -> list[str]:
    if opts.prompts is not None:
        pool = list(opts.prompts)
    else:
        pool = list(adapter.prompt_source() or DEFAULT_PROMPTS)
    chosen = [pool[i % len(pool)] for i in range(count)]
    if isinstance(adapter, TakesConditionImage) and not any(condition_of(p) for p in chosen):
        chosen = conditioned_prompts(chosen, adapter.condition_size)
    return chosen


_CONDITION_DIRS: dict[tuple[int, int], Path] = {}


def condition_image_paths(size: tuple[int, int], count: int = 4) -> list[str]:
    """``count`` seeded random RGB images of ``size`` (height, width), written once per process."""
    from PIL import Image

    if size not in _CONDITION_DIRS:
        _CONDITION_DIRS[size] = Path(tempfile.mkdtemp(prefix="flowrl-conformance-"))
    root = _CONDITION_DIRS[size]
    out = []
    for i in range(count):
        path = root / f"condition_{i}.png"
        if not path.is_file():
            g = torch.Generator().manual_seed(1000 + i)
            pixels = (torch.rand(size[0], size[1], 3, generator=g) * 255).to(torch.uint8).numpy()
            Image.fromarray(pixels).save(path)
        out.append(str(path))
    return out


def conditioned_prompts(prompts: Sequence[str], size: tuple[int, int]) -> list[PromptRow]:
    """The prompts, each carrying its own condition image (for editing adapters)."""
    paths = condition_image_paths(size, len(prompts))
    return [PromptRow(str(p), path) for p, path in zip(prompts, paths)]


def _noise(adapter, count: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(count, *adapter.latent_shape, generator=g).to(_device(adapter))


def _inputs(adapter, opts: ConformanceOptions, count: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``count`` prompts encoded by the adapter, and starting noise ``[count, *latent_shape]``."""
    text = adapter.encode_prompts(_prompts(adapter, opts, count))
    return text, _noise(adapter, count, opts.seed)


def _sigmas(adapter, opts: ConformanceOptions) -> torch.Tensor:
    own = adapter.sigmas(opts.num_steps)
    sig = own if own is not None else shifted_sigmas(opts.num_steps, 3.0)
    return sig.to(_device(adapter), torch.float32)


def _velocity_fn(adapter, text):
    return lambda x, s: adapter.velocity(x, s, text)


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    diff = (a.float() - b.float()).abs().max().item()
    return diff, b.float().abs().max().item()


# ------------------------------------------------------------------------------------ checks


@torch.no_grad()
def check_interface(adapter, opts: ConformanceOptions) -> str:
    """Attributes and methods exist; text embeddings are tensors with the batch on dim 0."""
    missing = [name for name in ("denoiser", "latent_shape", "to", "encode_prompts", "velocity", "decode",
                                 "trainable_parameters", "sigmas", "prompt_source") if not hasattr(adapter, name)]
    assert not missing and isinstance(adapter, ModelAdapter), f"not a flowrl.interfaces.ModelAdapter: missing {missing}"
    assert isinstance(adapter.denoiser, torch.nn.Module), "adapter.denoiser must be an nn.Module"
    shape = adapter.latent_shape
    assert isinstance(shape, tuple) and shape and all(isinstance(d, int) and d > 0 for d in shape), (
        f"latent_shape must be a tuple of positive ints, got {shape!r}"
    )
    ships = getattr(type(adapter), "ships_prompts", None)  # what validation reads without building it
    assert ships is None or ships == bool(adapter.prompt_source()), (
        f"{type(adapter).__name__}.ships_prompts = {ships}, but prompt_source() returns "
        f"{'prompts' if adapter.prompt_source() else 'none'}"
    )
    prompts = _prompts(adapter, opts, 3)
    text = adapter.encode_prompts(prompts)
    assert isinstance(text, dict) and text, "encode_prompts must return a non-empty dict of tensors"
    for k, v in text.items():
        assert torch.is_tensor(v), f"text embedding '{k}' is not a tensor"
        assert v.shape[0] == len(prompts), f"text embedding '{k}' has batch {v.shape[0]} for {len(prompts)} prompts"
    single = adapter.encode_prompts(prompts[1:2])
    for k, v in single.items():
        diff, scale = _max_rel(v, text[k][1:2])
        assert diff <= opts.rtol * scale + opts.atol, (
            f"encode_prompts is not per-prompt: '{k}' of prompt 1 differs by {diff:.3g} when encoded alone"
        )
    sig = adapter.sigmas(opts.num_steps)
    if sig is not None:
        try:
            sig = validate_sigmas(sig)
        except ValueError as exc:
            raise AssertionError(f"adapter.sigmas({opts.num_steps}) is not a valid schedule: {exc}") from exc
        assert sig.numel() == opts.num_steps + 1, f"sigmas({opts.num_steps}) has {sig.numel()} values"
    return f"latent_shape={shape}, text keys={sorted(text)}"


@torch.no_grad()
def check_velocity_calls_denoiser(adapter, opts: ConformanceOptions) -> str:
    """``velocity`` must call ``self.denoiser`` (the engine wraps or adapts that module)."""
    calls = []
    handle = adapter.denoiser.register_forward_hook(lambda m, a, o: calls.append(1))
    try:
        text, x = _inputs(adapter, opts, 2)
        sig = torch.full((2,), 0.5, device=_device(adapter))
        v = adapter.velocity(x, sig, text)
    finally:
        handle.remove()
    assert calls, "velocity() did not call adapter.denoiser; it must go through self.denoiser(...)"
    assert tuple(v.shape) == (2, *adapter.latent_shape), f"velocity shape {tuple(v.shape)}"
    return f"{len(calls)} denoiser call(s) per velocity"


@torch.no_grad()
def check_sde_noise0_equals_ode(adapter, opts: ConformanceOptions) -> str:
    """The flow and dance SDE kernels with noise 0 give exactly the ODE (Euler) trajectory."""
    text, noise = _inputs(adapter, opts, 2)
    sig = _sigmas(adapter, opts)
    ode = rollout(_velocity_fn(adapter, text), noise, sig, ODEKernel(), image_from="final")
    worst = 0.0
    for kernel in (FlowKernel(a=0.0), DanceKernel(eta=0.0)):
        gens = [torch.Generator().manual_seed(i) for i in range(2)]
        sde = rollout(_velocity_fn(adapter, text), noise, sig, kernel, generators=gens, image_from="final")
        diff, scale = _max_rel(sde.latents, ode.latents)
        assert diff <= opts.rtol * scale + opts.atol, f"{kernel.name} kernel with noise 0 differs from ODE by {diff:.3g}"
        worst = max(worst, diff)
    return f"max |x_sde - x_ode| = {worst:.2g}"


@torch.no_grad()
def check_on_policy_ratio(adapter, opts: ConformanceOptions) -> str:
    """Rollout log-probs re-scored by the same model give |log ratio| <= ratio_tol, also when the
    re-scoring batch is a reordered sub-batch (as the engine's micro-batches are)."""
    text, noise = _inputs(adapter, opts, 4)
    sig = _sigmas(adapter, opts)
    gens = [torch.Generator().manual_seed(opts.seed * 100 + i) for i in range(4)]
    traj = rollout(_velocity_fn(adapter, text), noise, sig, FlowKernel(a=0.7), generators=gens, image_from="x0_hat")
    worst = 0.0
    for idx in (torch.arange(4), torch.tensor([2, 0]), torch.tensor([3])):
        idx = idx.to(_device(adapter))
        sub = select_embeddings(text, idx)
        for i in traj.trainable_indices.tolist():
            lp = transition_log_prob(_velocity_fn(adapter, sub), traj, i, idx)
            dev = (lp - traj.log_probs[idx, i]).abs().max().item()
            assert math.isfinite(dev), f"non-finite log-prob at step {i}"
            worst = max(worst, dev)
    assert worst <= opts.ratio_tol, (
        f"on-policy |log ratio| = {worst:.3g} > {opts.ratio_tol:g}: rollout and re-scoring disagree "
        "(non-deterministic velocity? dtype casts? batch-dependent computation?)"
    )
    return f"max |log ratio| = {worst:.2g}"


@torch.no_grad()
def check_batch_independence(adapter, opts: ConformanceOptions) -> str:
    """A sample's velocity is the same alone, in a batch, and in a reordered batch."""
    text, x = _inputs(adapter, opts, 4)
    sig = torch.tensor([0.9, 0.6, 0.3, 0.1], device=_device(adapter))
    full = adapter.velocity(x, sig, text)
    order = torch.tensor([3, 1, 0, 2], device=x.device)
    perm = adapter.velocity(x[order], sig[order], select_embeddings(text, order))
    diff, scale = _max_rel(perm, full[order])
    worst = diff
    assert diff <= opts.rtol * scale + opts.atol, f"reordering the batch changes velocities by {diff:.3g}"
    for i in (0, 3):
        idx = torch.tensor([i], device=x.device)
        alone = adapter.velocity(x[idx], sig[idx], select_embeddings(text, idx))
        diff, scale = _max_rel(alone, full[idx])
        worst = max(worst, diff)
        assert diff <= opts.rtol * scale + opts.atol, f"sample {i} alone differs from in-batch by {diff:.3g}"
    return f"max |dv| = {worst:.2g} (|v| up to {scale:.3g})"


def _timestep_of(args, kwargs):
    t = kwargs.get("timestep", None)
    if t is None:
        for a in args[1:]:
            if torch.is_tensor(a) and a.ndim <= 1 and a.is_floating_point():
                t = a
                break
    return t


@torch.no_grad()
def check_sigma_direction(adapter, opts: ConformanceOptions) -> str:
    """Sigma 1 is noise and 0 is data: the timestep the denoiser receives is ``c * sigma`` with one
    constant ``c > 0`` (not ``1 - sigma``), the velocity depends on sigma, and the adapter's own
    schedule (if any) starts near 1 and decreases to 0.

    An adapter whose model takes another function of sigma (Z-Image's time runs from 0 = noise to
    1 = data) declares it as ``adapter.timestep_from_sigma(sigma) -> t``; the denoiser must then
    receive exactly that. Whether the declared map is the model's real convention is a property
    of the model, which only a comparison with the model's own sampler can prove (test that too).
    """
    seen: list[torch.Tensor] = []

    def hook(module, args, kwargs):
        t = _timestep_of(args, kwargs)
        if t is not None:
            # the largest: a timestep per token (Wan 2.2) gives a clean conditioning frame's tokens 0
            seen.append(t.detach().float().reshape(-1).max().cpu())

    handle = adapter.denoiser.register_forward_pre_hook(hook, with_kwargs=True)
    text, x = _inputs(adapter, opts, 1)
    levels = (1.0, 0.75, 0.5, 0.25)
    outs, pairs = [], []
    try:
        for s in levels:
            seen.clear()
            outs.append(adapter.velocity(x, torch.tensor([s], device=x.device), text))
            if seen:
                pairs.append((s, float(seen[0])))
    finally:
        handle.remove()
    diff, scale = _max_rel(outs[0], outs[-1])
    assert diff > opts.atol, "the velocity does not depend on sigma"
    notes = []
    if isinstance(adapter, DeclaresTimestep):
        declared = adapter.timestep_from_sigma
        assert len(pairs) == len(levels), (
            "the adapter declares timestep_from_sigma, but the timestep its denoiser receives was not seen: "
            "pass it as timestep=... or as the denoiser's second positional argument"
        )
        # A model whose time runs the other way (Z-Image: t = 1 - sigma) declares its map; the
        # denoiser must receive exactly that, and it must move with sigma.
        expected = [float(torch.as_tensor(declared(torch.tensor([s]))).reshape(-1)[0]) for s in levels]
        worst = max(abs(t - e) for (_, t), e in zip(pairs, expected))
        assert worst <= 1e-5 * max(1.0, max(abs(e) for e in expected)), (
            f"timestep passed to the denoiser is not the adapter's timestep_from_sigma: (sigma, t) = {pairs}, "
            f"declared {expected}"
        )
        ts = [t for _, t in pairs]
        steps = [a - b for a, b in zip(ts, ts[1:])]
        assert all(d > 0 for d in steps) or all(d < 0 for d in steps), (
            f"the declared timestep is not monotonic in sigma: (sigma, t) = {pairs}"
        )
        notes.append(f"timestep = timestep_from_sigma(sigma): sigma 1 -> {ts[0]:.4g}, 0.25 -> {ts[-1]:.4g}")
    elif len(pairs) == len(levels):
        ts = [t for _, t in pairs]  # levels run from sigma 1 down to 0.25
        assert all(a > b for a, b in zip(ts, ts[1:])) and ts[-1] > 0, (
            f"timestep passed to the denoiser does not grow with sigma: (sigma, t) = {pairs} (is it 1 - sigma?)"
        )
        ratios = [t / s for s, t in pairs]
        spread = (max(ratios) - min(ratios)) / max(ratios)
        assert spread < 1e-3, f"timestep is not proportional to sigma: (sigma, t) = {pairs}"
        notes.append(f"timestep = {ratios[0]:.4g} * sigma")
    else:
        notes.append("timestep not observed at the denoiser (checked the velocity's sigma dependence only)")
    sig = adapter.sigmas(opts.num_steps)
    if sig is not None:
        sig = torch.as_tensor(sig, dtype=torch.float32)
        assert float(sig[0]) > 0.5 and float(sig[-1]) == 0.0 and bool((sig[1:] < sig[:-1]).all()), (
            f"adapter.sigmas must run from ~1 (noise) down to 0 (data), got {sig.tolist()}"
        )
        notes.append(f"own schedule {float(sig[0]):.3g} -> 0")
    return "; ".join(notes)


@torch.no_grad()
def check_decode(adapter, opts: ConformanceOptions) -> str:
    """``decode`` maps ``[B, *L]`` to float32 images ``[B, 3, H, W]`` (or clips ``[B, F, 3, H,
    W]``) in [0, 1], finite."""
    x = _noise(adapter, 2, opts.seed)
    img = adapter.decode(x)
    assert torch.is_tensor(img) and img.ndim in (4, 5), (
        f"decode must return images [B, 3, H, W] or clips [B, F, 3, H, W], got {getattr(img, 'shape', img)}")
    assert img.shape[0] == 2 and img.shape[-3] == 3, f"decode returned shape {tuple(img.shape)} for 2 latents"
    assert img.dtype == torch.float32, f"decode must return float32, got {img.dtype}"
    assert torch.isfinite(img).all(), "decode returned non-finite values"
    lo, hi = img.min().item(), img.max().item()
    assert lo >= 0.0 and hi <= 1.0, f"decode range [{lo:.3g}, {hi:.3g}] is outside [0, 1]"
    return f"{'clips' if img.ndim == 5 else 'images'} {tuple(img.shape[1:])}, range [{lo:.2f}, {hi:.2f}]"


def _attach_lora(adapter, opts: ConformanceOptions):
    train = TrainConfig(finetune="lora", lora_rank=opts.lora_rank, lora_alpha=2.0 * opts.lora_rank, lora_init="gaussian")
    return prepare_trainable(adapter, train)


def check_lora_noop(adapter, opts: ConformanceOptions) -> str:
    """LoRA attached through the engine's own path (:func:`flowrl.train.finetune.prepare_trainable`)
    starts as a no-op, trains only LoRA matrices, and changes the velocity once non-zero."""
    if not (isinstance(adapter, HasLoraTargets) and adapter.lora_targets):
        return "skipped: the adapter names no lora_targets (HasLoraTargets)"
    model = copy.deepcopy(adapter)
    with torch.no_grad():
        text, x = _inputs(model, opts, 2)
        sig = torch.tensor([0.8, 0.3], device=x.device)
        before = model.velocity(x, sig, text)
    params = _attach_lora(model, opts)
    names = [n for n, p in model.denoiser.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names), f"LoRA must train only lora_ matrices, got e.g. {names[:3]}"
    trainable = {id(p) for p in model.trainable_parameters()}
    assert trainable == {id(p) for p in params}, "trainable_parameters() differs from the LoRA parameters"
    with torch.no_grad():
        after = model.velocity(x, sig, text)
        diff, scale = _max_rel(after, before)
        assert diff <= opts.atol, f"fresh LoRA changes the velocity by {diff:.3g}: it must start as a no-op"
        g = torch.Generator().manual_seed(1)
        for n, p in model.denoiser.named_parameters():
            if "lora_B" in n:
                p.add_(0.05 * torch.randn(p.shape, generator=g).to(p.device, p.dtype))
        moved = model.velocity(x, sig, text)
    change, _ = _max_rel(moved, before)
    assert change > opts.atol, "a non-zero LoRA does not change the velocity: LoRA is not on velocity()'s path"
    return f"{len(names)} LoRA tensors; fresh |dv| = {diff:.2g}, perturbed |dv| = {change:.2g}"


def check_reference_model(adapter, opts: ConformanceOptions) -> str:
    """``reference_velocity`` (optional) is the base model's velocity after the policy moved:
    LoRA disabled for LoRA, a frozen copy (``snapshot_reference``) for full fine-tuning."""
    if not isinstance(adapter, HasReferencePolicy):
        return "skipped: the adapter runs no reference of its own (HasReferencePolicy)"
    results = []
    # a quantised base (integer weights) trains only a LoRA: there is no full fine-tuning to check
    full = all(p.is_floating_point() for p in adapter.denoiser.parameters())
    for mode in ("lora", "full") if full else ("lora",):
        model = copy.deepcopy(adapter)
        with torch.no_grad():
            text, x = _inputs(model, opts, 2)
            sig = torch.tensor([0.8, 0.3], device=x.device)
            base = model.velocity(x, sig, text)
        if mode == "lora":
            params = _attach_lora(model, opts)
        else:
            model.denoiser.requires_grad_(True)
            params = [p for p in model.denoiser.parameters() if p.requires_grad]
        results.append(model.snapshot_reference())
        with torch.no_grad():
            g = torch.Generator().manual_seed(2)
            for p in params:
                p.add_(0.05 * torch.randn(p.shape, generator=g).to(p.device, p.dtype))
            moved = model.velocity(x, sig, text)
            ref = model.reference_velocity(x, sig, text)
        change, _ = _max_rel(moved, base)
        assert change > opts.atol, f"{mode}: perturbing the trained weights did not change the velocity"
        diff, scale = _max_rel(ref, base)
        assert diff <= opts.rtol * scale + opts.atol, (
            f"{mode}: reference_velocity differs from the base model by {diff:.3g}"
        )
    note = "" if full else " (quantised base: LoRA only)"
    return ("reference = " + ", ".join(results) if results else "reference ok") + note


@torch.no_grad()
def check_condition(adapter, opts: ConformanceOptions) -> str:
    """An editing adapter's velocity depends on the condition image: the same prompt with two
    different images gives different velocities (and different text embeddings)."""
    if not isinstance(adapter, TakesConditionImage):
        return "skipped: the adapter takes no condition image (TakesConditionImage)"
    text = str(_prompts(adapter, opts, 1)[0])
    a, b = condition_image_paths(tuple(adapter.condition_size), 2)
    emb = adapter.encode_prompts([PromptRow(text, a), PromptRow(text, b)])
    x = _noise(adapter, 1, opts.seed).repeat(2, *[1] * len(adapter.latent_shape))
    v = adapter.velocity(x, torch.tensor([0.6, 0.6], device=x.device), emb)
    diff, scale = _max_rel(v[0], v[1])
    assert diff > opts.rtol * scale + opts.atol, (
        f"the velocity does not depend on the condition image (|dv| = {diff:.3g}): it must reach velocity() "
        "through encode_prompts' embeddings"
    )
    return f"condition {tuple(adapter.condition_size)}: |dv| between two images = {diff:.2g}"


def check_shardable_blocks(adapter, opts: ConformanceOptions) -> str:
    """FSDP2 shards, and activation checkpointing recomputes, block by block
    (:func:`flowrl.train.parallel.transformer_blocks`). Blocks an adapter declares must be
    submodules of its denoiser, none inside another. An adapter whose blocks are not found
    still trains (FSDP2 then shards the denoiser as one unit); the note says so."""
    try:
        blocks = transformer_blocks(adapter.denoiser, declared_blocks(adapter))
    except FlowrlError as exc:
        raise AssertionError(str(exc)) from None
    if not blocks:
        return ("skipped: no transformer blocks found (no shardable_blocks(), no *blocks module list): "
                "FSDP2 shards the denoiser as one unit and activation checkpointing is refused")
    total = sum(p.numel() for p in adapter.denoiser.parameters())
    inside = sum(p.numel() for b in blocks for p in b.parameters())
    source = "shardable_blocks()" if isinstance(adapter, HasShardableBlocks) else "the *blocks module lists"
    return f"{len(blocks)} blocks from {source} hold {inside / max(total, 1):.0%} of the parameters"


@torch.no_grad()
def check_encode_images(adapter, opts: ConformanceOptions) -> str:
    """An adapter that encodes images (:class:`flowrl.interfaces.EncodesImages`, what offline data
    needs) gives latents of ``latent_shape`` that decode back to the images it was given (a
    learned VAE loses detail: the note gives the round trip's largest pixel error, and only a
    non-finite latent or one of the wrong shape fails)."""
    if not isinstance(adapter, EncodesImages):
        return "skipped: the adapter encodes no images (EncodesImages)"
    images = adapter.decode(_noise(adapter, 2, opts.seed)).float()
    z = adapter.encode_images(images)
    assert tuple(z.shape) == (2, *adapter.latent_shape), (
        f"encode_images gave {tuple(z.shape)}, expected {(2, *adapter.latent_shape)}")
    assert bool(torch.isfinite(z).all()), "encode_images gave non-finite latents"
    err = float((adapter.decode(z).float() - images).abs().max())
    return f"decode(encode(images)) differs from the images by at most {err:.2g}"


CHECKS: dict[str, Callable[..., str]] = {
    "interface": check_interface,
    "velocity_calls_denoiser": check_velocity_calls_denoiser,
    "sde_noise0_equals_ode": check_sde_noise0_equals_ode,
    "on_policy_ratio": check_on_policy_ratio,
    "batch_independence": check_batch_independence,
    "sigma_direction": check_sigma_direction,
    "decode": check_decode,
    "lora_noop": check_lora_noop,
    "reference_model": check_reference_model,
    "shardable_blocks": check_shardable_blocks,
    "condition": check_condition,
    "encode_images": check_encode_images,
}
CHECK_NAMES = tuple(CHECKS)


def run_check(adapter, name: str, options: ConformanceOptions | None = None, **overrides) -> str:
    """Run one check; raises AssertionError (with the reason) on failure, returns a note."""
    if name not in CHECKS:
        raise KeyError(f"unknown check '{name}'; valid: {', '.join(CHECK_NAMES)}")
    opts = dataclasses.replace(options or ConformanceOptions(), **overrides)
    return CHECKS[name](adapter, opts)


def check_adapter(
    adapter,
    *,
    checks: Sequence[str] | None = None,
    options: ConformanceOptions | None = None,
    raise_on_failure: bool = True,
    **overrides,
) -> ConformanceReport:
    """Run the suite (all checks, or ``checks``) and return a report.

    With ``raise_on_failure`` (default) an AssertionError lists every failed check.
    ``overrides`` set :class:`ConformanceOptions` fields (e.g. ``ratio_tol=1e-4`` for bf16).
    """
    opts = dataclasses.replace(options or ConformanceOptions(), **overrides)
    results = []
    for name in checks or CHECK_NAMES:
        start = time.perf_counter()
        try:
            note = run_check(adapter, name, opts)
            results.append(CheckResult(name, True, note, time.perf_counter() - start))
        except AssertionError as exc:
            results.append(CheckResult(name, False, str(exc), time.perf_counter() - start))
    report = ConformanceReport(results)
    if raise_on_failure and not report.passed:
        raise AssertionError("adapter conformance failed:\n" + report.summary())
    return report
