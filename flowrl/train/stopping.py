"""Stopping a training run within one model call: Ctrl-C, SIGTERM, SIGHUP or a STOP file.

- The first Ctrl-C (SIGINT), SIGTERM (Slurm preemption, Kubernetes, ``docker stop``, ``kill``)
  or SIGHUP (the terminal closed), or a file named ``STOP`` in the run directory (for a
  scheduler that cannot signal: ``touch RUN_DIR/STOP``), asks the run to stop. It is announced
  at once, and the run stops at its next stop point (:mod:`flowrl.stop_points`): before the
  next denoiser forward of a rollout or an evaluation, the next reward call, the next
  micro-batch of the update or of a re-scoring; or between two phases, or two iterations. The
  STOP file is looked for at those points, at most once every :data:`STOP_FILE_POLL` seconds.
  What has no stop point inside finishes first: a checkpoint being written, the adaptive
  chunker's re-profiling, the decode of an iteration's images, the text encoding.
- The unfinished iteration and its evaluation are abandoned: no metrics row, no picture, no
  checkpoint of them. Stopped before its update, the run's training state is still that of the
  last completed iteration: a checkpoint of it is written (unless the latest one is it).
  Stopped in the update, whose weights are then part-way through an iteration, none is: the
  latest checkpoint stays the one the run resumes from (``[checkpoint] every`` and
  ``every_minutes`` bound what that loses). Either way the run prints the command that resumes
  it and exits with status 130; the STOP file it saw is removed.
- A second Ctrl-C, SIGTERM or SIGHUP aborts at once (:class:`Aborted`): no checkpoint is
  written, the latest one stays valid (checkpoints are atomic), and the run says which
  iteration it resumes from (exit status 130, no traceback).

Several processes stop together, at the same point. A stop point that every process reaches in
the same order (the rollout's denoiser forwards, the reward calls, the update's micro-batches)
agrees there: one all-reduce of a flag, true when any process was asked to stop (a signal
reaches each process at its own moment; the STOP file is read by the main process only, and
a stop asked of one process is also set in the process group's store for the others). A
``ddp`` evaluation, in which each process evaluates its own share of the batches (shares of
different lengths), is checked by each process alone: abandoning its share takes a process to
the gather of the scores, which every process reaches once and where they agree. So the bound
is the same for a multi-process run, one model call (plus an all-reduce), with one exception:
an fsdp2 evaluation, whose reward calls the main process makes alone while the others sample
alongside, stops at its next denoiser forward, after the rewards of the evaluation batch under
way. (In a ddp evaluation, where no agreement runs between the forwards, a stop asked of one
process reaches the others through the process group's store: :meth:`RunStop._share`.)

Helper threads (overlapped rewards, the pipelined rollout) never make a collective: their stop
points stop them once the processes have agreed to stop (at once, in a one-process run), and
the loop's wait for their results (:meth:`RunStop.wait`) is itself a point where the processes
agree, so that a stop is not held up by a helper's remaining work.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

import torch

from .. import distributed
from ..stop_points import StopRequested, checked
from .progress import write_stderr

#: The file that stops a run when it appears in the run directory.
STOP_FILE = "STOP"
STOP_MESSAGE = "stopping at the next model call; the unfinished iteration is redone on resume"
#: Added to the message of a signal: the next one aborts.
ABORT_HINT = "(Ctrl-C again to abort)"
#: Seconds between two looks for the STOP file (a stat, which a network filesystem may make slow).
STOP_FILE_POLL = 1.0
#: The key of the process group's store that says a stop was asked of one of the processes.
STOP_KEY = "flowrl/stop"
#: Seconds between two looks for a stop while waiting for a helper thread's result.
WAIT_POLL = 0.05


class Aborted(KeyboardInterrupt):
    """A second Ctrl-C, SIGTERM or SIGHUP: stop now, without a checkpoint."""


class RunStop:
    """A run's stop (see the module docstring): the signal handlers while the block runs, the
    STOP file, and the checks of the stop points (:meth:`iterations`, :meth:`evaluation`,
    :meth:`changing_state`). ``announce`` says that a stop was asked (None: stay quiet, as the
    processes other than the main one do)."""

    SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))

    def __init__(self, run_dir: Path, ctx, announce: Callable[[str], None] | None = write_stderr):
        self.ctx, self.announce = ctx, announce
        self.file = Path(run_dir) / STOP_FILE if ctx.is_main else None  # the main process reads it
        self.requested = False  # asked here: a signal, the STOP file
        self.seen_file = False
        self.stopped = False  # every process agreed to stop: the loop ends
        self.state_changed = False  # stopped in the update: no checkpoint can be written of this state
        self.abandoned = threading.Event()  # helper threads end their work at their next stop point
        self.signals = 0
        self._looked = float("-inf")
        self._shared, self._polled = False, float("-inf")
        self._previous: dict[int, object] = {}

    # ------------------------------------------------------------------ asking

    def handler(self, signum, frame):
        self.signals += 1
        if self.signals > 1:
            raise Aborted
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        self._ask(f"{name}: {STOP_MESSAGE} {ABORT_HINT}")

    def _ask(self, message: str) -> None:
        if self.requested:
            return
        self.requested = True
        if self.ctx.process_count == 1:  # nothing to agree with: helper threads stop at once too
            self.abandoned.set()
        if self.announce is not None:
            self.announce(message)

    def look(self) -> bool:
        """Whether a stop was asked here, after a look for the STOP file when one is due; with
        several processes, also whether one was asked of another (:meth:`_share`)."""
        if not self.requested and self.file is not None and time.monotonic() - self._looked >= STOP_FILE_POLL:
            self._looked = time.monotonic()
            if self.file.exists():
                self.seen_file = True
                self._ask(f"{self.file} found: {STOP_MESSAGE}")
        if self.ctx.process_count > 1:
            self._share()
        return self.requested

    def _share(self) -> None:
        """A stop asked of this process is set in the process group's store, and one asked of
        another is read from it (at most once every :data:`STOP_FILE_POLL` seconds): processes
        that evaluate their own shares of a ddp evaluation (no agreement between their forwards)
        learn of the STOP file, which only the main process reads, at their next forward, not
        when their shares end. Set here, never in the signal handler (no store call interrupted
        by another)."""
        store = distributed.default_store()
        if store is None:
            return
        if self.requested and not self._shared:
            store.set(STOP_KEY, "1")
            self._shared = True
        elif not self.requested and time.monotonic() - self._polled >= STOP_FILE_POLL:
            self._polled = time.monotonic()
            if store.check([STOP_KEY]):
                self._shared = True  # already there
                self._ask(f"another process of the run was asked to stop: {STOP_MESSAGE}")

    def __enter__(self) -> RunStop:
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self.handler)
            except ValueError:  # not the main thread: leave the signals alone
                break
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if self.seen_file:  # honoured once: a resumed run must not stop at its first look
            self.file.unlink(missing_ok=True)

    # ------------------------------------------------------------------ agreeing

    def agreed(self) -> bool:
        """Whether any process was asked to stop; once true, the loop stops (:attr:`stopped`). A
        collective until then: every process calls it at the same point."""
        if not self.stopped and distributed.any_rank(self.look(), self.ctx):
            self.stopped = True
            self.abandoned.set()
        return self.stopped

    def check(self, every_process: bool = True, alone: bool = False) -> None:
        """A stop point: raise :class:`StopRequested` if the run stops here. ``alone``: this
        process makes the phase's model calls by itself (its share of a ddp evaluation), so it
        decides alone.
        Context-parallel partners of one data rank make every denoiser call together: they agree
        as data ranks do (the STOP file is read by the main process only)."""
        if alone or self.ctx.process_count == 1:
            if self.look():
                raise StopRequested
        elif every_process and self.agreed():
            raise StopRequested

    def wait(self, future: Future, alone: bool = False) -> Any:
        """``future``'s result, waited for at a point every process reaches (or, ``alone``, this
        one only): the processes look for a stop together every :data:`WAIT_POLL` seconds (one
        all-reduce each, until every process has its result), so a stop asked meanwhile ends
        the wait on all of them; the helper then stops at its own next stop point."""
        while True:
            wait_futures([future], timeout=WAIT_POLL)
            flags = torch.tensor([float(not future.done()), float(self.look())])
            if not alone:
                flags = distributed.all_reduce_sum(flags, self.ctx, every_process=True)
            pending, asked = (bool(x > 0) for x in flags)
            if not pending:  # every process has it: a stop asked meanwhile waits for the next point
                return future.result()
            if asked:
                self.stopped = True
                self.abandoned.set()
                raise StopRequested

    # ------------------------------------------------------------------ the loop's scopes

    @contextlib.contextmanager
    def iterations(self) -> Iterator[None]:
        """The training iterations: their stop points agree across processes, and a stop at one
        of them ends the block, abandoning the iteration under way (:attr:`stopped`)."""
        try:
            with checked(_Checks(self)):
                yield
        except StopRequested:
            self.stopped = True

    @contextlib.contextmanager
    def evaluation(self, shared: bool) -> Iterator[None]:
        """An evaluation: ``shared`` when every process samples it in lockstep (fsdp2), else each
        process its own share (ddp: checked alone). A stop abandons it and ends the block quietly;
        leaving the block, the processes agree whether to stop (:meth:`agreed`), so that a
        process abandoning its share alone brings the others along."""
        try:
            with checked(_Checks(self, alone=not shared)):
                yield
        except StopRequested:
            pass
        self.agreed()

    @contextlib.contextmanager
    def changing_state(self) -> Iterator[None]:
        """The update: a stop inside leaves the weights part-way through an iteration, of which
        no checkpoint may be written (:attr:`state_changed`)."""
        try:
            yield
        except StopRequested:
            self.state_changed = True
            raise


class _Checks:
    """The :class:`~flowrl.stop_points.StopChecks` of a scope of :class:`RunStop`."""

    def __init__(self, stop: RunStop, alone: bool = False):
        self.stop, self.alone = stop, alone

    def check(self, every_process: bool) -> None:
        self.stop.check(every_process, alone=self.alone)

    def wait(self, future: Future) -> Any:
        return self.stop.wait(future, alone=self.alone)

    def in_helper_thread(self) -> _HelperChecks:
        return _HelperChecks(self.stop)


class _HelperChecks:
    """A helper thread's checks: it stops once the run's processes have agreed to (or, alone, as
    soon as asked); never a collective, which only the loop's own thread may make."""

    def __init__(self, stop: RunStop):
        self.stop = stop

    def check(self, every_process: bool) -> None:
        if self.stop.abandoned.is_set():
            raise StopRequested

    def wait(self, future: Future) -> Any:
        while not future.done():
            self.check(True)
            wait_futures([future], timeout=WAIT_POLL)
        return future.result()

    def in_helper_thread(self) -> _HelperChecks:
        return self
