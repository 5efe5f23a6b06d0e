"""Which units (steps or chunks) each sample trains (docs/api.md §4, §6).

Every selector returns a bool mask ``[B, K]`` (``K`` units per sample, ``True`` = trained), so
the caller can report exactly which units it trained. ``generators`` is ``None`` (global RNG),
one ``torch.Generator`` (samples drawn one after the other from one stream) or a list of ``B``
generators (sample ``b`` uses ``generators[b]``: its draw does not depend on the batch
composition). Draws happen on the CPU; move the mask where you need it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from flowrl.checks import positive_int
from flowrl.chunking import chunk_mean, validate_chunks
from flowrl.sampling.kernels import GeneratorArg

__all__ = [
    "selection_count",
    "select_all",
    "select_uniform",
    "chunk_weights_from_l1rel",
    "select_weighted",
    "rollout_l1rel",
    "rollout_chunk_weights",
    "select_one_per_group",
    "unit_entropy",
    "select_top_entropy",
]


def _check_bk(B: int, K: int) -> None:
    positive_int(B, "B (number of samples)")
    positive_int(K, "K (number of units)")


def _gens(generators: GeneratorArg, B: int) -> list[torch.Generator | None]:
    if generators is None or isinstance(generators, torch.Generator):
        return [generators] * B
    gens = list(generators)
    if len(gens) != B:
        raise ValueError(f"a list of generators needs one per sample: got {len(gens)} for B = {B}")
    return gens


def _cpu_gen(g: torch.Generator | None) -> torch.Generator | None:
    if g is not None and g.device.type != "cpu":
        raise ValueError(f"selection draws on the CPU and needs CPU generators, got one on {g.device}")
    return g


def selection_count(K: int, fraction: float) -> int:
    """``max(1, int(K * fraction))`` for ``0 < fraction <= 1``: never zero (section 4: with
    K = 1 and fraction 0.5 an anchor trained nothing). ``int`` truncates as the anchors do
    (16 x 0.5 = 8, 15 x 0.6 = 9, 4 x 0.5 = 2)."""
    _check_bk(1, K)
    if not (isinstance(fraction, (int, float)) and math.isfinite(fraction) and 0 < fraction <= 1):
        raise ValueError(f"fraction must be a number in (0, 1], got {fraction!r}")
    return max(1, int(K * fraction))


def select_all(B: int, K: int) -> torch.Tensor:
    """Every unit of every sample: ``ones [B, K]`` bool."""
    _check_bk(B, K)
    return torch.ones(B, K, dtype=torch.bool)


def select_uniform(
    B: int, K: int, fraction: float, generators: GeneratorArg = None
) -> torch.Tensor:
    """Per sample, ``selection_count(K, fraction)`` distinct units uniformly at random."""
    _check_bk(B, K)
    count = selection_count(K, fraction)
    mask = torch.zeros(B, K, dtype=torch.bool)
    for b, g in enumerate(_gens(generators, B)):
        mask[b, torch.randperm(K, generator=_cpu_gen(g))[:count]] = True
    return mask


def chunk_weights_from_l1rel(l1rel: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """Chunk weights of the paper's weighted sampling (Eq. 16; section 6):
    ``w_j = mean_{i in chunk j} L1rel_i``. ``l1rel [T]`` (non-negative) -> float32 ``[K]``."""
    s = validate_chunks(sizes)
    l1 = torch.as_tensor(l1rel, dtype=torch.float32)
    if l1.ndim != 1 or l1.numel() != sum(s):
        raise ValueError(f"l1rel must be [T] with T = sum(sizes) = {sum(s)}, got shape {tuple(l1.shape)}")
    if not bool(torch.isfinite(l1).all()) or bool((l1 < 0).any()):
        raise ValueError("l1rel must be finite and >= 0")
    return chunk_mean(l1, s)


def select_weighted(
    B: int, weights: torch.Tensor, count: int, generators: GeneratorArg = None
) -> torch.Tensor:
    """Per sample, ``count`` distinct units drawn WITHOUT replacement, each draw picking unit
    ``j`` with probability ``w_j / sum of the remaining w`` (successive sampling; section 6).

    Implemented as an exponential race: ``key_j = E_j / w_j`` with ``E_j ~ Exp(1)``, keep the
    ``count`` smallest keys; the smallest is ``j`` with probability ``w_j / sum w`` and, by
    memorylessness, the next ones follow the same rule over the remaining units.
    ``weights`` is ``[K]`` (shared) or ``[B, K]`` (per sample), non-negative, with at least
    ``count`` positive entries per sample; ``1 <= count <= K``.
    """
    _check_bk(B, 1)
    w = torch.as_tensor(weights, dtype=torch.float64).cpu()
    if w.ndim == 1:
        w = w.unsqueeze(0).expand(B, -1)
    if w.ndim != 2 or w.shape[1] < 1:
        raise ValueError(f"weights must be [K] or [B, K] with K >= 1, got shape {tuple(w.shape)}")
    K = int(w.shape[1])
    if w.shape[0] != B:
        raise ValueError(f"per-sample weights must be [B, K] with B = {B}, got {tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError("weights must be finite and >= 0")
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= K:
        raise ValueError(f"count must be an integer in [1, K = {K}], got {count!r}")
    npos = (w > 0).sum(dim=1)
    if bool((npos < count).any()):
        raise ValueError(
            f"cannot draw {count} distinct units: some sample has only {int(npos.min())} "
            "units with positive weight"
        )
    if generators is None or isinstance(generators, torch.Generator):
        # one stream for the whole batch: draw all keys at once
        e = torch.empty(B, K, dtype=torch.float64).exponential_(1.0, generator=_cpu_gen(generators))
    else:
        e = torch.stack([
            torch.empty(K, dtype=torch.float64).exponential_(1.0, generator=_cpu_gen(g))
            for g in _gens(generators, B)
        ])
    keys = torch.where(w > 0, e / torch.where(w > 0, w, 1.0), torch.inf)
    mask = torch.zeros(B, K, dtype=torch.bool)
    mask.scatter_(1, torch.topk(keys, count, dim=1, largest=False).indices, True)
    return mask


def rollout_l1rel(sample: torch.Tensor, next_sample: torch.Tensor) -> torch.Tensor:
    """Each sample's relative L1 change over one transition of its own rollout (GCPO's weighted
    sampling input): ``mean|x' - x| / (mean|x| + 1e-8)`` over the sample's elements, float32 ``[B]``."""
    x = torch.as_tensor(sample, dtype=torch.float32)
    y = torch.as_tensor(next_sample, dtype=torch.float32)
    if x.shape != y.shape or x.ndim < 2:
        raise ValueError(f"sample and next_sample must be [B, ...] of one shape, got {tuple(x.shape)}, {tuple(y.shape)}")
    d = (y - x).abs().reshape(x.shape[0], -1).mean(dim=1)
    return d / (x.abs().reshape(x.shape[0], -1).mean(dim=1) + 1e-8)


def rollout_chunk_weights(l1rel: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """Per-sample chunk weights ``w[b, j] = mean_{i in chunk j} L1rel[b, i] + 1e-8`` from the
    rollout's ``l1rel [B, T]`` (GCPO's ``--sample_weight normalized``): float32 ``[B, K]``."""
    s = validate_chunks(sizes)
    l1 = torch.as_tensor(l1rel, dtype=torch.float32)
    if l1.ndim != 2 or l1.shape[1] != sum(s):
        raise ValueError(f"l1rel must be [B, T] with T = sum(sizes) = {sum(s)}, got shape {tuple(l1.shape)}")
    if not bool(torch.isfinite(l1).all()) or bool((l1 < 0).any()):
        raise ValueError("l1rel must be finite and >= 0")
    return torch.stack([chunk_mean(row, s) for row in l1]) + 1e-8


def select_one_per_group(
    group_ids: torch.Tensor, K: int, span: float = 1.0, generators: GeneratorArg = None
) -> torch.Tensor:
    """Exactly one unit per sample, the same for every sample of a prompt group (Flash-GRPO's
    iso-temporal grouping): the unit is uniform on the first ``selection_count(K, span)`` units.

    ``group_ids [B]`` names each row's group. Each group draws once, from the generator of its
    first row in the call (``generators`` as in the module docstring); the engine seeds every
    row's generator by (seed, iteration, group), so a group split over micro-batches or
    processes draws the same unit in each part."""
    g = torch.as_tensor(group_ids).reshape(-1).cpu()
    B = int(g.numel())
    _check_bk(B, K)
    hi = selection_count(K, span)
    gens = _gens(generators, B)
    drawn: dict[int, int] = {}
    mask = torch.zeros(B, K, dtype=torch.bool)
    for b in range(B):
        key = int(g[b])
        if key not in drawn:
            drawn[key] = int(torch.randint(hi, (1,), generator=_cpu_gen(gens[b])))
        mask[b, drawn[key]] = True
    return mask


def unit_entropy(std: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """Per-element differential entropy of each unit's Gaussian kernel, ``0.5 log(2 pi e s^2)``
    per step, averaged over the unit's steps: ``std [B, T]`` (the kernel's std at every trainable
    transition of each sample, > 0) -> float64 ``[B, K]``. A D-element step's entropy is D times
    this; the order of units is that of their (geometric mean) std."""
    s = validate_chunks(sizes)
    sd = torch.as_tensor(std, dtype=torch.float64).cpu()
    if sd.ndim != 2 or sd.shape[1] != sum(s):
        raise ValueError(f"std must be [B, T] with T = sum(sizes) = {sum(s)}, got shape {tuple(sd.shape)}")
    if not bool(torch.isfinite(sd).all()) or bool((sd <= 0).any()):
        raise ValueError("std must be finite and > 0 at every trainable transition")
    h = 0.5 * math.log(2 * math.pi * math.e) + torch.log(sd)
    return chunk_mean(h, s)


def select_top_entropy(
    entropy: torch.Tensor, count: int | None = None, threshold: float | None = None
) -> torch.Tensor:
    """E-GRPO's rule on ``entropy [B, K]`` (:func:`unit_entropy`): per sample, the ``count``
    units of highest entropy (ties to the earlier unit), or, with ``threshold``, every unit whose
    entropy is at least ``threshold`` (at least the highest one). Exactly one of the two."""
    h = torch.as_tensor(entropy, dtype=torch.float64).cpu()
    if h.ndim != 2:
        raise ValueError(f"entropy must be [B, K], got shape {tuple(h.shape)}")
    B, K = int(h.shape[0]), int(h.shape[1])
    _check_bk(B, K)
    if (count is None) == (threshold is None):
        raise ValueError("give exactly one of count and threshold")
    if threshold is not None:
        if not math.isfinite(threshold):
            raise ValueError(f"threshold must be finite, got {threshold!r}")
        mask = h >= threshold
        mask[torch.arange(B), torch.argmax(h, dim=1)] = True
        return mask
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= K:
        raise ValueError(f"count must be an integer in [1, K = {K}], got {count!r}")
    # stable descending sort: equal entropies keep index order, so the earlier unit wins
    order = torch.sort(h, dim=1, descending=True, stable=True).indices[:, :count]
    mask = torch.zeros(B, K, dtype=torch.bool)
    mask.scatter_(1, order, True)
    return mask
