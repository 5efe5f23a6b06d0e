"""Atomic, pickle-free checkpoints: safetensors for tensors, JSON for everything else.

Layout of ``RUN_DIR/checkpoints/``::

    iter_000010/            one complete checkpoint
        model.safetensors   trainable weights (all of them, or only the LoRA)
        optimizer.safetensors, optimizer.json
          or, for a sharded checkpoint (an fsdp2 run, flowrl.train.parallel), instead of those three:
        sharded/            model and AdamW state, torch.distributed.checkpoint format
        rng.safetensors     torch RNG states
        ema.safetensors     the EMA of the trainable weights (only with [ema] enabled)
        state.json          iteration, counters, LR schedule
        recipe.toml         the resolved recipe
    latest.json             {"name": "iter_000010"}: the newest COMPLETE checkpoint

A checkpoint is written into a temporary directory, flushed to disk, and renamed into place;
only then is ``latest.json`` replaced (write-to-temp, fsync, os.replace). A process killed at
any moment leaves ``latest.json`` pointing at a complete checkpoint.

Invariant that makes this hold: ``state.json`` is written (and fsynced) last, and removed
first, so a directory holding ``state.json`` is complete. A complete directory is never deleted
in place under its final name: it is renamed aside first. Should ``latest.json`` ever name a
directory that is gone (a kill in the rename window of a re-written checkpoint), the newest
complete directory is used instead.

:func:`write_checkpoint` and :func:`read_checkpoint` take either layout, as the strategy says
(:attr:`flowrl.train.parallel.Strategy.sharded`); the sharded one's I/O is
:func:`save_shards` / :func:`load_shards` (DCP over :meth:`~flowrl.train.parallel.Strategy.state_dict`).
What goes into ``state.json`` is composed in :mod:`flowrl.train.state`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..checkpoint_dirs import LATEST, MARKER, checkpoint_iteration, latest_checkpoint  # noqa: F401 (the writer's names too)
from ..checkpoint_dirs import complete_checkpoints as _complete_checkpoints
from ..distributed import DistContext, broadcast_object
from ..errors import FlowrlError, counted
from ..files import fsync_dir, give_ordinary_mode, write_text_atomic
from .finetune import load_trainable_state_dict, trainable_state_dict
from .parallel import SHARDED_MODEL_KEY, Strategy, unwrap_module

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

#: Sub-directory of a sharded checkpoint: model and optimizer in torch.distributed.checkpoint's
#: format (one file per process and ``.metadata``), written by every process together.
SHARDED = "sharded"
#: The name an objective's tensors are saved under (``objective.safetensors``; a sharded
#: checkpoint's DCP key), beside its JSON state in ``state.json`` (CheckpointsState)
OBJECTIVE = "objective"


def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write tensors to a safetensors file, with the run's other files' permissions (safetensors
    itself leaves 0600, :mod:`flowrl.files`), and flush it to disk."""
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))
    give_ordinary_mode(path)
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def optimizer_to_files(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split ``optimizer.state_dict()`` into tensors and JSON (no pickle). A per-parameter entry
    may nest dicts of tensors (bitsandbytes' 8-bit state does)."""
    tensors: dict[str, torch.Tensor] = {}
    shared: dict[tuple, str] = {}  # one copy of a tensor several entries hold (8-bit AdamW's quantisation maps)

    def encode(prefix: str, value: Any) -> Any:
        if torch.is_tensor(value):
            same = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), value.dtype)
            if value.numel() and same in shared:
                return {"tensor": shared[same]}
            shared[same] = prefix
            tensors[prefix] = value
            return {"tensor": prefix}
        if isinstance(value, dict):
            return {"nested": {k: encode(f"{prefix}.{k}", v) for k, v in value.items()}}
        return value

    meta: dict[str, Any] = {"param_groups": state["param_groups"], "state": {}}
    for idx, entry in state["state"].items():
        meta["state"][str(idx)] = {key: encode(f"{idx}.{key}", value) for key, value in entry.items()}
    return tensors, meta


