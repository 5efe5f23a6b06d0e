"""Prompt sources and the order in which training visits them.

A prompt source is ``"model"`` (the model adapter's own prompts, e.g. the embedded model's
grammar), a text file with one prompt per line, a table with named columns (JSONL, CSV / TSV or
Parquet), or a Hugging Face ``datasets`` dataset (a directory written by ``save_to_disk``, a
directory of data files, or ``hf:NAME`` from the local cache or the hub; the ``datasets`` extra).
The prompts of iteration ``k`` depend only on ``(seed, k)`` (epoch-wise seeded shuffles), which
makes resume exact; the evaluation prompts are a seeded subset, the same for the whole run and for
``flowrl eval`` of any of its checkpoints.

A table row may carry a condition image (the path in ``condition_column``, relative paths taken
from the table's directory): the prompt is then a :class:`PromptRow`, a ``str`` (the prompt text,
so rewards, captions and logs use it unchanged) that also holds ``condition``. An editing adapter
reads it in ``encode_prompts`` and puts the encoded image into the text embeddings, so the engine
carries it like any embedding; rewards get it in ``metadata`` (:func:`reward_metadata`).

Tables are read in bounded memory: JSONL and CSV keep only the byte offset of each selected row
(8 bytes a row) and read a row from disk when it is used; Parquet keeps the selected row numbers
and reads one row group (only the needed columns) at a time; a ``datasets`` dataset stays
memory-mapped by Arrow.
"""

from __future__ import annotations

import csv
import io
import json
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .errors import FlowrlError, MissingDependencyError, require
from .files import image_read_errors
from .seeding import generator

#: Prompts whose text embeddings a run keeps (the engine's per-prompt cache,
#: :class:`flowrl.train.session.PromptCache`, in CPU memory; the least recently used beyond it is
#: re-encoded when it comes back). ``flowrl plan`` counts the cache at most this large.
CACHED_PROMPTS = 1024
#: File suffixes read as tables with named columns (anything else is a text file, one prompt a line).
TABLE_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv", ".parquet": "parquet"}


class PromptRow(str):
    """A prompt that carries a condition image: the ``str`` is the prompt text, ``condition`` the
    image's path (absolute, or None).

    Two rows are equal when text and condition are equal, so caches keyed by the prompt (the
    engine's text-embedding cache) keep one entry per (text, image); a row without a condition
    equals the plain string.
    """

    condition: str | None

    def __new__(cls, text: str, condition: str | None = None):
        row = super().__new__(cls, text)
        row.condition = str(condition) if condition else None
        return row

    @property
    def text(self) -> str:
        return str.__str__(self)

    def __eq__(self, other):
        if not isinstance(other, str):
            return NotImplemented
        return str.__eq__(self, other) and self.condition == condition_of(other)

    def __ne__(self, other):
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self):
        return str.__hash__(self) if self.condition is None else hash((str.__str__(self), self.condition))

    def __reduce__(self):
        return (PromptRow, (str.__str__(self), self.condition))

    def __repr__(self):
        return f"PromptRow({str.__repr__(self)}, condition={self.condition!r})"


def condition_of(prompt) -> str | None:
    """The condition image path of a prompt (None for a plain string)."""
    return getattr(prompt, "condition", None)


def load_condition_image(path: str, where: str = "condition image"):
    """The condition image at ``path`` as an RGB PIL image (one clear error if it cannot be read)."""
    from PIL import Image

    if not Path(path).is_file():
        raise FlowrlError(f"condition image not found: {path}", where=where,
                          hint="condition paths are relative to the prompt table's directory")
    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except image_read_errors() as exc:
        raise FlowrlError(f"cannot read condition image {path}: {exc}", where=where) from exc


def condition_images(prompts: Sequence[str], height: int, width: int) -> torch.Tensor:
    """The prompts' condition images resized to ``height x width``: float32 ``[B, 3, H, W]`` in
    [0, 1]. Every prompt must carry one."""
    import numpy as np
    from PIL import Image

    out = []
    for p in prompts:
        path = condition_of(p)
        if path is None:
            raise FlowrlError(f"prompt {str(p)!r} has no condition image", where="[prompts].condition_column")
        img = load_condition_image(path).resize((width, height), Image.BICUBIC)
        out.append(torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1))
    return torch.stack(out)


