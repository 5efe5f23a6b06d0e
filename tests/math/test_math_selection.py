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


# ---------------------------------------------------------------- Flash-GRPO and E-GRPO

from flowrl.selection import select_one_per_group, select_top_entropy, unit_entropy  # noqa: E402


def test_flash_one_unit_per_sample_shared_by_its_group():
    groups = torch.tensor([5, 5, 5, 9, 9, 2])
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3, 4, 5, 6)]  # rows of a group differ on purpose
    m = select_one_per_group(groups, 16, 1.0, gens)
    assert m.dtype == torch.bool and m.shape == (6, 16)
    assert (m.sum(1) == 1).all()  # exactly one trained step per sample
    step = m.float().argmax(1)
    assert step[0] == step[1] == step[2] and step[3] == step[4]  # iso-temporal: one step per group
    # the group draws from its first row's generator: torch.randint(16) of seed 1, and of seed 4
    assert int(step[0]) == int(torch.randint(16, (1,), generator=torch.Generator().manual_seed(1)))
    assert int(step[3]) == int(torch.randint(16, (1,), generator=torch.Generator().manual_seed(4)))
    # span 0.5: only the first int(16 * 0.5) = 8 units; span keeps at least one unit
    assert (select_one_per_group(torch.arange(200), 16, 0.5).float().argmax(1) < 8).all()
    assert (select_one_per_group(torch.arange(5), 3, 0.1)[:, 0]).all()


def test_flash_steps_uniform_over_groups():
    # 4000 groups (or iterations: one fresh seed each), K = 4: each step with probability 1/4 (4 sigma)
    gens = [torch.Generator().manual_seed(s) for s in range(4000)]
    freq = select_one_per_group(torch.arange(4000), 4, 1.0, gens).double().mean(0)
    assert torch.all((freq - 0.25).abs() < 4 * math.sqrt(0.25 * 0.75 / 4000))


def test_entropy_by_hand():
    # per-element Gaussian entropy 0.5 log(2 pi e) + log s; chunk (2 steps) = mean of its steps
    std = torch.tensor([[0.7, 0.5, 0.2, 0.1, 0.3, 0.05]], dtype=torch.float64)
    c = 0.5 * math.log(2 * math.pi * math.e)
    h = unit_entropy(std, (1,) * 6)
    assert torch.allclose(h[0], torch.tensor([c + math.log(s) for s in std[0].tolist()], dtype=torch.float64))
    h2 = unit_entropy(std, (2, 2, 2))
    assert math.isclose(float(h2[0, 1]), c + 0.5 * (math.log(0.2) + math.log(0.1)), rel_tol=1e-9)
    # top 3 by entropy = the 3 largest std: 0.7, 0.5, 0.3 -> steps 0, 1, 4
    assert select_top_entropy(h, count=3)[0].nonzero().flatten().tolist() == [0, 1, 4]
    # threshold: entropy >= c + log 0.25 keeps std 0.7, 0.5, 0.3
    assert select_top_entropy(h, threshold=c + math.log(0.25))[0].nonzero().flatten().tolist() == [0, 1, 4]
    # a threshold above every step keeps the highest one
    assert select_top_entropy(h, threshold=10.0)[0].nonzero().flatten().tolist() == [0]
    # ties go to the earlier unit
    assert select_top_entropy(unit_entropy(torch.full((1, 4), 0.3), (1,) * 4), count=2)[0].tolist() == [True, True, False, False]
    with pytest.raises(ValueError, match="> 0"):
        unit_entropy(torch.tensor([[0.1, 0.0]]), (1, 1))
    with pytest.raises(ValueError, match="exactly one"):
        select_top_entropy(h)
