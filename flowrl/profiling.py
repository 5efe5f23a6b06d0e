"""Temporal dynamics of a sampler and chunk boundaries from them (algorithms.md section 6).

``flowrl profile`` samples trajectories with the training sampler (same schedule, kernels and
model as ``flowrl train``), measures how much each transition changes the state, and turns
those curves into chunk layouts. This module holds the maths, in three parts:

1. **Curves** (pure). For transition ``i`` (``x_i -> x_{i+1}``, ``i = 0 .. N-1``) and one sample:

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

2. **Segmentation** (pure, float64 on ``T`` trainable positions). A layout is a tuple of chunk
   sizes summing to ``T``; boundary ``b`` (``1 <= b <= T - 1``) is where a new chunk starts.
   Convention: a feature *at* position ``p`` (a kink or an extremum of the curve) starts a new
   chunk at ``p``; a feature between ``p - 1`` and ``p`` cuts there. Three rules, each under
   the limits ``min_size <= size <= max_size``:

   - ``curvature`` (paper v1): the ``K - 1`` boundaries with the largest ``|second difference|``
     (``|y[b+1] - 2 y[b] + y[b-1]|``), strongest first, skipping any that would make the limits
     unsatisfiable (:func:`curvature_segmentation`);
   - ``dp``: the exact least-squares segmentation, minimising the sum over chunks of the
     squared deviations from the chunk mean, by dynamic programming (:func:`optimal_segmentation`);
   - ``derivative`` (paper v3): cut where the first difference changes sign (the curve's extrema),
     then, inside every chunk still larger than ``max_size``, where the next higher difference
     changes sign, recursively (:func:`derivative_segmentation`).

   ``num_chunks = 0`` chooses ``K``: for ``dp`` and ``curvature`` the smallest ``K`` whose
   optimal segmentation explains ``explained`` (default 90%) of the curve's variance
   (:func:`choose_num_chunks`); for ``derivative`` the number the rule itself produces.

3. **Measuring a model** (:func:`measure_dynamics`, :func:`profile_model`, :func:`reprofile`):
   run :func:`flowrl.sampling.rollout` with the model and kernels the engine builds, recording
   the velocities, and return :class:`ProfileResult` (curves, proposals, settings).

Findings this design rests on (tiny pixel model prototype, environment.md): with an ODE sampler
at shift 3, ``l1rel`` is set by the step size and rises 10x towards the end, while
``l1rel_norm`` is nearly flat; on the SDE sampler (flow, a = 0.7) ``l1rel`` is high for the first
two steps, falls, then rises mildly, which gives small-early, large-late chunks like the paper's.
The curves are prompt-invariant (CV 1-5%); ``x0_change`` spreads more (17-42%).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "CURVES",
    "CURVE_HELP",
    "METHODS",
    "relative_change",
    "transition_curves",
    "CurveStats",
    "curve_stats",
    "check_limits",
    "feasible_num_chunks",
    "segment_cost",
    "optimal_segmentation",
    "curvature_scores",
    "curvature_segmentation",
    "sign_change_boundaries",
    "derivative_segmentation",
    "choose_num_chunks",
    "Segmentation",
    "segment",
    "boundaries_from_sizes",
    "recipe_snippet",
    "sparkline",
    "ProfileResult",
    "measure_dynamics",
    "profile_model",
    "reprofile",
    "pick_prompts",
]

#: The curves, in the order they are reported.
CURVES = ("l1rel", "l1rel_norm", "x0_change", "v_change")
CURVE_HELP = {
    "l1rel": "||x_{i+1} - x_i||_1 / ||x_i||_1 (paper's L1rel)",
    "l1rel_norm": "L1rel / |dsigma| (change per unit noise level)",
    "x0_change": "relative L1 change of x0_hat = x - sigma v",
    "v_change": "relative L1 change of the velocity v",
}
#: Segmentation rules (see the module docstring).
METHODS = ("dp", "curvature", "derivative")


# ============================================================================ 1. curves


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


# ====================================================================== 2. segmentation


def _curve(y) -> list[float]:
    out = [float(v) for v in (y.tolist() if isinstance(y, torch.Tensor) else y)]
    if not out:
        raise ValueError("the curve is empty: need at least one transition")
    if not all(math.isfinite(v) for v in out):
        raise ValueError(f"the curve has non-finite values: {out}")
    return out


def _limits(T: int, min_size: int, max_size: int | None) -> tuple[int, int]:
    lo = int(min_size)
    hi = T if not max_size else int(max_size)
    if lo < 1:
        raise ValueError(f"min_size must be >= 1, got {min_size}")
    if max_size and hi < lo:
        raise ValueError(f"max_size ({hi}) must be >= min_size ({lo})")
    return lo, max(hi, 1)


def feasible_num_chunks(T: int, min_size: int = 1, max_size: int | None = None) -> range:
    """Every ``K`` for which ``T`` splits into ``K`` chunks of sizes in ``[min_size, max_size]``
    (``max_size`` 0 or None = no limit): ``ceil(T / max) <= K <= floor(T / min)``."""
    lo, hi = _limits(T, min_size, max_size)
    return range(-(-T // hi), T // lo + 1)


def check_limits(T: int, num_chunks: int, min_size: int = 1, max_size: int | None = None) -> None:
    """Raise ``ValueError`` saying why ``T`` cannot be cut into ``num_chunks`` chunks within the limits."""
    ks = feasible_num_chunks(T, min_size, max_size)
    lo, hi = _limits(T, min_size, max_size)
    if not ks:
        raise ValueError(
            f"no layout of T = {T} transitions has every chunk size in [{lo}, {hi}]; "
            "relax min_size / max_size"
        )
    if num_chunks not in ks:
        raise ValueError(
            f"T = {T} transitions cannot be cut into num_chunks = {num_chunks} chunks of sizes in "
            f"[{lo}, {hi}]; possible num_chunks: {ks.start}..{ks.stop - 1} (or 0 to choose)"
        )


def boundaries_from_sizes(sizes: Sequence[int]) -> list[int]:
    """Positions where chunks 1.. start: ``(2, 3, 4, 7) -> [2, 5, 9]``."""
    out, acc = [], 0
    for s in list(sizes)[:-1]:
        acc += int(s)
        out.append(acc)
    return out


def _sizes_from_cuts(T: int, cuts) -> tuple[int, ...]:
    edges = [0, *sorted(cuts), T]
    return tuple(b - a for a, b in zip(edges, edges[1:]))


def _completable(T: int, cuts, lo: int, hi: int, num_chunks: int | None) -> bool:
    """Can the cut set be extended to a layout with sizes in [lo, hi] (and exactly num_chunks)?

    A gap of length L splits into k pieces within the limits iff k lo <= L <= k hi, so the
    feasible k of a gap form the interval [ceil(L / hi), floor(L / lo)] and those of the whole
    layout the sum of the intervals.
    """
    kmin = kmax = 0
    for length in _sizes_from_cuts(T, cuts):
        a, b = -(-length // hi), length // lo
        if a > b:
            return False
        kmin, kmax = kmin + a, kmax + b
    return num_chunks is None or kmin <= num_chunks <= kmax


def _greedy(T: int, ranked: Sequence[int], lo: int, hi: int, num_chunks: int | None, start=()) -> set[int]:
    """Accept boundaries in the given order while the layout stays completable; with
    ``num_chunks`` stop at ``num_chunks - 1`` cuts. Every candidate of a completing layout is
    accepted when reached if nothing accepted before excludes it, so if ``ranked`` holds every
    boundary the result is always completable to exactly ``num_chunks`` chunks."""
    cuts = set(start)
    for b in ranked:
        if num_chunks is not None and len(cuts) >= num_chunks - 1:
            break
        if b in cuts or not 1 <= b <= T - 1:
            continue
        if _completable(T, cuts | {b}, lo, hi, num_chunks):
            cuts.add(b)
    return cuts


def _even_fill(T: int, cuts: set[int], lo: int, hi: int, num_chunks: int | None) -> set[int]:
    """Complete a completable cut set with near-equal pieces: each gap gets the fewest pieces it
    needs, then (for an exact num_chunks) the largest gaps get more, one at a time."""
    gaps = [(a, b) for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), T])]
    count = [-(-(b - a) // hi) for a, b in gaps]
    if num_chunks is not None:
        while sum(count) < num_chunks:
            # the gap whose pieces are largest and can still be split further
            j = max(
                (j for j, (a, b) in enumerate(gaps) if (count[j] + 1) * lo <= b - a),
                key=lambda j: ((gaps[j][1] - gaps[j][0]) / count[j], -j),
            )
            count[j] += 1
    out = set(cuts)
    for (a, b), k in zip(gaps, count):
        q, r = divmod(b - a, k)
        pos = a
        for piece in range(k - 1):
            pos += q + (1 if piece < r else 0)
            out.add(pos)
    return out


def segment_cost(y: Sequence[float], sizes: Sequence[int]) -> float:
    """Within-chunk sum of squared deviations from each chunk's mean (what ``dp`` minimises)."""
    y = _curve(y)
    total, pos = 0.0, 0
    for s in sizes:
        part = y[pos : pos + s]
        m = sum(part) / len(part)
        total += sum((v - m) ** 2 for v in part)
        pos += s
    return total


