"""Segmentation rules of `flowrl profile` on synthetic curves with known answers (flowrl/dynamics/).

The DP is checked against brute-force enumeration of every layout, with the cost computed
independently (numpy variance); the curvature and derivative rules against answers worked out
by hand in the comments.
"""

import itertools
import random

import numpy as np
import pytest

from flowrl.dynamics.segment import (
    METHODS,
    boundaries_from_sizes,
    check_limits,
    choose_num_chunks,
    curvature_scores,
    curvature_segmentation,
    derivative_segmentation,
    feasible_num_chunks,
    optimal_segmentation,
    recipe_snippet,
    segment,
    sign_change_boundaries,
)


def all_layouts(T):
    for r in range(T):
        for cuts in itertools.combinations(range(1, T), r):
            edges = [0, *cuts, T]
            yield tuple(b - a for a, b in zip(edges, edges[1:]))


def sse(y, sizes):
    """Independent cost: sum over chunks of n * variance (numpy)."""
    out, pos = 0.0, 0
    for s in sizes:
        part = np.asarray(y[pos : pos + s], dtype=np.float64)
        out += part.size * part.var()
        pos += s
    return out


def brute_force(y, K, lo, hi):
    ok = [c for c in all_layouts(len(y)) if len(c) == K and all(lo <= s <= hi for s in c)]
    return min(sse(y, c) for c in ok)


def test_dp_equals_brute_force_on_random_curves():
    rng = random.Random(0)
    checked = 0
    for _ in range(60):
        T = rng.randint(1, 9)
        y = [rng.random() for _ in range(T)]
        lo = rng.randint(1, 3)
        hi = rng.choice([0, lo, lo + 1, lo + 3])
        if not feasible_num_chunks(T, lo, hi or None):
            continue
        for K in feasible_num_chunks(T, lo, hi or None):
            sizes = optimal_segmentation(y, K, lo, hi or None)
            assert len(sizes) == K and sum(sizes) == T
            assert all(lo <= s <= (hi or T) for s in sizes)
            assert sse(y, sizes) == pytest.approx(brute_force(y, K, lo, hi or T), abs=1e-12)
            checked += 1
    assert checked > 100


def test_dp_known_answers():
    # three plateaus: the only zero-cost layout with 3 chunks
    assert optimal_segmentation([1, 1, 1, 5, 5, 9, 9, 9, 9], 3) == (3, 2, 4)
    # one spike first: unconstrained it is isolated; with min_size 2, (2, 4) costs 50 < (3, 3)'s 66.7
    assert optimal_segmentation([10, 0, 0, 0, 0, 0], 2) == (1, 5)
    assert optimal_segmentation([10, 0, 0, 0, 0, 0], 2, min_size=2) == (2, 4)
    # max_size forces the plateau of 4 to split
    assert optimal_segmentation([1, 1, 1, 1, 9, 9], 2, max_size=3) == (3, 3)


def test_curvature_known_answers():
    # slope 0 -> 2 at position 4 (|d2| = 2), slope 2 -> 1 at position 9 (|d2| = 1)
    y = [0, 0, 0, 0, 0, 2, 4, 6, 8, 10, 11, 12, 13, 14]
    scores = curvature_scores(y)
    assert scores[4 - 1] == 2 and scores[9 - 1] == 1
    assert sum(1 for s in scores if s > 0) == 2
    assert curvature_segmentation(y, 2) == (4, 10)
    assert curvature_segmentation(y, 3) == (4, 5, 5)
    # min_size 5 forbids the cut at 4 (first chunk of 4): the next strongest, 9, is used
    assert curvature_segmentation(y, 2, min_size=5) == (9, 5)


def test_curvature_is_top_k_of_second_differences_without_limits():
    rng = random.Random(1)
    for _ in range(30):
        T = rng.randint(4, 20)
        y = [rng.random() for _ in range(T)]
        d2 = np.abs(np.diff(np.asarray(y), 2))  # d2[j] centred at position j + 1
        for K in range(1, T - 1):
            expected = sorted((np.argsort(-d2, kind="stable")[: K - 1] + 1).tolist())
            assert boundaries_from_sizes(curvature_segmentation(y, K)) == expected


