"""Sweeps: a grid of settings x seeds, each run a ``flowrl train`` subprocess; the library behind
``flowrl sweep`` (its command, and what a sweep does, in ``flowrl/commands/sweep.py``; docs/sweep.md).

- parsing and planning: :func:`parse_grid`, :func:`parse_variant`, :func:`parse_seed_list`,
  :func:`plan_runs`;
- the manifest ``SWEEP_DIR/sweep.json``: :func:`write_manifest` (atomic), :func:`read_manifest`;
- defining or reopening a sweep: :func:`define_sweep`, :func:`open_sweep`, :func:`resumed_manifest`;
- running it: :class:`Sweep` (launches, watches and records the runs; forwards stop signals),
  :func:`follow_the_sweep` (the start of each run's process).

Recipes are validated with the caller's loader (``load(recipe, overrides)``: the CLI passes its
own, with its plugin registry), and output goes to the caller's rich console.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .checkpoint_dirs import checkpoint_iteration, latest_checkpoint
from .errors import FlowrlError
from .files import sha256_of
from .processes import pid_alive, signal_on_parent_death

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

if TYPE_CHECKING:
    from rich.console import Console

#: ``load(recipe, overrides)``: a validated recipe (raising FlowrlError), as the CLI loads one.
LoadRecipe = Callable[[Path, list[str]], Any]

MANIFEST = "sweep.json"
MANIFEST_VERSION = 1
LOCK = ".sweep.lock"
#: Keys the sweep sets itself.
RESERVED = {"run.seed": "seeds come from --seeds or --seed-list", "run.output_dir": "the sweep names each run's directory"}
STDERR_TAIL = 20


# ----------------------------------------------------------------------------- parsing


def split_values(text: str, where: str) -> list[str]:
    """Split ``text`` at the commas outside ``[]``, ``{}`` and TOML strings.

    >>> split_values("[2,3,4,7],[16]", "--grid")
    ['[2,3,4,7]', '[16]']
    """
    parts, start, quote, i = [], 0, "", 0
    closing = {"]": "[", "}": "{"}
    stack: list[str] = []
    while i < len(text):
        ch = text[i]
        if quote:
            if quote == '"' and ch == "\\":
                i += 2
                continue
            if ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            stack.append(ch)
        elif ch in "]}":
            if not stack or stack[-1] != closing[ch]:
                raise FlowrlError(f"unbalanced '{ch}' at character {i + 1} of '{text}'", where=where,
                                  hint="lists are written [a,b], tables {k = v}; separate values with commas")
            stack.pop()
        elif ch == "," and not stack:
            parts.append(text[start:i])
            start = i + 1
        i += 1
    if quote:
        raise FlowrlError(f"unterminated string in '{text}'", where=where, hint=f"close the {quote} quote")
    if stack:
        raise FlowrlError(f"unclosed '{stack[-1]}' in '{text}'", where=where, hint="close every [ and {")
    parts.append(text[start:])
    parts = [p.strip() for p in parts]
    if any(not p for p in parts):
        raise FlowrlError(f"empty value in '{text}'", where=where, hint="separate values with single commas: key=v1,v2")
    return parts


_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)+$")


def _check_key(key: str, where: str) -> None:
    if not _KEY.match(key):
        raise FlowrlError(f"'{key}' is not a recipe key", where=where,
                          hint="name a table and a key, e.g. train.lr or chunker.sizes (rewards.0.weight for arrays)")
    if key in RESERVED:
        raise FlowrlError(f"'{key}' cannot be swept here: {RESERVED[key]}", where=where)


def parse_grid(options: list[str]) -> dict[str, list[str]]:
    """``["k=v1,v2", "k2=[1,2],[3]"]`` -> ``{"k": ["v1", "v2"], "k2": ["[1,2]", "[3]"]}``."""
    grid: dict[str, list[str]] = {}
    for text in options:
        where = f"--grid {text}"
        if "=" not in text:
            raise FlowrlError("a grid option must look like KEY=V1,V2,...", where=where,
                              hint="e.g. --grid train.lr=1e-4,3e-4 or --grid 'chunker.sizes=[2,3,4,7],[16]'")
        key, raw = text.split("=", 1)
        key = key.strip()
        _check_key(key, where)
        values = split_values(raw, where)
        seen = grid.setdefault(key, [])
        for v in values:
            if v in seen:
                raise FlowrlError(f"value {v} is listed twice for {key}", where=where)
            seen.append(v)
    return grid


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``"step:chunker.use=step,selector.fraction=0.5"`` -> ``("step", [overrides])``."""
    where = f"--variant {text}"
    name, sep, rest = text.partition(":")
    name = name.strip()
    if not sep or not _NAME.match(name):
        raise FlowrlError("a variant must look like NAME:KEY=V,KEY=V (NAME: letters, digits, . _ -)", where=where,
                          hint="e.g. --variant 'step:chunker.use=step,selector.fraction=0.5' (or 'base:' for the recipe as is)")
    overrides = []
    if rest.strip():
        for item in split_values(rest, where):
            if "=" not in item:
                raise FlowrlError(f"'{item}' must look like KEY=VALUE", where=where)
            key = item.split("=", 1)[0].strip()
            _check_key(key, where)
            overrides.append(item)
    return name, overrides


