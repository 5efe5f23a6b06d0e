"""Chunk boundaries from a curve: the segmentation rules of ``flowrl profile`` (pure, float64).

A layout is a tuple of chunk sizes summing to ``T`` (the trainable transitions); boundary ``b``
(``1 <= b <= T - 1``) is where a new chunk starts. Convention: a feature *at* position ``p`` (a
kink or an extremum of the curve) starts a new chunk at ``p``; a feature between ``p - 1`` and
``p`` cuts there. Three rules, each under the limits ``min_size <= size <= max_size``:

- ``curvature`` (the Chunk-GRPO paper's first version): the ``K - 1`` boundaries with the
  largest ``|second difference|`` (``|y[b+1] - 2 y[b] + y[b-1]|``), strongest first, skipping
  any that would make the limits unsatisfiable (:func:`curvature_segmentation`);
- ``dp``: the exact least-squares segmentation, minimising the sum over chunks of the squared
  deviations from the chunk mean, by dynamic programming (:func:`optimal_segmentation`);
- ``derivative`` (the paper's later version): cut where the first difference changes sign (the
  curve's extrema), then, inside every chunk still larger than ``max_size``, where the next
  higher difference changes sign, recursively (:func:`derivative_segmentation`).

``num_chunks = 0`` chooses ``K``: for ``dp`` and ``curvature`` the smallest ``K`` whose optimal
segmentation explains ``explained`` (default 90%) of the curve's variance
(:func:`choose_num_chunks`); for ``derivative`` the number the rule itself produces.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

#: Segmentation rules (see the module docstring).
METHODS = ("dp", "curvature", "derivative")

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
