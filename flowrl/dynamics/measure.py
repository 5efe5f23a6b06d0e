"""Measuring a sampler's temporal dynamics (the curves ``flowrl profile`` draws).

For transition ``i`` (``x_i -> x_{i+1}``, ``i = 0 .. N-1``) and one sample:

- ``l1rel``:      ``||x_{i+1} - x_i||_1 / ||x_i||_1`` (the paper's relative L1 change);
- ``l1rel_norm``: ``l1rel_i / |sigma_{i+1} - sigma_i|``, the change per unit of noise level.
  With a shifted schedule the raw curve is dominated by the step size; this one is not;
- ``x0_change``:  the same relative L1 change of the prediction ``x0_hat_i = x_i - sigma_i v_i``
  (``x0_hat_N = x_N``, since ``sigma_N = 0``): how much the model's idea of the final image
  moves. It is the model-dependent curve (a fixed schedule gives ``l1rel`` even with no model);
- ``v_change``:   the relative L1 change of the velocity (``v_N`` is evaluated at ``x_N``,
  ``sigma = 0``; one extra forward per trajectory).

:func:`curve_stats` reduces per-sample curves ``[S seeds, P prompts, N]`` to the mean, the
spread across prompts and across seeds (standard deviation and coefficient of variation, the
"prompt invariance" of the paper) and the first and second differences of the mean.
:func:`measure_dynamics` samples with :func:`flowrl.sampling.rollout.rollout` exactly as training does;
:func:`profile_model` adds every segmentation proposal (:mod:`flowrl.dynamics.segment`).

What this rests on (measured on the tiny pixel model): with an ODE sampler at shift 3,
``l1rel`` is set by the step size and rises 10x towards the end, while ``l1rel_norm`` is nearly
flat; on the SDE sampler (flow, a = 0.7) ``l1rel`` is high for the first two steps, falls, then
rises mildly, which gives small-early, large-late chunks like the paper's. The curves are
prompt-invariant (CV 1-5%); ``x0_change`` spreads more (17-42%).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..sampling.rollout import rollout, trainable_mask
from ..seeding import generator
from .segment import METHODS, Segmentation, segment

#: The curves, in the order they are reported.
CURVES = ("l1rel", "l1rel_norm", "x0_change", "v_change")
CURVE_HELP = {
    "l1rel": "||x_{i+1} - x_i||_1 / ||x_i||_1 (paper's L1rel)",
    "l1rel_norm": "L1rel / |dsigma| (change per unit noise level)",
    "x0_change": "relative L1 change of x0_hat = x - sigma v",
    "v_change": "relative L1 change of the velocity v",
}

def relative_change(states: torch.Tensor) -> torch.Tensor:
    """Per-sample relative L1 change along dim 1: ``states [B, M + 1, ...] -> float32 [B, M]``,
    ``out[b, i] = ||s[b, i+1] - s[b, i]||_1 / ||s[b, i]||_1``. Raises ``ValueError`` for an
    all-zero state (the ratio is undefined)."""
    if states.ndim < 3:
        raise ValueError(f"states must be [B, M + 1, ...] with >= 3 dims, got shape {tuple(states.shape)}")
    s = states.to(torch.float32).flatten(2)
    num = (s[:, 1:] - s[:, :-1]).abs().sum(-1)
    den = s[:, :-1].abs().sum(-1)
    if not bool((den > 0).all()):
        raise ValueError("relative change is undefined for an all-zero state (||s_i||_1 = 0)")
    return num / den


def transition_curves(
    latents: torch.Tensor, velocities: torch.Tensor, sigmas: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Every curve of :data:`CURVES` per sample and transition.

    Args:
        latents: ``[B, N + 1, ...]``, the states ``x_0 .. x_N`` of a rollout.
        velocities: ``[B, N + 1, ...]``, ``v_i`` used at step ``i`` (``i < N``) and ``v_N`` at
            ``(x_N, sigma_N = 0)``.
        sigmas: ``[N + 1]``, decreasing, ``sigmas[N] == 0``.

    Returns ``{name: float32 [B, N]}``.
    """
    if latents.shape != velocities.shape:
        raise ValueError(
            f"latents and velocities must have the same shape, got {tuple(latents.shape)} and {tuple(velocities.shape)}"
        )
    n = latents.shape[1] - 1
    sig = torch.as_tensor(sigmas, dtype=torch.float32).to(latents.device).flatten()
    if sig.numel() != n + 1:
        raise ValueError(f"need N + 1 = {n + 1} sigmas for {n} transitions, got {sig.numel()}")
    x = latents.to(torch.float32)
    v = velocities.to(torch.float32)
    x0_hat = x - sig.reshape(1, -1, *([1] * (x.ndim - 2))) * v
    l1rel = relative_change(x)
    dsigma = (sig[1:] - sig[:-1]).abs()
    return {
        "l1rel": l1rel,
        "l1rel_norm": l1rel / dsigma,
        "x0_change": relative_change(x0_hat),
        "v_change": relative_change(v),
    }