def parse_seed_list(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in split_values(text, "--seed-list")]
    except ValueError:
        raise FlowrlError(f"seeds must be whole numbers, got '{text}'", where="--seed-list", hint="e.g. --seed-list 1,2,3") from None
    if any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise FlowrlError(f"seeds must be distinct and >= 0, got '{text}'", where="--seed-list")
    return seeds


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=-]+", "_", name).strip("_")[:80] or "run"


def plan_runs(recipe_stem: str, variants: list[tuple[str, list[str]]], grid: dict[str, list[str]],
              seeds: list[int]) -> list[dict[str, Any]]:
    """Every run of the sweep: id, variant label, seed, overrides (without seed and directory), dir."""
    combos = list(itertools.product(*grid.values())) if grid else [()]
    settings, slugs = [], {}
    for vname, voverrides in variants or [("", [])]:
        for combo in combos:
            grid_over = [f"{k}={v}" for k, v in zip(grid, combo)]
            label = " ".join([vname] * bool(vname) + grid_over) or recipe_stem
            slug = _slug(label)
            if slugs.setdefault(slug, label) != label:
                slug = f"{slug}_{len(slugs)}"
                slugs[slug] = label
            settings.append((label, slug, list(voverrides) + grid_over))
    # seed-major order: a partial sweep has every setting at the first seeds, and a slow spell of
    # the machine falls on all settings alike
    return [{"id": f"{slug}_seed{seed}", "variant": label, "seed": seed, "overrides": overrides,
             "dir": f"runs/{slug}_seed{seed}", "status": "pending", "exit_code": None, "wall_time_s": 0.0, "attempts": 0}
            for seed in seeds for label, slug, overrides in settings]


