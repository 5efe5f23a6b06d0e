"""Prompt embeddings computed once and kept on disk (``flowrl embed``, ``[prompts] embeddings``).

A run encodes every distinct prompt once (:class:`flowrl.train.session.PromptCache`), but it
still loads the text encoders to do so: FLUX.1's T5-XXL alone is 4.7 B parameters (9.5 GB in
bf16), held for the whole run and visiting the GPU whenever a prompt is new. ``flowrl embed
RECIPE -o DIR`` encodes the recipe's training and evaluation prompts (and any others given)
exactly as training would, one prompt at a time, and writes them here; a recipe with ``[prompts]
embeddings = "DIR"`` then reads them back and the diffusers adapters load no text encoder or
tokenizer at all. The embeddings are the ones training computes, bit for bit, so a run with the
store equals a run without it.

The store is a directory: ``index.json`` (format, the fingerprint below, every prompt with its
shard and row) and ``shard-NNNNN.safetensors`` files of at most ``SHARD_BYTES`` each, tensors
named ``"<row>/<key>"`` (each ``[1, ...]``, as the cache keeps them). It is written into a
temporary directory beside its place and renamed into it, so a reader never sees half of one.

The fingerprint is the model component and every ``[model]`` setting except those known not to
change what ``encode_prompts`` returns (``NOT_ENCODING``: image size, memory and LoRA settings).
A setting not on that list counts, so a new one errs towards refusing a store, never towards
using embeddings of another encoder configuration.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from .errors import FlowrlError
from .files import fsync_dir, give_ordinary_mode, process_umask

__all__ = ["FORMAT", "NOT_ENCODING", "SHARD_BYTES", "EmbeddingStore", "encoder_fingerprint", "recipe_fingerprint",
           "open_store", "write_store", "without_text_encoders", "loading_text_encoders"]

FORMAT = 1
#: A shard is closed once it holds this many bytes (safetensors files are read by memory-mapping).
SHARD_BYTES = 1 << 30
#: [model] settings that do not change a prompt's embeddings: the image or clip's size, memory and
#: LoRA settings, and what only the denoiser, the sampler's schedule or the VAE reads (FLUX's
#: embedded guidance, Wan's flow shift and VAE dtype, Z-Image's CFG normalisation and truncation,
#: Qwen-Image's padding trim, LTX-Video's decode timestep). ``cfg_scale``
#: counts: whether CFG is on decides whether the negative prompt is encoded.
NOT_ENCODING = frozenset({
    "height", "width", "num_frames", "frame_rate", "gradient_checkpointing", "offload_encoders", "lora_preset",
    "vae_batch_size", "quantize", "denoiser_dtype", "attention", "condition_height", "condition_width",
    "train_experts", "timestep_conditioning", "guidance", "flow_shift", "vae_dtype", "cfg_normalization",
    "cfg_truncation", "trim_text_padding", "decode_timestep",
})
INDEX = "index.json"


def encoder_fingerprint(model: str, settings: dict[str, Any]) -> dict[str, Any]:
    """What a prompt's embeddings depend on: the model component and its settings that count."""
    return {"model": model, "settings": {k: settings[k] for k in sorted(settings) if k not in NOT_ENCODING}}


def recipe_fingerprint(recipe) -> dict[str, Any]:
    """:func:`encoder_fingerprint` of a recipe's ``[model]``."""
    choice = recipe.components["model"]
    params = choice.params
    settings = dataclasses.asdict(params) if dataclasses.is_dataclass(params) else dict(params or {})
    return encoder_fingerprint(choice.use, json.loads(json.dumps(settings, default=str)))


def open_store(recipe) -> EmbeddingStore | None:
    """The store a recipe names in ``[prompts] embeddings`` (None when it names none)."""
    directory = recipe.prompts.embeddings
    if not directory:
        return None
    return EmbeddingStore(Path(directory), recipe_fingerprint(recipe), where=f"{recipe.source}: [prompts].embeddings")


def write_store(directory: Path, rows: Iterable[tuple[str, dict[str, torch.Tensor]]], fingerprint: dict[str, Any],
                *, shard_bytes: int = SHARD_BYTES) -> int:
    """Write the prompts' embeddings (``(prompt, {key: [1, ...] tensor})`` pairs, each prompt once)
    as a store at ``directory``, which must not exist yet; returns the number of prompts."""
    from safetensors.torch import save_file

    directory = Path(directory)
    if directory.exists():
        raise FlowrlError(f"{directory} exists", hint="choose a new directory for the embeddings (a store is written whole)")
    directory.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        prompts: dict[str, list[int]] = {}
        keys: list[str] | None = None
        shard: dict[str, torch.Tensor] = {}
        size, shards = 0, 0

        def flush() -> None:
            nonlocal shard, size, shards
            if shard:
                path = work / f"shard-{shards:05d}.safetensors"
                save_file(shard, str(path), metadata={"format": str(FORMAT)})
                give_ordinary_mode(path)
                shard, size, shards = {}, 0, shards + 1

        for row, (prompt, embeddings) in enumerate(rows):
            if prompt in prompts:
                raise ValueError(f"prompt given twice: {prompt!r}")
            if keys is None:
                keys = sorted(embeddings)
            elif sorted(embeddings) != keys:
                raise ValueError(f"prompt {prompt!r} has embeddings {sorted(embeddings)}, the first had {keys}")
            for key, value in embeddings.items():
                shard[f"{row}/{key}"] = value.detach().cpu().contiguous()
                size += value.numel() * value.element_size()
            prompts[prompt] = [shards, row]
            if size >= shard_bytes:
                flush()
        flush()
        index = {"format": FORMAT, "fingerprint": fingerprint, "keys": keys or [], "shards": shards, "prompts": prompts}
        (work / INDEX).write_text(json.dumps(index, ensure_ascii=False) + "\n", encoding="utf-8")
        give_ordinary_mode(work / INDEX)
        os.chmod(work, 0o777 & ~process_umask())  # mkdtemp makes it 0700
        os.replace(work, directory)
        fsync_dir(directory.parent)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return len(prompts)