def _dp_table(y: list[float], lo: int, hi: int, kmax: int):
    T = len(y)
    p1 = [0.0] * (T + 1)
    p2 = [0.0] * (T + 1)
    for i, v in enumerate(y):
        p1[i + 1] = p1[i] + v
        p2[i + 1] = p2[i] + v * v

    def sse(a: int, b: int) -> float:
        s = p1[b] - p1[a]
        return max(0.0, (p2[b] - p2[a]) - s * s / (b - a))

    inf = float("inf")
    # cost[k][t]: best cost of covering positions 0..t-1 with k chunks; arg[k][t]: start of the last
    cost = [[inf] * (T + 1) for _ in range(kmax + 1)]
    arg = [[-1] * (T + 1) for _ in range(kmax + 1)]
    cost[0][0] = 0.0
    for k in range(1, kmax + 1):
        for t in range(k * lo, T + 1):
            best, best_a = inf, -1
            for a in range(max(0, t - hi), t - lo + 1):
                if cost[k - 1][a] == inf:
                    continue
                c = cost[k - 1][a] + sse(a, t)
                # strict '<' with a scanned upwards: ties keep the earliest boundary
                if best_a < 0 or c < best - 1e-12 * max(1.0, abs(best)):
                    best, best_a = c, a
            cost[k][t], arg[k][t] = best, best_a
    return cost, arg


