"""Small process utilities shared by ``flowrl sweep``, the reward fleet and the ``--num-processes``
launcher (Linux-aware)."""

from __future__ import annotations

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


def die_with_parent(parent_pid: int, signum: int = getattr(signal, "SIGKILL", signal.SIGTERM)) -> None:
    """Ask for ``signum`` when the parent exits, then exit at once if the parent (``parent_pid``)
    is already gone: it may have died before the request took effect, and then no signal comes."""
    signal_on_parent_death(signum)
    if os.getppid() != parent_pid:
        os._exit(128 + int(signum))


def run_launch_agent(argv: list[str]) -> None:
    """The torchrun agent of ``flowrl train --num-processes`` (:func:`flowrl.distributed.launch`):
    it dies with the launcher, tells its workers its pid (they die with it), and runs torchrun
    with ``argv``. A stop forwarded by the launcher ends without torchrun's traceback: by then
    torchrun has passed the signal to its workers and waited for them."""
    import runpy

    die_with_parent(int(os.environ.pop("FLOWRL_LAUNCHER_PID")))
    os.environ["FLOWRL_AGENT_PID"] = str(os.getpid())
    sys.argv = ["torchrun", *argv]
    try:
        runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
    except Exception as exc:
        if type(exc).__name__ != "SignalException":  # torch.distributed.elastic's: no torch import here
            raise
        sys.exit(128 + int(getattr(exc, "sigval", signal.SIGTERM)))


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
