"""What a person watching a run sees: seconds per phase, the progress bar, Ctrl-C handling."""

from __future__ import annotations

import signal
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class PhaseTimer:
    """Seconds per phase for this iteration (synchronising CUDA so the numbers are real); with a
    :class:`~flowrl.train.compute.ComputeCounter`, the model work is counted under the same phase."""

    def __init__(self, device: torch.device, counter=None):
        self.device = device
        self.counter = counter
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, phase: str):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        try:
            if self.counter is None:
                yield
            else:
                with self.counter.phase(phase):
                    yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.seconds[phase] += time.perf_counter() - start


class GracefulInterrupt:
    """First Ctrl-C: finish the current phase safely, checkpoint, exit. Second: stop now."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        def handler(signum, frame):
            if self.requested:
                raise KeyboardInterrupt
            self.requested = True

        try:
            self._previous = signal.signal(signal.SIGINT, handler)
        except ValueError:  # not the main thread
            self._previous = None
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def progress_bar(console: Console, enabled: bool) -> Progress:
    """The training progress bar: iterations done, the first reward's mean, elapsed and ETA."""
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[reward]}"), TimeElapsedColumn(), TimeRemainingColumn(),
        console=console, disable=not enabled, transient=False,
    )
