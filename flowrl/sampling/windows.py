"""Where the SDE window sits: MixGRPO's sliding schedule and Flow-GRPO-Fast's random placement.

A window is a half-open range of step indices ``[start, start + size)`` sampled with the SDE
kernel (and trained); the other steps are deterministic.

MixGRPO (``fastvideo/utils/grpo_states.py`` of its code, strategy ``progressive``): the window
starts at 0 and moves by ``stride`` steps every ``every`` iterations; past ``max_start`` it rolls
back to 0. In closed form, iteration ``k`` starts at::

    start_k = ((k // every) mod (max_start // stride + 1)) * stride      (stride > 0)
    start_k = 0                                                          (stride = 0: frozen)

MixGRPO's own bound lets the window run past the last trainable step (``max_start = M``),
truncating it and, at ``start = M``, leaving it empty for ``every`` iterations;
:func:`mixgrpo_sde_window` reproduces that. flowrl's planner keeps whole windows
(``max_start = M - size``, as verl-omni does) so that T, and with it the chunk layout, is the
same at every iteration.

Flow-GRPO-Fast: the window's start is uniform on ``{lo, ..., hi - size}`` (both ends included),
drawn per sample, per group or per iteration (:func:`random_sde_window_start`).
"""

from __future__ import annotations

import torch

__all__ = ["sliding_sde_window_start", "mixgrpo_sde_window", "random_sde_window_start"]


def _check(name: str, value, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def sliding_sde_window_start(iteration: int, *, every: int, stride: int, max_start: int) -> int:
    """The start of iteration ``iteration``'s window (module docstring; roll back past
    ``max_start``)."""
    _check("iteration", iteration)
    _check("every", every, 1)
    _check("stride", stride)
    _check("max_start", max_start)
    if stride == 0:
        return 0
    return ((iteration // every) % (max_start // stride + 1)) * stride


def mixgrpo_sde_window(iteration: int, *, size: int, every: int, stride: int, max_stop: int) -> tuple[int, int]:
    """MixGRPO's window ``[start, stop)`` exactly as its code moves it (``roll_back`` on):
    ``start`` runs up to ``max_stop`` itself and ``stop = min(start + size, max_stop)``, so the
    last windows are truncated or empty (``start == stop``)."""
    _check("size", size, 1)
    start = sliding_sde_window_start(iteration, every=every, stride=stride, max_start=_check("max_stop", max_stop, 1))
    return start, min(start + size, max_stop)


def random_sde_window_start(generator: torch.Generator | None, lo: int, hi: int, size: int) -> int:
    """A start uniform on ``{lo, ..., hi - size}`` (Flow-GRPO-Fast's ``randint(lo, hi - size)``),
    drawn from ``generator`` (CPU)."""
    _check("lo", lo)
    _check("size", size, 1)
    if hi - size < lo:
        raise ValueError(f"a window of {size} steps does not fit in [{lo}, {hi})")
    return int(torch.randint(lo, hi - size + 1, (1,), generator=generator))
