"""``flowrl reward serve NAME``: run any registered reward as a small HTTP server.

The trainer then scores through the ``http`` reward (``url = "http://HOST:PORT"``), so a reward
whose dependencies clash with the trainer's (HPSv3's transformers pin) runs in its own
environment, or on another GPU or machine. Protocol: :mod:`flowrl.serving.protocol`; servers:
:mod:`flowrl.serving.simple` (default) and :mod:`flowrl.serving.fleet` (``--backend litserve``).
"""

from __future__ import annotations

import os
import sys
from typing import Annotated, Optional

import typer
from rich.markup import escape

from ..errors import FlowrlError
from .base import app
from .reward_common import build_reward, reward_app

app.add_typer(reward_app, name="reward")  # `flowrl reward score` adds its command to it too


@reward_app.command("serve")
def serve(
    name: Annotated[str, typer.Argument(help="A registered reward (see `flowrl plugins`).")],
    set_: Annotated[
        Optional[list[str]], typer.Option("--set", "-s", help="A reward parameter: key=value (TOML value). Repeatable.")
    ] = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on (127.0.0.1 = this machine only).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", "-p", help="Port to listen on; 0 picks a free one.")] = 8700,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log every request.")] = False,
    backend: Annotated[str, typer.Option("--backend", help="'simple' (stdlib, one process) or 'litserve' "
                                         "(a fleet: replicas, dynamic batching; needs flowrl-diffusion\\[fleet]).")] = "simple",
    replicas: Annotated[Optional[int], typer.Option("--replicas", help="litserve: replica processes (default 1).")] = None,
    max_batch: Annotated[Optional[int], typer.Option("--max-batch", help="litserve: most requests scored together (default 8).")] = None,
    max_wait: Annotated[Optional[float], typer.Option("--max-wait", help="litserve: seconds a replica waits to fill a batch (default 0.01).")] = None,
    devices: Annotated[Optional[str], typer.Option("--devices", help="litserve: comma-separated devices, replica i gets "
                                                   "device = the i-th (e.g. cuda:0,cuda:1).")] = None,
) -> None:
    """Serve reward NAME over HTTP for the `http` reward (GET /health, POST /score)."""
    from ..processes import stop_on_signals

    # Ctrl-C or SIGTERM at any point, building the reward included: one line, exit 130 / 143.
    with stop_on_signals() as stopped:
        try:
            what = _serve(name, list(set_ or []), host=host, port=port, verbose=verbose, backend=backend,
                          replicas=replicas, max_batch=max_batch, max_wait=max_wait, devices=devices)
        except KeyboardInterrupt:
            if not stopped:
                raise
            what = f"the reward {'fleet' if backend == 'litserve' else 'server'} for '{name}' has ended"
    if stopped:
        _stopped(stopped[0], what)


def _serve(name: str, settings: list[str], *, host: str, port: int, verbose: bool, backend: str,
           replicas: Optional[int], max_batch: Optional[int], max_wait: Optional[float], devices: Optional[str]) -> str:
    """Serve until stopped; returns what has ended, for the stop's message."""
    if backend not in ("simple", "litserve"):
        raise FlowrlError(f"unknown --backend '{backend}'", where="flowrl reward serve", hint="use 'simple' or 'litserve'")
    fleet = {"--replicas": replicas, "--max-batch": max_batch, "--max-wait": max_wait, "--devices": devices}
    if backend == "litserve":
        import functools

        from ..serving.fleet import serve_fleet

        n = 1 if replicas is None else replicas
        serve_fleet(functools.partial(build_reward, name), settings, name=name, host=host, port=port,
                    replicas=n, max_batch=8 if max_batch is None else max_batch,
                    max_wait=0.01 if max_wait is None else max_wait,
                    devices=[d.strip() for d in devices.split(",") if d.strip()] if devices else None, verbose=verbose)
        return f"the reward fleet for '{name}' and its {n} replica(s) have ended"
    given = [flag for flag, value in fleet.items() if value is not None]
    if given:
        raise FlowrlError(f"{', '.join(given)} need(s) --backend litserve", where="flowrl reward serve",
                          hint="the simple backend serves one reward in one process")
    from ..serving.simple import check_port, make_server

    check_port(port)  # before the reward is built: a model may download and load for minutes
    reward = build_reward(name, settings)
    server = make_server(reward, name=name, host=host, port=port, verbose=verbose)
    # Printed (and flushed) only once the socket is bound, so scripts can wait for this line.
    print(f"serving reward '{name}' on {server.url} (Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return f"the reward server for '{name}' has ended"


def _stopped(signum: int, what: str) -> None:
    """A server stopped by a signal: one line on stderr, exit status 128 + signal (130 for
    Ctrl-C, 143 for SIGTERM), as a shell reports a process its signal ended."""
    from ..processes import stopped_message
    from .base import err_console

    err_console.print(escape(stopped_message(signum, what)), highlight=False, soft_wrap=True)
    # Everything is closed and every child has ended: skip the interpreter's finalization, whose
    # garbage collection of the reward's modules (torch, transformers) takes seconds, so that a
    # supervisor's SIGTERM ends the server as promptly as the signal's default action did.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + signum)