class EmbeddingStore:
    """A store written by :func:`write_store`, opened for a model configuration (its
    ``fingerprint``): a different one, a damaged index or another format is one error naming
    the store and what differs."""

    def __init__(self, directory: Path, fingerprint: dict[str, Any], *, where: str | None = None):
        self.directory = Path(directory)
        where = where or str(self.directory)
        try:
            index = json.loads((self.directory / INDEX).read_text(encoding="utf-8"))
            prompts, shards, keys = index["prompts"], int(index["shards"]), list(index["keys"])
        except FileNotFoundError:
            raise FlowrlError(f"{self.directory} holds no prompt embeddings ({INDEX} missing)", where=where,
                              hint="write them with `flowrl embed RECIPE -o DIR`") from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise FlowrlError(f"{self.directory / INDEX} is not a readable index of prompt embeddings ({exc})",
                              where=where, hint="write the store again with `flowrl embed RECIPE -o DIR`") from None
        if index.get("format") != FORMAT:
            raise FlowrlError(f"{self.directory} is a store of format {index.get('format')!r}; this flowrl reads {FORMAT}",
                              where=where, hint="write the store again with `flowrl embed RECIPE -o DIR`")
        theirs = index.get("fingerprint", {})
        if theirs != fingerprint:
            raise FlowrlError(f"the prompt embeddings in {self.directory} were computed for another model configuration: "
                              f"{_differences(theirs, fingerprint)}", where=where,
                              hint="write them for this recipe with `flowrl embed RECIPE -o NEW_DIR`, or set the "
                                   "[model] settings back")
        self.prompts: dict[str, tuple[int, int]] = {p: (int(s), int(r)) for p, (s, r) in prompts.items()}
        self.shards, self.keys = shards, keys
        self._open: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.prompts)

    def __contains__(self, prompt: str) -> bool:
        return prompt in self.prompts

    def missing(self, prompts: Iterable[str]) -> list[str]:
        """The distinct prompts (in order) the store does not hold."""
        return [p for p in dict.fromkeys(prompts) if p not in self.prompts]

    def get(self, prompt: str) -> dict[str, torch.Tensor]:
        """The prompt's embeddings, ``{key: [1, ...]}`` on the CPU, as training's cache keeps them."""
        if prompt not in self.prompts:
            raise FlowrlError(f"prompt {prompt!r} is not in the prompt embeddings of {self.directory}",
                              hint="add it: `flowrl embed RECIPE --prompts FILE -o NEW_DIR` with the prompts the run "
                                   "uses, or remove [prompts] embeddings to encode prompts as they come")
        shard, row = self.prompts[prompt]
        handle = self._shard(shard)
        return {key: handle.get_tensor(f"{row}/{key}") for key in self.keys}

    def _shard(self, number: int):
        if number not in self._open:
            from safetensors import SafetensorError, safe_open

            path = self.directory / f"shard-{number:05d}.safetensors"
            try:
                self._open[number] = safe_open(str(path), framework="pt")
            except (OSError, SafetensorError) as exc:  # missing or damaged
                raise FlowrlError(f"cannot read {path}: {exc}",
                                  hint="write the store again with `flowrl embed RECIPE -o DIR`") from None
        return self._open[number]


def _differences(theirs: dict[str, Any], ours: dict[str, Any]) -> str:
    """``model 'flux' here, 'sd3' in the store; max_sequence_length 512 here, 256 in the store``."""
    if theirs.get("model") != ours.get("model"):
        return f"model {ours.get('model')!r} here, {theirs.get('model')!r} in the store"
    a, b = theirs.get("settings", {}), ours.get("settings", {})
    keys = sorted(set(a) | set(b), key=str)
    return "; ".join(f"[model].{k} = {b.get(k, '(unset)')!r} here, {a.get(k, '(unset)')!r} in the store"
                     for k in keys if a.get(k) != b.get(k))


# ---- loading a model without its text encoders ---------------------------------------------------

_SKIP_TEXT_ENCODERS: contextvars.ContextVar[bool] = contextvars.ContextVar("skip_text_encoders", default=False)


@contextlib.contextmanager
def without_text_encoders(skip: bool = True) -> Iterator[None]:
    """Within it, model adapters that can (the diffusers ones; an adapter says so with a class
    attribute ``loads_without_text_encoders = True``, which ``flowrl plan`` reads) load no text
    encoder or tokenizer: the run's prompt embeddings come from a store. The engine builds the
    model inside it."""
    token = _SKIP_TEXT_ENCODERS.set(skip)
    try:
        yield
    finally:
        _SKIP_TEXT_ENCODERS.reset(token)


def loading_text_encoders() -> bool:
    """Whether a model built now should load its text encoders (see :func:`without_text_encoders`)."""
    return not _SKIP_TEXT_ENCODERS.get()