@dataclasses.dataclass
class CurveStats:
    """Summary of one curve over ``S`` seeds x ``P`` prompts (all ``[N]`` unless noted).

    - ``mean``: over every sample;
    - ``prompt_std`` / ``prompt_cv``: standard deviation (unbiased) across prompts of the
      per-prompt mean (over seeds), and that divided by ``mean``; ``None`` when ``P == 1``;
    - ``seed_std`` / ``seed_cv``: for each prompt the standard deviation across seeds (and
      divided by that prompt's mean), averaged over prompts; ``None`` when ``S == 1``;
    - ``d1`` ``[N - 1]``, ``d2`` ``[N - 2]``: first and second differences of ``mean``.
    """

    mean: list[float]
    prompt_std: list[float] | None
    prompt_cv: list[float] | None
    seed_std: list[float] | None
    seed_cv: list[float] | None
    d1: list[float]
    d2: list[float]

    def summary(self, positions: Sequence[int] | None = None) -> dict[str, float | None]:
        """Mean CV across prompts and across seeds (over ``positions``, default all; undefined
        CVs, where the mean is 0, are skipped)."""
        idx = list(range(len(self.mean))) if positions is None else list(positions)

        def avg(v):
            # a zero mean (e.g. x0_hat not moving on an ODE's last step) has no CV: skip it
            vals = [] if v is None else [v[i] for i in idx if v[i] is not None and math.isfinite(v[i])]
            return sum(vals) / len(vals) if vals else None

        return {"prompt_cv": avg(self.prompt_cv), "seed_cv": avg(self.seed_cv)}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _list(t: torch.Tensor) -> list[float]:
    return [float(v) for v in t.tolist()]


def curve_stats(values: torch.Tensor) -> CurveStats:
    """Reduce per-sample curves ``values [S, P, N]`` (seed, prompt, transition) to :class:`CurveStats`."""
    if values.ndim != 3:
        raise ValueError(f"values must be [S seeds, P prompts, N transitions], got shape {tuple(values.shape)}")
    v = values.to(torch.float64)
    s, p, n = v.shape
    mean = v.mean(dim=(0, 1))
    per_prompt = v.mean(dim=0)  # [P, N]
    prompt_std = per_prompt.std(dim=0, unbiased=True) if p > 1 else None
    if s > 1:
        seed_std_pp = v.std(dim=0, unbiased=True)  # [P, N]
        seed_std = seed_std_pp.mean(dim=0)
        seed_cv = (seed_std_pp / per_prompt).mean(dim=0)
    else:
        seed_std = seed_cv = None
    d1 = mean[1:] - mean[:-1]
    d2 = d1[1:] - d1[:-1]
    return CurveStats(
        mean=_list(mean),
        prompt_std=None if prompt_std is None else _list(prompt_std),
        prompt_cv=None if prompt_std is None else _list(prompt_std / mean),
        seed_std=None if seed_std is None else _list(seed_std),
        seed_cv=None if seed_cv is None else _list(seed_cv),
        d1=_list(d1),
        d2=_list(d2),
    )


