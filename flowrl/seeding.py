"""Deterministic per-sample randomness, independent of the number of processes.

Every random draw in a run comes from a generator seeded by a hash of
``(seed, purpose, iteration, global sample index, ...)``. A sample therefore gets the same noise
whether it is generated on rank 0 of 1 or rank 3 of 8, in a batch of 2 or of 64, and a resumed
run draws exactly what the uninterrupted run would have.
"""

from __future__ import annotations

import hashlib
import struct

import torch


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from any mix of ints and strings (stable across Python runs)."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        data = part.encode() if isinstance(part, str) else struct.pack("<q", int(part))
        h.update(len(data).to_bytes(2, "little") + data)
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def generator(*parts: int | str, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch.Generator on ``device`` seeded by :func:`derive_seed`."""
    g = torch.Generator(device=device)
    g.manual_seed(derive_seed(*parts))
    return g


def sample_generators(seed: int, purpose: str, iteration: int, indices, device="cpu") -> list[torch.Generator]:
    """One generator per global sample index."""
    return [generator(seed, purpose, iteration, int(i), device=device) for i in indices]