def reward_metadata(prompts: Sequence[str], images: torch.Tensor | None) -> dict[str, Any] | None:
    """What rewards get in ``metadata`` for these prompts: None without condition images, else
    ``conditions`` (each prompt's image path or None) and, when every prompt has one and there are
    generated ``images`` to size them by, ``condition_images`` (float32 ``[B, 3, H, W]`` in [0, 1],
    at the generated images' size)."""
    paths = [condition_of(p) for p in prompts]
    if all(p is None for p in paths):
        return None
    meta: dict[str, Any] = {"conditions": paths}
    if images is not None and all(p is not None for p in paths):
        meta["condition_images"] = condition_images(prompts, images.shape[-2], images.shape[-1])
    return meta


# ------------------------------------------------------------------------------------- sources


def read_prompts(source: str, model, where: str, config=None, *, role: str = "train") -> Sequence[str]:
    """The prompts of ``source`` for ``role`` (``"train"`` or ``"eval"``).

    ``config`` (a ``[prompts]`` table, :class:`flowrl.recipe.PromptsConfig`) names a table's
    columns and splits; without it a table's ``prompt`` column is read whole. A text file is a list
    of plain strings; a table gives :class:`PromptRow` when it has a condition column.
    """
    if source == "model":
        if config is not None and getattr(config, "balance_column", ""):
            raise FlowrlError("the model's own prompts have no columns to balance", where=where,
                              hint="give a prompt table with the column, or leave [prompts].balance_column empty")
        prompts = model.prompt_source()
        if not prompts:
            raise FlowrlError("the model has no prompt source of its own", where=where, hint="give a prompt file path")
        return list(prompts)
    columns = TableColumns.from_config(config, role)
    path = Path(source)
    kind = TABLE_SUFFIXES.get(path.suffix.lower())
    if source.startswith("hf:") or path.is_dir():
        rows = HFDatasetRows.open(source[3:] if source.startswith("hf:") else str(path), columns, where)
    elif not path.is_file():
        raise FlowrlError(f"prompt file not found: {path}", where=where)
    elif kind == "parquet":
        rows = ParquetRows(path, columns, where)
    elif kind is not None:
        rows = LineTableRows(path, kind, columns, where)
    else:
        rows = None
    if rows is not None:
        rows = non_empty(rows, source, where)
        return BalancedRows(rows) if columns.balance else rows
    if columns.balance:
        raise FlowrlError(f"{path} is a text file, with no column {columns.balance!r} to balance", where=where,
                          hint="give a table (.csv, .jsonl, .parquet) with that column, or leave "
                               "[prompts].balance_column empty")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise FlowrlError(f"prompt file {path} is not UTF-8 text (byte {exc.start} cannot be decoded)", where=where,
                          hint="a text file of one prompt a line, or a table (.csv, .tsv, .jsonl, .parquet)") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise FlowrlError(f"prompt file {path} is empty", where=where)
    return prompts


def distinct_rows(prompts: Sequence[str]) -> Sequence[str]:
    """Each row of a prompt source once (a balanced view repeats the rows of small categories)."""
    return prompts.rows if isinstance(prompts, BalancedRows) else prompts


def non_empty(rows: Sequence[str], source: str, where: str) -> Sequence[str]:
    if len(rows) == 0:
        raise FlowrlError(f"no prompts in {source}{rows.describe_filter()}", where=where,
                          hint="check the split column and split names, or the prompt column")
    return rows


class TableColumns:
    """Which columns of a table are read, and which split value selects the rows."""

    def __init__(self, text: str = "prompt", condition: str = "", split_column: str = "", split: str = "",
                 balance: str = ""):
        self.text, self.condition, self.split_column, self.split = text, condition, split_column, split
        self.balance = balance

    @classmethod
    def from_config(cls, config, role: str) -> TableColumns:
        if config is None:
            return cls()
        split = config.eval_split if role == "eval" else config.train_split
        return cls(config.text_column, config.condition_column, config.split_column, split,
                   getattr(config, "balance_column", ""))

    @property
    def needed(self) -> list[str]:
        return [c for c in (self.text, self.condition, self.split_column, self.balance) if c]


