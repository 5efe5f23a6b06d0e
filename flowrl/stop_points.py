"""Stop points: the places between two model calls where a training run may stop.

A run asked to stop (Ctrl-C, SIGTERM, SIGHUP, its STOP file: :mod:`flowrl.train.stopping`) must
not wait for the phase under way to end: an evaluation, a rollout or an update of a large model
can take many minutes, longer than a scheduler's grace period (Kubernetes gives 30 s). So the
code that makes the run's model calls marks a stop point before each one: :func:`stop_point`
before a reward call or a micro-batch, :func:`stoppable` before every call of a denoiser's
velocity. :func:`wait_for` waits for a helper thread's result where the run may stop meanwhile.

What a stop point does is the business of the code that runs the phase: it opens a scope
(:func:`checked`) with a :class:`StopChecks`, whose checks raise :class:`StopRequested` once the
run is to stop. Outside any scope (``flowrl sample``, ``flowrl eval``, a library user's
rollout) a stop point does nothing and :func:`wait_for` just waits.

A scope belongs to the thread that opened it (a context variable). A helper thread that makes
model calls for the phase (overlapped rewards, the pipelined rollout) runs its work through
:func:`carried`, which hands it the checks the scope gives helper threads
(:meth:`StopChecks.in_helper_thread`): those never make a collective call.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

__all__ = ["StopChecks", "StopRequested", "carried", "checked", "stop_point", "stoppable", "wait_for"]

T = TypeVar("T")


class StopRequested(BaseException):
    """Raised at a stop point once the run is to stop: the phase under way is abandoned.

    A BaseException, like KeyboardInterrupt, so that no ``except Exception`` on the way up (a
    reward's failure report, a retry) takes it for a failure of the call it interrupted."""


class StopChecks(Protocol):
    """What the stop points of a scope do (the training loop's: :mod:`flowrl.train.stopping`)."""

    def check(self, every_process: bool) -> None:
        """Raise :class:`StopRequested` if the run is to stop here. ``every_process``: every
        process of the run reaches this point, in the same order (the check may then be a
        collective); False: only this process does (the main process's reward calls of an
        evaluation), and a check that has to agree across processes skips it."""

    def wait(self, future: Future) -> Any:
        """``future.result()``, or :class:`StopRequested` when the run is to stop meanwhile."""

    def in_helper_thread(self) -> StopChecks | None:
        """The checks for a helper thread of this scope (never a collective), or None."""


_CHECKS: contextvars.ContextVar[StopChecks | None] = contextvars.ContextVar("flowrl_stop_checks", default=None)


def stop_point(every_process: bool = True) -> None:
    """Before a model call: stop here if the scope says so (see :meth:`StopChecks.check`)."""
    checks = _CHECKS.get()
    if checks is not None:
        checks.check(every_process)


def stoppable(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` with a stop point before each call (every process calls it the same number of
    times: a rollout's or an evaluation's velocity)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        stop_point()
        return fn(*args, **kwargs)

    return call


def wait_for(future: Future) -> Any:
    """The result of a helper thread's ``future``, at a point every process reaches; the scope
    may end the wait with :class:`StopRequested` (then the helper stops at its own next point)."""
    checks = _CHECKS.get()
    return future.result() if checks is None else checks.wait(future)


@contextlib.contextmanager
def checked(checks: StopChecks | None) -> Iterator[None]:
    """Inside the block, this thread's stop points make ``checks`` (None: nothing)."""
    token = _CHECKS.set(checks)
    try:
        yield
    finally:
        _CHECKS.reset(token)


def carried(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` to run in a helper thread, with the checks this thread's scope gives its helpers
    (taken now, in the thread that hands the work over)."""
    checks = _CHECKS.get()
    helper = checks.in_helper_thread() if checks is not None else None

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with checked(helper):
            return fn(*args, **kwargs)

    return run
