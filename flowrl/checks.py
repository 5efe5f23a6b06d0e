"""Argument checks shared by flowrl's maths modules: each raises ``ValueError`` naming the argument."""

from __future__ import annotations

__all__ = ["positive_int"]


def positive_int(value, what: str) -> int:
    """``value`` if it is an ``int`` >= 1 (a ``bool`` is not), else ``ValueError``:
    ``"<what> must be an integer >= 1, got <value!r>"``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
    return value
