"""Unit selection (docs/api.md §4, §6)."""

import itertools
import math

import pytest
import torch

from flowrl.selection import (
    chunk_weights_from_l1rel,
    select_all,
    select_uniform,
    select_weighted,
    selection_count,
)


def test_counts_never_zero():
    assert selection_count(16, 0.5) == 8
    assert selection_count(15, 0.6) == 9
    assert selection_count(4, 0.5) == 2
    assert selection_count(1, 0.5) == 1  # the anchor's int(0.5) = 0 trains nothing
    with pytest.raises(ValueError, match="fraction"):
        selection_count(4, 0.0)


def test_select_all_and_uniform():
    assert select_all(2, 3).all() and select_all(2, 3).shape == (2, 3)
    m = select_uniform(50, 4, 0.5, torch.Generator().manual_seed(0))
    assert m.dtype == torch.bool and m.shape == (50, 4)
    assert (m.sum(1) == 2).all()
    assert (select_uniform(3, 1, 0.5).sum(1) == 1).all()
    # per-sample generators: sample 1's draw does not depend on the batch
    full = select_uniform(3, 16, 0.5, [torch.Generator().manual_seed(s) for s in (7, 8, 9)])
    alone = select_uniform(1, 16, 0.5, [torch.Generator().manual_seed(8)])
    assert torch.equal(full[1], alone[0])
    # uniform inclusion: each of K = 4 units is in with probability 2/4 (4-sigma bound, n = 4000)
    big = select_uniform(4000, 4, 0.5, torch.Generator().manual_seed(1)).double().mean(0)
    assert torch.all((big - 0.5).abs() < 4 * math.sqrt(0.25 / 4000))


def test_chunk_weights_from_l1rel_by_hand():
    l1 = torch.arange(16, dtype=torch.float32)
    # means of [0,1], [2,3,4], [5..8], [9..15] = 0.5, 3, 6.5, 12
    assert chunk_weights_from_l1rel(l1, (2, 3, 4, 7)).tolist() == [0.5, 3.0, 6.5, 12.0]
    with pytest.raises(ValueError, match=">= 0"):
        chunk_weights_from_l1rel(-l1, (16,))


W = [1.0, 2.0, 3.0, 4.0]


def test_weighted_first_draw_frequencies():
    # count = 1: P(j) = w_j / sum w = [0.1, 0.2, 0.3, 0.4]; 4-sigma binomial bounds on 20000
    n = 20000
    m = select_weighted(n, torch.tensor(W), 1, torch.Generator().manual_seed(42))
    assert (m.sum(1) == 1).all()
    freq = m.double().mean(0)
    for j, w in enumerate(W):
        p = w / sum(W)
        assert abs(freq[j].item() - p) < 4 * math.sqrt(p * (1 - p) / n), (j, freq[j].item(), p)


def test_weighted_inclusion_count_two_matches_enumeration():
    # exact without-replacement inclusion: P(j in) = sum over ordered pairs (a, b), a != b,
    # with j in {a, b} of  w_a / W * w_b / (W - w_a)
    total = sum(W)
    incl = [0.0] * 4
    for a, b in itertools.permutations(range(4), 2):
        p = W[a] / total * W[b] / (total - W[a])
        incl[a] += p
        incl[b] += p
    assert abs(sum(incl) - 2.0) < 1e-12
    n = 20000
    m = select_weighted(n, torch.tensor(W), 2, torch.Generator().manual_seed(7))
    assert (m.sum(1) == 2).all()
    freq = m.double().mean(0)
    for j in range(4):
        p = incl[j]
        assert abs(freq[j].item() - p) < 4 * math.sqrt(p * (1 - p) / n), (j, freq[j].item(), p)


def test_weighted_zero_weights_and_errors():
    m = select_weighted(200, torch.tensor([0.0, 1.0, 0.0, 2.0]), 2, torch.Generator().manual_seed(0))
    assert m[:, [0, 2]].sum() == 0 and m[:, [1, 3]].all()
    per_sample = select_weighted(2, torch.tensor([[1.0, 0.0], [0.0, 1.0]]), 1)
    assert per_sample.tolist() == [[True, False], [False, True]]
    with pytest.raises(ValueError, match="positive weight"):
        select_weighted(2, torch.tensor([0.0, 1.0, 0.0]), 2)
    with pytest.raises(ValueError, match="count"):
        select_weighted(2, torch.tensor(W), 0)
    with pytest.raises(ValueError, match=">= 0"):
        select_weighted(2, torch.tensor([1.0, -1.0]), 1)
