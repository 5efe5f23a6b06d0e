"""Remote rewards over HTTP: the ``http`` reward (client) and the server behind ``flowrl reward serve``.

Why: some reward models cannot share an environment with the trainer (HPSv3 pins
transformers 4.45; GenEval pins mmdet). Run the reward in its own environment::

    flowrl reward serve pickscore --set device=cuda:1 --port 8700

and point a recipe at it::

    [[rewards]]
    use = "http"
    url = "http://127.0.0.1:8700"

Protocol (version 1), safetensors both ways, never pickle:

- ``GET /health`` -> JSON ``{"status": "ok", "reward": NAME, "protocol": 1}``.
- ``POST /score`` with a safetensors body: tensor ``images`` ``[B, 3, H, W]`` as uint8
  (0-255) or float16/float32 (0-1); header metadata ``prompts`` (a JSON list of B strings) and
  optionally ``metadata`` (a JSON object).
- Reply 200: safetensors with ``scores`` float32 ``[B]`` and one ``extra/NAME`` float32 ``[B]``
  per extra. Any failure is a 4xx (bad request) or 5xx (the reward raised) status with a JSON
  body ``{"error": message}``.

The client checks everything it receives (status, format, tensor names, dtype, length) and
raises :class:`RewardServerError` with the URL and the cause when anything is wrong: a reward
is never replaced by a default value. Connection failures, timeouts and 502/503/504 are
retried ``retries`` times with a growing pause; other failures raise at once.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

import torch

from flowrl.config import param
from flowrl.errors import FlowrlError
from flowrl.interfaces import RewardOutput, score

from .common import check_images

PROTOCOL = 1
#: Statuses that mean "try again": the proxy or server is overloaded or restarting.
RETRY_STATUSES = {502, 503, 504}


class RewardServerError(FlowrlError):
    """A remote reward could not be computed (unreachable, timed out, bad reply)."""


# ----------------------------------------------------------------------------- wire format


def encode_request(images: torch.Tensor, prompts: Sequence[str], metadata: Mapping[str, Any] | None, image_dtype: str) -> bytes:
    from safetensors.torch import save

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
    from safetensors.torch import load

    try:
        tensors = load(body)
        header = _safetensors_metadata(body)
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


def _safetensors_metadata(body: bytes) -> dict[str, str]:
    import struct

    (n,) = struct.unpack("<Q", body[:8])
    header = json.loads(body[8 : 8 + n])
    return dict(header.get("__metadata__") or {})


def encode_response(out: RewardOutput) -> bytes:
    from safetensors.torch import save

    tensors = {"scores": out.scores.float().contiguous()}
    for key, value in out.extras.items():
        tensors[f"extra/{key}"] = value.float().reshape(-1).contiguous()
    return save(tensors, metadata={"protocol": str(PROTOCOL)})


def decode_response(body: bytes, expected: int, url: str) -> RewardOutput:
    from safetensors.torch import load

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


# ----------------------------------------------------------------------------- client


@dataclasses.dataclass(frozen=True)
class HttpRewardConfig:
    url: str = param("http://127.0.0.1:8700", "Base URL of a `flowrl reward serve` server.")
    timeout: float = param(120.0, "Seconds to wait for one request (connect and reply) before it counts as failed.", min=0, exclusive_min=True)
    retries: int = param(2, "Extra attempts after a connection failure, timeout or 502/503/504; then the run stops with an error.", min=0)
    retry_wait: float = param(1.0, "Seconds before the first retry; doubles each retry.", min=0)
    batch_size: int = param(32, "Images per request.", min=1)
    image_dtype: Literal["uint8", "float16", "float32"] = param(
        "uint8", "How images travel: 'uint8' (4x smaller; what image reward models consume), 'float16' or 'float32'."
    )
    check_on_start: bool = param(True, "Call GET /health when the reward is built, so a wrong URL fails before training.")


class HttpReward:
    """A reward computed by a remote `flowrl reward serve` server; failures raise, never default."""

    Config = HttpRewardConfig

    def __init__(self, config: HttpRewardConfig):
        parsed = urllib.parse.urlsplit(config.url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise FlowrlError(f"url '{config.url}' is not an http(s) URL", where="reward 'http'",
                              hint="e.g. url = 'http://127.0.0.1:8700'")
        self.config = config
        self.base = config.url.rstrip("/")
        self.name = "http"
        # No proxies: an http_proxy set for downloads would otherwise capture requests to a
        # reward server on this machine or the cluster network.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self.remote_name = "?"
        if config.check_on_start:
            info = self.health()
            self.remote_name = str(info.get("reward", "?"))

    def health(self) -> dict[str, Any]:
        body = self._request("GET", "/health", None)
        try:
            info = json.loads(body)
        except json.JSONDecodeError as exc:
            raise RewardServerError(f"malformed /health reply from {self.base}: {body[:120]!r}",
                                    hint="is the URL a flowrl reward server?") from exc
        if not isinstance(info, dict) or info.get("protocol") != PROTOCOL:
            raise RewardServerError(f"{self.base} does not speak reward protocol {PROTOCOL}: {info!r}")
        return info

    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        prompts = list(prompts)
        check_images(images, prompts, "http")
        scores, extras = [], {}
        for start in range(0, images.shape[0], self.config.batch_size):
            chunk = images[start : start + self.config.batch_size]
            body = encode_request(chunk, prompts[start : start + self.config.batch_size], metadata, self.config.image_dtype)
            reply = self._request("POST", "/score", body)
            out = decode_response(reply, chunk.shape[0], self.base)
            scores.append(out.scores)
            for key, value in out.extras.items():
                extras.setdefault(key, []).append(value)
        extras = {k: torch.cat(v) for k, v in extras.items() if len(v) == len(scores)}
        return RewardOutput(scores=torch.cat(scores), extras=extras)

    def _request(self, method: str, path: str, body: bytes | None) -> bytes:
        cfg = self.config
        url = self.base + path
        last = ""
        for attempt in range(cfg.retries + 1):
            if attempt:
                time.sleep(cfg.retry_wait * 2 ** (attempt - 1))
            request = urllib.request.Request(url, data=body, method=method)
            if body is not None:
                request.add_header("Content-Type", "application/octet-stream")
            try:
                with self._opener.open(request, timeout=cfg.timeout) as response:
                    return response.read()
            except urllib.error.HTTPError as exc:
                detail = _error_detail(exc)
                if exc.code in RETRY_STATUSES:
                    last = f"HTTP {exc.code}: {detail}"
                    continue
                raise RewardServerError(
                    f"reward server {url} failed with HTTP {exc.code}: {detail}",
                    hint="see the server's log; the reward itself raised or rejected the request"
                    if exc.code >= 500 else "the request was rejected; client and server versions may differ",
                ) from exc
            except (TimeoutError, socket.timeout) as exc:
                last = f"no reply within timeout = {cfg.timeout} s ({exc})"
            except urllib.error.URLError as exc:
                if isinstance(exc.reason, (TimeoutError, socket.timeout)):
                    last = f"no reply within timeout = {cfg.timeout} s ({exc.reason})"
                else:
                    last = f"cannot connect ({exc.reason})"
            except (http.client.HTTPException, ConnectionError, OSError) as exc:
                # The server died or closed the connection mid-reply.
                last = f"connection lost ({type(exc).__name__}: {exc})"
        raise RewardServerError(
            f"reward server {url} failed after {cfg.retries + 1} attempt(s): {last}",
            hint="is `flowrl reward serve` running at that address? raise 'timeout' for slow rewards, "
            "or 'retries' for flaky networks",
        )


def _error_detail(exc: urllib.error.HTTPError) -> str:
    try:
        raw = exc.read()
    except Exception:  # the body itself may be cut off
        return exc.reason or "(no detail)"
    try:
        return str(json.loads(raw)["error"])
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode("utf-8", "replace") or str(exc.reason)


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
