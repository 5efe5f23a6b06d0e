"""The run directory: may this run write there, one writer at a time, and is its run complete.

- :func:`check_run_directory`: a new run does not overwrite an earlier one; a resumed run names
  a run directory (:func:`check_resume_directory`) and uses the recipe that started it
  (:func:`check_resumable_recipe`, naming every differing key) and the files it started with
  (:func:`flowrl.train.inputs.check_inputs_unchanged`);
- :func:`run_is_complete`: a resumed run with nothing left to do is left untouched;
- :func:`hold_run_directory`: one writer per run directory, described below.
(What a run writes there: :mod:`flowrl.train.outputs`, :mod:`flowrl.train.checkpoint`.)

One writer per run directory: ``RUN_DIR/.lock``, held with ``flock`` for the run's life.

Why ``flock``: the kernel drops the lock the moment its holder dies (SIGKILL, the OOM killer),
so a lock is never stale and nobody has to judge whether the pid in a file still runs; the pid
written into the file only names the holder in the message a refused writer gets.

Who holds it: ``flowrl train`` takes it in the process that runs the command, before it clears
(``--overwrite``) or writes anything. Under ``--num-processes N`` that is the launcher, whose
workers die with it (:func:`flowrl.distributed.launch`); it tells them through
:data:`HELD_FOR_WORKERS` that the lock is held on their behalf. Under an external launcher
(torchrun, ``accelerate launch``) the process of rank 0 takes it. :func:`flowrl.train.train`
called as a library takes it too, unless this process already holds it.

Taking the lock creates the run directory, so an OS error making it (read-only filesystem, a
parent that is a regular file, ``/proc``) is one message before any model loads; a run that
stops before writing anything leaves no directory behind that it made.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from ..errors import FlowrlError, counted
from ..files import read_jsonl
from ..plugins import Registry
from ..recipe import Recipe, read_toml, validate
from .inputs import check_inputs_unchanged
from .checkpoint import (
    LATEST,
    MARKER,
    checkpoint_damage,
    checkpoint_iteration,
    latest_checkpoint,
    newest_intact_checkpoint,
)

LOCK_NAME = ".lock"
#: Set by the launcher for its workers: the lock file it holds for them (resolved path).
HELD_FOR_WORKERS = "FLOWRL_RUN_LOCK"
#: Filesystems that cannot lock (some FUSE and old NFS mounts): run unlocked, with a warning,
#: rather than refuse to train there at all.
_NO_LOCKING = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)

_held: dict[str, RunLock] = {}  # run directories this process holds: train() inside the command re-enters


def lock_path(run_dir: Path) -> Path:
    return Path(run_dir).resolve() / LOCK_NAME


def os_error_message(action: str, path: Path, exc: OSError) -> str:
    """``cannot ACTION PATH: STRERROR`` (and the file the OS named, where it is another one)."""
    reason = exc.strerror or str(exc)
    if exc.filename and Path(str(exc.filename)) != Path(path):
        reason += f" ({exc.filename})"
    return f"cannot {action} {path}: {reason}"


class RunLock:
    """The held lock of one run directory; :meth:`release` gives it back."""

    def __init__(self, run_dir: Path, fd: int | None, made: list[Path]):
        self.run_dir, self.fd, self.made = run_dir, fd, made

    @classmethod
    def acquire(cls, run_dir: Path, where: str) -> RunLock:
        run_dir = Path(run_dir)
        made = make_directory(run_dir, where)
        try:
            return cls(run_dir, lock_file(run_dir, where), made)
        except BaseException:
            remove_made(made)
            raise

    def release(self) -> None:
        """Unlock; a directory this lock made and the run left empty (it stopped before writing
        anything) is removed again, so a refused or failed start leaves nothing behind."""
        path = self.run_dir / LOCK_NAME
        if self.fd is not None:
            # unlink before unlocking: a writer waiting on this file then finds it gone and locks
            # the new one (lock_file checks), never an unlinked file nobody else can see
            with contextlib.suppress(OSError):
                path.unlink()
            os.close(self.fd)
            self.fd = None
        remove_made(self.made)


def make_directory(run_dir: Path, where: str) -> list[Path]:
    """Create ``run_dir`` and its missing parents; returns those made, outermost first. An OS
    error is a FlowrlError naming the path, and what was made before it is removed again."""
    if run_dir.exists() and not run_dir.is_dir():
        raise FlowrlError(f"cannot use {run_dir} as the run directory: it is a file, not a directory", where=where,
                          hint="pass another --output-dir, or move the file away")
    missing = []
    for path in (run_dir, *run_dir.parents):
        if path.is_dir():
            break
        missing.append(path)
    made: list[Path] = []
    try:
        for path in reversed(missing):
            try:
                path.mkdir()
            except FileExistsError:
                if not path.is_dir():  # a regular file in the way
                    raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path)) from None
                continue  # made by someone else meanwhile: not ours to remove
            made.append(path)
    except OSError as exc:
        remove_made(made)
        raise FlowrlError(os_error_message("create the run directory", run_dir, exc), where=where,
                          hint="choose a run directory you can write (--output-dir, or [run].output_dir)") from exc
    return made


def remove_made(made: list[Path]) -> None:
    """Remove the directories in ``made`` (outermost first) that hold nothing but a lock file."""
    for path in reversed(made):
        try:
            leftover = [p for p in path.iterdir() if p.name != LOCK_NAME]
            if leftover:
                return
            with contextlib.suppress(FileNotFoundError):
                (path / LOCK_NAME).unlink()
            path.rmdir()
        except OSError:
            return


def lock_file(run_dir: Path, where: str) -> int | None:
    """Open and lock ``RUN_DIR/.lock``; refuse with one message while another process holds it."""
    path = run_dir / LOCK_NAME
    for _ in range(10):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)  # not inherited by torchrun
        except OSError as exc:
            raise FlowrlError(os_error_message("write into the run directory", run_dir, exc), where=where,
                              hint="choose a run directory you can write (--output-dir, or [run].output_dir)") from exc
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = read_holder(fd)
            os.close(fd)
            raise busy(run_dir, holder, where) from None
        except ImportError:  # no fcntl (Windows): nothing to lock with
            os.close(fd)
            return None
        except OSError as exc:
            os.close(fd)
            if exc.errno in _NO_LOCKING:
                print(f"warning: {run_dir} is on a filesystem that cannot lock files ({exc.strerror}); "
                      "nothing stops a second run from writing it at the same time", file=sys.stderr)
                return None
            raise FlowrlError(os_error_message("lock the run directory", run_dir, exc), where=where) from exc
        if same_file(fd, path):
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return fd
        os.close(fd)  # the previous holder removed the file as we locked it: lock the one there now
    raise FlowrlError(f"could not lock {path}: it kept being replaced", where=where,
                      hint="is another run starting there?")


def same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return text if text.isdigit() else ""


def busy(run_dir: Path, holder: str, where: str) -> FlowrlError:
    who = f"another flowrl process (pid {holder})" if holder else "another flowrl process"
    stop = f"`kill -INT {holder}`" if holder else "Ctrl-C in its terminal"
    return FlowrlError(
        f"{run_dir} is in use: {who} is training there, and a second writer would corrupt the run",
        where=where,
        hint=f"wait for that run to end, or stop it ({stop}: it checkpoints first) and continue it with "
        f"`flowrl train --resume {run_dir}`; to train alongside it, pass another --output-dir",
    )


def held_here(run_dir: Path) -> bool:
    """Whether this process may write ``run_dir`` without taking the lock: it holds it already,
    or its launcher holds it for it."""
    key = str(lock_path(run_dir))
    return key in _held or os.environ.get(HELD_FOR_WORKERS) == key


@contextlib.contextmanager
def hold_run_directory(run_dir: Path, *, where: str = "[run].output_dir", main: bool | None = None) -> Iterator[None]:
    """Hold ``run_dir``'s lock for the block (creating the directory). ``main``: whether this is
    the process that owns the run (default: RANK 0, or no launcher); the others write only
    what the main process's lock already covers."""
    main = os.environ.get("RANK", "0") == "0" if main is None else main
    if not main or held_here(run_dir):
        yield
        return
    key = str(lock_path(run_dir))
    lock = RunLock.acquire(Path(run_dir), where)
    _held[key] = lock
    try:
        yield
    finally:
        del _held[key]
        lock.release()


