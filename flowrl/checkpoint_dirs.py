"""Which checkpoints a run directory holds, read without torch: the names of the layout
:mod:`flowrl.train.checkpoint` writes (``RUN_DIR/checkpoints/iter_NNNNNN/``, ``state.json``
written last as the completion marker, ``latest.json`` naming the newest complete one).

Kept apart from the writer so that processes that only look at runs (``flowrl sweep`` watching
its runs, ``flowrl compare``) need not import torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import FlowrlError

LATEST = "latest.json"
#: Written last into a checkpoint directory: its presence means the directory is complete.
MARKER = "state.json"


def complete_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete checkpoint directories (with ``state.json``), oldest iteration first."""
    found = []
    for p in ckpt_root.iterdir() if ckpt_root.is_dir() else []:
        if p.is_dir() and (p / MARKER).is_file():
            try:
                iteration = int(json.loads((p / MARKER).read_text())["iteration"])
            except (ValueError, KeyError, TypeError):
                continue
            found.append((iteration, not p.name.startswith("."), p.name, p))
    return [p for *_, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint ``latest.json`` names, or None when the run has none yet.

    Falls back to the newest complete checkpoint directory when the pointer is unreadable or
    names a directory that is not complete (:mod:`flowrl.train.checkpoint` says why that can happen).
    """
    root = Path(run_dir) / "checkpoints"
    pointer = root / LATEST
    if not pointer.is_file():
        # killed between renaming the first checkpoint into place and writing the pointer
        complete = complete_checkpoints(root)
        return complete[-1] if complete else None
    try:
        path = root / json.loads(pointer.read_text())["name"]
    except (ValueError, KeyError, TypeError):
        path = None
    if path is not None and (path / MARKER).is_file():
        return path
    complete = complete_checkpoints(root)
    if not complete:
        raise FlowrlError(
            f"{pointer} names no complete checkpoint and none is left in {root}",
            hint="start a new run (another --output-dir)",
        )
    return complete[-1]


def checkpoint_iteration(path: Path | None) -> int | None:
    """The number of completed iterations a checkpoint directory holds (None for no checkpoint)."""
    if path is None:
        return None
    return int(json.loads((Path(path) / MARKER).read_text())["iteration"])
