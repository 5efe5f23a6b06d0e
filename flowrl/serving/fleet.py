"""A reward fleet: ``flowrl reward serve NAME --backend litserve --replicas N``.

Serves one reward from N replica processes behind one HTTP endpoint, on LitServe (the optional
extra ``flowrl-diffusion[fleet]``), speaking protocol 1 exactly (:mod:`flowrl.serving.protocol`), so
the ``http`` reward needs no change:

- dynamic batching: each replica takes up to ``max_batch`` queued requests, waiting at most
  ``max_wait`` seconds for more, from any number of trainer processes, and scores requests
  with equal image size and metadata in one reward call;
- N replicas pulling from one queue; a replica that dies is restarted, and the requests it
  was scoring are answered 503 at once so that the client retries them (request ids keep every
  reply matched to its request);
- ``GET /health``: ``{"status": "ok", "reward", "protocol": 1, "backend": "litserve",
  "replicas", "ready"}``, status 503 while no replica is ready.

Why LitServe rather than Ray Serve is argued in docs/rewards.md (section "A reward fleet").
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

from flowrl.errors import FlowrlError, require
from flowrl.processes import spawned_children_ignore_sigint, stop_on_signals

from .protocol import PROTOCOL

#: How long the fleet waits for its replicas to build the reward before it gives up.
STARTUP_TIMEOUT = 3600.0


def require_litserve():
    return require("litserve", extra="fleet", purpose="`flowrl reward serve --backend litserve` (a reward fleet)")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_options(*, host: str, port: int, replicas: int, max_batch: int, max_wait: float) -> None:
    """Reject what LitServe would reject, with flowrl's error messages."""
    if host not in ("127.0.0.1", "0.0.0.0", "::"):
        raise FlowrlError(f"--host {host} is not supported by the litserve backend", where="flowrl reward serve",
                          hint="use 127.0.0.1 (this machine only), 0.0.0.0 or ::")
    if port != 0 and not 1024 <= port <= 65535:
        raise FlowrlError(f"--port {port} is not in 1024-65535 (the litserve backend's range)", where="flowrl reward serve",
                          hint="choose a port from 1024 to 65535, or 0 for any free one")
    for flag, value in (("--replicas", replicas), ("--max-batch", max_batch)):
        if value < 1:
            raise FlowrlError(f"{flag} must be at least 1, got {value}", where="flowrl reward serve")
    if not max_wait >= 0:
        raise FlowrlError(f"--max-wait must be >= 0 seconds, got {max_wait}", where="flowrl reward serve")


def serve_fleet(build: Callable[[list[str]], Any], settings: list[str], *, name: str, host: str = "127.0.0.1",
                port: int = 8700, replicas: int = 1, max_batch: int = 8, max_wait: float = 0.01,
                devices: list[str] | None = None, verbose: bool = False) -> int | None:
    """Run the fleet until Ctrl-C or SIGTERM; prints ``serving reward 'NAME' on URL ...`` once
    every replica is ready. Returns the signal that stopped it, once every replica has ended.

    ``build(settings)`` makes the reward in each replica (``settings`` are ``key=value``
    strings; with ``devices``, replica i gets ``device=devices[i % len(devices)]`` added). It
    must be picklable (a module-level function or a ``functools.partial`` of one).
    """
    check_options(host=host, port=port, replicas=replicas, max_batch=max_batch, max_wait=max_wait)
    ls = require_litserve()
    from ._litserve_api import ReplicaWatch, RewardAPI, manager_process_init  # optional extra: fleet (litserve)

    if port == 0:
        port = free_port("127.0.0.1" if host == "127.0.0.1" else "")
    state_dir = tempfile.mkdtemp(prefix="flowrl-fleet-")
    (Path(state_dir) / "claims").mkdir()
    os.environ["FLOWRL_FLEET_MAIN_PID"] = str(os.getpid())
    api = RewardAPI(build, settings, name=name, state_dir=state_dir, devices=devices, max_batch_size=max_batch,
                    batch_timeout=max_wait, verbose=verbose)
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=replicas, timeout=False, restart_workers=True,
                          healthcheck_path="/litserve/health", info_path="/litserve/info", disable_openapi_url=True,
                          middlewares=[(ReplicaWatch, {"state_dir": state_dir})])
    _add_health_route(server, name=name, replicas=replicas)
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    failure: list[str] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, daemon=True,
                               args=(server, url, name, replicas, max_batch, max_wait, Path(state_dir), failure, stop))

    # The main process alone answers Ctrl-C (which a terminal sends to the whole process group)
    # and SIGTERM: it ends the HTTP process and every replica itself. The replicas ignore SIGINT
    # from their start (spawned_children_ignore_sigint), forked processes end by the signal's
    # default action, and LitServe's manager ignores SIGINT (multiprocessing's) and SIGTERM
    # (manager_process_init).
    # LitServe's queue manager is a child process too: make it end with this one (like the replicas).
    import multiprocessing.managers as managers

    start_manager = managers.BaseManager.start

    def start_dying_with_parent(self, initializer=None, initargs=()):
        return start_manager(self, initializer or manager_process_init, initargs)

    managers.BaseManager.start = start_dying_with_parent
    try:
        with stop_on_signals() as stopped, spawned_children_ignore_sigint():
            _quiet_shutdown_after_a_stop(server, stopped)
            watcher.start()
            try:
                server.run(host=host, port=port, generate_client_file=False, num_api_servers=1,
                           log_level="info" if verbose else "warning")
            except KeyboardInterrupt:  # during start-up: LitServe catches it only once its replicas are ready
                pass
            except RuntimeError as exc:  # LitServe: "One or more workers failed to start"
                if not failure and not stopped:
                    failure.append(_setup_errors(Path(state_dir)) or str(exc))
            finally:
                stop.set()
                watcher.join(5)
                end_replicas(server)
    finally:
        managers.BaseManager.start = start_manager
        shutil.rmtree(state_dir, ignore_errors=True)
    if stopped:
        return stopped[0]
    if failure:
        raise FlowrlError(f"the reward fleet for '{name}' stopped: a replica could not build the reward: {failure[0]}",
                          where="flowrl reward serve --backend litserve",
                          hint="fix the reward's settings (--set) or its installation; try the simple backend to debug")
    return None