def optimizer_from_files(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    def decode(value: Any) -> Any:
        if isinstance(value, dict) and "tensor" in value:
            return tensors[value["tensor"]]
        if isinstance(value, dict) and "nested" in value:
            return {k: decode(v) for k, v in value["nested"].items()}
        return value

    state = {int(idx): {k: decode(v) for k, v in entry.items()} for idx, entry in meta["state"].items()}
    groups = meta["param_groups"]
    for g in groups:
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
    return {"state": state, "param_groups": groups}


def rng_state() -> dict[str, torch.Tensor]:
    """The CPU generator's state, and each GPU's once this process has started CUDA: a process
    that never did (a CPU run on a GPU machine) has drawn nothing there, and asking would start a
    CUDA context on every visible GPU (memory held, and no fork afterwards)."""
    out = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"torch_cuda_{i}"] = s
    return out


def set_rng_state(tensors: dict[str, torch.Tensor]) -> None:
    """Restore :func:`rng_state`'s states: the GPUs' in index order (``torch_cuda_10`` after
    ``torch_cuda_9``), as many as both the checkpoint and this machine have."""
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = sorted((int(k.removeprefix("torch_cuda_")), v) for k, v in tensors.items() if k.startswith("torch_cuda_"))
    if cuda and torch.cuda.is_available():
        for index, state in cuda[: torch.cuda.device_count()]:
            torch.cuda.set_rng_state(state, index)


def save_checkpoint(
    ckpt_root: Path,
    name: str,
    *,
    model: dict[str, torch.Tensor],
    optimizer: dict[str, Any],
    state: dict[str, Any],
    recipe_toml: str,
    keep_last: int = 2,
    extra: dict[str, dict[str, torch.Tensor]] | None = None,
) -> Path:
    """Write one checkpoint atomically and point ``latest.json`` at it; ``extra`` maps a name
    to tensors written as ``NAME.safetensors`` (e.g. ``ema``)."""
    tmp = new_checkpoint_dir(ckpt_root, name, os.getpid())
    opt_tensors, opt_meta = optimizer_to_files(optimizer)
    save_tensors(model, tmp / "model.safetensors")
    save_tensors(opt_tensors, tmp / "optimizer.safetensors")
    write_text_atomic(tmp / "optimizer.json", json.dumps(opt_meta))
    return commit_checkpoint(ckpt_root, tmp, name, state=state, recipe_toml=recipe_toml, keep_last=keep_last,
                             extra=extra)