# ----------------------------------------------------------------------------- manifest


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def write_manifest(sweep_dir: Path, manifest: dict[str, Any]) -> None:
    """Write-to-temp, fsync, rename: a reader (or a kill) never sees half a manifest.
    (flowrl.checkpoint.write_text_atomic does the same but imports torch.)"""
    manifest["updated"] = _now()
    path = sweep_dir / MANIFEST
    tmp = path.with_name(f".{MANIFEST}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(manifest, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(sweep_dir: Path) -> dict[str, Any]:
    path = sweep_dir / MANIFEST
    if not path.is_file():
        raise FlowrlError(f"no {MANIFEST} in {sweep_dir}", where="--resume",
                          hint="pass the directory a `flowrl sweep` wrote (its -o)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FlowrlError(f"{path} is not a valid sweep manifest ({exc})", where=str(path)) from exc
    if not isinstance(manifest, dict) or manifest.get("version") != MANIFEST_VERSION or "spec" not in manifest \
            or "runs" not in manifest:
        raise FlowrlError(f"{path} is not a flowrl sweep manifest (version {MANIFEST_VERSION})", where=str(path))
    problem = manifest_problem(manifest)
    if problem is not None:
        raise FlowrlError(f"{path} is not a sweep manifest flowrl wrote: {problem}", where=str(path),
                          hint="restore it from a copy, or start the sweep afresh in another -o")
    return manifest


#: The keys (and their types) of a manifest's run entries that the commands reading it use.
RUN_ENTRY_KEYS: dict[str, type | tuple[type, ...]] = {"id": str, "dir": str, "variant": str, "status": str}


def run_entries_problem(runs: Any) -> str | None:
    """What is wrong with a manifest's ``runs`` (None: a list of entries with :data:`RUN_ENTRY_KEYS`)."""
    if not isinstance(runs, list):
        return f"'runs' is a {type(runs).__name__}, not a list of runs"
    for i, run in enumerate(runs):
        if not isinstance(run, dict):
            return f"runs[{i}] is a {type(run).__name__}, not a table"
        for key, kind in RUN_ENTRY_KEYS.items():
            if not isinstance(run.get(key), kind):
                return f"runs[{i}] has no {key!r} ({'a string' if kind is str else kind})"
    return None


def manifest_problem(manifest: dict[str, Any]) -> str | None:
    """What a resumed sweep would trip over in its manifest (None: nothing)."""
    spec = manifest.get("spec")
    if not isinstance(spec, dict):
        return "'spec' is not a table"
    for key in ("recipe", "recipe_sha256"):
        if not isinstance(spec.get(key), str):
            return f"spec has no {key!r}"
    if not isinstance(manifest.get("cwd"), str):
        return "it has no 'cwd'"
    return run_entries_problem(manifest["runs"])


def _tail(path: Path, start: int, lines: int = STDERR_TAIL) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").rstrip().splitlines()[-lines:])


def _last_iteration(metrics: Path) -> int:
    """Iterations completed according to the last line of metrics.jsonl (0 if none)."""
    try:
        with open(metrics, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 65536))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        it = record.get("iteration")
        if isinstance(it, int):
            return it if record.get("final") else it + 1
    return 0


def _checkpoint_iteration(run_dir: Path) -> int | None:
    """The iteration the run's latest complete checkpoint resumes at, or None."""
    try:
        return checkpoint_iteration(latest_checkpoint(run_dir))
    except (OSError, ValueError, KeyError, TypeError, FlowrlError):
        return None


def _pid_is_run(pid: int | None, run_dir: Path) -> bool:
    """Whether ``pid`` is alive and (where /proc tells) a process of this run."""
    if not pid or not pid_alive(pid):
        return False
    cmdline = Path(f"/proc/{pid}/cmdline")
    if cmdline.exists():
        try:
            return str(run_dir) in cmdline.read_bytes().decode("utf-8", "replace")
        except OSError:
            return False
    return True


# ----------------------------------------------------------------------------- child processes


#: The signal a run's process asks the kernel for when its sweep dies (:func:`follow_the_sweep`):
#: not one of the signals a run stops on (SIGINT, SIGTERM, SIGHUP), which count each delivery.
PARENT_DEATH_SIGNAL = getattr(signal, "SIGUSR2", signal.SIGTERM)


def follow_the_sweep() -> None:
    """Start of a run's process, before it runs the flowrl CLI (:data:`_CHILD`): on Linux, ask
    for a signal when the sweep dies, turned into ONE SIGINT (so a killed sweep's runs checkpoint
    and stop).

    The kernel sends the parent-death signal each time the thread the run is attached to exits,
    and a dying multi-threaded sweep may hand the run from thread to thread: a second SIGINT
    would stop the run without its checkpoint. So only the first death signal becomes a SIGINT,
    and the death signal is one that no other part of a run handles (:data:`PARENT_DEATH_SIGNAL`):
    were it SIGHUP, the run's own stop handler (flowrl/train/stopping.py, for which SIGHUP is the
    terminal closing) would take the second one as a second stop and abort without a checkpoint,
    as a slow lane run on a loaded machine once did.
    """
    parent = int(os.environ.get("FLOWRL_SWEEP_PID", "0") or 0)
    if sys.platform.startswith("linux"):
        fired = []

        def on_parent_death(signum, frame):
            if not fired:
                fired.append(signum)
                print("flowrl sweep: the sweep process died; this run stops after a checkpoint", file=sys.stderr, flush=True)
                signal.raise_signal(signal.SIGINT)

        signal.signal(PARENT_DEATH_SIGNAL, on_parent_death)
        signal_on_parent_death(PARENT_DEATH_SIGNAL)
    if parent and os.getppid() != parent:  # the sweep died before prctl took effect
        sys.exit(130)


# The run's process: follow the sweep, then the flowrl CLI with the run's arguments. (The CLI is
# imported here, not by this module: flowrl.cli imports this module.)
_CHILD = ("import sys; from flowrl.sweeps import follow_the_sweep; follow_the_sweep(); "
          "from flowrl.cli import main; main(sys.argv[1:])")


@dataclasses.dataclass
class Running:
    run: dict[str, Any]
    proc: subprocess.Popen
    start: float
    err_path: Path
    err_offset: int
    iterations: int
    task: Any = None
    signalled: int = 0  # SIGINTs forwarded so far


class Sweep:
    """Launches, watches and records the runs of one sweep directory."""

    def __init__(self, sweep_dir: Path, manifest: dict[str, Any], jobs: int, threads: int, *,
                 console: Console, cli_flags: Sequence[str] = ()):
        self.dir = sweep_dir
        self.console = console
        self.cli_flags = list(cli_flags)  # global flowrl options every run gets (--debug, --disable-plugin)
        self.manifest = manifest
        self.jobs = jobs
        self.threads = threads
        self.running: dict[str, Running] = {}
        self.stop_signal: int | None = None
        self.signals = 0

    # -- bookkeeping
    def save(self) -> None:
        write_manifest(self.dir, self.manifest)

    def run_dir(self, run: dict[str, Any]) -> Path:
        return self.dir / run["dir"]

    def iterations(self, run: dict[str, Any]) -> int:
        return int(run.get("iterations") or 1)

    # -- signals
    def _on_signal(self, signum, frame) -> None:
        self.signals += 1  # forwarded by the loop, one SIGINT per signal to every running run
        self.stop_signal = self.stop_signal or signum

    def _forward(self) -> None:
        for r in self.running.values():
            while r.signalled < self.signals:
                r.signalled += 1
                try:
                    os.killpg(r.proc.pid, signal.SIGINT)
                except (ProcessLookupError, PermissionError):
                    pass

    # -- launching
    def command(self, run: dict[str, Any]) -> tuple[list[str], str]:
        spec = self.manifest["spec"]
        run_dir = self.run_dir(run).resolve()
        prefix = [sys.executable, "-c", _CHILD, *self.cli_flags]
        ckpt = _checkpoint_iteration(run_dir)
        if ckpt is not None:
            return prefix + ["train", "--resume", str(run_dir)], f"resume at iteration {ckpt}"
        if run_dir.exists():
            shutil.rmtree(run_dir)  # started but never checkpointed: begin again from nothing
        overrides = list(spec["sets"]) + list(run["overrides"]) + [f"run.seed={run['seed']}"]
        argv = prefix + ["train", spec["recipe"]]
        for o in overrides:
            argv += ["--set", o]
        return argv + ["--output-dir", str(run_dir)], "new"

    def launch(self, run: dict[str, Any], progress) -> None:
        argv, how = self.command(run)
        logs = self.dir / "logs"
        logs.mkdir(exist_ok=True)
        out_path, err_path = logs / f"{run['id']}.out", logs / f"{run['id']}.err"
        header = f"\n===== {_now()} attempt {run['attempts'] + 1} ({how}): {' '.join(argv[3:])}\n"
        for p in (out_path, err_path):
            with open(p, "a", encoding="utf-8") as f:
                f.write(header)
        err_offset = err_path.stat().st_size
        env = dict(os.environ)
        env.update(OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads),
                   FLOWRL_SWEEP_PID=str(os.getpid()), COLUMNS=env.get("COLUMNS", "120"))
        with open(out_path, "ab") as out, open(err_path, "ab") as err:
            proc = subprocess.Popen(argv, cwd=self.manifest["cwd"], env=env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, start_new_session=True)
        run.update(status="running", pid=proc.pid, started=_now(), attempts=run["attempts"] + 1, exit_code=None)
        run.pop("stderr_tail", None)
        self.save()
        r = Running(run, proc, time.monotonic(), err_path, err_offset, self.iterations(run))
        r.task = progress.add_task(run["id"], total=r.iterations, completed=_last_iteration(self.run_dir(run) / "metrics.jsonl"),
                                   info=how)
        self.running[run["id"]] = r
        progress.console.print(f"start  {run['id']} ({how})", highlight=False)

    def finish(self, r: Running, code: int, progress) -> None:
        run = r.run
        run["wall_time_s"] = round(float(run.get("wall_time_s") or 0.0) + time.monotonic() - r.start, 3)
        run["exit_code"] = code
        run["finished"] = _now()
        run.pop("pid", None)
        if code == 0:
            run["status"] = "done"
            progress.console.print(f"done   {run['id']} in {run['wall_time_s']:.1f} s", highlight=False)
        elif self.stop_signal is not None:
            run["status"] = "interrupted"
            how = "from its checkpoint" if _checkpoint_iteration(self.run_dir(run)) is not None else "from the start"
            progress.console.print(f"interrupted {run['id']} (exit {code}); a resumed sweep continues it {how}", highlight=False)
        else:
            run["status"] = "failed"
            run["stderr_tail"] = _tail(r.err_path, r.err_offset)
            last = "\n    ".join(run["stderr_tail"].splitlines()[-5:])
            from rich.markup import escape

            progress.console.print(f"[red]FAILED[/red] {escape(run['id'])} (exit {code}); last lines of stderr "
                                   f"({escape(str(r.err_path))}):\n    {escape(last)}", highlight=False)
        progress.remove_task(r.task)
        del self.running[run["id"]]
        self.save()

    # -- the loop
    def prepare(self) -> list[dict[str, Any]]:
        """Runs still to do; waits for processes a killed sweep left behind."""
        todo = []
        for run in self.manifest["runs"]:
            if run["status"] == "done":
                continue
            run_dir = self.run_dir(run).resolve()
            pid = run.get("pid")
            if run["status"] == "running" and _pid_is_run(pid, run_dir):
                self.console.print(f"waiting for pid {pid} ({run['id']}, left by a stopped sweep) to checkpoint and exit")
                deadline = time.monotonic() + 300
                while _pid_is_run(pid, run_dir):
                    if time.monotonic() > deadline:
                        raise FlowrlError(f"run {run['id']} is still running as pid {pid}", where=str(self.dir),
                                          hint=f"wait for it to finish, or stop it (kill -INT {pid}), then run the sweep again")
                    time.sleep(0.5)
            if run["status"] == "running":  # the sweep that ran it died: count the lost attempt's time
                run["wall_time_s"] = round(float(run.get("wall_time_s") or 0.0) + _lost_attempt_seconds(self.dir, run), 3)
                run["wall_time_estimated"] = True
                run["status"] = "interrupted"
                run.pop("pid", None)
            ckpt = _checkpoint_iteration(run_dir)
            if ckpt is not None and ckpt >= self.iterations(run) and _final_written(run_dir):
                run.update(status="done", exit_code=0)  # it finished after the sweep stopped watching it
                run.pop("pid", None)
                continue
            todo.append(run)
        self.save()
        return todo

    def _show(self, progress, overall) -> None:
        runs = self.manifest["runs"]
        completed = 0
        for run in runs:
            if run["status"] == "done":
                completed += self.iterations(run)
            elif run["attempts"]:  # running, or stopped with iterations behind it (a stop keeps what it trained)
                n = min(_last_iteration(self.run_dir(run) / "metrics.jsonl"), self.iterations(run))
                completed += n
                if run["id"] in self.running:
                    progress.update(self.running[run["id"]].task, completed=n)
        n_done = sum(r["status"] == "done" for r in runs)
        n_failed = sum(r["status"] == "failed" for r in runs)
        info = f"iterations; runs {n_done}/{len(runs)} done, {len(self.running)} running" + (f", {n_failed} failed" if n_failed else "")
        if self.stop_signal is not None:
            info += ", stopping"
        progress.update(overall, completed=completed, info=info)

    def execute(self) -> int:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        runs = self.manifest["runs"]
        todo = self.prepare()
        done_before = sum(r["status"] == "done" for r in runs)
        if done_before:
            self.console.print(f"{done_before} of {len(runs)} run(s) already done; {len(todo)} to go")
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                            console=self.console, transient=False)
        total_iters = sum(self.iterations(r) for r in runs)
        started = time.monotonic()
        self.manifest["status"] = "running"
        self.save()
        try:
            with progress:
                overall = progress.add_task("sweep", total=total_iters, info="")
                queue = list(todo)
                while True:
                    while queue and len(self.running) < self.jobs and self.stop_signal is None:
                        self.launch(queue.pop(0), progress)
                    self._forward()
                    for r in list(self.running.values()):
                        code = r.proc.poll()
                        if code is not None:
                            self.finish(r, code, progress)
                    self._show(progress, overall)
                    if not self.running and (not queue or self.stop_signal is not None):
                        break
                    time.sleep(0.25)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.manifest["elapsed_s"] = round(float(self.manifest.get("elapsed_s") or 0.0) + time.monotonic() - started, 3)
            if self.stop_signal is None:
                failed = [r for r in runs if r["status"] != "done"]
                self.manifest["status"] = "failed" if failed else "done"
            else:
                self.manifest["status"] = "interrupted"
            self.save()
        n_done = sum(r["status"] == "done" for r in runs)
        failed = [r["id"] for r in runs if r["status"] == "failed"]
        self.console.print(f"{n_done}/{len(runs)} run(s) done in {self.dir}"
                      + (f"; failed: {', '.join(failed)} (see {self.dir / MANIFEST})" if failed else "")
                      + f"; compare them with `flowrl compare {self.dir}`")
        if self.stop_signal is not None:
            self.console.print(f"stopped; continue with `flowrl sweep --resume {self.dir}`")
            return 128 + int(self.stop_signal)
        return 1 if failed else 0