# ------------------------------------------------------------------------------ may this run write there


def resume_hint(run_dir: Path) -> str:
    return f"flowrl train {run_dir / 'recipe.toml'} --resume {run_dir}"


#: What a run directory holds; said whenever something is not one.
RUN_DIRECTORY = ("a run directory is what `flowrl train` writes: recipe.toml (the resolved recipe), "
                 "metrics.jsonl, images/ and checkpoints/iter_NNNNNN/")


def check_resume_directory(run_dir: Path) -> None:
    """``--resume PATH`` must name a run directory (one with the recipe.toml that training wrote)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FlowrlError(f"cannot resume: {run_dir} does not exist", where="--resume", hint=RUN_DIRECTORY)
    if (run_dir / MARKER).is_file():
        parent = run_dir.parent.parent if run_dir.parent.name == "checkpoints" else None
        raise FlowrlError(
            f"cannot resume: {run_dir} is a checkpoint directory, not a run directory", where="--resume",
            hint=f"pass the run directory{f' ({parent})' if parent else ''}: a run resumes from its latest checkpoint",
        )
    if not (run_dir / "recipe.toml").is_file():
        raise FlowrlError(
            f"cannot resume: {run_dir} is not a run directory (it has no recipe.toml)", where="--resume",
            hint=f"{RUN_DIRECTORY}; pass that directory (e.g. runs/quickstart)",
        )


def check_run_directory(recipe: Recipe, run_dir: Path, resume: Path | None, registry: Registry) -> None:
    """A new run must not overwrite an earlier one (checkpoints, or metrics without a checkpoint;
    ``flowrl train --overwrite`` clears it first); a resumed run must use its recipe."""
    if resume is None:
        if (run_dir / "checkpoints" / LATEST).exists():
            raise FlowrlError(
                f"{run_dir} already holds a run with checkpoints; a new run would overwrite it",
                where="[run].output_dir",
                hint=f"continue it with `{resume_hint(run_dir)}`, pass another --output-dir, "
                "or start afresh there with `flowrl train ... --overwrite` (deletes the old run's files)",
            )
        if (run_dir / "metrics.jsonl").is_file():
            raise FlowrlError(
                f"{run_dir} already holds the metrics.jsonl of an earlier run (it has no checkpoint to resume); "
                "a new run would overwrite them",
                where="[run].output_dir",
                hint="pass another --output-dir, or replace the old run with `flowrl train ... --overwrite`",
            )
        return
    check_resume_directory(run_dir)
    check_resumable_recipe(recipe, run_dir, registry)
    check_inputs_unchanged(run_dir)
    check_latest_checkpoint_reads(run_dir)


#: Where the resume hint for a damaged checkpoint moves it (and any newer one): out of checkpoints/,
#: so that the run resumes from its newest intact checkpoint, and kept, not deleted.
DAMAGED_CHECKPOINTS = "damaged_checkpoints"


def check_latest_checkpoint_reads(run_dir: Path) -> None:
    """The checkpoint a resumed run starts from must read whole. A damaged file in it (a partial
    copy, an interrupted transfer: :func:`~flowrl.train.checkpoint.checkpoint_damage`) is one
    message before any model loads, naming the file, the newest intact checkpoint and the
    command that resumes from it."""
    import shlex

    ckpt = latest_checkpoint(run_dir)
    damage = checkpoint_damage(ckpt) if ckpt is not None else None
    if damage is None:
        return
    file, why = damage
    intact, in_the_way = newest_intact_checkpoint(run_dir, ckpt)
    message = (f"cannot resume: the latest checkpoint {ckpt.name} is damaged: {file} {why} "
               "(a partial copy or an interrupted transfer leaves this)")
    if intact is None:
        raise FlowrlError(message, where="--resume", hint=(
            f"no intact checkpoint is left in {run_dir / 'checkpoints'}: copy {ckpt.name} again from where it came, "
            f"or start afresh with `flowrl train {run_dir / 'recipe.toml'} -o {run_dir} --overwrite`"))
    aside = run_dir / DAMAGED_CHECKPOINTS
    command = (f"mkdir -p {shlex.quote(str(aside))} && mv {' '.join(shlex.quote(str(p)) for p in in_the_way)} "
               f"{shlex.quote(str(aside))}/ && {resume_hint(run_dir)}")
    damaged = "the damaged checkpoint" if len(in_the_way) == 1 else f"the {len(in_the_way)} damaged checkpoints"
    raise FlowrlError(message, where="--resume", hint=(
        f"the previous checkpoint {intact} ({counted(checkpoint_iteration(intact), 'iteration')}) is intact; to "
        f"resume from it, move {damaged} out of checkpoints/ (kept in {DAMAGED_CHECKPOINTS}/, not deleted): `{command}`"))


#: ``[pipeline]`` keys that place the rollout (a thread or a process, which device) without
#: changing a draw: a resumed run may change them.
RESUMABLE_PIPELINE_KEYS = ("overlap", "worker", "device")
#: ``[train]`` keys that place state without changing what is computed: where the KL reference is
#: kept (a run whose only reference was ``[log] kl_every``'s, resumed without it, must drop it)
RESUMABLE_TRAIN_KEYS = ("iterations", "reference_on_cpu")


def check_resumable_recipe(recipe: Recipe, run_dir: Path, registry: Registry) -> None:
    """A resumed run must use the recipe that wrote it; only iterations, [log], [checkpoint]
    and [[trackers]] (what is recorded, never what is trained), where ``[pipeline]`` draws
    (:data:`RESUMABLE_PIPELINE_KEYS`) and where the KL reference is kept
    (:data:`RESUMABLE_TRAIN_KEYS`) and where the prompt embeddings come from (``[prompts]
    embeddings``: a store holds what encoding gives, bit for bit) may change. A difference names
    every differing key with the run's value and the new one."""
    saved = run_dir / "recipe.toml"
    if not saved.is_file():
        return
    data = read_toml(saved)
    data.pop("trackers", None)  # may change, and the old tracker's plugin need not be installed
    old = validate(data, source=str(saved), registry=registry).to_toml_dict()
    new = recipe.to_toml_dict()
    for section in ("log", "checkpoint", "trackers"):
        old.pop(section, None)
        new.pop(section, None)
    for d in (old, new):
        for key in RESUMABLE_TRAIN_KEYS:
            d["train"].pop(key, None)
        d["run"].pop("output_dir", None)
        for key in RESUMABLE_PIPELINE_KEYS:
            d.get("pipeline", {}).pop(key, None)
        d.get("prompts", {}).pop("embeddings", None)
    if old != new:
        diff = recipe_differences(old, new)
        shown = [f"{key}: {a} in the run, {b} now" for key, a, b in diff[:6]]
        more = f"; and {len(diff) - 6} more" if len(diff) > 6 else ""
        raise FlowrlError(
            f"the recipe differs from the one that started {run_dir} in {len(diff)} key(s): " + "; ".join(shown) + more,
            where="--resume",
            hint=f"resume with `flowrl train {saved} --resume {run_dir}` (only iterations, [log], [checkpoint], "
                     "[[trackers]], where [pipeline] draws, train.reference_on_cpu and prompts.embeddings may change)",
        )