@dataclasses.dataclass
class ProfileResult:
    """What one profiling run measured.

    ``sigmas [N + 1]``; ``trainable [N]`` (the engine's :func:`flowrl.sampling.rollout.trainable_mask`);
    ``curves[name]`` a :class:`CurveStats` over all N transitions; ``proposals[curve][method]``
    a :class:`Segmentation` of that curve restricted to the trainable transitions; ``settings``
    everything needed to reproduce it (JSON-able).
    """

    sigmas: list[float]
    trainable: list[bool]
    curves: dict[str, CurveStats]
    proposals: dict[str, dict[str, Segmentation]]
    settings: dict[str, Any]
    elapsed_s: float = 0.0

    @property
    def positions(self) -> list[int]:
        """Step indices of the trainable transitions (position t of a layout -> step positions[t])."""
        return [i for i, t in enumerate(self.trainable) if t]

    def trainable_curve(self, curve: str = "l1rel") -> list[float]:
        if curve not in self.curves:
            raise ValueError(f"unknown curve {curve!r}; expected one of {sorted(self.curves)}")
        mean = self.curves[curve].mean
        return [mean[i] for i in self.positions]


def _device_of(model) -> torch.device:
    denoiser = getattr(model, "denoiser", None)
    if isinstance(denoiser, torch.nn.Module):
        for p in denoiser.parameters():
            return p.device
    return torch.device("cpu")


