"""Loading diffusers pipelines from a hub id or a local directory, with errors a user can act on.

Every way ``from_pretrained`` can fail for lack of weights (a local path that does not exist, a
gated repository whose licence was not accepted, no token, no network and nothing cached) ends
as one :class:`~flowrl.errors.FlowrlError` that says what is missing and how to fix it, instead of
a multi-page traceback from huggingface_hub.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from flowrl.compat import quiet_library_messages
from flowrl.errors import FlowrlError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

_ACCESS_HINT = (
    "log in with `huggingface-cli login` (or set HF_TOKEN), accept the licence on "
    "https://huggingface.co/{repo}, or set [model].path to a local directory written by "
    "`save_pretrained` (one with model_index.json)"
)


def resolve_dtype(name: str, where: str) -> torch.dtype:
    if name not in DTYPES:
        raise FlowrlError(f"unknown dtype '{name}'", where=where, hint=f"one of {', '.join(DTYPES)}")
    return DTYPES[name]


def looks_like_local_path(path: str) -> bool:
    """A hub id is ``owner/name``; anything else (absolute, relative, ~, more slashes) is a path."""
    if path.startswith(("/", "./", "../", "~", ".\\")) or os.path.exists(os.path.expanduser(path)):
        return True
    return path.count("/") != 1 or "\\" in path


def check_local_pipeline(path: str, where: str) -> Path:
    local = Path(path).expanduser()
    if not local.exists():
        raise FlowrlError(
            f"model path not found: {local}",
            where=where,
            hint="give a directory written by `save_pretrained` (with model_index.json), or a hub id "
            "such as black-forest-labs/FLUX.1-dev",
        )
    if not (local / "model_index.json").is_file():
        raise FlowrlError(
            f"{local} is not a diffusers pipeline directory (no model_index.json)",
            where=where,
            hint="point [model].path at the directory `pipe.save_pretrained(...)` wrote, or at a hub id",
        )
    return local


def dtype_kwarg(dtype: torch.dtype) -> dict:
    """diffusers renamed ``torch_dtype`` to ``dtype`` (the old name now warns); detect which."""
    from diffusers.utils import deprecation_utils

    new = hasattr(deprecation_utils, "_resolve_dtype")
    return {"dtype" if new else "torch_dtype": dtype}


def load_pipeline(pipeline_cls, path: str, *, where: str, revision: str = "", empty: str | tuple[str, ...] = (),
                  **kwargs):
    """``pipeline_cls.from_pretrained(path, **kwargs)``, translating missing-weights errors.

    ``empty``: the names of components (``("transformer",)``; one name alone is accepted) to build
    from their configurations on the ``meta`` device instead of loading them: no weights are read
    or held, every other component loads as usual (a process that receives the denoiser's weights
    from rank 0, :func:`flowrl.distributed.receives_weights`)."""
    if looks_like_local_path(path):
        check_local_pipeline(path, where)
        path = str(Path(path).expanduser())
        revision = ""
    if revision:
        kwargs["revision"] = revision
    quiet_library_messages()  # diffusers is imported by now: filter its handlers (flowrl.compat)
    try:
        for name in (empty,) if isinstance(empty, str) else empty:
            dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
            kwargs[name] = empty_component(pipeline_cls, path, name, dtype, revision=kwargs.get("revision"))
        return pipeline_cls.from_pretrained(path, **kwargs)
    except Exception as exc:  # translate the hub's many exception types below
        translated = _access_error(exc, path, where)
        if translated is exc:
            raise
        raise translated from exc


def empty_component(pipeline_cls, path: str, name: str, dtype: torch.dtype | None, revision: str | None = None):
    """The pipeline's component ``name`` (its class from ``model_index.json``) built from its own
    configuration on the ``meta`` device, in ``dtype``: parameters and buffers with shapes and no
    storage. Reads two small JSON files, no weights."""
    import importlib

    library, class_name = pipeline_cls.load_config(path, revision=revision)[name]
    cls = getattr(importlib.import_module(library), class_name)
    config = cls.load_config(path, subfolder=name, revision=revision)
    with torch.device("meta"):
        module = cls.from_config(config)
    return module.to(dtype) if dtype is not None else module


def _access_error(exc: Exception, repo: str, where: str) -> Exception:
    """Map a from_pretrained failure to a FlowrlError; unknown failures pass through unchanged."""
    from huggingface_hub import errors as hub_errors

    name = type(exc).__name__
    text = str(exc)
    first = text.strip().splitlines()[0] if text.strip() else name
    hint = _ACCESS_HINT.format(repo=repo)
    gated = isinstance(exc, getattr(hub_errors, "GatedRepoError", ())) or "gated" in text.lower()
    if gated:
        return FlowrlError(
            f"'{repo}' is a gated repository and this account has no access to it",
            where=where,
            hint="accept the licence on https://huggingface.co/" + repo + ", then log in with "
            "`huggingface-cli login` (or set HF_TOKEN); or set [model].path to a local copy",
        )
    if isinstance(exc, getattr(hub_errors, "RepositoryNotFoundError", ())) or "401" in text or "403" in text:
        return FlowrlError(
            f"cannot access '{repo}' on the Hugging Face hub (not found, private, or not logged in): {first}",
            where=where,
            hint=hint,
        )
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    hub_types = tuple(
        getattr(hub_errors, n) for n in ("LocalEntryNotFoundError", "OfflineModeIsEnabled", "HfHubHTTPError")
        if hasattr(hub_errors, n)
    )
    not_cached = any(
        s in text for s in ("offline", "Cannot find", "cannot find", "Connection", "connect", "not found in cache")
    )
    if isinstance(exc, (OSError, ConnectionError) + hub_types) or not_cached:
        why = "HF_HUB_OFFLINE is set and " if offline else ""
        return FlowrlError(
            f"the weights of '{repo}' are not available: {why}they are not in the local Hugging Face "
            f"cache and could not be downloaded ({name}: {first})",
            where=where,
            hint="download them where the hub is reachable (`huggingface-cli download " + repo + "`, after "
            "`huggingface-cli login` and accepting the licence on the model page), or set [model].path "
            "to a local directory with model_index.json",
        )
    return exc
