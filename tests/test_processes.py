"""flowrl.processes: a stop that arrives while a child is being spawned."""

from __future__ import annotations

import subprocess
import sys

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