class TableRows(Sequence):
    """Rows of a table as prompts: ``rows[i]`` reads row ``i`` of the selected split on demand."""

    def __init__(self, source: str, columns: TableColumns, where: str, base: Path | None):
        self.source, self.columns, self.where, self.base = source, columns, where, base
        self.categories: array = array("q")  # per selected row: its balance column's value, as an index
        self.category_names: dict[str, int] = {}

    def note_category(self, value) -> None:
        """Record the balance column's value of the row just selected (nothing without one)."""
        if self.columns.balance:
            self.categories.append(self.category_names.setdefault(str(value), len(self.category_names)))

    def describe_filter(self) -> str:
        c = self.columns
        return f" with {c.split_column} = {c.split!r}" if c.split_column else ""

    def check_columns(self, names: Sequence[str]) -> None:
        missing = [c for c in self.columns.needed if c not in names]
        if missing:
            raise FlowrlError(f"{self.source} has no column {', '.join(map(repr, missing))} (columns: {', '.join(names)})",
                              where=self.where, hint="set [prompts].text_column / condition_column / split_column")

    def selected(self, record: dict) -> bool:
        c = self.columns
        return not c.split_column or str(record.get(c.split_column)) == c.split

    def make_row(self, record: dict, index: int) -> str:
        text = record.get(self.columns.text)
        if not isinstance(text, str) or not text.strip():
            raise FlowrlError(f"row {index} of {self.source} has no prompt text in column {self.columns.text!r}",
                              where=self.where)
        if not self.columns.condition:
            return text.strip()
        cond = record.get(self.columns.condition)
        if isinstance(cond, dict):  # a datasets Image feature: embedded bytes, or a path
            cond = stored_image(cond["bytes"]) if cond.get("bytes") else cond.get("path")
        if cond in (None, ""):
            return PromptRow(text.strip())
        path = Path(str(cond)).expanduser()
        if not path.is_absolute() and self.base is not None:
            path = self.base / path
        return PromptRow(text.strip(), str(path))

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n = len(self)
        if not -n <= index < n:
            raise IndexError(index)
        return self.row(index % n)

    def row(self, index: int) -> str:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError


class BalancedRows(Sequence):
    """A table's rows with every category of its balance column equally often.

    Item ``i`` is of category ``c = i % C`` (categories in the order they first appear), the
    ``(i // C) % n_c``-th row of that category in table order; the length is ``C`` times the largest
    category's ``n_c``, so a pass visits every row of the largest category once and repeats the
    rows of smaller ones. Training shuffles this view epoch by epoch like any prompt list
    (:func:`prompts_for_iteration`); the evaluation takes items round-robin over the categories
    (:meth:`stratified`). ``rows`` is the table itself (each row once)."""

    def __init__(self, rows: TableRows):
        self.rows = rows
        self.names = list(rows.category_names)
        self.members: list[array] = [array("q") for _ in self.names]
        for index, category in enumerate(rows.categories):
            self.members[category].append(index)
        self.largest = max(len(m) for m in self.members)

    def __len__(self) -> int:
        return len(self.members) * self.largest

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        k, category = divmod(index % len(self), len(self.members))
        members = self.members[category]
        return self.rows[members[k % len(members)]]

    def stratified(self, seed: int, count: int) -> list[str]:
        """``count`` prompts round-robin over the categories, each category's rows in an order
        seeded by ``seed`` (repeating when a category has fewer rows than its turns)."""
        orders = [torch.randperm(len(m), generator=generator(seed, "eval-prompts", c)) for c, m in enumerate(self.members)]
        out = []
        for i in range(count):
            k, category = divmod(i, len(self.members))
            members = self.members[category]
            out.append(self.rows[members[int(orders[category][k % len(members)])]])
        return out