def end_replicas(server) -> None:
    """End every replica this process started (SIGTERM, then wait): those in LitServe's list and
    those a stop kept out of it. A Ctrl-C while LitServe starts its replicas interrupts it after a
    replica's process has started and before LitServe has listed it; such a replica, left
    running, would build its reward and then, at this process's exit, find LitServe's queue
    manager gone and die with a traceback."""
    import multiprocessing

    replicas = {process.pid: process for process in getattr(server, "inference_workers", None) or []}
    replicas.update({process.pid: process for process in multiprocessing.active_children()
                     if process.name == "inference-worker"})  # LitServe's name for them
    for process in replicas.values():
        if process.is_alive():
            process.terminate()
    for process in replicas.values():
        process.join(10)


def _quiet_shutdown_after_a_stop(server, stopped: list[int]) -> None:
    """Once a signal has stopped the fleet, LitServe shuts it down: its monitor thread must not
    restart the replicas being ended (it would start orphans), nor log their end, or the
    manager's, as a crash with a traceback."""
    import logging

    launch, shut_down = server.launch_single_inference_worker, server._perform_graceful_shutdown

    def launch_unless_stopped(*args, **kwargs):
        while stopped:  # park the monitor (a daemon thread) until the process exits
            time.sleep(60)
        return launch(*args, **kwargs)

    def shut_down_quietly(*args, **kwargs):
        if stopped:
            logging.getLogger("litserve").setLevel(logging.CRITICAL)
        return shut_down(*args, **kwargs)

    server.launch_single_inference_worker = launch_unless_stopped
    server._perform_graceful_shutdown = shut_down_quietly


def _add_health_route(server, *, name: str, replicas: int) -> None:
    from fastapi.responses import JSONResponse
    from litserve.utils import WorkerSetupStatus

    @server.app.get("/health")
    async def health():
        try:
            ready = sum(1 for v in server.workers_setup_status.values() if v == WorkerSetupStatus.READY)
        except Exception:  # the status dict lives in LitServe's manager process
            ready = 0
        info = {"status": "ok" if ready else "starting", "reward": name, "protocol": PROTOCOL, "backend": "litserve",
                "replicas": replicas, "ready": ready}
        if not ready:
            info["error"] = "no replica is ready yet"
        return JSONResponse(info, status_code=200 if ready else 503)


def _watch(server, url: str, name: str, replicas: int, max_batch: int, max_wait: float, state_dir: Path,
           failure: list[str], stop: threading.Event) -> None:
    """Print the ready line once every replica is up; stop the fleet if a replica cannot build."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    announced = False
    deadline = time.monotonic() + STARTUP_TIMEOUT

    def shut_down(reason: str) -> None:
        failure.append(reason)
        while not stop.is_set():  # LitServe's own shutdown (its main thread waits on this event)
            event = getattr(server, "_shutdown_event", None)
            if event is not None:
                event.set()
                return
            stop.wait(0.1)

    while not stop.wait(0.1):
        errors = _setup_errors(state_dir)
        if errors:
            return shut_down(errors)
        if announced:
            continue
        try:
            with opener.open(url + "/health", timeout=2) as response:
                ready = json.loads(response.read()).get("ready", 0)
        except Exception:  # not listening yet, or 503 while replicas start
            ready = 0
        if ready >= replicas:
            print(f"serving reward '{name}' on {url} with {replicas} replica(s), max batch {max_batch} requests, "
                  f"max wait {max_wait} s (LitServe; Ctrl-C to stop)", flush=True)
            announced = True
        elif time.monotonic() > deadline:
            return shut_down(f"the replicas were not ready within {STARTUP_TIMEOUT:.0f} s")


def _setup_errors(state_dir: Path) -> str:
    texts = [p.read_text() for p in sorted(state_dir.glob("setup-error-*.txt"))]
    return texts[0] if texts else ""