def _lost_attempt_seconds(sweep_dir: Path, run: dict[str, Any]) -> float:
    """An attempt whose sweep died: from its start to the last write to its logs."""
    try:
        started = _dt.datetime.fromisoformat(run["started"]).timestamp()
        last = max((sweep_dir / "logs" / f"{run['id']}{ext}").stat().st_mtime for ext in (".out", ".err"))
    except (KeyError, ValueError, OSError):
        return 0.0
    return max(0.0, last - started)


def _final_written(run_dir: Path) -> bool:
    """Whether metrics.jsonl ends with the final evaluation (or the run evaluates nothing)."""
    try:
        text = (run_dir / "recipe.toml").read_text(encoding="utf-8")
        num_eval = tomllib.loads(text).get("prompts", {}).get("num_eval", 0)
    except (OSError, ValueError):
        return False
    if not num_eval:
        return True
    try:
        with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
            return any('"final": true' in line for line in f)
    except OSError:
        return False


# ----------------------------------------------------------------------------- building a sweep


def _validate_runs(recipe: Path, sets: list[str], runs: list[dict[str, Any]], load: LoadRecipe) -> dict[str, int]:
    """Validate every variant's recipe (seeds do not change validity); iterations per variant."""
    iterations: dict[str, int] = {}
    for run in runs:
        if run["variant"] in iterations:
            continue
        overrides = list(sets) + run["overrides"] + [f"run.seed={run['seed']}"]
        try:
            resolved = load(recipe, overrides)
        except FlowrlError as exc:
            shown = " ".join(run["overrides"]) or "(no overrides)"
            raise FlowrlError(f"variant '{run['variant']}' (overrides: {shown}) is not a valid recipe: {exc.message}",
                              where=exc.where, hint=exc.hint) from exc
        iterations[run["variant"]] = resolved.train.iterations
    return iterations