def stored_image(data: bytes) -> str:
    """The path of an image embedded in a dataset, written once to a cache directory (named by its hash)."""
    import hashlib
    import tempfile

    root = Path(tempfile.gettempdir()) / "flowrl-conditions"
    root.mkdir(exist_ok=True)
    path = root / f"{hashlib.sha256(data).hexdigest()[:32]}.img"
    if not path.is_file():
        tmp = path.with_suffix(f".{id(data)}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
    return str(path)


class LineTableRows(TableRows):
    """JSONL or CSV / TSV: one pass records the byte offset of every selected row; a row is
    parsed from the file when it is used."""

    def __init__(self, path: Path, kind: str, columns: TableColumns, where: str):
        super().__init__(str(path), columns, where, path.parent)
        self.path, self.kind = path, kind
        self.offsets = array("q")
        self.header: list[str] | None = None
        with path.open("rb") as f:
            try:
                if kind == "jsonl":
                    self.scan_jsonl(f)
                else:
                    self.scan_csv(f)
            except UnicodeDecodeError as exc:
                raise FlowrlError(f"prompt table {path} is not UTF-8 text ({exc.reason} at byte {exc.start} of a "
                                  "row)", where=where, hint="save the table as UTF-8") from None

    def parse_json(self, line: bytes, index: int) -> dict:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise FlowrlError(f"{self.path}, line {index + 1}: not JSON ({exc.msg})", where=self.where) from exc
        if not isinstance(record, dict):
            raise FlowrlError(f"{self.path}, line {index + 1}: not a JSON object", where=self.where)
        return record

    def scan_jsonl(self, f) -> None:
        checked = False
        for index, (start, line) in enumerate(iter_lines(f)):
            if not line.strip():
                continue
            record = self.parse_json(line, index)
            if not checked:
                self.check_columns(list(record))
                checked = True
            if self.selected(record):
                self.offsets.append(start)
                self.note_category(record.get(self.columns.balance))

    def csv_reader(self, lines):
        return csv.reader(lines, delimiter="\t" if self.kind == "tsv" else ",")

    def scan_csv(self, f) -> None:
        starts: list[int] = []  # the offsets of the lines the reader consumed for the current row

        def texts():
            for start, line in iter_lines(f):
                starts.append(start)
                yield line.decode("utf-8-sig" if start == 0 else "utf-8")

        reader = self.csv_reader(texts())  # it reads exactly the lines of one row, no further
        self.header = next(reader, None) or []
        self.check_columns(self.header)
        starts.clear()
        for values in reader:
            first = starts[0]
            starts.clear()
            record = dict(zip(self.header, values))
            if values and self.selected(record):
                self.offsets.append(first)
                self.note_category(record.get(self.columns.balance))

    def __len__(self) -> int:
        return len(self.offsets)

    def row(self, index: int) -> str:
        with self.path.open("rb") as f:
            f.seek(self.offsets[index])
            if self.kind == "jsonl":
                record = self.parse_json(f.readline(), index)
            else:
                text = io.TextIOWrapper(f, encoding="utf-8", newline="")
                record = dict(zip(self.header, next(self.csv_reader(text))))
        return self.make_row(record, index)


def iter_lines(f):
    """``(byte offset, line)`` of every line of a binary file."""
    while True:
        start = f.tell()
        line = f.readline()
        if not line:
            return
        yield start, line


class ParquetRows(TableRows):
    """Parquet (the ``datasets`` extra: pyarrow): the selected rows' numbers, and at most two row
    groups of the needed columns in memory."""

    def __init__(self, path: Path, columns: TableColumns, where: str):
        super().__init__(str(path), columns, where, path.parent)
        pq = import_extra("pyarrow.parquet", "datasets", where)
        self.file = pq.ParquetFile(str(path))
        self.check_columns(self.file.schema_arrow.names)
        meta = self.file.metadata
        self.group_starts = [0]
        for g in range(meta.num_row_groups):
            self.group_starts.append(self.group_starts[-1] + meta.row_group(g).num_rows)
        self.rows = array("q")
        self.cache: OrderedDict[int, dict[str, list]] = OrderedDict()
        split_column, balance = self.columns.split_column, self.columns.balance
        for g in range(meta.num_row_groups):
            if not (split_column or balance):
                self.rows.extend(range(self.group_starts[g], self.group_starts[g + 1]))
                continue
            table = self.file.read_row_group(g, columns=[c for c in dict.fromkeys((split_column, balance)) if c])
            splits = table.column(split_column).to_pylist() if split_column else None
            kinds = table.column(balance).to_pylist() if balance else None
            for i in range(table.num_rows):
                if splits is None or str(splits[i]) == self.columns.split:
                    self.rows.append(self.group_starts[g] + i)
                    self.note_category(kinds[i] if kinds is not None else None)

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, index: int) -> str:
        import bisect

        n = self.rows[index]
        g = bisect.bisect_right(self.group_starts, n) - 1
        if g not in self.cache:
            table = self.file.read_row_group(g, columns=[c for c in (self.columns.text, self.columns.condition) if c])
            self.cache[g] = table.to_pydict()
            if len(self.cache) > 2:
                self.cache.popitem(last=False)
        group = self.cache[g]
        return self.make_row({k: v[n - self.group_starts[g]] for k, v in group.items()}, index)


