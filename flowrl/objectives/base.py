"""What the update hands an objective per micro-batch (:class:`MicroBatch`) and what it gets
back (:class:`MicroBatchResult`); the objective protocol itself is
:class:`flowrl.interfaces.Objective`."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch of an optimizer step.

    ``batch``: the iteration's :class:`flowrl.train.collect.Batch`; ``rows``: the micro-batch's
    rows in it (long, CPU); ``sizes``: the chunk layout (``()`` for objectives without units);
    ``epoch``: the pass over the rollout; ``normaliser``: the samples of the whole optimizer step
    on this process (divide the summed per-sample losses by it); ``first``: the first optimizer
    step after the rollout (exactly on-policy); ``probe``: an
    :class:`flowrl.train.update.OnPolicyProbe` to feed the re-scored log-probs of that step
    (None otherwise; objectives without log-probs leave it unfed)."""

    batch: object
    rows: torch.Tensor
    sizes: tuple[int, ...]
    epoch: int
    normaliser: float
    first: bool
    probe: object | None = None


@dataclasses.dataclass
class MicroBatchResult:
    """``losses``: the loss terms back-propagated, as floats, summed in this order into the
    step's logged ``loss``; ``metrics``: per-micro-batch metrics (in the order they are logged;
    combined over micro-batches and processes by ``flowrl.train.update.update_aggregate``);
    ``trained``: bool ``[len(rows), K]``, the units each row trained (K = ``len(sizes)``)."""

    losses: tuple[float, ...]
    metrics: dict[str, float]
    trained: torch.Tensor
