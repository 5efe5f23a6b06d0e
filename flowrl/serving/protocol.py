"""The reward-server wire format (protocol 1): safetensors both ways, never pickle.

Shared by the ``http`` reward (the client, ``flowrl_plugins.rewards.http``) and the two servers
behind ``flowrl reward serve`` (:mod:`flowrl.serving.simple`, :mod:`flowrl.serving.fleet`).

- ``GET /health`` -> JSON ``{"status": "ok", "reward": NAME, "protocol": 1, ...}``.
- ``POST /score`` with a safetensors body: tensor ``images`` ``[B, 3, H, W]`` as uint8
  (0-255) or float16/float32 (0-1); header metadata ``prompts`` (a JSON list of B strings),
  optionally ``metadata`` (a JSON object) and ``request_id`` (see below).
- Reply 200: safetensors with ``scores`` float32 ``[B]`` and one ``extra/NAME`` float32 ``[B]``
  per extra. Any failure is a 4xx (bad request) or 5xx (the reward raised) status with a JSON
  body ``{"error": message}``.

Request ids (optional, backward compatible): a client may put ``request_id`` (1-64 letters,
digits, ``-`` or ``_``) in the request's header metadata and the same value in the HTTP header
``X-Flowrl-Request-Id``; a server that knows them echoes it in the reply's header metadata, and
the client then checks that the reply answers its own request. Servers ignore unknown keys and
clients accept replies without an id, so old clients and servers keep working.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from flowrl.errors import FlowrlError
from flowrl.interfaces import RewardOutput

PROTOCOL = 1
#: Statuses that mean "try again": the proxy or server is overloaded or restarting.
RETRY_STATUSES = {502, 503, 504}
#: The HTTP header that carries the request id (the same value as the body's ``request_id``).
REQUEST_ID_HEADER = "X-Flowrl-Request-Id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


class RewardServerError(FlowrlError):
    """A remote reward could not be computed (unreachable, timed out, bad reply)."""


def valid_request_id(value: object) -> bool:
    return isinstance(value, str) and _REQUEST_ID.fullmatch(value) is not None


def encode_request(images: torch.Tensor, prompts: Sequence[str], metadata: Mapping[str, Any] | None, image_dtype: str,
                   request_id: str | None = None) -> bytes:
    from safetensors.torch import save

    images = images.detach().float().clamp(0, 1).cpu()
    if image_dtype == "uint8":
        wire = (images * 255).round().to(torch.uint8)
    elif image_dtype == "float16":
        wire = images.to(torch.float16)
    else:
        wire = images
    header = {"protocol": str(PROTOCOL), "prompts": json.dumps(list(prompts))}
    if request_id is not None:
        if not valid_request_id(request_id):
            raise ValueError(f"request id {request_id!r} must be 1-64 letters, digits, '-' or '_'")
        header["request_id"] = request_id
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
    if "request_id" in header and not valid_request_id(header["request_id"]):
        raise ValueError("metadata 'request_id' must be 1-64 letters, digits, '-' or '_'")
    meta = json.loads(header["metadata"]) if "metadata" in header else None
    return images, prompts, meta


def request_id_of(body: bytes) -> str | None:
    """The ``request_id`` of a request or reply body (``None`` if absent or unreadable)."""
    try:
        value = safetensors_metadata(body).get("request_id")
    except Exception:  # a malformed body has no id; decode_request reports what is wrong
        return None
    return value if valid_request_id(value) else None


def safetensors_metadata(body: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors body, read from its header alone."""
    (n,) = struct.unpack("<Q", body[:8])
    header = json.loads(body[8 : 8 + n])
    return dict(header.get("__metadata__") or {})


def encode_response(out: RewardOutput, request_id: str | None = None, info: Mapping[str, str] | None = None) -> bytes:
    """The reply body; ``request_id`` echoes the request's, ``info`` adds string metadata."""
    from safetensors.torch import save

    tensors = {"scores": out.scores.float().contiguous()}
    for key, value in out.extras.items():
        tensors[f"extra/{key}"] = value.float().reshape(-1).contiguous()
    header = {"protocol": str(PROTOCOL), **dict(info or {})}
    if request_id is not None:
        header["request_id"] = request_id
    return save(tensors, metadata=header)


def decode_response(body: bytes, expected: int, url: str, request_id: str | None = None) -> RewardOutput:
    """Check and decode a reply; with ``request_id``, a reply that names another id is refused."""
    from safetensors.torch import load

    try:
        tensors = load(body)
    except Exception as exc:
        preview = body[:120].decode("utf-8", "replace")
        raise RewardServerError(
            f"malformed response from reward server {url}: not a safetensors body ({exc}); starts with {preview!r}",
            hint="is the URL a flowrl reward server (`flowrl reward serve`)? check its log",
        ) from exc
    if request_id is not None:
        echoed = safetensors_metadata(body).get("request_id")
        if echoed is not None and echoed != request_id:
            raise RewardServerError(
                f"reward server {url} answered request '{echoed}' to request '{request_id}'",
                hint="a proxy or server mixed up replies; the scores were not used",
            )
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