def test_sign_change_positions():
    # V with its minimum at position 4: the first difference changes sign there
    assert sign_change_boundaries([5, 4, 3, 2, 1, 2, 3, 4], 1) == [(4, 2.0)]
    # steepest step 4 -> 7 is between positions 2 and 3: the second difference changes sign there
    assert [b for b, _ in sign_change_boundaries([1, 2, 4, 7, 9], 2)] == [3]


def test_derivative_known_answers():
    v = [5, 4, 3, 2, 1, 2, 3, 4]
    assert derivative_segmentation(v) == (4, 4)
    assert derivative_segmentation(v, 2) == (4, 4)
    # both halves exceed max_size 3 and have no higher-order feature: near-equal split
    assert derivative_segmentation(v, max_size=3) == (2, 2, 2, 2)
    # a hump: maximum at 5 -> (5, 6); with max_size 4 each side is cut at its inflection:
    # left [1, 2, 4, 7, 9] between 2 and 3, right [10, 9, 7, 4, 2, 1] between 7 and 8
    hump = [1, 2, 4, 7, 9, 10, 9, 7, 4, 2, 1]
    assert derivative_segmentation(hump) == (5, 6)
    assert derivative_segmentation(hump, max_size=4) == (3, 2, 3, 3)
    # monotone and smooth: no extremum, one chunk unless a limit asks for more
    assert derivative_segmentation([9, 7, 5.5, 4.5, 4, 3.8]) == (6,)


def test_every_method_respects_the_limits():
    rng = random.Random(2)
    for _ in range(80):
        T = rng.randint(1, 12)
        y = [rng.random() for _ in range(T)]
        lo, hi = rng.randint(1, 3), rng.choice([0, 2, 3, 5])
        if hi and hi < lo or not feasible_num_chunks(T, lo, hi or None):
            continue
        for method in METHODS:
            for K in [0, *feasible_num_chunks(T, lo, hi or None)]:
                seg = segment(y, method, K, lo, hi or None)
                assert sum(seg.sizes) == T
                assert all(lo <= s <= (hi or T) for s in seg.sizes), (method, K, lo, hi, seg.sizes)
                if K:
                    assert len(seg.sizes) == K
                assert seg.boundaries == boundaries_from_sizes(seg.sizes)


def test_impossible_limits_are_clear_errors():
    with pytest.raises(ValueError, match="possible num_chunks: 2..4"):
        check_limits(16, 5, min_size=4, max_size=8)
    with pytest.raises(ValueError, match="no layout"):
        check_limits(5, 1, min_size=3, max_size=4)
    with pytest.raises(ValueError, match="max_size"):
        segment([1, 2, 3], "dp", 1, min_size=3, max_size=2)
    for method in METHODS:
        with pytest.raises(ValueError):
            segment([1.0] * 16, method, 3, min_size=6)


def test_choose_k():
    steps3 = [1, 1, 1, 1, 5, 5, 5, 5, 9, 9, 9, 9]
    # K = 2 explains 75% of the variance, K = 3 all of it
    assert choose_num_chunks(steps3, explained=0.9) == 3
    assert choose_num_chunks(steps3, explained=0.7) == 2
    seg = segment(steps3, "dp", 0)
    assert seg.sizes == (4, 4, 4) and seg.chosen_k and seg.explained == pytest.approx(1.0)
    assert choose_num_chunks([2.0] * 6) == 1
    assert choose_num_chunks([2.0] * 6, max_size=2) == 3


def test_deterministic_and_snippet():
    rng = random.Random(3)
    y = [rng.random() for _ in range(16)]
    for method in METHODS:
        assert segment(y, method, 4, 2, 8) == segment(list(y), method, 4, 2, 8)
    assert recipe_snippet((2, 3, 4, 7)) == '[chunker]\nuse = "explicit"\nsizes = [2, 3, 4, 7]'
