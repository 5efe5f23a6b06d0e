"""The dependency-free reward server: one reward, one process, stdlib ``http.server``.

``flowrl reward serve NAME`` (the default ``--backend simple``). Requests are accepted
concurrently but scored one at a time, because reward models are not thread-safe and share one
device. For batching across many trainer processes and several replicas, see
:mod:`flowrl.serving.fleet`. Wire format: :mod:`flowrl.serving.protocol`.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from flowrl.errors import FlowrlError, counted
from flowrl.rewards import score

from .protocol import PROTOCOL, decode_request, encode_response, request_id_of


class RewardHTTPServer(ThreadingHTTPServer):
    """Serves one reward. Requests are accepted concurrently but scored one at a time (a lock),
    because reward models are not thread-safe and share one device."""

    daemon_threads = True

    def __init__(self, address, reward, *, name: str, max_bytes: int = 2**31, verbose: bool = False):
        super().__init__(address, _Handler)
        self.reward = reward
        self.reward_name = name
        self.max_bytes = max_bytes
        self.verbose = verbose
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class _Handler(BaseHTTPRequestHandler):
    server: RewardHTTPServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 - the stdlib's signature
        if self.server.verbose:
            sys.stderr.write("%s - %s\n" % (self.address_string(), format % args))

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str) -> None:
        self._send(status, json.dumps({"error": message}).encode(), "application/json")

    def do_GET(self):  # noqa: N802 - the stdlib's name
        if self.path.rstrip("/") == "/health":
            info = {"status": "ok", "reward": self.server.reward_name, "protocol": PROTOCOL, "backend": "simple"}
            self._send(200, json.dumps(info).encode(), "application/json")
        else:
            self._error(404, f"unknown path {self.path}; use GET /health or POST /score")

    def do_POST(self):  # noqa: N802
        if self.path.rstrip("/") != "/score":
            self._error(404, f"unknown path {self.path}; use POST /score")
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._error(411, "Content-Length is required")
            return
        if length > self.server.max_bytes:
            self._error(413, f"request of {length} bytes exceeds the server's limit of {self.server.max_bytes}")
            return
        body = self.rfile.read(length)
        try:
            images, prompts, metadata = decode_request(body)
        except ValueError as exc:
            self._error(400, f"malformed request: {exc}")
            return
        start = time.perf_counter()
        try:
            with self.server.lock:
                out = score(self.server.reward, images, prompts, metadata)
        except Exception as exc:  # report the reward's failure to the client, keep serving
            self._error(500, f"reward '{self.server.reward_name}' raised {type(exc).__name__}: {exc}")
            return
        if self.server.verbose:
            sys.stderr.write(f"scored {counted(len(prompts), 'image')} in {time.perf_counter() - start:.3f} s\n")
        self._send(200, encode_response(out, request_id=request_id_of(body)), "application/octet-stream")


def make_server(reward, *, name: str, host: str = "127.0.0.1", port: int = 8700, verbose: bool = False) -> RewardHTTPServer:
    """Bind a server for ``reward`` (port 0 picks a free port; read it from ``server.url``)."""
    check_port(port)
    try:
        return RewardHTTPServer((host, port), reward, name=name, verbose=verbose)
    except socket.gaierror as exc:  # the address, not the port
        raise FlowrlError(f"cannot listen on {host}:{port}: {host!r} is no address of this machine ({exc})",
                          where="--host", hint="give an address of this machine, e.g. 127.0.0.1 or 0.0.0.0") from exc
    except OSError as exc:
        raise FlowrlError(f"cannot listen on {host}:{port}: {exc}", hint="choose another --port (0 = any free port)") from exc


def check_port(port: int) -> None:
    """``--port`` is a port number (the socket would raise OverflowError, not OSError); checked
    before the reward is built (a model's download and load)."""
    if not 0 <= port <= 65535:
        raise FlowrlError(f"--port {port} is not a port number (0-65535)", where="flowrl reward serve",
                          hint="choose a port from 1024 to 65535, or 0 for any free one")
