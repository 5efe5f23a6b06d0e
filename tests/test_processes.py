"""flowrl.processes: a stop that arrives while a child is being spawned; a child started with
``exits_with_parent`` does not outlive the script that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

SCRIPT = """
import multiprocessing, os, signal
from multiprocessing import util

from flowrl.processes import spawned_children_ignore_sigint, stop_on_signals


def child():
    print("child ran", flush=True)


if __name__ == "__main__":
    with stop_on_signals() as stopped, spawned_children_ignore_sigint():
        spawn = util.spawnv_passfds

        def interrupted_right_after_the_exec(*args):
            pid = spawn(*args)
            os.kill(os.getpid(), signal.SIGINT)  # before the parent writes the child's data
            return pid

        util.spawnv_passfds = interrupted_right_after_the_exec
        process = multiprocessing.get_context("spawn").Process(target=child)
        try:
            process.start()
            print("start not interrupted", flush=True)
        except KeyboardInterrupt:
            print("interrupted once started", flush=True)
        process.join(120)
        print("child exit", process.exitcode, "stopped", stopped, flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="multiprocessing's spawn on POSIX")
def test_a_ctrl_c_between_a_childs_exec_and_its_data_is_raised_once_the_child_has_its_data(tmp_path):
    """A spawned child reads its preparation data from a pipe its parent writes after the exec; a
    KeyboardInterrupt in between used to close the pipe unwritten, and the child died reading
    it with a traceback (seen as a flaky Ctrl-C test of the reward fleet). The stop now waits
    for the write: the child runs, and the parent sees the KeyboardInterrupt once start() is done."""
    script = tmp_path / "spawn_then_stop.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "EOFError" not in proc.stderr, proc.stderr
    lines = proc.stdout.splitlines()
    assert "interrupted once started" in lines and "child ran" in lines, proc.stdout
    assert lines[-1] == "child exit 0 stopped [2]", proc.stdout


LAUNCHER = """
import subprocess, sys, threading
from flowrl.processes import exits_with_parent

lock = threading.Lock()  # one whole line per child: print() from two threads may interleave


def start():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                             preexec_fn=exits_with_parent())
    with lock:
        sys.stdout.write(f"{child.pid}\\n")
        sys.stdout.flush()
    child.wait()

# as the benchmarks start flowrl commands: from the main thread and from a worker thread
threads = [threading.Thread(target=start) for _ in range(2)]
for t in threads:
    t.start()
start()
"""


def _ignoring_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_a_killed_launcher_leaves_no_child_started_with_exits_with_parent(sigint):
    """Also when the launcher ignores SIGINT, as a script started with `&` from a non-interactive
    shell does (and a pytest worker may): an ignored signal survives exec, so exits_with_parent
    gives the child its default action back."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True,
                                preexec_fn=_ignoring_sigint if sigint == "ignored" else None)
    pids = [int(launcher.stdout.readline()) for _ in range(3)]
    for pid in pids:
        os.kill(pid, 0)  # running
    launcher.kill()  # SIGKILL: the launcher runs no handler of its own
    launcher.wait(30)
    deadline = time.monotonic() + 30
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if _alive(pid)]
        time.sleep(0.1)
    assert not alive, f"children outlived their launcher: {alive}"


def _alive(pid: int) -> bool:
    from flowrl.processes import pid_alive

    return pid_alive(pid)