def new_checkpoint_dir(ckpt_root: Path, name: str, tag: int) -> Path:
    """An empty temporary directory ``.tmp-NAME-TAG`` for a checkpoint being written (a stale one
    of the same name is removed first)."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_root / f".tmp-{name}-{tag}"
    if tmp.exists():
        _remove_checkpoint_dir(tmp)
    tmp.mkdir()
    return tmp


def commit_checkpoint(ckpt_root: Path, tmp: Path, name: str, *, state: dict[str, Any], recipe_toml: str,
                      keep_last: int = 2, extra: dict[str, dict[str, torch.Tensor]] | None = None) -> Path:
    """Complete the checkpoint written into ``tmp`` (RNG states, ``extra`` tensors, the recipe,
    then ``state.json`` last), rename it into place as ``name`` and point ``latest.json`` at it."""
    save_tensors(rng_state(), tmp / "rng.safetensors")
    for extra_name, tensors in (extra or {}).items():
        save_tensors(tensors, tmp / f"{extra_name}.safetensors")
    write_text_atomic(tmp / "recipe.toml", recipe_toml)
    write_text_atomic(tmp / MARKER, json.dumps(state, indent=1))  # last: marks the directory complete
    fsync_dir(tmp)
    final = ckpt_root / name
    aside = None
    if final.exists():  # re-written: move the old one aside (atomic) rather than delete it in place
        aside = ckpt_root / f".old-{name}-{os.getpid()}"
        if aside.exists():
            _remove_checkpoint_dir(aside)
        os.replace(final, aside)
    os.replace(tmp, final)
    fsync_dir(ckpt_root)
    write_text_atomic(ckpt_root / LATEST, json.dumps({"name": name}))
    if aside is not None:
        _remove_checkpoint_dir(aside)
    _prune(ckpt_root, keep_last, keep=name)
    return final


def _remove_checkpoint_dir(path: Path) -> None:
    """Delete a checkpoint directory so that it is never seen half-deleted as complete."""
    marker = path / MARKER
    if marker.exists():
        marker.unlink()
        fsync_dir(path)
    shutil.rmtree(path, ignore_errors=True)


def _prune(ckpt_root: Path, keep_last: int, keep: str) -> None:
    done = sorted(p for p in ckpt_root.iterdir() if p.is_dir() and not p.name.startswith("."))
    for old in done[:-keep_last]:
        if old.name != keep:
            _remove_checkpoint_dir(old)
    for tmp in list(ckpt_root.glob(".tmp-*")) + list(ckpt_root.glob(".old-*")):
        _remove_checkpoint_dir(tmp)


# ----------------------------------------------------------------------------- damage


def checkpoint_damage(path: Path) -> tuple[Path, str] | None:
    """The first file of a complete checkpoint directory that cannot be read whole, and what is
    wrong with it; None when every file reads. A partial copy or an interrupted transfer leaves
    such a file (``state.json`` is there, so the directory counts as complete). Cheap: it reads
    headers and file sizes, not the tensors: a safetensors file must be exactly as long as its
    header says, a sharded checkpoint's files as long as its ``.metadata`` says; the JSON and
    TOML files must parse."""
    path = Path(path)
    for file in sorted(path.iterdir()) if path.is_dir() else []:
        if not file.is_file():
            continue
        try:
            if file.suffix == ".safetensors":
                why = _safetensors_damage(file)
            elif file.suffix == ".json":
                json.loads(file.read_text(encoding="utf-8"))
                why = None
            elif file.suffix == ".toml":
                tomllib.loads(file.read_text(encoding="utf-8"))
                why = None
            else:
                why = None
        except (ValueError, OSError) as exc:  # JSONDecodeError, TOMLDecodeError, UnicodeDecodeError
            why = f"does not parse ({type(exc).__name__}: {exc})"
        if why is not None:
            return file, why
    if (path / SHARDED).is_dir():
        return _shards_damage(path / SHARDED)
    return None


def _safetensors_damage(file: Path) -> str | None:
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"is truncated ({size} bytes: not even its header's length)"
        n = int.from_bytes(head, "little")
        if n > size - 8:
            return f"is truncated ({size} bytes; its header alone takes {n + 8})"
        header = json.loads(f.read(n).decode("utf-8"))
    end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    expected = 8 + n + end
    if size < expected:
        return f"is truncated ({size} of the {expected} bytes its header describes)"
    if size > expected:
        return f"is longer than its header describes ({size} bytes, {expected} expected)"
    return None


def _shards_damage(shards: Path) -> tuple[Path, str] | None:
    """A DCP directory's first file shorter than its ``.metadata`` says (or a missing one)."""
    import pickle

    import torch.distributed.checkpoint as dcp

    metadata = shards / ".metadata"
    try:
        storage = dcp.FileSystemReader(str(shards)).read_metadata().storage_data
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError) as exc:  # missing or cut short
        return metadata, f"cannot be read ({type(exc).__name__}: {exc})"
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, length in sorted(needed.items()):
        file = shards / name
        size = file.stat().st_size if file.is_file() else None
        if size is None:
            return file, "is missing"
        if size < length:
            return file, f"is truncated ({size} of the {length} bytes .metadata describes)"
    return None


