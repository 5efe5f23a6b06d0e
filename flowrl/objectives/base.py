"""What the update and an objective hand each other: the :class:`UpdateContext` an objective
works in, the :class:`MicroBatch` it back-propagates and the :class:`MicroBatchResult` it returns
(the objective protocol itself is :class:`flowrl.interfaces.Objective`).

The update (:class:`flowrl.train.update.PolicyUpdate`) never hands an objective itself: an
objective sees the model, the device, the seed, the process layout and the few services of the
update it needs, as typed members of the context, and nothing of the training loop. So an
objective written against this module keeps working whatever the update's internals become.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import torch

from flowrl.batch import Batch
from flowrl.distributed import DistContext
from flowrl.interfaces import ChunkSelector, ModelAdapter
from flowrl.objectives.chunk_gradient import Lockstep, StepLogProbFn
from flowrl.objectives.kl import KLSettings

__all__ = ["CountsCompute", "UpdateMode", "UpdateContext", "OnPolicyProbe", "MicroBatch", "MicroBatchResult"]


class CountsCompute(Protocol):
    """The compute accounting an objective reports to (:class:`flowrl.train.compute.ComputeCounter`):
    ``expect(phase, rows)`` adds to the algorithmic minimum of a phase (``update``, ``reference``),
    ``phase(name)`` counts the forwards inside it under ``name``, ``paused()`` counts none (work
    the engine does for itself, such as measuring memory), ``measuring(name)`` counts them under
    ``name`` and reports its seconds as ``time/<name>``, apart from the training phase around it
    (measuring the policy without training it, as the KL monitor does)."""

    def expect(self, phase: str, rows: int) -> None: ...

    def phase(self, name: str) -> AbstractContextManager[None]: ...

    def paused(self) -> AbstractContextManager[None]: ...

    def measuring(self, name: str) -> AbstractContextManager[None]: ...


@dataclasses.dataclass
class UpdateMode:
    """``[train].update_mode`` for an off-policy micro-batch of the ratio-based family: ``lean``,
    ``chunk_graph`` or ``auto``. For ``auto``, ``decided`` is the mode measured on the first
    off-policy step; the update checkpoints it, so a resumed run keeps it."""

    setting: str
    decided: str | None = None


@dataclasses.dataclass(frozen=True)
class UpdateContext:
    """Everything of the run an objective may use, fixed when the update is built.

    - ``model``: the adapter (its ``denoiser`` as the strategy placed it);
    - ``device``: this process's device; ``seed``: ``[run].seed``;
    - ``process``: this process's rank and the world size (for collectives);
    - ``counter``: the compute accounting (:class:`CountsCompute`);
    - ``selector``: the ``[selector]`` that picks each sample's trained chunks;
    - ``lockstep``: under FSDP2 over several processes, the agreement every process makes before it
      skips work (:class:`flowrl.objectives.chunk_gradient.Lockstep`); None otherwise;
    - ``params``: the trainable parameters, as the strategy holds them;
    - ``kl``: the ``[loss]``'s KL term and its reference policy (:class:`flowrl.objectives.kl.KLSettings`);
    - ``fast_path``: ``[train].fast_path`` (the on-policy first step skips the re-scoring);
    - ``update_mode``: ``[train].update_mode`` (:class:`UpdateMode`);
    - ``update_group``: ``[train].update_group`` (steps of a chunk per forward in the fast path);
    - ``samples_per_process``: the samples of an iteration on each process (a process's rows in
      a batch gathered over processes start at ``process.rank * samples_per_process``);
    - ``rows_per_sample``: network rows per sample in one velocity call (2 with true CFG), for the
      compute minimum;
    - ``optimizer_steps()``: the optimizer steps taken so far in the run (checkpointed with it).
    """

    model: ModelAdapter
    device: torch.device
    seed: int
    process: DistContext
    counter: CountsCompute
    selector: ChunkSelector
    lockstep: Lockstep | None
    params: Sequence[torch.nn.Parameter]
    kl: KLSettings
    fast_path: bool
    update_mode: UpdateMode
    update_group: int
    samples_per_process: int
    rows_per_sample: int
    optimizer_steps: Callable[[], int]


class OnPolicyProbe:
    """Largest per-step ``|log pi_new - log pi_old|`` seen while re-scoring, before any update.

    The update hands one to the objective with the first optimizer step after a rollout
    (:attr:`MicroBatch.probe`) and checks it afterwards (``[train].on_policy_tolerance``). The
    objective wraps its step log-prob function with it and so reads every recomputation of a
    selected transition, with or without grad (the lean update scores the last position of each
    chunk only with grad): the check costs no extra forward. Before the first optimizer step
    every call is on-policy. It is stricter than looking at unit ratios: a per-step error cannot
    cancel inside a chunk mean.
    """

    def __init__(self):
        self.max_abs = 0.0
        self.fed = False  # an objective without log-probs never feeds it

    def wrap(self, fn: StepLogProbFn, old_lp: torch.Tensor) -> StepLogProbFn:
        """``fn(t, b, grad)`` with ``old_lp [len(micro-batch), T]`` the rollout log-probs."""

        def probed(t: int, b: torch.Tensor, grad: bool) -> torch.Tensor:
            lp = fn(t, b, grad)
            self.observe(lp, old_lp[b, t])
            return lp

        return probed

    def wrap_forward(self, forward, old_lp: torch.Tensor):
        """The same check for ``forward(t, b) -> (log_prob, extra)`` (the fast path with a KL term)."""

        def probed(t: int, b: torch.Tensor):
            lp, extra = forward(t, b)
            self.observe(lp, old_lp[b, t])
            return lp, extra

        return probed

    def wrap_many(self, many, old_lp: torch.Tensor):
        """The same check for ``many(ts, b) -> log_probs [len(ts), n]`` (the fast path with
        ``[train].update_group`` > 1: several steps in one forward)."""

        def probed(ts, b):
            lp = many(ts, b)
            rows = torch.arange(old_lp.shape[0]) if b is None else b
            self.observe(lp, old_lp[rows][:, list(ts)].T)
            return lp

        return probed

    def observe(self, lp: torch.Tensor, old: torch.Tensor) -> None:
        self.fed = True
        d = float((lp.detach().float() - old.float()).abs().max())
        if not d <= self.max_abs:  # also catches NaN
            self.max_abs = d


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch of an optimizer step.

    ``batch``: the iteration's :class:`flowrl.batch.Batch` (its ``trajectory``, ``text``,
    ``advantages``, ``rewards``, ``indices`` and ``iteration``); ``rows``: the micro-batch's rows
    in it (long, CPU); ``sizes``: the chunk layout (``()`` for objectives without units);
    ``epoch``: the pass over the rollout; ``normaliser``: the samples of the whole optimizer step
    on this process (divide the summed per-sample losses by it); ``first``: the first optimizer
    step after the rollout (exactly on-policy); ``probe``: the :class:`OnPolicyProbe` to feed
    the re-scored log-probs of that step (None otherwise; objectives without log-probs leave it
    unfed); ``replayed``: a kept rollout of an earlier iteration trained again (``[replay]``)."""

    batch: Batch
    rows: torch.Tensor
    sizes: tuple[int, ...]
    epoch: int
    normaliser: float
    first: bool
    probe: OnPolicyProbe | None = None
    replayed: bool = False


@dataclasses.dataclass
class MicroBatchResult:
    """``losses``: the loss terms back-propagated, as floats, summed in this order into the
    step's logged ``loss``; ``metrics``: per-micro-batch metrics (in the order they are logged;
    combined over micro-batches and processes by ``flowrl.train.update.update_aggregate``);
    ``trained``: bool ``[len(rows), K]``, the units each row trained (K = ``len(sizes)``)."""

    losses: tuple[float, ...]
    metrics: dict[str, float]
    trained: torch.Tensor

    @classmethod
    def without_units(cls, micro: MicroBatch, loss: float = 0.0, metrics: dict[str, float] | None = None
                      ) -> MicroBatchResult:
        """The result of an objective whose loss is not per chunk unit (a forward-process or
        preference loss): one loss term, and ``trained`` False for every unit of every row."""
        return cls(losses=(loss,), metrics={} if metrics is None else metrics,
                   trained=torch.zeros(len(micro.rows), len(micro.sizes), dtype=torch.bool))
