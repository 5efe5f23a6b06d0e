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

__all__ = ["DECAY_PRESETS", "old_policy_decay", "OldPolicy", "TrailingPolicy", "WithTrailingPolicy", "side_velocities"]

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


class TrailingPolicy:
    """The old policy of an objective that draws its rollouts with it and scores ratios (or
    reference velocities) against it: :class:`OldPolicy` with NFT's decay type ``decay_type``
    applied after each rollout, and the bookkeeping that lets its forward be skipped while its
    values equal the trained ones (decay 0 and no optimizer step yet in this rollout).

    ``prepare`` once the strategy holds the parameters; ``start(steps)`` and ``end(steps)`` around
    each rollout's update (``steps``: optimizer steps so far); ``is_current(steps)``: whether a
    forward now would return the old policy's values."""

    def __init__(self, decay_type: int):
        if decay_type not in DECAY_PRESETS:
            raise ValueError(f"decay_type must be one of {sorted(DECAY_PRESETS)}, got {decay_type!r}")
        self.decay_type = decay_type
        self.old: OldPolicy | None = None
        self.steps = 0
        self.same_as_current = True  # set when the old values were copied, cleared by an optimizer step
        self.steps_at_rollout = 0

    def prepare(self, params: Sequence[torch.Tensor], denoiser: torch.nn.Module) -> None:
        self.old = OldPolicy(params, denoiser)
        self.same_as_current = True

    def rollout_weights(self):
        """The old weights in place of the trained ones (nothing to swap while they are equal)."""
        if self.old is None or self.same_as_current:
            return contextlib.nullcontext()
        return self.old.swapped_in()

    def swapped_in(self):
        return self.old.swapped_in()

    def start(self, steps: int) -> None:
        self.steps_at_rollout = int(steps)

    def is_current(self, steps: int) -> bool:
        return self.same_as_current and int(steps) == self.steps_at_rollout

    def end(self, steps: int) -> float:
        """After a rollout's last optimizer step: the old values follow the trained ones; returns the decay."""
        self.steps = int(steps)
        d = old_policy_decay(self.steps, *DECAY_PRESETS[self.decay_type])
        moved = self.steps != self.steps_at_rollout
        if moved or not self.same_as_current:
            self.old.follow(d)
        self.same_as_current = d == 0.0 or (self.same_as_current and not moved)
        return d

    def state_dict(self) -> dict:
        return {"steps": self.steps, "same_as_current": self.same_as_current}

    def tensors(self) -> dict:
        return self.old.tensors() if self.old is not None else {}

    def load_state(self, state, tensors) -> None:
        self.steps = int(state.get("steps", 0))
        # a checkpoint that does not say (written before this was kept) runs the old forward: always right
        self.same_as_current = bool(state.get("same_as_current", False))
        if tensors and self.old is not None:
            self.old.load(tensors)


class WithTrailingPolicy:
    """What an objective that keeps a :class:`TrailingPolicy` as ``self.trailing`` shares:
    rollouts drawn with it (``SamplesWithOwnWeights``), its state in every checkpoint
    (``CheckpointsState``), and ``flowrl plan`` counting its copy (``keeps_old_policy``)."""

    keeps_old_policy = True
    trailing: TrailingPolicy

    @property
    def old(self) -> OldPolicy | None:
        return self.trailing.old

    def rollout_weights(self):
        """The old weights in place of the trained ones (restored after), swapped by storage: no copy
        of the model; nothing to swap while they are equal."""
        return self.trailing.rollout_weights()

    def state_dict(self) -> dict:
        return self.trailing.state_dict()

    def tensors(self) -> dict:
        return self.trailing.tensors()

    def load_state(self, state, tensors) -> None:
        self.trailing.load_state(state, tensors)


def side_velocities(ctx, trailing: TrailingPolicy, reference, x: torch.Tensor, sigma: torch.Tensor, text,
                    minimum: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The forwards beside the trained one at the points ``(x, sigma)``, without gradient: the old
    policy's velocity (None while its weights equal the trained ones: the trained forward's own
    value is then the old one) and the reference's (None without a reference), each counted in its
    compute phase against ``minimum`` rows (``ctx``: the objective's UpdateContext)."""
    v_old = v_ref = None
    if not trailing.is_current(ctx.optimizer_steps()):
        ctx.counter.expect("old", minimum)
        with torch.no_grad(), ctx.counter.phase("old"), trailing.swapped_in():
            v_old = ctx.model.velocity(x, sigma, text).to(torch.float32)
    if reference is not None:
        ctx.counter.expect("reference", minimum)
        with torch.no_grad(), ctx.counter.phase("reference"):
            v_ref = reference.velocity(x, sigma, text).to(torch.float32)
    return v_old, v_ref