def intact_checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints that read whole (:func:`checkpoint_damage`), newest first."""
    return [p for p in reversed(_complete_checkpoints(Path(run_dir) / "checkpoints")) if checkpoint_damage(p) is None]


def newest_intact_checkpoint(run_dir: Path, damaged: Path) -> tuple[Path | None, list[Path]]:
    """Where a run whose checkpoint ``damaged`` cannot be read can resume from: its newest other
    checkpoint that reads whole (None when it has none), and the checkpoints newer than that one
    (``damaged`` among them), which stand in its way: the run resumes from its latest checkpoint."""
    intact = [p for p in intact_checkpoints(run_dir) if p != Path(damaged)]
    since = checkpoint_iteration(intact[0]) if intact else -1
    newer = [p for p in _complete_checkpoints(Path(run_dir) / "checkpoints") if checkpoint_iteration(p) > since]
    return (intact[0] if intact else None), newer + ([Path(damaged)] if Path(damaged) not in newer else [])


def damaged_file_error(file: Path, why: str) -> FlowrlError:
    """The one message for a checkpoint file that cannot be read: which file, what is wrong, and
    the run's newest intact checkpoint, if it has one."""
    ckpt = file.parent.parent if file.parent.name == SHARDED else file.parent
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None
    intact = [p for p in intact_checkpoints(run_dir) if p != ckpt] if run_dir is not None else []
    if intact:
        hint = (f"the run's newest intact checkpoint is {intact[0]} "
                f"({counted(checkpoint_iteration(intact[0]), 'iteration')}); `flowrl sample`, `eval` and `export` "
                f"read it with --checkpoint {intact[0]}")
    elif run_dir is not None:
        hint = f"the run has no other intact checkpoint; copy {ckpt.name} again from where it came"
    else:
        hint = f"copy {ckpt} again from where it came"
    return FlowrlError(f"checkpoint file {file} {why}: the checkpoint is damaged (a partial copy or an interrupted "
                       "transfer leaves this)", hint=hint)


