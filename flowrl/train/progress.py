"""What a person watching a run sees: seconds per phase, the progress bar, the messages above it.

(Stopping a run, Ctrl-C and SIGTERM included, is :mod:`flowrl.train.stopping`.)
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class PhaseTimer:
    """Seconds per phase for this iteration (synchronising CUDA so the numbers are real); with a
    :class:`~flowrl.train.compute.ComputeCounter`, the model work is counted under the same phase,
    and the seconds of a measurement inside it (the counter's ``measuring(name)``) are moved from
    the phase to ``name``;
    ``on_phase(name)`` is told when a phase starts (the progress bar shows it)."""

    def __init__(self, device: torch.device, counter=None, on_phase: Callable[[str], None] | None = None):
        self.device = device
        self.counter = counter
        self.on_phase = on_phase
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, phase: str):
        if self.on_phase is not None:
            self.on_phase(phase)
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
            elapsed = time.perf_counter() - start
            # measurement inside the phase (the counter's ``measuring``) is its own phase, not this one
            if self.counter is not None:
                for name, seconds in self.counter.take_measured_seconds().items():
                    elapsed -= seconds
                    self.seconds[name] += seconds
            self.seconds[phase] += elapsed


def write_stderr(text: str) -> None:
    """Write a line to stderr with one system call (safe inside a signal handler)."""
    os.write(2, f"{text}\n".encode())


def progress_bar(console: Console, enabled: bool) -> Progress:
    """The training progress bar: iterations done, the phase running now, the first reward's
    mean, images per second (per process), elapsed time and the estimated time to finish."""
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[phase]:<10}"), TextColumn("{task.fields[reward]}"), TextColumn("{task.fields[speed]}"),
        TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
        console=console, disable=not enabled, transient=False,
    )


def shown_reward(rewards) -> str:
    """The label of the reward the progress bar shows: the first one training optimises (weight
    not 0), not a judge listed first only to be logged; the first of all when none is weighted."""
    return next((r.label for r in rewards if r.weight), rewards[0].label)


class RunDisplay:
    """The progress bar of one run (off on processes other than the main one, or with
    ``[log].progress = false``): the phase running now, the first reward, the throughput."""

    def __init__(self, console: Console, enabled: bool, train, completed: int, reward_label: str):
        self.progress = progress_bar(console, enabled)
        self.enabled, self.label = enabled, reward_label
        self.task = self.progress.add_task("training", total=train.iterations, completed=completed, reward="-",
                                           phase="start", speed="")

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        self.phase("done" if exc[0] is None else "stopped")
        return self.progress.__exit__(*exc)

    def say(self, text: str) -> None:
        """A message now: above the live progress bar, or on stderr when there is none."""
        if self.enabled:
            self.progress.console.print(text, markup=False, highlight=False)
        else:
            write_stderr(text)

    def phase(self, name: str) -> None:
        self.progress.update(self.task, phase=name)

    def timer(self, device: torch.device, counter=None) -> PhaseTimer:
        """An iteration's phase timer that shows each phase as it starts (and counts the model's
        work per phase with a :class:`~flowrl.train.compute.ComputeCounter`)."""
        return PhaseTimer(device, counter, on_phase=self.phase)

    def advance(self, record: dict, speed: dict[str, float]) -> None:
        """One more iteration done: its first reward's mean (an offline run scores none in training:
        its loss) and its throughput."""
        key = f"reward/{self.label}/mean"
        reward = f"{self.label}={record.get(key, float('nan')):.4f}" if key in record or "loss" not in record \
            else f"loss={record['loss']:.4f}"
        text = f"{speed['speed/images_per_second']:.3g} img/s"
        if "speed/mfu" in speed:
            text += f" MFU {100 * speed['speed/mfu']:.1f}%"
        self.progress.update(self.task, advance=1, phase="", reward=reward, speed=text)
