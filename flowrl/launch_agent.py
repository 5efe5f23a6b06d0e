"""The torchrun agent and the workers of ``flowrl train --num-processes``
(:func:`flowrl.distributed.launch` starts the agent; see its docstring for how every process of a
run dies with the launcher)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys

from .cli import main
from .processes import die_with_parent, pid_alive, signal_on_parent_death


def run_launch_agent(argv: list[str]) -> None:
    """The torchrun agent of ``flowrl train --num-processes`` (:func:`flowrl.distributed.launch`):
    it dies with the launcher and runs torchrun's elastic agent with ``argv`` (torchrun's own
    options, then ``-m flowrl`` and the command's arguments). A stop forwarded by the launcher
    ends without torchrun's traceback: by then torchrun has passed the signal to its workers and
    waited for them. So does a stop the workers made themselves (the run's STOP file:
    :mod:`flowrl.train.stopping`), which ends them with status 130: torchrun would report it as
    a failed worker (:func:`stopped_workers_are_no_failure`).

    The workers are started from a fork server that imported the training stack once
    (:data:`WORKER_PRELOAD`), not as fresh interpreters that each import it again: importing torch,
    diffusers and flowrl costs several CPU-seconds a process, paid once per launch this way instead
    of once per worker. The fork server is a child of this agent, started by fork and exec, so it
    carries none of torchrun's threads; it dies with this agent (:mod:`flowrl.fork_server`), and
    each worker dies with the fork server (:func:`run_launched_worker`)."""
    import multiprocessing
    import uuid

    # FLOWRL_LAUNCHER_PID stays in the environment: every process of the run (this agent, the
    # fork server, the workers) then names its launcher in /proc/PID/environ.
    die_with_parent(int(os.environ["FLOWRL_LAUNCHER_PID"]))
    os.environ["FLOWRL_AGENT_PID"] = str(os.getpid())
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    args = get_args_parser().parse_args(argv)
    if args.standalone:  # what torchrun's --standalone means: a rendezvous on a free local port
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    config, _, _ = config_from_args(args)
    config.start_method = "forkserver"
    multiprocessing.set_forkserver_preload(list(WORKER_PRELOAD))
    try:
        with stopped_workers_are_no_failure():
            record(elastic_launch(config, run_launched_worker))(*args.training_script_args)
    except Exception as exc:
        if type(exc).__name__ != "SignalException":  # torch.distributed.elastic's
            raise
        sys.exit(128 + int(getattr(exc, "sigval", signal.SIGTERM)))


#: The exit status of a worker whose run stopped (a stop request honoured; ``flowrl.cli``).
STOPPED = 130


@contextlib.contextmanager
def stopped_workers_are_no_failure():
    """Inside, a worker that ended with :data:`STOPPED` (its run stopped, checkpointed and said how
    to resume) is no failure: torchrun's log of it, and of ending the other workers after it, is
    dropped, and the agent exits with the same status instead of raising its ``ChildFailedError``
    (a traceback and a report naming the "failed" worker). Any other failure is reported as
    torchrun reports it."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    stopped = []

    def not_a_stop(record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("failed (exitcode") and record.args and record.args[0] == STOPPED:
            stopped.append(True)
        return not stopped

    # the failure, then ending the other workers
    loggers = [logging.getLogger(f"torch.{name}") for name in ("distributed.elastic.multiprocessing.api",
                                                                "multiprocessing.spawn")]
    for logger in loggers:
        logger.addFilter(not_a_stop)
    try:
        yield
    except ChildFailedError as exc:
        if exc.get_first_failure()[1].exitcode != STOPPED:
            raise
        sys.exit(STOPPED)
    finally:
        for logger in loggers:
            logger.removeFilter(not_a_stop)


#: What the fork server of :func:`run_launch_agent` imports before it forks any worker: the CLI,
#: the training loop and :mod:`flowrl.fork_server` (which ties the server's life to the agent
#: and imports diffusers' model code where it is installed).
WORKER_PRELOAD = ("flowrl.cli", "flowrl.train.loop", "flowrl.fork_server")


def run_launched_worker(*argv: str) -> None:
    """One worker of ``flowrl train --num-processes``: ``flowrl`` with ``argv``, dying with the fork
    server that forked it (whose parent is the agent, whose parent is the launcher), and exiting at
    once if the agent is already gone (a worker forked as the agent died gets no death signal)."""
    agent = int(os.environ.pop("FLOWRL_AGENT_PID"))
    signal_on_parent_death(signal.SIGKILL)  # the parent is the fork server
    if not pid_alive(agent):
        os._exit(128 + int(signal.SIGKILL))
    sys.argv = ["flowrl", *argv]
    main()