def read_tensors(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint's safetensors file; a damaged file is one message
    (:func:`damaged_file_error`), not safetensors' error."""
    if not Path(file).is_file():
        raise damaged_file_error(Path(file), "is missing")
    try:
        return load_file(str(file))
    except SafetensorError as exc:
        raise damaged_file_error(Path(file), _safetensors_damage_or(file, exc)) from exc


def _safetensors_damage_or(file: Path, exc: Exception) -> str:
    try:
        return _safetensors_damage(Path(file)) or f"cannot be read ({exc})"
    except (ValueError, OSError):
        return f"cannot be read ({exc})"


def read_model_weights(path: Path) -> dict[str, torch.Tensor]:
    """The trainable weights stored in a checkpoint directory (all weights, or only the LoRA), as
    full tensors on the CPU, whether the checkpoint is sharded (:data:`SHARDED`) or not."""
    if (Path(path) / SHARDED).is_dir():
        return read_sharded_model_weights(Path(path) / SHARDED)
    return read_tensors(Path(path) / "model.safetensors")


def read_sharded_model_weights(shards: Path, key: str = SHARDED_MODEL_KEY) -> dict[str, torch.Tensor]:
    """Full CPU tensors of the model part (or another ``key``: the EMA's) of a
    torch.distributed.checkpoint directory, read in this one process without a process group
    (DCP reassembles every tensor from its shards); ``{}`` when it holds nothing under ``key``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(shards))
    metadata = reader.read_metadata().state_dict_metadata
    prefix = f"{key}."
    out = {
        key[len(prefix):]: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.items() if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    if out:
        with _single_process_ok():  # "assuming the intent is to load in a single process": it is
            dcp.load({key: out}, storage_reader=reader, no_dist=True)
    return out


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read a checkpoint directory written by :func:`save_checkpoint`."""
    return {
        "model": read_model_weights(path),
        "optimizer": optimizer_from_files(
            read_tensors(path / "optimizer.safetensors"), json.loads((path / "optimizer.json").read_text())
        ),
        "rng": read_tensors(path / "rng.safetensors"),
        "ema": read_tensors(path / "ema.safetensors") if (path / "ema.safetensors").is_file() else None,
        "objective": read_tensors(path / f"{OBJECTIVE}.safetensors") if (path / f"{OBJECTIVE}.safetensors").is_file() else {},
        "state": json.loads((path / MARKER).read_text()),
        "recipe_toml": (path / "recipe.toml").read_text(),
    }


# ----------------------------------------------------------------------------- checkpoints


def is_sharded_checkpoint(path: Path) -> bool:
    """True for a checkpoint directory written by :func:`save_sharded_checkpoint`."""
    return (Path(path) / SHARDED).is_dir()


def save_sharded_checkpoint(ckpt_root: Path, name: str, strategy: Strategy, *, state: dict[str, Any],
                            recipe_toml: str, keep_last: int = 2,
                            extra: dict[str, dict[str, torch.Tensor]] | None = None) -> Path | None:
    """Write one checkpoint atomically, every process together: each writes its shards into a
    temporary directory (DCP), then the main process adds the RNG states, the recipe and
    ``state.json`` (last), renames the directory into place and points ``latest.json`` at it
    (:func:`commit_checkpoint`). Several nodes need a shared file
    system. Returns the checkpoint's path on the main process, None on the others."""
    ctx = DistContext(rank=strategy.topology.rank, world_size=strategy.topology.world_size)
    tag = broadcast_object(os.getpid(), ctx)
    tmp = Path(ckpt_root) / f".tmp-{name}-{tag}"
    if ctx.is_main:
        tmp = new_checkpoint_dir(Path(ckpt_root), name, tag)
    _barrier(ctx)
    save_shards(strategy, tmp / SHARDED, extra)
    _barrier(ctx)  # every shard and DCP's .metadata are on disk
    final = None
    if ctx.is_main:
        # state's world_size is the data-parallel ranks' (the grouping of samples a resume checks);
        # the shards were written by every process, context-parallel ones included
        state = dict(state, processes=ctx.world_size, strategy=strategy.kind, format="dcp")
        final = commit_checkpoint(Path(ckpt_root), tmp, name, state=state, recipe_toml=recipe_toml, keep_last=keep_last)
    _barrier(ctx)
    return final


def load_sharded_checkpoint(path: Path, strategy: Strategy,
                            extra: dict[str, dict[str, torch.Tensor]] | None = None) -> dict[str, Any]:
    """Load a checkpoint's model and optimizer into ``strategy``'s prepared module and optimizer,
    on every process; set the RNG; return ``state.json``. A sharded checkpoint of another
    process count or strategy loads (DCP reshards; the continuation then groups samples
    differently, see :mod:`flowrl.train.state`). An unsharded one (safetensors, written by one
    process) loads under ``none`` and ``ddp``."""
    path = Path(path)
    if not (path / MARKER).is_file():
        raise FlowrlError(f"{path} is not a complete checkpoint (no {MARKER})", where="--resume")
    if is_sharded_checkpoint(path):
        load_shards(strategy, path / SHARDED, extra)
    elif strategy.sharded:
        raise FlowrlError(f"{path} was written without sharding (model.safetensors); an fsdp2 run cannot load it",
                          where="--resume", hint="resume it with [distributed].strategy = 'ddp' or 'none'")
    else:
        saved = load_checkpoint(path)
        load_trainable_state_dict(unwrap_module(strategy.module), saved["model"])
        strategy.optimizer.load_state_dict(saved["optimizer"])
    set_rng_state(read_tensors(path / "rng.safetensors"))
    return json.loads((path / MARKER).read_text())


def write_checkpoint(ckpt_root: Path, name: str, strategy: Strategy, *, state: dict[str, Any], recipe_toml: str,
                     keep_last: int = 2, extra: dict[str, dict[str, torch.Tensor]] | None = None) -> Path | None:
    """Write the strategy's trainable weights and optimizer, ``extra``'s named tensors (the EMA's,
    an objective's), the RNG states, the recipe and ``state`` as one checkpoint, atomically: under
    FSDP2 every process writes its shards (:func:`save_sharded_checkpoint`; no process gathers
    the model), otherwise the main process writes the single-process files
    (:func:`save_checkpoint`). Returns its path on the main process, None on the others."""
    if strategy.sharded:
        return save_sharded_checkpoint(ckpt_root, name, strategy, state=state, recipe_toml=recipe_toml,
                                       keep_last=keep_last, extra=extra or None)
    path = None
    if strategy.topology.rank == 0:
        path = save_checkpoint(ckpt_root, name, model=trainable_state_dict(unwrap_module(strategy.module)),
                               optimizer=strategy.optimizer.state_dict(), state=state, recipe_toml=recipe_toml,
                               keep_last=keep_last, extra=extra or None)
    # The others wait for the write: a stopping worker that left first (status 130) would have
    # torchrun end the main process part-way through the stop's checkpoint.
    _barrier(DistContext(rank=strategy.topology.rank, world_size=strategy.topology.world_size))
    return path


def read_checkpoint(path: Path, strategy: Strategy, extra: dict[str, dict[str, torch.Tensor]]
                    ) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
    """Load a checkpoint's weights and optimizer into the strategy's module and optimizer and set
    the RNG, on every process (either layout, :func:`load_sharded_checkpoint`); return its
    ``state.json`` and the named tensors it holds of ``extra`` (``{name: tensors like the saved
    ones}``; a name is absent when the checkpoint has none). A sharded checkpoint's are read
    into ``extra``'s tensors in place (only those whose ``state.json`` entry of the same name
    says the run kept them); a single-process checkpoint's come from ``NAME.safetensors``."""
    path = Path(path)
    if strategy.sharded or is_sharded_checkpoint(path):
        marker = json.loads((path / MARKER).read_text()) if (path / MARKER).is_file() else {}
        kept = {k: v for k, v in extra.items() if k in marker and v}
        return load_sharded_checkpoint(path, strategy, kept or None), kept
    state = load_sharded_checkpoint(path, strategy)
    return state, {k: read_tensors(path / f"{k}.safetensors") for k in extra if (path / f"{k}.safetensors").is_file()}


def save_shards(strategy: Strategy, path: Path, extra: dict[str, dict[str, torch.Tensor]] | None = None) -> None:
    """Every process writes its part of the model and optimizer (:meth:`Strategy.state_dict`) into
    ``path`` (DCP), and of ``extra`` (``{key: {name: tensor}}``, tensors sharded like the weights:
    the EMA's)."""
    import torch.distributed.checkpoint as dcp

    with _single_process_ok():
        dcp.save({**strategy.state_dict(), **(extra or {})}, checkpoint_id=str(path), no_dist=not dist.is_initialized())


def load_shards(strategy: Strategy, path: Path, extra: dict[str, dict[str, torch.Tensor]] | None = None) -> None:
    """Every process reads its part from ``path`` into the strategy's module and optimizer (DCP
    reshards a checkpoint written by another number of processes or another strategy);
    ``extra``'s tensors are filled in place."""
    import torch.distributed.checkpoint as dcp

    state = {**strategy.state_dict(), **(extra or {})}
    with _single_process_ok():
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    strategy.load_state_dict(state)


@contextlib.contextmanager
def _single_process_ok() -> Iterator[None]:
    """DCP warns that it assumes one process when there is no process group: that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _barrier(ctx: DistContext) -> None:
    if ctx.process_count > 1:  # every process, context-parallel partners of one data rank included
        dist.barrier()