def _dp_sizes(arg, T: int, k: int) -> tuple[int, ...]:
    sizes, t = [], T
    for kk in range(k, 0, -1):
        a = arg[kk][t]
        sizes.append(t - a)
        t = a
    return tuple(reversed(sizes))


def optimal_segmentation(
    y: Sequence[float], num_chunks: int, min_size: int = 1, max_size: int | None = None
) -> tuple[int, ...]:
    """The exact minimiser of :func:`segment_cost` over layouts of ``num_chunks`` chunks with
    sizes in ``[min_size, max_size]`` (dynamic programming, ``O(K T^2)``; ties keep earlier cuts)."""
    y = _curve(y)
    T = len(y)
    check_limits(T, num_chunks, min_size, max_size)
    lo, hi = _limits(T, min_size, max_size)
    _, arg = _dp_table(y, lo, hi, num_chunks)
    return _dp_sizes(arg, T, num_chunks)


def choose_num_chunks(
    y: Sequence[float], min_size: int = 1, max_size: int | None = None, explained: float = 0.9
) -> int:
    """The smallest feasible ``K`` whose optimal segmentation leaves at most ``1 - explained`` of
    the curve's total sum of squares ``sum (y - mean)^2`` within chunks (the largest feasible
    ``K`` if none does; the smallest if the curve is flat)."""
    if not 0 < explained < 1:
        raise ValueError(f"explained must be in (0, 1), got {explained}")
    y = _curve(y)
    T = len(y)
    ks = feasible_num_chunks(T, min_size, max_size)
    if not ks:
        check_limits(T, 1, min_size, max_size)
    lo, hi = _limits(T, min_size, max_size)
    mean = sum(y) / T
    total = sum((v - mean) ** 2 for v in y)
    cost, _ = _dp_table(y, lo, hi, ks.stop - 1)
    for k in ks:
        if cost[k][T] <= (1 - explained) * total:
            return k
    return ks.stop - 1


def curvature_scores(y: Sequence[float]) -> list[float]:
    """Score of each boundary ``b = 1 .. T - 1`` (list index ``b - 1``): ``|y[b+1] - 2 y[b] + y[b-1]|``
    for ``b <= T - 2``; the last boundary has no centred second difference and scores 0."""
    y = _curve(y)
    T = len(y)
    return [abs(y[b + 1] - 2 * y[b] + y[b - 1]) if b <= T - 2 else 0.0 for b in range(1, T)]


def curvature_segmentation(
    y: Sequence[float], num_chunks: int, min_size: int = 1, max_size: int | None = None
) -> tuple[int, ...]:
    """Paper v1's rule: cut at the ``num_chunks - 1`` boundaries of largest :func:`curvature_scores`
    (ties: earlier first), skipping a boundary when no layout within the limits would contain it
    together with those already taken."""
    y = _curve(y)
    T = len(y)
    check_limits(T, num_chunks, min_size, max_size)
    lo, hi = _limits(T, min_size, max_size)
    scores = curvature_scores(y)
    ranked = sorted(range(1, T), key=lambda b: (-scores[b - 1], b))
    return _sizes_from_cuts(T, _greedy(T, ranked, lo, hi, num_chunks))