@torch.no_grad()
def measure_dynamics(
    model,
    sigmas: torch.Tensor,
    kernels: Sequence[Any],
    prompts: Sequence[str],
    *,
    num_seeds: int = 2,
    seed: int = 0,
    batch_size: int = 64,
    image_from: str = "x0_hat",
    reduction: str = "mean",
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Sample ``num_seeds x len(prompts)`` trajectories and return ``{curve: float32 [S, P, N]}``.

    Sampling is :func:`flowrl.sampling.rollout.rollout` with the given kernels, exactly as the engine
    rolls out. Seed ``k`` uses the same starting noise and the same SDE noise (per-sample
    generators seeded by ``(seed, "profile-noise" / "profile-sde", k)``) for every prompt, so the
    spread across prompts measures the prompt alone, and the result does not depend on
    ``batch_size``. ``progress(done, total)`` is called after each batch.
    """
    prompts = list(prompts)
    if not prompts:
        raise ValueError("profiling needs at least one prompt")
    if num_seeds < 1:
        raise ValueError(f"num_seeds must be >= 1, got {num_seeds}")
    device = _device_of(model)
    sig = torch.as_tensor(sigmas, dtype=torch.float32).to(device)
    n = sig.numel() - 1
    shape = tuple(model.latent_shape)
    unique = list(dict.fromkeys(prompts))
    # one prompt at a time, as training's prompt cache encodes them and a prompt store holds them
    # (a batch may round otherwise): the profile is the same with a store and without
    each = [model.encode_prompts([p]) for p in unique]
    encoded = {key: torch.cat([e[key][:1] for e in each]) for key in each[0]}
    row = {p: i for i, p in enumerate(unique)}
    items = [(k, j) for k in range(num_seeds) for j in range(len(prompts))]
    out = {c: torch.zeros(num_seeds, len(prompts), n) for c in CURVES}
    noises = [torch.randn(shape, generator=generator(seed, "profile-noise", k)) for k in range(num_seeds)]
    for start in range(0, len(items), batch_size):
        batch = items[start : start + batch_size]
        idx = torch.tensor([row[prompts[j]] for _, j in batch])
        text = {key: t.index_select(0, idx.to(t.device)) for key, t in encoded.items()}
        noise = torch.stack([noises[k] for k, _ in batch]).to(device)
        gens = [generator(seed, "profile-sde", k) for k, _ in batch]  # CPU, as the engine
        velocities: list[torch.Tensor] = []

        def velocity_fn(x, s, text=text, velocities=velocities):
            v = model.velocity(x, s, text)
            velocities.append(v.to(torch.float32))
            return v

        traj = rollout(velocity_fn, noise, sig, kernels, generators=gens, image_from=image_from, reduction=reduction)
        x_last = traj.latents[:, -1]
        velocities.append(model.velocity(x_last, sig[-1].expand(len(batch)), text).to(torch.float32))
        curves = transition_curves(traj.latents, torch.stack(velocities, dim=1), sig)
        for c, vals in curves.items():
            for b, (k, j) in enumerate(batch):
                out[c][k, j] = vals[b].cpu()
        if progress is not None:
            progress(min(start + batch_size, len(items)), len(items))
    return out


def profile_model(
    model,
    sigmas: torch.Tensor,
    kernels: Sequence[Any],
    prompts: Sequence[str],
    *,
    num_seeds: int = 2,
    seed: int = 0,
    batch_size: int = 64,
    image_from: str = "x0_hat",
    reduction: str = "mean",
    num_chunks: int = 4,
    min_size: int = 1,
    max_size: int | None = None,
    explained: float = 0.9,
    settings: Mapping[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ProfileResult:
    """Measure the curves (:func:`measure_dynamics`) and segment every curve with every method."""
    t0 = time.perf_counter()
    sig = torch.as_tensor(sigmas, dtype=torch.float32)
    trainable = trainable_mask(tuple(kernels), sig.cpu(), image_from)
    values = measure_dynamics(
        model, sig, kernels, prompts, num_seeds=num_seeds, seed=seed, batch_size=batch_size,
        image_from=image_from, reduction=reduction, progress=progress,
    )
    curves = {c: curve_stats(values[c]) for c in CURVES}
    result = ProfileResult(
        sigmas=[float(s) for s in sig.cpu().tolist()],
        trainable=[bool(t) for t in trainable.tolist()],
        curves=curves,
        proposals={},
        settings={
            **dict(settings or {}),
            "num_prompts": len(list(prompts)),
            "num_seeds": num_seeds,
            "seed": seed,
            "image_from": image_from,
            "segmentation": {
                "num_chunks": num_chunks, "min_size": min_size, "max_size": max_size or 0, "explained": explained,
            },
        },
    )
    # A deterministic sampler (all-ODE) has no trainable transition: its curves are still worth
    # seeing (beside the SDE's), but there is nothing to cut into chunks.
    result.proposals = {
        c: {
            m: segment(result.trainable_curve(c), m, num_chunks, min_size, max_size, curve=c, explained=explained)
            for m in METHODS
        }
        for c in CURVES
    } if result.positions else {}
    result.elapsed_s = time.perf_counter() - t0
    return result


def reprofile(
    model,
    sigmas: torch.Tensor,
    kernels: Sequence[Any],
    prompts: Sequence[str],
    *,
    curve: str = "l1rel",
    method: str = "dp",
    num_chunks: int = 4,
    min_size: int = 1,
    max_size: int | None = None,
    num_seeds: int = 1,
    seed: int = 0,
    image_from: str = "x0_hat",
    batch_size: int = 64,
) -> tuple[tuple[int, ...], ProfileResult]:
    """Adaptive chunking: profile the current policy and return ``(new sizes, profile)``.

    Call it with the model being trained (its current weights), the run's sigmas and kernels, and
    a fixed prompt list: with the same ``seed`` every call sees the same noise, so a change of
    boundaries reflects the policy, not the draw. Runs under no_grad; costs
    ``num_seeds x len(prompts)`` rollouts of N + 1 forwards.
    """
    if curve not in CURVES:
        raise ValueError(f"curve must be one of {CURVES}, got {curve!r}")
    result = profile_model(
        model, sigmas, kernels, prompts, num_seeds=num_seeds, seed=seed, batch_size=batch_size,
        image_from=image_from, num_chunks=num_chunks, min_size=min_size, max_size=max_size,
        settings={"purpose": "reprofile"},
    )
    seg = segment(result.trainable_curve(curve), method, num_chunks, min_size, max_size, curve=curve)
    return seg.sizes, result


def pick_prompts(prompts: Sequence[str], num_prompts: int, seed: int = 0) -> list[str]:
    """``num_prompts`` distinct entries of ``prompts`` (all of them if there are fewer), chosen by
    a seeded permutation and kept in their original order: a fixed, spread-out subset."""
    prompts = list(dict.fromkeys(prompts))
    if num_prompts >= len(prompts):
        return prompts
    perm = torch.randperm(len(prompts), generator=generator(seed, "profile-prompts"))
    keep = sorted(int(i) for i in perm[:num_prompts])
    return [prompts[i] for i in keep]
