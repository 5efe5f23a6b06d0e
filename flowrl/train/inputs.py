"""The files a run reads again when it resumes, fingerprinted: ``RUN_DIR/inputs.json``.

A resumed run must draw what the interrupted one would have drawn. The recipe holds only the
paths of its prompt tables, offline data and profiles, so the resume check of the recipe
(:func:`flowrl.train.run_dir.check_resumable_recipe`) cannot see a prompt file edited in
between, which silently changes every later batch. So a run records the sha256 of every local
file its recipe's path keys name (up to :data:`MAX_BYTES`: model weights are not read twice at
start), and a resume whose files differ is refused with the keys and files that changed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..config import fields_of
from ..errors import FlowrlError
from ..files import sha256_of, write_text_atomic
from ..recipe import Recipe
from ..recipe.schema import SECTIONS

#: The record's name in the run directory.
INPUTS_FILE = "inputs.json"
#: Files larger than this are not fingerprinted (weights: a reward model's checkpoint).
MAX_BYTES = 256 * 2**20


def input_files(recipe: Recipe) -> dict[str, Path]:
    """``{recipe key: file}`` of every path-typed recipe value that names a local file of at most
    :data:`MAX_BYTES`: ``prompts.source``, ``data.path``, ``chunker.profile``, ``rewards.0.model``..."""
    tables = [(name, getattr(recipe, name)) for name in SECTIONS]
    tables += [(section, choice.params) for section, choice in recipe.components.items()]
    tables += [(f"rewards.{i}", choice.params) for i, choice in enumerate(recipe.rewards)]
    found: dict[str, Path] = {}
    for prefix, table in tables:
        if not dataclasses.is_dataclass(table):
            continue
        for f, _ in fields_of(type(table)):
            value = getattr(table, f.name)
            # resolved paths are absolute; a word ("model") or a hub id is no file of the run's
            if f.metadata.get("path") and isinstance(value, str) and Path(value).is_absolute():
                path = Path(value)
                if path.is_file() and path.stat().st_size <= MAX_BYTES:
                    found[f"{prefix}.{f.name}"] = path
    return found


def record_inputs(recipe: Recipe, run_dir: Path) -> None:
    """Write ``RUN_DIR/inputs.json``, at a run's start (a resumed run keeps the record of its start)."""
    record = {key: {"path": str(path), "sha256": sha256_of(path)} for key, path in input_files(recipe).items()}
    write_text_atomic(run_dir / INPUTS_FILE, json.dumps(record, indent=1) + "\n")


def check_inputs_unchanged(run_dir: Path) -> None:
    """A resume reads the files its run started with: refuse one whose recorded file changed."""
    recorded = run_dir / INPUTS_FILE
    if not recorded.is_file():  # a run from before the record
        return
    try:
        record = json.loads(recorded.read_text(encoding="utf-8"))
        entries = [(key, Path(entry["path"]), entry["sha256"]) for key, entry in record.items()]
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise FlowrlError(f"{recorded} is not a record flowrl wrote ({exc})", where="--resume",
                          hint="restore it from a copy of the run, or delete it to resume without the check") from None
    changed = [(key, path) for key, path, digest in entries if path.is_file() and sha256_of(path) != digest]
    if changed:
        shown = "; ".join(f"{key} ({path})" for key, path in changed)
        raise FlowrlError(
            f"{len(changed)} file(s) the run started with changed since: {shown}. The resumed run would draw "
            "other prompts, rows or layouts than the interrupted one", where="--resume",
            hint="restore the file(s) as they were (the sha256 of each is in "
                 f"{recorded}), or start a new run with the changed files")
