"""Wording helpers of user messages (:mod:`flowrl.errors`)."""

from __future__ import annotations

import pytest

from flowrl.errors import counted


@pytest.mark.parametrize("n, noun, plural, said", [
    (1, "iteration", None, "1 iteration"),
    (0, "iteration", None, "0 iterations"),
    (2, "image", None, "2 images"),
    (1, "process", "processes", "1 process"),
    (8, "process", "processes", "8 processes"),
])
def test_counted_uses_the_singular_for_one_only(n, noun, plural, said):
    assert counted(n, noun, plural) == said