def _available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def lock_sweep(sweep_dir: Path):
    import fcntl

    f = open(sweep_dir / LOCK, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise FlowrlError(f"another flowrl sweep is running on {sweep_dir}", where=str(sweep_dir),
                          hint="wait for it, or stop it (Ctrl-C) before continuing here") from None
    return f


def resumed_manifest(sweep_dir: Path) -> dict[str, Any]:
    """The manifest of the sweep to continue; its working directory and recipe must be unchanged."""
    manifest = read_manifest(sweep_dir)
    spec = manifest["spec"]
    recipe_path = Path(manifest["cwd"]) / spec["recipe"]
    if not Path(manifest["cwd"]).is_dir():
        raise FlowrlError(f"the sweep's working directory {manifest['cwd']} no longer exists", where=str(sweep_dir / MANIFEST))
    if not recipe_path.is_file() or sha256_of(recipe_path) != spec["recipe_sha256"]:
        raise FlowrlError(f"the recipe {recipe_path} is missing or changed since the sweep started", where=str(sweep_dir / MANIFEST),
                          hint="restore it, or start a new sweep in another directory (-o)")
    return manifest


#: The most runs one sweep defines: every run is planned and its recipe validated before the first
#: starts, so a mistyped count (--seeds 1000000) would otherwise validate for minutes.
MAX_RUNS = 10_000


def define_sweep(recipe, grid, variant, seeds, seed_list, output_dir, set_, load: LoadRecipe) -> tuple[Path, dict[str, Any]]:
    """Check the options of a sweep given on the command line: its directory and its spec (the
    recipe and its sha256, the ``--set`` overrides, the grid, the variants and the seeds)."""
    if recipe is None:
        raise FlowrlError("sweep needs a RECIPE (or --resume SWEEP_DIR)",
                          hint="flowrl sweep recipes/quickstart.toml --grid train.lr=1e-4,3e-4 --seeds 3")
    if seeds is not None and seed_list is not None:
        raise FlowrlError("give --seeds N or --seed-list, not both", where="--seed-list")
    for s in set_ or []:
        key = s.split("=", 1)[0].strip()
        if key == "run.output_dir":
            raise FlowrlError("run.output_dir is set by the sweep for each run", where=f"--set {s}", hint="use -o SWEEP_DIR")
    grid_values = parse_grid(list(grid or []))
    variants = [parse_variant(v) for v in variant or []]
    names = [n for n, _ in variants]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise FlowrlError(f"variant '{dupes[0]}' is defined twice", where="--variant")
    listed = parse_seed_list(seed_list) if seed_list is not None else None
    count = math.prod(len(values) for values in grid_values.values()) * max(1, len(variants)) * \
        (len(listed) if listed is not None else seeds or 1)
    if count > MAX_RUNS:
        raise FlowrlError(f"the sweep defines {count:,} runs, more than {MAX_RUNS:,}", where="--grid, --variant, --seeds",
                          hint="sweep fewer values at once: a search this wide is a sequence of sweeps")
    base = load(recipe, set_)  # the recipe as the sweep starts from it (and its base seed)
    seed_values = listed if listed is not None else [base.run.seed + k for k in range(seeds or 1)]
    sweep_dir = output_dir if output_dir is not None else Path("runs") / f"sweep_{recipe.stem}"
    spec = {"recipe": os.path.normpath(str(recipe)), "recipe_sha256": sha256_of(recipe), "sets": list(set_ or []),
            "grid": grid_values, "variants": [{"name": n, "overrides": o} for n, o in variants],
            "seeds": seed_values}
    return sweep_dir, spec


def open_sweep(recipe: Path, sweep_dir: Path, spec: dict[str, Any], load: LoadRecipe, *, write: bool) -> dict[str, Any]:
    """The manifest of the sweep ``spec`` defines: the one in ``sweep_dir`` (which must hold this
    very sweep), else a new one with every run planned and validated (written if ``write``)."""
    if (sweep_dir / MANIFEST).is_file():
        manifest = read_manifest(sweep_dir)
        if manifest["spec"]["recipe_sha256"] != spec["recipe_sha256"] and manifest["spec"]["recipe"] == spec["recipe"]:
            raise FlowrlError(f"{recipe} changed since the sweep in {sweep_dir} started", where=str(sweep_dir / MANIFEST),
                              hint="restore the recipe, or start a new sweep in another directory (-o)")
        if manifest["spec"] != spec:
            diff = [k for k in spec if manifest["spec"].get(k) != spec[k]]
            raise FlowrlError(f"{sweep_dir} holds a different sweep (it differs in: {', '.join(diff)})",
                              where=str(sweep_dir / MANIFEST),
                              hint=f"continue it with `flowrl sweep --resume {sweep_dir}`, or pass another -o")
        return manifest
    variants = [(v["name"], v["overrides"]) for v in spec["variants"]]
    runs = plan_runs(recipe.stem, variants, spec["grid"], spec["seeds"])
    per_variant = _validate_runs(recipe, spec["sets"], runs, load)
    for run in runs:
        run["iterations"] = per_variant[run["variant"]]
    manifest = {"version": MANIFEST_VERSION, "created": _now(), "cwd": os.getcwd(), "spec": spec,
                "command": command_line(spec, sweep_dir), "status": "pending", "elapsed_s": 0.0, "runs": runs}
    if write:
        sweep_dir.mkdir(parents=True, exist_ok=True)
        write_manifest(sweep_dir, manifest)
    return manifest


def jobs_and_threads(manifest: dict[str, Any], jobs: int | None, threads: int | None, console: Console) -> tuple[int, int]:
    """``--jobs`` and ``--threads``, else the sweep's own, else 1 (recorded in the manifest); the
    runs at once are capped by the cores available / threads."""
    jobs = jobs or int(manifest.get("jobs") or 1)
    threads = threads or int(manifest.get("threads") or 1)
    manifest.update(jobs=jobs, threads=threads)
    cores = _available_cores()
    allowed = max(1, cores // threads)
    if jobs > allowed:
        console.print(f"note: --jobs {jobs} x --threads {threads} exceeds the {cores} core(s) available; running {allowed} at a time")
        jobs = allowed
    return jobs, threads


def command_line(spec: dict[str, Any], sweep_dir: Path) -> str:
    """The `flowrl sweep` command that defines this sweep (seeds listed explicitly)."""
    import shlex

    parts = ["flowrl", "sweep", spec["recipe"]]
    for s in spec["sets"]:
        parts += ["--set", s]
    for v in spec["variants"]:
        parts += ["--variant", f"{v['name']}:{','.join(v['overrides'])}"]
    for key, values in spec["grid"].items():
        parts += ["--grid", f"{key}={','.join(values)}"]
    parts += ["--seed-list", ",".join(str(s) for s in spec["seeds"]), "-o", str(sweep_dir)]
    return " ".join(shlex.quote(p) for p in parts)
