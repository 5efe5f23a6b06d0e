"""Atomic file writes: a reader (or a process killed mid-write) never sees a half-written file.

Write to a temporary file beside the target, flush and fsync it, ``os.replace`` it into place,
then fsync the directory so the rename itself is durable.

And the permissions of files written by libraries that ignore the umask: safetensors (0.8 and
later) writes through a temporary file it creates with mode 0600 and renames into place, so
weights would be readable by their owner only while the rest of a run (metrics, recipe, state)
is readable by whoever the umask allows. :func:`give_ordinary_mode` gives them the mode any
``open()`` would have.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .errors import FlowrlError


def fsync_dir(path: Path) -> None:
    """fsync a directory (makes a rename in it durable); a no-op where that is not supported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def process_umask() -> int:
    """This process's umask: read from ``/proc`` (Linux) where it can be, since setting it to read
    it back (the portable way) briefly changes it for every thread of the process."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def give_ordinary_mode(*paths: Path) -> None:
    """Give each file the mode a new file from ``open()`` gets (``0o666`` less the umask)."""
    mode = 0o666 & ~process_umask()
    for path in paths:
        os.chmod(path, mode)


def file_identities(directory: Path, pattern: str = "*.safetensors") -> dict[Path, int]:
    """``{path: inode}`` of the files matching ``pattern`` under ``directory``."""
    return {p: p.stat().st_ino for p in Path(directory).rglob(pattern) if p.is_file()}


def give_ordinary_mode_since(directory: Path, before: dict[Path, int], pattern: str = "*.safetensors") -> None:
    """:func:`give_ordinary_mode` for the files matching ``pattern`` under ``directory`` that were
    written since ``before`` (:func:`file_identities`): new ones, and ones replaced by a rename.
    What a library's ``save_pretrained`` wrote with safetensors; a file that was already there is
    left with the mode its owner gave it."""
    give_ordinary_mode(*(p for p, inode in file_identities(directory, pattern).items() if before.get(p) != inode))


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` atomically and durably."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every record of a JSON-lines file, in order, blank lines skipped; a line that is not JSON
    is a :class:`~flowrl.errors.FlowrlError` naming the file and the line."""
    records = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise FlowrlError(f"line {n} is not JSON ({exc})", where=str(path)) from exc
    return records
