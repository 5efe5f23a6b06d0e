"""The LitServe side of the reward fleet (imports litserve; loaded only by :mod:`flowrl.serving.fleet`).

Three pieces, all picklable by reference because LitServe spawns one process per replica:

- :class:`RewardAPI`: the ``LitAPI`` each replica runs. It builds the reward once
  (``setup``), decodes each request body, scores a whole dynamic batch with as few reward calls
  as possible (requests with the same image size and metadata are concatenated), and encodes
  one reply per request, echoing its request id. A bad request or a reward that raises fails
  only the requests concerned (400 / 500 with ``{"error": ...}``), never the whole batch.
- :class:`ReplicaWatch`: ASGI middleware in the HTTP process. A replica that takes a request
  writes a claim file (request id -> its pid); if that process dies before answering, the
  request is answered 503 at once so the client retries it on another replica instead of
  waiting for its timeout.
- :func:`die_with_parent`: replicas and HTTP processes end when the fleet's main process does
  (:func:`manager_process_init`: LitServe's queue manager too).
"""

# No `from __future__ import annotations` here: LitServe hands decode_request's annotation to
# FastAPI, which must see the real Annotated[bytes, Body(...)] to read the raw body.
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Annotated, Any, Callable

import litserve as ls
from fastapi import Body, Response

from flowrl.errors import FlowrlError
from flowrl.rewards import score
from flowrl.processes import pid_alive, signal_on_parent_death

from .protocol import (
    PROTOCOL,
    REQUEST_ID_HEADER,
    decode_request,
    encode_response,
    request_id_of,
    valid_request_id,
)

