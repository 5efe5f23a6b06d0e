"""The wire protocol of remote rewards, and the server behind ``flowrl reward serve``.

Why: some reward models cannot share an environment with the trainer (HPSv3 pins transformers
4.45; GenEval pins mmdet). Such a reward runs in its own environment behind a small HTTP
server, and the trainer scores through the ``http`` reward (the client, a built-in plugin).

Protocol (version 1), safetensors both ways, never pickle:

- ``GET /health`` -> JSON ``{"status": "ok", "reward": NAME, "protocol": 1}``.
- ``POST /score`` with a safetensors body: tensor ``images`` ``[B, 3, H, W]`` as uint8
  (0-255) or float16/float32 (0-1); header metadata ``prompts`` (a JSON list of B strings) and
  optionally ``metadata`` (a JSON object).
- Reply 200: safetensors with ``scores`` float32 ``[B]`` and one ``extra/NAME`` float32 ``[B]``
  per extra. Any failure is a 4xx (bad request) or 5xx (the reward raised) status with a JSON
  body ``{"error": message}``.
"""

from __future__ import annotations

import json
import struct
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from safetensors.torch import load, save

from .errors import FlowrlError
from .interfaces import RewardOutput, score

PROTOCOL = 1
#: Statuses that mean "try again": the proxy or server is overloaded or restarting.
RETRY_STATUSES = {502, 503, 504}


class RewardServerError(FlowrlError):
    """A remote reward could not be computed (unreachable, timed out, bad reply)."""


# ----------------------------------------------------------------------------- wire format


def encode_request(images: torch.Tensor, prompts: Sequence[str], metadata: Mapping[str, Any] | None, image_dtype: str) -> bytes:
    images = images.detach().float().clamp(0, 1).cpu()
    if image_dtype == "uint8":
        wire = (images * 255).round().to(torch.uint8)
    elif image_dtype == "float16":
        wire = images.to(torch.float16)
    else:
        wire = images
    header = {"protocol": str(PROTOCOL), "prompts": json.dumps(list(prompts))}
    if metadata:
        try:
            header["metadata"] = json.dumps(dict(metadata))
        except TypeError as exc:
            raise RewardServerError(
                f"metadata for a remote reward must be JSON-serialisable ({exc})",
                hint="pass only numbers, strings, lists and dicts as reward metadata",
            ) from exc
    return save({"images": wire.contiguous()}, metadata=header)


def decode_request(body: bytes) -> tuple[torch.Tensor, list[str], dict[str, Any] | None]:
    """Inverse of :func:`encode_request`; raises ``ValueError`` saying what is malformed."""
    try:
        tensors = load(body)
        header = safetensors_metadata(body)
    except Exception as exc:  # safetensors raises its own error types for corrupt input
        raise ValueError(f"body is not a safetensors file ({exc})") from exc
    if set(tensors) != {"images"}:
        raise ValueError(f"expected exactly one tensor 'images', got {sorted(tensors)}")
    images = tensors["images"]
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be [B, 3, H, W], got {tuple(images.shape)}")
    if images.dtype == torch.uint8:
        images = images.float() / 255.0
    elif images.dtype in (torch.float16, torch.float32, torch.bfloat16):
        images = images.float()
    else:
        raise ValueError(f"images must be uint8, float16 or float32, got {images.dtype}")
    try:
        prompts = json.loads(header.get("prompts", "null"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"metadata 'prompts' is not JSON ({exc})") from exc
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ValueError("metadata 'prompts' must be a JSON list of strings")
    if len(prompts) != images.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {len(prompts)} prompts")
    meta = json.loads(header["metadata"]) if "metadata" in header else None
    return images, prompts, meta


def safetensors_metadata(body: bytes) -> dict[str, str]:
    """The string metadata in a safetensors file's header."""
    (n,) = struct.unpack("<Q", body[:8])
    header = json.loads(body[8 : 8 + n])
    return dict(header.get("__metadata__") or {})


def encode_response(out: RewardOutput) -> bytes:
    tensors = {"scores": out.scores.float().contiguous()}
    for key, value in out.extras.items():
        tensors[f"extra/{key}"] = value.float().reshape(-1).contiguous()
    return save(tensors, metadata={"protocol": str(PROTOCOL)})


def decode_response(body: bytes, expected: int, url: str) -> RewardOutput:
    try:
        tensors = load(body)
    except Exception as exc:
        preview = body[:120].decode("utf-8", "replace")
        raise RewardServerError(
            f"malformed response from reward server {url}: not a safetensors body ({exc}); starts with {preview!r}",
            hint="is the URL a flowrl reward server (`flowrl reward serve`)? check its log",
        ) from exc
    if "scores" not in tensors:
        raise RewardServerError(f"malformed response from reward server {url}: no 'scores' tensor (got {sorted(tensors)})")
    out = {}
    for key, value in tensors.items():
        if not value.is_floating_point():
            raise RewardServerError(f"malformed response from reward server {url}: '{key}' has dtype {value.dtype}")
        if value.ndim != 1 or value.shape[0] != expected:
            raise RewardServerError(
                f"reward server {url} returned '{key}' of shape {tuple(value.shape)} for a batch of {expected} images",
                hint="the server's reward must return one score per image",
            )
        out[key] = value.float()
    scores = out.pop("scores")
    return RewardOutput(scores=scores, extras={k.removeprefix("extra/"): v for k, v in out.items()})


# ----------------------------------------------------------------------------- server


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
            info = {"status": "ok", "reward": self.server.reward_name, "protocol": PROTOCOL}
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
            sys.stderr.write(f"scored {len(prompts)} images in {time.perf_counter() - start:.3f} s\n")
        self._send(200, encode_response(out), "application/octet-stream")


def make_server(reward, *, name: str, host: str = "127.0.0.1", port: int = 8700, verbose: bool = False) -> RewardHTTPServer:
    """Bind a server for ``reward`` (port 0 picks a free port; read it from ``server.url``)."""
    try:
        return RewardHTTPServer((host, port), reward, name=name, verbose=verbose)
    except OSError as exc:
        raise FlowrlError(f"cannot listen on {host}:{port}: {exc}", hint="choose another --port (0 = any free port)") from exc
