"""Compute accounting: the model work an iteration does, beside the algorithmic minimum.

:class:`ComputeCounter` counts the rows (samples) that pass through the denoiser's forward and
backward, by phase (the phase timer sets the phase: ``rollout``, ``update``, ``eval``, ...; the
reference policy's forwards count as ``reference``). The minimum of an iteration (per process):

- rollout: sampling steps x samples x the adapter's network rows per sample (2 with true CFG);
  a branch rollout's shared prefixes count once (``compute/rollout/saved``: the forward rows they
  spared against one full trajectory per sample, :mod:`flowrl.sampling.branching`);
- update: every selected transition whose gradient is not zero (a sample with a non-zero
  advantage, or any trained sample when there is a KL term) once forward and once backward;
- reference: one reference forward per trained transition for the reference KL kinds;
- old: one forward of a trailing old policy per trained point, for the objectives that keep one
  (the ELBO policy gradient while its old weights differ from the trained ones);
- rescore: after an FP8 rollout with ``rollout_correction = "rescore"``, one forward without grad
  per trainable transition of every sample (:mod:`flowrl.sampling.precision`).

``compute/ratio`` is the work counted in those phases over their minimum: 1.00 means nothing was
computed twice. Evaluation and profiling are counted but not part of the ratio.

``compute/decoded`` counts the samples the iteration's training phases decoded to images (the
VAE, or the model's own decoder): the samples, or 0 when every reward scores latents
(:class:`~flowrl.interfaces.ScoresLatents`). Evaluation's decodes are not counted.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator

import torch

from .. import distributed
from ..interfaces import CountsForwards

#: Phases whose work the minimum covers.
ACCOUNTED = ("rollout", "update", "reference", "old", "rescore")
#: The counter's tables of rows by phase.
_TABLES = ("forward", "backward", "minimum", "saving")


def network_rows_per_sample(model) -> int:
    """Rows the network runs per sample in one velocity call (2 with true CFG)."""
    return int(model.forwards_per_velocity) if isinstance(model, CountsForwards) else 1


def _synchronize() -> None:
    """Wait for the GPU's queued work, when this process has used CUDA (real seconds)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class ComputeCounter:
    """Forward and backward rows through the watched modules, by phase."""

    def __init__(self, *modules: torch.nn.Module):
        self.current = "other"
        self._paused = False
        self.forward: dict[str, int] = defaultdict(int)
        self.backward: dict[str, int] = defaultdict(int)
        self.minimum: dict[str, int] = defaultdict(int)
        self.saving: dict[str, int] = defaultdict(int)
        self.decodes = 0
        self.measured_seconds: dict[str, float] = defaultdict(float)
        self._handles = []
        for module in modules:
            self.watch(module)

    def watch(self, module: torch.nn.Module) -> None:
        self._handles.append(module.register_forward_hook(self._on_forward, with_kwargs=True))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        previous, self.current = self.current, name
        try:
            yield
        finally:
            self.current = previous

    @contextlib.contextmanager
    def measuring(self, name: str) -> Iterator[None]:
        """Work that measures the policy inside a training phase without training it (the KL
        monitor of ``[log].kl_every``): its forwards count under ``name`` and its seconds are kept
        apart, for the phase timer around it to report as ``time/<name>`` rather than as the
        enclosing phase's (so ``speed/*`` does not dip on the iterations that measure)."""
        _synchronize()
        start = time.perf_counter()
        try:
            with self.phase(name):
                yield
        finally:
            _synchronize()
            self.measured_seconds[name] += time.perf_counter() - start

    def take_measured_seconds(self) -> dict[str, float]:
        """The seconds of :meth:`measuring` since the last call, by name (then forgotten)."""
        taken, self.measured_seconds = dict(self.measured_seconds), defaultdict(float)
        return taken

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Work the engine does for itself (measuring memory), not for the algorithm: uncounted."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def _on_forward(self, module, args, kwargs, output) -> None:
        if self._paused:
            return
        first = next((a for a in (*args, *kwargs.values()) if torch.is_tensor(a)), None)
        rows = int(first.shape[0]) if first is not None and first.ndim else 1
        phase = self.current
        self.forward[phase] += rows
        out = output[0] if isinstance(output, (tuple, list)) else getattr(output, "sample", output)
        if torch.is_tensor(out) and out.requires_grad:
            out.register_hook(lambda grad, phase=phase, rows=rows: self._on_backward(phase, rows))

    def _on_backward(self, phase: str, rows: int) -> None:
        self.backward[phase] += rows

    def decoded(self, samples: int) -> None:
        """Count ``samples`` decoded to images for training (not for evaluation)."""
        self.decodes += int(samples)

    def expect(self, phase: str, rows: int) -> None:
        """Add to the minimum of ``phase`` (forward rows; the update's backward equals its forward)."""
        self.minimum[phase] += rows

    def saved(self, phase: str, rows: int) -> None:
        """Record forward rows ``phase`` did not need to run (a branch rollout's shared prefixes)."""
        self.saving[phase] += int(rows)

    def counts(self) -> dict:
        """The raw tables (``forward``, ``backward``, ``minimum``, ``saving``: rows by phase) and
        ``decodes``, as plain data: what another counter :meth:`add` s (a rollout drawn elsewhere)."""
        return {**{table: dict(getattr(self, table)) for table in _TABLES}, "decodes": self.decodes}

    def add(self, counts: dict) -> None:
        """Add another counter's :meth:`counts` to this one."""
        for table in _TABLES:
            for phase, rows in counts[table].items():
                getattr(self, table)[phase] += rows
        self.decodes += counts["decodes"]

    def take(self, ctx=None) -> dict[str, float]:
        """This iteration's counts over all processes, as metrics (``compute/<phase>/forward`` ...),
        then reset. Every process must call it (the counts are summed with one collective)."""
        phases = sorted(set(self.forward) | set(self.backward) | set(self.minimum) | set(self.saving))
        counts = {f"{phase}/{kind}": float(table[phase]) for phase in phases
                  for kind, table in (("forward", self.forward), ("backward", self.backward), ("minimum", self.minimum),
                                      ("saved", self.saving))}
        counts["decoded"] = float(self.decodes)
        if ctx is not None and ctx.enabled:  # summed: each process counts its own share
            counts = distributed.reduce_metrics(counts, {k: "sum" for k in counts}, ctx)
        decoded = counts.pop("decoded")
        phases = sorted({key.rsplit("/", 1)[0] for key in counts})
        out: dict[str, float] = {}
        for phase in phases:
            if counts[f"{phase}/forward"]:
                out[f"compute/{phase}/forward"] = counts[f"{phase}/forward"]
            if counts[f"{phase}/backward"]:
                out[f"compute/{phase}/backward"] = counts[f"{phase}/backward"]
            if counts[f"{phase}/saved"]:
                out[f"compute/{phase}/saved"] = counts[f"{phase}/saved"]
        done = sum(counts.get(f"{p}/forward", 0.0) for p in ACCOUNTED) + counts.get("update/backward", 0.0)
        minimum = sum(counts.get(f"{p}/minimum", 0.0) for p in ACCOUNTED) + counts.get("update/minimum", 0.0)
        out["compute/minimum"] = minimum
        out["compute/ratio"] = done / minimum if minimum else 1.0
        out["compute/decoded"] = decoded
        self.decodes = 0
        self.forward.clear()
        self.backward.clear()
        self.minimum.clear()
        self.saving.clear()
        return out

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