def _sign(v: float, tol: float) -> int:
    return 0 if abs(v) <= tol else (1 if v > 0 else -1)


def sign_change_boundaries(y: Sequence[float], order: int) -> list[tuple[int, float]]:
    """Boundaries where the ``order``-th difference of ``y`` changes sign, with their strength.

    ``d = diff^order(y)`` (``d[k]`` spans positions ``k .. k + order``, centred at ``k + order / 2``).
    A sign change between ``d[k-1]`` and ``d[k]`` lies at ``k + (order - 1) / 2``; it becomes
    boundary ``k + ceil((order - 1) / 2)`` (order 1: an extremum at ``k`` starts a chunk at ``k``;
    order 2: an inflection between ``k`` and ``k + 1`` cuts there). Strength ``|d[k] - d[k-1]|``.
    Values within ``1e-9 * max|d|`` of zero count as zero, a sign of its own. Returns
    ``[(boundary, strength)]`` with ``1 <= boundary <= len(y) - 1``, in position order.
    """
    y = _curve(y)
    d = list(y)
    for _ in range(order):
        d = [b - a for a, b in zip(d, d[1:])]
    if len(d) < 2:
        return []
    tol = 1e-9 * max(abs(v) for v in d)
    s = [_sign(v, tol) for v in d]
    shift = (order - 1 + 1) // 2  # ceil((order - 1) / 2)
    out = []
    for k in range(1, len(d)):
        if s[k] != s[k - 1]:
            b = k + shift
            if 1 <= b <= len(y) - 1:
                out.append((b, abs(d[k] - d[k - 1])))
    return out


def derivative_segmentation(
    y: Sequence[float],
    num_chunks: int | None = None,
    min_size: int = 1,
    max_size: int | None = None,
    max_order: int = 3,
) -> tuple[int, ...]:
    """Paper v3's adaptive rule.

    1. Cut at every sign change of the first difference (the extrema of the curve), strongest
       first, skipping cuts that would break the size limits.
    2. Inside each chunk larger than ``max_size``, cut at the sign changes of the next higher
       difference of that chunk's values (order 2, then 3 in the new pieces still too large,
       up to ``max_order``); a chunk with no such feature left is split into near-equal pieces.

    ``num_chunks = None`` (or 0) returns what the rule gives. With a number, the rule's cuts are
    taken in priority order (lower order first, then stronger), then the other sign changes of
    orders ``1 .. max_order`` of the whole curve, then the remaining boundaries by curvature,
    each kept only while a layout of exactly ``num_chunks`` chunks within the limits stays possible.
    """
    y = _curve(y)
    T = len(y)
    lo, hi = _limits(T, min_size, max_size)
    if not feasible_num_chunks(T, lo, hi):
        check_limits(T, 1, lo, hi)
    if num_chunks:
        check_limits(T, num_chunks, lo, hi)
    if max_order < 1:
        raise ValueError(f"max_order must be >= 1, got {max_order}")

    # priority of each accepted cut: (order, -strength)
    priority: dict[int, tuple[int, float]] = {}

    def accept(cands: list[tuple[int, float]], order: int, cuts: set[int]) -> list[int]:
        taken = []
        for b, strength in sorted(cands, key=lambda c: (-c[1], c[0])):
            if b not in cuts and _completable(T, cuts | {b}, lo, hi, None):
                cuts.add(b)
                priority[b] = (order, -strength)
                taken.append(b)
        return taken

    cuts: set[int] = set()
    accept(sign_change_boundaries(y, 1), 1, cuts)

    def refine(a: int, b: int, order: int) -> None:
        if b - a <= hi:
            return
        for m in range(order, max_order + 1):
            local = [(a + p, s) for p, s in sign_change_boundaries(y[a:b], m)]
            if accept(local, m, cuts):
                edges = [a, *sorted(c for c in cuts if a < c < b), b]
                for pa, pb in zip(edges, edges[1:]):
                    refine(pa, pb, m + 1)
                return
        filled = _even_fill(b - a, {c - a for c in cuts if a < c < b}, lo, hi, None)
        for c in filled:
            if a + c not in cuts:
                cuts.add(a + c)
                priority[a + c] = (max_order + 1, 0.0)

    edges = [0, *sorted(cuts), T]
    for a, b in zip(edges, edges[1:]):
        refine(a, b, 2)
    if not num_chunks or len(cuts) == num_chunks - 1:
        return _sizes_from_cuts(T, cuts)

    ranked = sorted(cuts, key=lambda c: (priority[c], c))
    extra: list[tuple[tuple[int, float], int]] = []
    for m in range(1, max_order + 1):
        extra += [((m, -s), b) for b, s in sign_change_boundaries(y, m) if b not in cuts]
    ranked += [b for _, b in sorted(extra)]
    scores = curvature_scores(y)
    ranked += sorted(range(1, T), key=lambda b: (-scores[b - 1], b))
    chosen = _greedy(T, ranked, lo, hi, num_chunks)
    return _sizes_from_cuts(T, chosen)


