"""Remote rewards over HTTP: the ``http`` reward, client of ``flowrl reward serve``.

Why: some reward models cannot share an environment with the trainer (HPSv3 pins
transformers 4.45; GenEval pins mmdet), or are large enough to be served once to many trainer
processes. Run the reward in its own environment::

    flowrl reward serve pickscore --set device=cuda:1 --port 8700

(or as a fleet of replicas that batch requests: ``--backend litserve --replicas 2``, see
:mod:`flowrl.serving.fleet`) and point a recipe at it::

    [[rewards]]
    use = "http"
    url = "http://127.0.0.1:8700"

Protocol 1, safetensors both ways, never pickle: :mod:`flowrl.serving.protocol`.

The client checks everything it receives (status, format, tensor names, dtype, length, and the
request id the server echoes) and raises :class:`RewardServerError` with the URL and the cause
when anything is wrong: a reward is never replaced by a default value. Connection failures,
timeouts and 502/503/504 are retried ``retries`` times, waiting ``retry_wait`` seconds before
the first retry and doubling the wait each time; other failures raise at once. Every retry
resends the same request id, so a reply is matched to its request whichever replica answers.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from typing import Any, Literal

import torch

from flowrl.config import param
from flowrl.errors import FlowrlError
from flowrl.interfaces import RewardOutput

# The wire format and the servers live in flowrl.serving (the CLI serves from there); they are
# re-exported here, where they have always been importable from.
from flowrl.serving.protocol import (  # noqa: F401 - re-exported
    PROTOCOL,
    REQUEST_ID_HEADER,
    RETRY_STATUSES,
    RewardServerError,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
)
from flowrl.serving.simple import RewardHTTPServer, make_server  # noqa: F401 - re-exported

from .common import check_images

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
            request_id = uuid.uuid4().hex
            body = encode_request(chunk, prompts[start : start + self.config.batch_size], metadata, self.config.image_dtype,
                                  request_id=request_id)
            reply = self._request("POST", "/score", body, headers={REQUEST_ID_HEADER: request_id})
            out = decode_response(reply, chunk.shape[0], self.base, request_id=request_id)
            scores.append(out.scores)
            for key, value in out.extras.items():
                extras.setdefault(key, []).append(value)
        extras = {k: torch.cat(v) for k, v in extras.items() if len(v) == len(scores)}
        return RewardOutput(scores=torch.cat(scores), extras=extras)

    def _request(self, method: str, path: str, body: bytes | None, headers: dict[str, str] | None = None) -> bytes:
        cfg = self.config
        url = self.base + path
        last = ""
        for attempt in range(cfg.retries + 1):
            if attempt:
                time.sleep(cfg.retry_wait * 2 ** (attempt - 1))
            request = urllib.request.Request(url, data=body, method=method)
            if body is not None:
                request.add_header("Content-Type", "application/octet-stream")
            for key, value in (headers or {}).items():
                request.add_header(key, value)
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
