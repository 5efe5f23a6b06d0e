"""Chunk layouts over the T trainable transitions (docs/api.md §4, §5, §6).

A layout is a tuple of positive ints ``sizes`` with ``sum(sizes) == T``: the chunks cover the
trainable transitions in order (chunk 0 holds positions ``0 .. sizes[0] - 1``, and so on).
Positions are indices into the trainable sequence (``0 <= t < T``), not step indices.

- step-level GRPO: ``step_chunks(T) = (1,) * T``;
- GSPO / sequence level: ``sequence_chunks(T) = (T,)``;
- Chunk-GRPO paper v1 for N = 17, s = 3: ``explicit_chunks(16, (2, 3, 4, 7))``.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from .checks import positive_int

__all__ = [
    "step_chunks",
    "sequence_chunks",
    "fixed_chunks",
    "explicit_chunks",
    "chunks_from_boundaries",
    "validate_chunks",
    "chunk_index",
    "chunk_mean",
    "relative_l1_change",
]


def _check_T(T: int) -> int:
    return positive_int(T, "the number of trainable transitions T")


def _as_int(v, what: str) -> int:
    if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_floating_point():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ValueError(f"{what} must be an integer, got {v!r}")
    return int(v)


def validate_chunks(sizes: Sequence[int], T: int | None = None) -> tuple[int, ...]:
    """Check a layout: a non-empty sequence of integers >= 1 (summing to ``T`` if given)."""
    try:
        seq = list(sizes)
    except TypeError as exc:
        raise ValueError(f"chunk sizes must be a sequence of integers, got {sizes!r}") from exc
    if not seq:
        raise ValueError("chunk sizes must hold at least one chunk, got an empty sequence")
    out = tuple(_as_int(s, "every chunk size") for s in seq)
    bad = [s for s in out if s < 1]
    if bad:
        raise ValueError(f"every chunk size must be >= 1, got {list(out)}")
    if T is not None and sum(out) != _check_T(T):
        raise ValueError(
            f"chunk sizes {list(out)} sum to {sum(out)}, but they must sum to the number of "
            f"trainable transitions T = {T}"
        )
    return out


def step_chunks(T: int) -> tuple[int, ...]:
    """``(1,) * T``: every transition its own unit (step-level GRPO; section 5)."""
    return (1,) * _check_T(T)


def sequence_chunks(T: int) -> tuple[int, ...]:
    """``(T,)``: one unit holding every transition (GSPO sequence ratio; section 5)."""
    return (_check_T(T),)


_REMAINDERS = ("last", "merge", "first")


def fixed_chunks(T: int, size: int, remainder: str = "last") -> tuple[int, ...]:
    """Chunks of ``size`` with ``q, r = divmod(T, size)``.

    ``remainder="last"`` (default): ``(size,) * q + (r,)`` when ``r > 0``: every chunk stays
    ``<= size`` (section 6: small chunks are preferred). ``remainder="merge"``: the remainder is
    added to the last full chunk, ``(size,) * (q - 1) + (size + r,)`` (one chunk of ``T`` when
    ``size > T``). ``remainder="first"``: the smaller chunk opens the layout, ``(r,) + (size,) * q``,
    so the full chunks end on the last, lowest-noise transition. Dropping the remainder is not
    offered: a layout must cover all T transitions.
    Examples: ``fixed_chunks(16, 4) = (4, 4, 4, 4)``, ``fixed_chunks(15, 4) = (4, 4, 4, 3)``,
    ``fixed_chunks(15, 4, "merge") = (4, 4, 7)``, ``fixed_chunks(15, 4, "first") = (3, 4, 4, 4)``.
    """
    _check_T(T)
    size = _as_int(size, "chunk size")
    if size < 1:
        raise ValueError(f"chunk size must be >= 1, got {size}")
    if remainder not in _REMAINDERS:
        raise ValueError(
            f"remainder must be one of {_REMAINDERS} (a layout must cover all T transitions), "
            f"got {remainder!r}"
        )
    q, r = divmod(T, size)
    if r == 0:
        return (size,) * q
    if remainder == "last" or q == 0:
        return (size,) * q + (r,)
    if remainder == "first":
        return (r,) + (size,) * q
    return (size,) * (q - 1) + (size + r,)


def explicit_chunks(T: int, sizes: Sequence[int]) -> tuple[int, ...]:
    """The given sizes, checked: integers >= 1 that sum to ``T``."""
    return validate_chunks(sizes, _check_T(T))


def chunks_from_boundaries(T: int, boundaries: Sequence[int]) -> tuple[int, ...]:
    """Sizes from cut points: each boundary is the position where a new chunk starts.

    Boundaries must be strictly increasing integers in ``1 .. T - 1``; a leading 0 and a
    trailing ``T`` are accepted and ignored. ``chunks_from_boundaries(16, (2, 5, 9)) =
    (2, 3, 4, 7)``; no boundaries gives ``(T,)``.
    """
    _check_T(T)
    cuts = [_as_int(b, "every boundary") for b in boundaries]
    if cuts and cuts[0] == 0:
        cuts = cuts[1:]
    if cuts and cuts[-1] == T:
        cuts = cuts[:-1]
    if any(c < 1 or c > T - 1 for c in cuts):
        raise ValueError(f"boundaries must lie in 1 .. T - 1 = {T - 1}, got {list(boundaries)}")
    if any(b <= a for a, b in zip(cuts, cuts[1:])):
        raise ValueError(f"boundaries must be strictly increasing, got {list(boundaries)}")
    edges = [0, *cuts, T]
    return tuple(b - a for a, b in zip(edges, edges[1:]))


def chunk_index(sizes: Sequence[int], device=None) -> torch.Tensor:
    """LongTensor ``[T]``: the unit id of each transition position, e.g. ``(2, 3) -> [0,0,1,1,1]``."""
    s = validate_chunks(sizes)
    return torch.repeat_interleave(
        torch.arange(len(s), device=device), torch.tensor(s, device=device)
    )


def chunk_mean(values: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """Mean of ``values [..., T]`` within each chunk: ``[..., K]`` (keeps the gradient)."""
    s = validate_chunks(sizes)
    if values.ndim < 1 or values.shape[-1] != sum(s):
        raise ValueError(
            f"values must be [..., T] with T = sum(sizes) = {sum(s)}, got shape {tuple(values.shape)}"
        )
    parts = torch.split(values, list(s), dim=-1)
    return torch.stack([p.mean(dim=-1) for p in parts], dim=-1)


def relative_l1_change(latents: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """``L1rel_i = ||x_{i+1} - x_i||_1 / ||x_i||_1`` averaged over the batch (section 6).

    ``latents [B, N + 1, ...]`` (a trajectory's states) -> float32 ``[N]``. ``eps`` is added to
    the denominator (0 by default).
    """
    if latents.ndim < 3:
        raise ValueError(f"latents must be [B, N + 1, ...], got shape {tuple(latents.shape)}")
    x = latents.to(torch.float32).flatten(2)
    num = (x[:, 1:] - x[:, :-1]).abs().sum(-1)
    den = x[:, :-1].abs().sum(-1) + eps
    if not bool((den > 0).all()):
        raise ValueError("relative L1 change is undefined for an all-zero state (||x_i||_1 = 0)")
    return (num / den).mean(0)