class HFDatasetRows(TableRows):
    """A Hugging Face ``datasets`` dataset (memory-mapped Arrow): ``save_to_disk`` directories,
    directories of data files, or a hub name from the local cache (offline with HF_HUB_OFFLINE=1).
    A dataset with splits uses ``train_split`` / ``eval_split`` as split names."""

    @classmethod
    def open(cls, name: str, columns: TableColumns, where: str) -> HFDatasetRows:
        datasets = import_extra("datasets", "datasets", where)
        path = Path(name).expanduser()
        base = path if path.is_dir() else None
        try:
            if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
                data = datasets.load_from_disk(str(path))
            else:
                repo, _, config = name.partition(":") if not path.is_dir() else (str(path), "", "")
                data = datasets.load_dataset(repo, config or None)
        except FileNotFoundError as exc:
            raise FlowrlError(f"dataset {name!r} not found: {exc}", where=where,
                              hint="give a directory written by save_to_disk, a directory of data files, or "
                              "hf:NAME of a dataset in the local Hugging Face cache") from exc
        except Exception as exc:  # the hub and the builders raise many types; all mean "cannot load"
            raise FlowrlError(f"cannot load dataset {name!r}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                              where=where, hint="offline, a hub dataset must already be in the local cache "
                              "(HF_HUB_OFFLINE=1); or save it with save_to_disk and give the directory") from exc
        return cls(name, data, columns, where, base)

    def __init__(self, name: str, data, columns: TableColumns, where: str, base: Path | None):
        super().__init__(name, columns, where, base)
        if isinstance(data, dict):  # a DatasetDict: one dataset per split
            data = self.pick_split(data)
        self.check_columns(data.column_names)
        keep = [c for c in (columns.text, columns.condition) if c]
        self.indices = None
        if columns.split_column or columns.balance:
            self.indices = array("q")
            for start in range(0, len(data), 4096):
                chunk = data[start : start + 4096]
                kinds = chunk[columns.balance] if columns.balance else None
                for i, v in enumerate(chunk[columns.split_column] if columns.split_column else [None] * len(kinds)):
                    if not columns.split_column or str(v) == columns.split:
                        self.indices.append(start + i)
                        self.note_category(kinds[i] if kinds is not None else None)
        if columns.condition and hasattr(data, "cast_column"):
            feature = data.features.get(columns.condition)
            if type(feature).__name__ == "Image":  # read the stored path, do not decode the image
                data = data.cast_column(columns.condition, type(feature)(decode=False))
        self.data = data.select_columns(keep)

    def pick_split(self, data):
        split = self.columns.split or "train"
        if self.columns.split_column:  # rows are chosen by a column; the dataset's own split must be one
            if len(data) != 1:
                raise FlowrlError(f"dataset {self.source!r} has splits {sorted(data)} and a split column is set",
                                  where=self.where, hint="use the dataset's splits (train_split / eval_split) "
                                  "and leave split_column empty")
            return next(iter(data.values()))
        if split not in data:
            raise FlowrlError(f"dataset {self.source!r} has no split {split!r} (splits: {', '.join(sorted(data))})",
                              where=self.where, hint="set [prompts].train_split / eval_split")
        return data[split]

    def describe_filter(self) -> str:
        return super().describe_filter() or f" (split {self.columns.split or 'train'!r})"

    def __len__(self) -> int:
        return len(self.indices) if self.indices is not None else len(self.data)

    def row(self, index: int) -> str:
        n = self.indices[index] if self.indices is not None else index
        return self.make_row(self.data[int(n)], index)


def import_extra(module: str, extra: str, where: str):
    """Import a module of an optional extra, or say which extra installs it (and where it was needed)."""
    try:
        return require(module, extra=extra, purpose="reading this prompt source")
    except MissingDependencyError as exc:
        exc.where = exc.where or where
        raise


# ------------------------------------------------------------------------------------- order


def prompts_for_iteration(prompts: Sequence[str], seed: int, iteration: int, count: int) -> list[str]:
    """The global prompts of one iteration: epoch-wise shuffles of the list, seeded.

    The data position is fully determined by (seed, iteration), which makes resume exact.
    """
    out, perms = [], {}
    start = iteration * count
    for k in range(start, start + count):
        epoch, pos = divmod(k, len(prompts))
        if epoch not in perms:
            perms[epoch] = torch.randperm(len(prompts), generator=generator(seed, "data", epoch))
        out.append(prompts[int(perms[epoch][pos])])
    return out


def evaluation_prompts(pool: Sequence[str], seed: int, count: int) -> list[str]:
    """The run's fixed evaluation prompts: ``count`` of ``pool`` in a seeded order (a balanced
    table: round-robin over its categories, :meth:`BalancedRows.stratified`)."""
    if isinstance(pool, BalancedRows):
        return pool.stratified(seed, count)
    perm = torch.randperm(len(pool), generator=generator(seed, "eval-prompts"))
    return [pool[int(i)] for i in perm[:count]]