@dataclasses.dataclass
class Segmentation:
    """One proposal: the layout, where it cuts, and how well it fits the curve."""

    method: str
    curve: str
    sizes: tuple[int, ...]
    boundaries: list[int]
    cost: float  # segment_cost of the curve under this layout
    explained: float  # 1 - cost / total sum of squares (1.0 for a flat curve)
    chosen_k: bool  # K was chosen by the rule, not given

    def snippet(self) -> str:
        return recipe_snippet(self.sizes)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["sizes"] = list(self.sizes)
        out["snippet"] = self.snippet()
        return out


def segment(
    y: Sequence[float],
    method: str = "dp",
    num_chunks: int = 0,
    min_size: int = 1,
    max_size: int | None = None,
    *,
    curve: str = "l1rel",
    explained: float = 0.9,
) -> Segmentation:
    """Run one of :data:`METHODS` on the curve ``y [T]`` (``num_chunks = 0`` chooses K)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    y = _curve(y)
    T = len(y)
    k = int(num_chunks or 0)
    if k < 0:
        raise ValueError(f"num_chunks must be >= 0 (0 = choose), got {num_chunks}")
    if method == "derivative":
        sizes = derivative_segmentation(y, k or None, min_size, max_size)
    else:
        if not k:
            k = choose_num_chunks(y, min_size, max_size, explained)
        rule = optimal_segmentation if method == "dp" else curvature_segmentation
        sizes = rule(y, k, min_size, max_size)
    cost = segment_cost(y, sizes)
    mean = sum(y) / T
    total = sum((v - mean) ** 2 for v in y)
    return Segmentation(
        method=method,
        curve=curve,
        sizes=tuple(sizes),
        boundaries=boundaries_from_sizes(sizes),
        cost=cost,
        explained=1.0 - cost / total if total > 0 else 1.0,
        chosen_k=not num_chunks,
    )


def recipe_snippet(sizes: Sequence[int]) -> str:
    """The recipe table that uses a layout: ``[chunker] use = "explicit" sizes = [...]``."""
    return '[chunker]\nuse = "explicit"\nsizes = [' + ", ".join(str(int(s)) for s in sizes) + "]"


_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float | None], boundaries: Sequence[int] = (), lo: float | None = None, hi: float | None = None) -> str:
    """A one-line unicode bar chart; ``|`` is drawn before each boundary position, ``·`` for None."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    lo = min(vals) if lo is None and vals else (lo or 0.0)
    hi = max(vals) if hi is None and vals else (hi or 1.0)
    span = hi - lo
    cuts = set(boundaries)
    out = []
    for i, v in enumerate(values):
        if i in cuts:
            out.append("|")
        if v is None or not math.isfinite(v):
            out.append("·")
        else:
            level = 0 if span <= 0 else int(round((v - lo) / span * (len(_BARS) - 1)))
            out.append(_BARS[min(max(level, 0), len(_BARS) - 1)])
    return "".join(out)


# ==================================================================== 3. measuring a model


@dataclasses.dataclass
class ProfileResult:
    """What one profiling run measured.

    ``sigmas [N + 1]``; ``trainable [N]`` (the engine's :func:`flowrl.sampling.trainable_mask`);
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

    Sampling is :func:`flowrl.sampling.rollout` with the given kernels, exactly as the engine
    rolls out. Seed ``k`` uses the same starting noise and the same SDE noise (per-sample
    generators seeded by ``(seed, "profile-noise" / "profile-sde", k)``) for every prompt, so the
    spread across prompts measures the prompt alone, and the result does not depend on
    ``batch_size``. ``progress(done, total)`` is called after each batch.
    """
    from .sampling import rollout
    from .seeding import generator

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
    encoded = model.encode_prompts(unique)
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
    from .sampling import trainable_mask

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
    from .seeding import generator

    prompts = list(dict.fromkeys(prompts))
    if num_prompts >= len(prompts):
        return prompts
    perm = torch.randperm(len(prompts), generator=generator(seed, "profile-prompts"))
    keep = sorted(int(i) for i in perm[:num_prompts])
    return [prompts[i] for i in keep]