SETUP_ERROR = "setup-error-{}.txt"


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent exits (no orphaned replicas)."""
    signal_on_parent_death(signal.SIGTERM)


def manager_process_init() -> None:
    """LitServe's queue manager: ends with the fleet's main process (SIGKILL: it ignores SIGTERM),
    and not before it. A SIGTERM sent to the whole process group (``kill -- -PGID``) would
    otherwise end the manager while the main process still shuts the fleet down through it
    (LitServe's monitor thread then dies with a BrokenPipeError traceback); it ignores SIGINT
    itself (multiprocessing's manager server does)."""
    signal_on_parent_death(signal.SIGKILL)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class _Decoded:
    __slots__ = ("request_id", "images", "prompts", "metadata", "error")

    def __init__(self, request_id, images=None, prompts=None, metadata=None, error=None):
        self.request_id, self.images, self.prompts, self.metadata, self.error = request_id, images, prompts, metadata, error


class RewardAPI(ls.LitAPI):
    """One replica: ``build(settings)`` makes the reward; requests are protocol-1 bodies."""

    def __init__(self, build: Callable[[list[str]], Any], settings: list[str], *, name: str, state_dir: str,
                 devices: list[str] | None, max_batch_size: int, batch_timeout: float, verbose: bool = False):
        super().__init__(max_batch_size=max_batch_size, batch_timeout=batch_timeout, api_path="/score")
        self.build, self.settings, self.reward_name = build, list(settings), name
        self.state_dir, self.devices, self.verbose = state_dir, devices, verbose

    # ------------------------------------------------------------------ replica process
    def setup(self, device) -> None:  # LitServe's device is unused: the reward's `device` key places it
        die_with_parent()
        self.index = int(os.environ.get("LITSERVE_WORKER_ID", "0"))
        self.pid = os.getpid()
        settings = list(self.settings)
        if self.devices:
            settings.append(f"device={json.dumps(self.devices[self.index % len(self.devices)])}")
        try:
            self.reward = self.build(settings)
        except BaseException as exc:  # the fleet's main process reports it and stops
            message = exc.format() if isinstance(exc, FlowrlError) else f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            Path(self.state_dir, SETUP_ERROR.format(self.index)).write_text(message)
            raise

    def decode_request(self, request: Annotated[bytes, Body(media_type="application/octet-stream")]) -> _Decoded:
        request_id = request_id_of(request)
        if request_id is not None:  # claim it: if this process dies, the HTTP process answers 503
            claim = Path(self.state_dir, "claims", request_id)
            claim.write_text(str(self.pid))
        try:
            images, prompts, metadata = decode_request(request)
        except ValueError as exc:
            return _Decoded(request_id, error=(400, f"malformed request: {exc}"))
        return _Decoded(request_id, images, prompts, metadata)

    def batch(self, inputs):
        return list(inputs)

    def predict(self, items: list[_Decoded]) -> list[tuple]:
        import torch

        start = time.perf_counter()
        results: dict[int, tuple] = {}
        groups: dict[tuple, list[int]] = {}
        for i, item in enumerate(items):
            if item.error is not None:
                results[i] = item.error
            else:
                key = (tuple(item.images.shape[2:]), json.dumps(item.metadata, sort_keys=True))
                groups.setdefault(key, []).append(i)

        def run(indices: list[int]) -> None:
            images = torch.cat([items[i].images for i in indices])
            prompts = [p for i in indices for p in items[i].prompts]
            out = score(self.reward, images, prompts, items[indices[0]].metadata)
            offset = 0
            for i in indices:
                n = items[i].images.shape[0]
                part = type(out)(scores=out.scores[offset : offset + n],
                                 extras={k: v.reshape(-1)[offset : offset + n] for k, v in out.extras.items()})
                results[i] = (200, part)
                offset += n

        for indices in groups.values():
            try:
                run(indices)
            except Exception as exc:
                if len(indices) == 1:
                    results[indices[0]] = (500, f"reward '{self.reward_name}' raised {type(exc).__name__}: {exc}")
                    continue
                for i in indices:  # isolate the request that fails: score each one alone
                    try:
                        run([i])
                    except Exception as single:
                        results[i] = (500, f"reward '{self.reward_name}' raised {type(single).__name__}: {single}")
        if self.verbose:
            images = sum(item.images.shape[0] for item in items if item.error is None)
            sys.stderr.write(f"replica {self.index} (pid {self.pid}): {len(items)} request(s), {images} image(s) "
                             f"in {time.perf_counter() - start:.3f} s\n")
        info = {"replica": str(self.index), "replica_pid": str(self.pid), "batch_requests": str(len(items))}
        return [(items[i].request_id, *results[i], info) for i in range(len(items))]

    def unbatch(self, output):
        return list(output)

    def encode_response(self, output) -> Response:
        request_id, status, payload, info = output
        if request_id is not None:  # answered: the HTTP process no longer needs to watch this replica
            Path(self.state_dir, "claims", request_id).unlink(missing_ok=True)
        if status != 200:
            return Response(content=json.dumps({"error": payload}), status_code=status, media_type="application/json")
        return Response(content=encode_response(payload, request_id=request_id, info=info),
                        media_type="application/octet-stream")


class ReplicaWatch:
    """ASGI middleware: answer 503 for a request whose replica died while scoring it."""

    def __init__(self, app, state_dir: str, poll: float = 0.2):
        self.app, self.claims, self.poll = app, Path(state_dir, "claims"), poll
        if os.environ.get("FLOWRL_FLEET_MAIN_PID") != str(os.getpid()):
            die_with_parent()  # built in the HTTP process LitServe forks

    async def __call__(self, scope, receive, send):
        import asyncio

        if scope["type"] != "http" or scope.get("method") != "POST" or scope["path"].rstrip("/") != "/score":
            return await self.app(scope, receive, send)
        wanted = REQUEST_ID_HEADER.lower().encode()
        request_id = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == wanted), None)
        if not valid_request_id(request_id):
            return await self.app(scope, receive, send)
        claim = self.claims / request_id
        claim.unlink(missing_ok=True)  # a retry: forget the replica that took the earlier attempt
        state = {"started": False, "abandoned": False}

        async def guarded_send(message):
            if state["abandoned"]:
                return
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        task = asyncio.ensure_future(self.app(scope, receive, guarded_send))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.poll)
                if done:
                    return task.result()
                if state["started"]:
                    continue
                try:
                    pid = int(claim.read_text())
                except (OSError, ValueError):
                    continue  # not taken by a replica yet (or the claim is being written)
                if not pid_alive(pid):
                    state["abandoned"] = True
                    task.cancel()
                    body = json.dumps({"error": f"the replica (pid {pid}) scoring request {request_id} died; retry it",
                                       "protocol": PROTOCOL}).encode()
                    await send({"type": "http.response.start", "status": 503,
                                "headers": [(b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode())]})
                    await send({"type": "http.response.body", "body": body})
                    return
        finally:
            claim.unlink(missing_ok=True)
