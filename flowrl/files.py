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

import hashlib
import json
import os
import tempfile
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
    """Every record (a JSON object a line) of a JSON-lines file, in order, blank lines skipped.

    A last line without its newline that does not parse is a record still being written (a live
    run's metrics, read while it trains) and is left out. Anything else that is not one object a
    line (binary data, a cut line inside the file, an array) is a
    :class:`~flowrl.errors.FlowrlError` naming the file and the line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise FlowrlError(f"is not UTF-8 text, so not a JSON-lines file (byte {exc.start} cannot be decoded)",
                          where=str(path), hint="point at the run's own metrics.jsonl, or restore it from a copy") from None
    lines = text.splitlines()
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if n == len(lines) and not text.endswith("\n"):
                break  # the record being written now
            raise FlowrlError(f"line {n} is not JSON ({exc})", where=str(path),
                              hint="a file cut mid-line by a crash: delete that line (the records after it are "
                                   "intact) or restore the file") from None
        if not isinstance(record, dict):
            raise FlowrlError(f"line {n} is a JSON {type(record).__name__}, not an object of named values",
                              where=str(path), hint="every line of a metrics file is one JSON object, as flowrl "
                                                    "train writes them") from None
        records.append(record)
    return records


def ensure_writable(path: Path, *, where: str, directory: bool, suffix: str = ".json") -> Path:
    """Fail now, with one message, when ``path`` cannot be written: as a directory (``directory``)
    or as a file. Commands call it before their work, so that an unwritable output costs no
    evaluation or sampling. A file path that is a directory, a directory path that is a file, a
    parent that is a file, and a location the process may not write (or that does not hold files,
    as under ``/proc``) are each a :class:`~flowrl.errors.FlowrlError` naming ``where``. Creates
    nothing (a probe file in the nearest existing folder comes and goes). ``suffix``: the file
    name's ending the hint suggests."""
    path = Path(path)
    if directory and path.exists() and not path.is_dir():
        raise FlowrlError(f"{path} is a file, not a directory", where=where, hint="give a directory path")
    if not directory and path.is_dir():
        raise FlowrlError(f"{path} is a directory; a file path is expected", where=where,
                          hint=f"name a file, e.g. {path / ('output' + suffix)}")
    if not directory and path.is_file() and not os.access(path, os.W_OK):
        raise FlowrlError(f"cannot write {path}: it exists and this user may not replace it", where=where,
                          hint="choose another file name, or a location this user may write")
    folder = path if directory else path.parent
    existing = next((a for a in [folder, *folder.parents] if a.exists()), Path("."))
    if not existing.is_dir():
        raise FlowrlError(f"cannot write {path}: {existing} is a file, not a directory", where=where,
                          hint="choose a path whose parent folders are folders")
    try:  # the nearest folder that exists must take a new entry (the rest are created beneath it)
        handle, probe = tempfile.mkstemp(prefix=".flowrl-write-test-", dir=existing)
        os.close(handle)
        os.unlink(probe)
    except OSError as exc:
        raise FlowrlError(f"cannot write {path}: {exc.strerror or exc}", where=where,
                          hint="choose a location this user may write") from None
    return path


def image_read_errors() -> tuple[type[BaseException], ...]:
    """What PIL raises for a file that is no readable image: not an image, cut short after its
    header (OSError), or larger than PIL decodes without a warning of a decompression bomb."""
    from PIL import Image, UnidentifiedImageError

    return UnidentifiedImageError, OSError, Image.DecompressionBombError


def sha256_of(path: Path) -> str:
    """The hex sha256 of a file's bytes, read a megabyte at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
