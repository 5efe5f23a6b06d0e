"""A second set of values of the trained parameters (an "old policy"), swapped in by storage.

DiffusionNFT (:mod:`flowrl.objectives.nft`) and the ELBO policy gradient
(:mod:`flowrl.objectives.elbo`) draw their rollouts with, and score their ratios against, old
weights that trail the trained ones: after each rollout ``theta_old <- d theta_old + (1 - d) theta``
(:func:`old_policy_decay`, NFT's schedule).

Running the old policy must not copy the model. :meth:`OldPolicy.swapped_in` exchanges each
trained parameter's storage with its old values (``p.data`` and the kept tensor trade places: no
copy, no transient memory) and exchanges them back on exit. A parameter sharded by FSDP2 (a
``DTensor``, whose all-gather reads FSDP's own flat buffer rather than ``p.data``) is exchanged in
place instead, one parameter at a time through one temporary of that parameter's shard: never a
copy of the whole model. What stays is the old values themselves, one copy of the trained
parameters (the LoRA adapter, or the full model's shard under FSDP2), which ``flowrl plan``
counts as the objective's state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from flowrl.distributed import drop_gathered_weights

__all__ = ["DECAY_PRESETS", "old_policy_decay", "OldPolicy"]

#: NFT's decay types: (flat, uprate, uphold) of :func:`old_policy_decay`.
DECAY_PRESETS: dict[int, tuple[int, float, float]] = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}


def old_policy_decay(step: int, flat: int, uprate: float, uphold: float) -> float:
    """The old policy's decay after ``step`` optimizer steps: ``0`` before ``flat``, then
    ``min((step - flat) * uprate, uphold)`` (NFT's schedule; :data:`DECAY_PRESETS`)."""
    if step < flat:
        return 0.0
    return min((step - flat) * uprate, uphold)


def _is_sharded(p: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed tensors shards nothing
        return False
    return isinstance(p, DTensor)


class OldPolicy:
    """The old values of ``params`` (the trainable parameters as the strategy holds them) of
    ``denoiser``; starts equal to them."""

    def __init__(self, params: Sequence[torch.Tensor], denoiser: torch.nn.Module):
        self.params = list(params)
        self.denoiser = denoiser
        with torch.no_grad():
            self.values = [p.detach().clone() for p in self.params]

    def _exchange(self) -> None:
        with torch.no_grad():
            for i, (p, old) in enumerate(zip(self.params, self.values)):
                if _is_sharded(p):
                    held = p.detach().clone()
                    p.detach().copy_(old)
                    old.copy_(held)
                else:
                    trained = p.data
                    p.data = old
                    self.values[i] = trained

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The old values in place of the trained ones inside the block (restored after, also on
        an error). Under FSDP2 the root's gathered weights are dropped on both sides, so that the
        forwards inside gather the old values and those after the trained ones."""
        drop_gathered_weights(self.denoiser)
        self._exchange()
        try:
            yield
        finally:
            drop_gathered_weights(self.denoiser)
            self._exchange()

    def follow(self, decay: float) -> None:
        """``old <- decay old + (1 - decay) trained`` (a plain copy for ``decay = 0``)."""
        with torch.no_grad():
            for old, p in zip(self.values, self.params):
                if decay == 0.0:
                    old.copy_(p.detach())
                else:
                    old.mul_(decay).add_(p.detach(), alpha=1.0 - decay)

    def tensors(self, prefix: str = "old") -> dict[str, torch.Tensor]:
        return {f"{prefix}.{i}": t for i, t in enumerate(self.values)}

    def load(self, tensors: dict[str, torch.Tensor], prefix: str = "old") -> None:
        with torch.no_grad():
            for i, old in enumerate(self.values):
                old.copy_(tensors[f"{prefix}.{i}"])
