"""Small process utilities shared by ``flowrl sweep``, the reward fleet and the ``--num-processes``
launcher (Linux-aware)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from pathlib import Path

#: prctl option: the signal this process receives when its parent exits.
PR_SET_PDEATHSIG = 1


def signal_on_parent_death(signum: int) -> bool:
    """Ask Linux to send ``signum`` to this process when its parent exits (no orphans).
    Returns False where that is not available (other systems)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum))
    except (OSError, AttributeError):
        return False
    return True


def exits_with_parent(signum: int = signal.SIGINT):
    """A ``preexec_fn`` for :mod:`subprocess`: the child receives ``signum`` when the thread that
    started it exits, so that killing a script which launches flowrl commands (the benchmarks)
    leaves none of them running. SIGINT by default: a flowrl command then stops as on Ctrl-C (a
    training run or a sweep after its checkpoint). Linux only; elsewhere the child is unchanged.

    The prctl function is looked up here, in the parent: between fork and exec the child only
    calls it (no library loading there, which another thread of the parent may hold a lock of)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
        prctl, set_disposition = (libc.prctl, libc.signal) if libc is not None else (None, None)
    except (OSError, AttributeError):
        prctl = set_disposition = None
    parent = os.getpid()

    def preexec() -> None:
        if prctl is not None:
            # a signal ignored by an ancestor stays ignored across exec (a script started with `&`
            # from a non-interactive shell ignores SIGINT): the child would never see its parent die
            set_disposition(int(signum), 0)  # SIG_DFL
            prctl(PR_SET_PDEATHSIG, int(signum))
        if os.getppid() != parent:  # the parent died before the request took effect
            os._exit(128 + int(signum))

    return preexec


def die_with_parent(parent_pid: int, signum: int = getattr(signal, "SIGKILL", signal.SIGTERM)) -> None:
    """Ask for ``signum`` when the parent exits, then exit at once if the parent (``parent_pid``)
    is already gone: it may have died before the request took effect, and then no signal comes."""
    signal_on_parent_death(signum)
    if os.getppid() != parent_pid:
        os._exit(128 + int(signum))


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, dead but not yet reaped, counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: trust os.kill
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


_STOPPED: list[list[int]] = []  # the list of the stop_on_signals block in force, if any
#: While the main thread hands a spawned child its preparation data, a stop is held back (see
#: :func:`spawned_children_ignore_sigint`): ``[depth, deferred]``.
_SPAWNING = [0, False]


@contextlib.contextmanager
def stop_on_signals(signals=(signal.SIGINT, signal.SIGTERM)):
    """While inside, the first SIGINT or SIGTERM raises KeyboardInterrupt in this process's main
    thread and is recorded in the list yielded, so that the caller can end quietly with exit
    status 128 + signal (130 for Ctrl-C, 143 for SIGTERM) once it has shut down; a second one is
    ignored (the shutdown under way is bounded, and a KeyboardInterrupt inside it would leave
    children behind and print a traceback). A process forked from this one inherits the
    handler: it just ends by the signal's default action (no KeyboardInterrupt, no traceback).
    Nested blocks share the outer block's handler and list (a command around a library call)."""
    if _STOPPED:
        yield _STOPPED[-1]
        return
    main_pid = os.getpid()
    stopped: list[int] = []

    def on_signal(signum, frame):
        if os.getpid() != main_pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if stopped:
            return
        stopped.append(signum)
        if _SPAWNING[0]:  # raised once the child has its data (spawned_children_ignore_sigint)
            _SPAWNING[1] = True
            return
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, on_signal) for s in signals}
    _STOPPED.append(stopped)
    try:
        yield stopped
    finally:
        _STOPPED.pop()
        for s, handler in previous.items():
            signal.signal(s, handler)


def stopped_message(signum: int, what: str) -> str:
    """One line for a process stopped by ``signum``: ``stopped by SIGINT (Ctrl-C): WHAT``."""
    name = signal.Signals(signum).name
    return f"stopped by {name}{' (Ctrl-C)' if signum == signal.SIGINT else ''}: {what}"


class _IgnoresSigint:
    """Makes the process that unpickles it ignore SIGINT (see :func:`spawned_children_ignore_sigint`):
    by a call of the ``signal`` module itself, so that unpickling it imports nothing that takes time."""

    def __reduce__(self):
        return (signal.signal, (int(signal.SIGINT), signal.SIG_IGN))


@contextlib.contextmanager
def spawned_children_ignore_sigint():
    """Every process started inside with multiprocessing's ``spawn`` ignores SIGINT from its very
    start, whichever thread starts it: Ctrl-C reaches a terminal's whole process group, and a
    child that its parent ends must not die of its own KeyboardInterrupt, with a traceback,
    while it still imports its modules (seconds, for torch). A Python handler does not survive
    the exec of ``spawn``; so the child is told by the first thing it unpickles, its preparation
    data, before it re-imports the parent's main module. Until then (the interpreter's own start,
    ``site`` included) SIGINT is blocked: the spawning thread blocks it around the fork and exec,
    and a child keeps the signal mask it is started with, so a Ctrl-C then stays pending and is
    discarded when the child ignores it. The parent's own Ctrl-C is only delayed by the spawn:
    the child reads its preparation data from a pipe the parent writes after the exec, so a
    KeyboardInterrupt between the two (a stop of :func:`stop_on_signals`, when the main thread
    spawns) would leave the child reading an empty pipe, which it reports with a traceback; the
    stop is raised once the child is started."""
    import threading
    from multiprocessing import process, spawn, util

    get_preparation_data = spawn.get_preparation_data
    spawnv_passfds = util.spawnv_passfds
    start = process.BaseProcess.start

    def with_sigint_ignored(name):
        return {"flowrl_ignore_sigint": _IgnoresSigint(), **get_preparation_data(name)}

    def with_sigint_blocked(path, args, passfds):
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            return spawnv_passfds(path, args, passfds)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    def start_whole(self):
        if threading.current_thread() is not threading.main_thread():
            return start(self)  # the main thread's KeyboardInterrupt cannot cut it short
        _SPAWNING[0] += 1
        try:
            return start(self)
        finally:
            _SPAWNING[0] -= 1
            if not _SPAWNING[0] and _SPAWNING[1]:
                _SPAWNING[1] = False
                raise KeyboardInterrupt

    spawn.get_preparation_data, util.spawnv_passfds = with_sigint_ignored, with_sigint_blocked
    process.BaseProcess.start = start_whole
    try:
        yield
    finally:
        spawn.get_preparation_data, util.spawnv_passfds = get_preparation_data, spawnv_passfds
        process.BaseProcess.start = start