def recipe_differences(old: dict, new: dict) -> list[tuple[str, str, str]]:
    """``(key, old value, new value)`` of every key whose value differs between two resolved
    recipes: ``[train].lr``, ``[[rewards]] #2.weight``; an absent key or entry reads ``(absent)``."""
    def show(value) -> str:
        return "(absent)" if value is _ABSENT else json.dumps(value)

    out = []
    for section in sorted(set(old) | set(new), key=lambda s: (list(old) + list(new)).index(s)):
        a, b = old.get(section, _ABSENT), new.get(section, _ABSENT)
        if isinstance(a, list) or isinstance(b, list):
            a = a if isinstance(a, list) else []
            b = b if isinstance(b, list) else []
            pairs = [(f"[[{section}]] #{i + 1}", a[i] if i < len(a) else {}, b[i] if i < len(b) else {})
                     for i in range(max(len(a), len(b)))]
        else:
            pairs = [(f"[{section}]", a if isinstance(a, dict) else {}, b if isinstance(b, dict) else {})]
        for prefix, ta, tb in pairs:
            for key in list(dict.fromkeys([*ta, *tb])):
                va, vb = ta.get(key, _ABSENT), tb.get(key, _ABSENT)
                if va != vb:
                    out.append((f"{prefix}.{key}", show(va), show(vb)))
    return out


_ABSENT = object()


def run_is_complete(run_dir: Path, completed: int, recipe: Recipe, evaluates: bool) -> bool:
    """True when a resumed run (``completed`` iterations) has nothing left to do: every iteration is done and, when the run
    evaluates, the final evaluation's row is in ``metrics.jsonl`` (a run stopped during that
    evaluation still has it to do)."""
    if completed < recipe.train.iterations:
        return False
    if not evaluates:
        return True
    path = Path(run_dir) / "metrics.jsonl"
    rows = read_jsonl(path) if path.is_file() else []
    return any(r.get("final") and r.get("iteration") == recipe.train.iterations for r in rows)
