"""The device memory a run has used, as torch's CUDA allocator counts it, for the metrics rows.

``memory/peak_allocated_gib`` is ``torch.cuda.max_memory_allocated``: the most bytes of live
tensors at any moment since the process started (or since other code last called
``torch.cuda.reset_peak_memory_stats``), which is what ``flowrl plan`` estimates.
``memory/peak_reserved_gib`` is ``torch.cuda.max_memory_reserved``: the allocator's pool at its
largest, fragmentation included, nearer to what ``nvidia-smi`` shows. Neither counts the CUDA
context or memory outside torch. The high-water marks are read, never reset, so that a caller
measuring a whole run around ``train()`` (``flowrl selftest``, the GPU memory check) reads the
same peak. The CPU allocator keeps no peak: a CPU run logs no ``memory/*``.
"""

from __future__ import annotations

import torch

GIB = 2**30


def peak_memory(device: torch.device) -> dict[str, float]:
    """``memory/*`` of the run so far on ``device``: empty unless it is a CUDA device."""
    if device.type != "cuda":
        return {}
    return {"memory/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "memory/peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB}
