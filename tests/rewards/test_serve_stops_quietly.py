"""`flowrl reward serve` stopped by a signal ends quietly: Ctrl-C (SIGINT to the whole process
group, as a terminal sends it), SIGTERM to the main process (`kill PID`, a supervisor) or to the
whole group (`kill -- -PGID`) ends every process the server started, with exit status 130 / 143,
one line on stderr and no traceback. Each server runs in a real subprocess in its own session, so
that a signal to its group reaches it and its children only.

The fleet (`--backend litserve`) used to print a KeyboardInterrupt traceback from every replica
on Ctrl-C, and exited 0 on SIGINT or SIGTERM (LitServe catches the interrupt); the simple backend
exited 0 on Ctrl-C and died of SIGTERM without a word. Needs the `fleet` extra for the litserve
cases (skipped without it).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time

import pytest

needs_litserve = pytest.mark.skipif(importlib.util.find_spec("litserve") is None,
                                    reason="the reward fleet needs the 'fleet' extra (LitServe)")
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the server's processes")

# (how the signal is sent, the signal, the exit status): Ctrl-C reaches the whole group
STOPS = [("group", signal.SIGINT, 130), ("main", signal.SIGTERM, 143), ("group", signal.SIGTERM, 143)]


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry))
    return members


class Server:
    def __init__(self, flowrl_cli, *args: str):
        self.proc = subprocess.Popen([str(flowrl_cli.script), "reward", "serve", "brightness", "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=dict(flowrl_cli.env(), OMP_NUM_THREADS="1"), start_new_session=True)

    def wait_ready(self, timeout: float = 120) -> str:
        line = self.proc.stdout.readline()  # printed once every replica is ready
        assert line.startswith("serving reward"), (line, self.finish(timeout)[1])
        return line

    def wait_children(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(group_members(self.proc.pid)) < 1 + n:
            assert time.monotonic() < deadline and self.proc.poll() is None, self.finish(10)
            time.sleep(0.05)

    def send(self, to: str, signum: int) -> None:
        if to == "group":
            os.killpg(self.proc.pid, signum)
        else:
            os.kill(self.proc.pid, signum)

    def finish(self, timeout: float = 90) -> tuple[int, str, str]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        finally:
            for pid in group_members(self.proc.pid):  # never leave a server behind, whatever failed
                os.kill(pid, signal.SIGKILL)
        return self.proc.returncode, out, err


def assert_quiet_stop(server: Server, code: int, err: str, signum: int, expected: int, *fragments: str) -> None:
    assert "Traceback" not in err and "Error" not in err, err
    assert code == expected, (code, err)
    name = signal.Signals(signum).name
    assert err.strip().splitlines() == [err.strip()] and err.startswith(f"stopped by {name}"), err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    deadline = time.monotonic() + 10
    while group_members(server.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_members(server.proc.pid), "processes of the server outlived it"


@linux
@pytest.mark.parametrize("to, signum, expected", STOPS, ids=lambda v: str(v))
def test_the_simple_server_stops_quietly(flowrl_cli, to, signum, expected):
    server = Server(flowrl_cli)
    server.wait_ready()
    server.send(to, signum)
    code, _, err = server.finish()
    assert_quiet_stop(server, code, err, signum, expected, "the reward server for 'brightness' has ended")


@pytest.mark.slow
@needs_litserve
@linux
@pytest.mark.parametrize("to, signum, expected", STOPS, ids=lambda v: str(v))
def test_the_fleet_and_its_replicas_stop_quietly(flowrl_cli, to, signum, expected):
    server = Server(flowrl_cli, "--backend", "litserve", "--replicas", "2")
    server.wait_ready()
    server.send(to, signum)
    code, _, err = server.finish()
    assert_quiet_stop(server, code, err, signum, expected,
                      "the reward fleet for 'brightness' and its 2 replica(s) have ended")


@needs_litserve
@linux
def test_ctrl_c_while_the_replicas_start_stops_the_fleet_quietly(flowrl_cli):
    """Ctrl-C while the replicas still import and build the reward (LitServe catches the
    interrupt only once they are ready; a replica used to die of it with a traceback)."""
    server = Server(flowrl_cli, "--backend", "litserve", "--replicas", "2")
    server.wait_children(3)  # the queue manager and two replicas have started, none is ready
    server.send("group", signal.SIGINT)
    code, out, err = server.finish()
    assert "serving reward" not in out
    assert_quiet_stop(server, code, err, signal.SIGINT, 130)


@linux
def test_a_stop_ends_the_replicas_litserve_had_not_listed_yet():
    """The race behind the test above: a Ctrl-C lands after a replica's process has started and
    before LitServe has put it in its list. The fleet must end that replica too (it used to
    outlive the stop, then die with a traceback once LitServe's queue manager had gone)."""
    import multiprocessing
    from types import SimpleNamespace

    from flowrl.serving.fleet import end_replicas

    unlisted = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), name="inference-worker")
    other = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), name="not-a-replica")
    unlisted.start()
    other.start()
    try:
        started = time.monotonic()
        end_replicas(SimpleNamespace(inference_workers=[]))
        assert not unlisted.is_alive() and unlisted.exitcode == -signal.SIGTERM
        assert time.monotonic() - started < 10
        assert other.is_alive()  # only LitServe's replicas are the fleet's to end
    finally:
        for process in (unlisted, other):
            process.kill()
            process.join()
