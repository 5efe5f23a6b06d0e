"""Worker processes forked from the test process, set up the way torchrun sets up its workers.

A multi-process test that starts its workers as fresh interpreters pays for importing torch,
diffusers and flowrl in each (several CPU-seconds a process on the CI machine, more than the tiny
runs the tests train). Forked from the test process, the workers share its imports and are still
separate processes with their own process group (gloo), as under torchrun: RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment, each in a session of
its own, dying with the test process. Tests of the launchers themselves start the real ones.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable


def forget_the_test_process_state() -> None:
    """In a forked worker: drop the process-wide state an earlier in-process run of the test
    process left behind, which a fresh worker would not have (accelerate's shared state, sized for
    that run's processes, and torch.distributed's default group of a one-process fsdp2 run)."""
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def fork_workers(work: Callable[[], int], num_processes: int, *, timeout: float, cwd: Path,
                 env: dict | None = None, argv: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run ``work()`` (returning an exit status) in ``num_processes`` forked workers, ``env`` added
    to each one's environment and ``argv`` as its ``sys.argv``. Returns what :func:`subprocess.run`
    would: the first failing worker's exit status (0 if all succeed), and stdout and stderr of
    every worker in rank order. A worker that fails ends the others (as torchrun does); past
    ``timeout`` all are killed and :class:`subprocess.TimeoutExpired` is raised."""
    import torch

    if torch.cuda.is_initialized():  # CUDA does not survive fork: each worker's first CUDA call would fail
        raise RuntimeError("this test process has started CUDA, so forked workers cannot use it: "
                           "start the workers as fresh processes (engine_helpers.run_cli does so by itself)")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    logs = Path(tempfile.mkdtemp(prefix="flowrl-workers-"))
    pids = []
    for rank in range(num_processes):
        pid = os.fork()
        if pid == 0:  # the worker: it never returns into the test process
            code = 1
            try:
                os.setsid()
                from flowrl.processes import signal_on_parent_death

                signal_on_parent_death(signal.SIGKILL)
                for fd, stream in ((1, "out"), (2, "err")):
                    target = os.open(logs / f"{rank}.{stream}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                    os.dup2(target, fd)
                    os.close(target)
                sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
                sys.stderr = open(2, "w", encoding="utf-8", closefd=False)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.chdir(cwd)
                os.environ.update(OMP_NUM_THREADS="1", **(env or {}), RANK=str(rank), LOCAL_RANK=str(rank),
                                  WORLD_SIZE=str(num_processes), LOCAL_WORLD_SIZE=str(num_processes),
                                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                if argv is not None:
                    sys.argv = list(argv)
                forget_the_test_process_state()
                code = work()
            except BaseException:  # printed as the interpreter would print it
                traceback.print_exc()
            finally:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    codes: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(codes) < len(pids):
            for pid in pids:
                if pid not in codes:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[pid] = os.waitstatus_to_exitcode(status)
            if any(codes.values()):
                break  # a worker failed: end the others
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(argv or ["workers"], timeout)
            time.sleep(0.02)
    finally:
        for pid in pids:
            if pid not in codes:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        def read(name: str) -> str:
            return (logs / name).read_text(errors="replace") if (logs / name).is_file() else ""

        out = "".join(read(f"{rank}.out") for rank in range(num_processes))
        # each rank's stderr under its own header, a failed rank's last: a test's assertion shows the
        # tail, and a worker killed by a signal (an abort in a C++ thread) says why only in its own log
        if num_processes == 1:
            err = read("0.err")
        else:
            order = sorted(range(num_processes), key=lambda rank: codes[pids[rank]] != 0)
            err = "".join(f"--- rank {rank} (exit {codes[pids[rank]]}) ---\n{read(f'{rank}.err')}" for rank in order)
        shutil.rmtree(logs, ignore_errors=True)
    failed = [codes[pid] for pid in pids if codes[pid]]
    return subprocess.CompletedProcess(argv or ["workers"], failed[0] if failed else 0, out, err)
