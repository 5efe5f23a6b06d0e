"""Chunk layouts (docs/api.md §4-§6)."""

import pytest
import torch

from flowrl.chunking import (
    chunk_index,
    chunk_mean,
    chunks_from_boundaries,
    explicit_chunks,
    fixed_chunks,
    relative_l1_change,
    sequence_chunks,
    step_chunks,
)


def test_layouts_by_hand():
    assert step_chunks(4) == (1, 1, 1, 1)
    assert sequence_chunks(16) == (16,)
    assert fixed_chunks(16, 4) == (4, 4, 4, 4)
    assert fixed_chunks(16, 8) == (8, 8)
    assert fixed_chunks(15, 4) == (4, 4, 4, 3)          # remainder as its own last chunk
    assert fixed_chunks(15, 4, "merge") == (4, 4, 7)    # remainder merged into the last chunk
    assert fixed_chunks(3, 5) == (3,) and fixed_chunks(3, 5, "merge") == (3,)
    assert fixed_chunks(15, 4, "first") == (3, 4, 4, 4)    # the smaller chunk first
    assert fixed_chunks(16, 4, "first") == (4, 4, 4, 4) and fixed_chunks(3, 5, "first") == (3,)
    assert explicit_chunks(16, [2, 3, 4, 7]) == (2, 3, 4, 7)
    assert chunks_from_boundaries(16, [2, 5, 9]) == (2, 3, 4, 7)
    assert chunks_from_boundaries(16, [0, 2, 5, 9, 16]) == (2, 3, 4, 7)
    assert chunks_from_boundaries(5, []) == (5,)


def test_layout_errors():
    with pytest.raises(ValueError, match="must sum to the number of trainable transitions T = 16"):
        explicit_chunks(16, [2, 3, 4])
    with pytest.raises(ValueError, match=">= 1"):
        explicit_chunks(3, [3, 0])
    with pytest.raises(ValueError, match="at least one chunk"):
        explicit_chunks(3, [])
    with pytest.raises(ValueError, match="T must be an integer >= 1"):
        step_chunks(0)
    with pytest.raises(ValueError, match="chunk size must be >= 1"):
        fixed_chunks(8, 0)
    with pytest.raises(ValueError, match="remainder"):
        fixed_chunks(8, 3, "drop")
    with pytest.raises(ValueError, match="strictly increasing"):
        chunks_from_boundaries(16, [5, 2])
    with pytest.raises(ValueError, match="1 .. T - 1"):
        chunks_from_boundaries(16, [2, 17])
    with pytest.raises(ValueError, match="integer"):
        explicit_chunks(4, [2.0, 2.0])


def test_chunk_index_and_mean():
    assert chunk_index((2, 3)).tolist() == [0, 0, 1, 1, 1]
    v = torch.tensor([[1.0, 3.0, 0.0, 3.0, 6.0], [2.0, 2.0, 1.0, 1.0, 1.0]], requires_grad=True)
    m = chunk_mean(v, (2, 3))
    # [(1+3)/2, (0+3+6)/3] and [2, 1]
    assert m.tolist() == [[2.0, 3.0], [2.0, 1.0]]
    m.sum().backward()
    assert torch.allclose(v.grad, torch.tensor([[0.5, 0.5, 1 / 3, 1 / 3, 1 / 3]] * 2))
    with pytest.raises(ValueError, match="T = sum"):
        chunk_mean(v, (2, 2))


def test_relative_l1_change_by_hand():
    # one sample, states [1, -1] -> [2, 0] -> [2, 1]: |(1, 1)|_1 / 2 = 1 ; |(0, 1)|_1 / 2 = 0.5
    lat = torch.tensor([[[1.0, -1.0], [2.0, 0.0], [2.0, 1.0]]])
    assert relative_l1_change(lat).tolist() == [1.0, 0.5]


def test_every_remainder_the_fixed_chunker_offers_is_a_layout():
    """The recipe key's choices (plugins/chunkers.py) and the layout function agree: each one
    yields sizes covering T (``first`` was offered and refused by every recipe once)."""
    import typing

    from flowrl.plugins import get_registry

    comp = get_registry().get("chunker", "fixed")
    choices = typing.get_args(typing.get_type_hints(comp.params)["remainder"])
    assert set(choices) == {"last", "merge", "first"}
    for remainder in choices:
        sizes = comp.build(comp.params(size=4, remainder=remainder)).sizes(15)
        assert sum(sizes) == 15 and max(sizes) <= 7
