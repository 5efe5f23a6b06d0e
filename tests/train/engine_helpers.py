"""Helpers for the training tests: runs of the tiny recipe (tests/tiny_recipe.py, ``ENGINE``) on
the randomly initialised embedded model, their comparison, interrupts and killed checkpoint writes.

Every run here uses 5 sampling steps (T = 4 trainable transitions in chunks of 2), 2 prompts x
4 samples, two passes over each rollout with two optimizer steps each, and a warm-up + cosine LR
schedule, so resume has optimizer moments, a moving LR and off-policy ratios to get right. AdamW's
eps is 1e-6 so that comparing two runs is well conditioned (why: ``tiny_recipe.ENGINE``).
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from unittest import mock

import torch
from safetensors.torch import load_file
from tiny_recipe import ENGINE, tiny_recipe, write_recipe  # noqa: F401 (write_recipe: tests/gpu imports it from here)

from flowrl import hookimpl
from flowrl.recipe import load_recipe
from flowrl.runlog import read_metrics

REPO = Path(__file__).resolve().parents[2]

#: The training tests' recipe as TOML text, ``tiny_recipe(ENGINE)`` (tests/gpu imports it from here).
TINY_RECIPE = tiny_recipe(ENGINE)

#: Keys never compared between runs: wall-clock times, and (CUDA) the allocator's peaks, which
#: depend on the process (a resumed run starts a new one).
TIMING_PREFIX = ("time/", "memory/")


def load(path: Path, *overrides: str):
    return load_recipe(path, list(overrides))


def comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(TIMING_PREFIX)}


def _float_list(x) -> bool:
    return isinstance(x, list) and any(isinstance(v, float) for v in x) and all(
        v is None or isinstance(v, (int, float)) for v in x)


def assert_records_close(a: dict, b: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    a, b = comparable(a), comparable(b)
    assert sorted(a) == sorted(b), set(a) ^ set(b)
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, float) or isinstance(y, float):
            assert math.isclose(x, y, rel_tol=rtol, abs_tol=atol), (key, x, y)
        elif _float_list(x) and _float_list(y):  # per-step diagnostics: floats, same tolerance
            assert len(x) == len(y) and all(
                (u is None and v is None) or (u is not None and v is not None and math.isclose(u, v, rel_tol=rtol, abs_tol=atol))
                for u, v in zip(x, y)), (key, x, y)
        else:
            assert x == y, (key, x, y)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from flowrl.train.checkpoint import latest_checkpoint

    return load_file(str(latest_checkpoint(run_dir) / "model.safetensors"))


def assert_weights_close(a: dict, b: dict, atol: float = 1e-6) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=atol, msg=k)


def quiet_console():
    from rich.console import Console

    return Console(file=open(os.devnull, "w"), width=200)


class InterruptAt:
    """A tracker plugin that sends this process SIGINT (a Ctrl-C) after logging an iteration."""

    def __init__(self, iteration: int):
        self.iteration = iteration

    @hookimpl
    def register_trackers(self, register):
        at = self.iteration

        class Tracker:
            def log_metrics(self, step, metrics):
                if step == at:
                    import signal

                    os.kill(os.getpid(), signal.SIGINT)

            def log_image(self, step, name, image):
                pass

            def close(self):
                pass

        register("interrupt_at", lambda: Tracker())


def run_cli(args: list[str], timeout: float = 120, env: dict | None = None, launcher: bool = False,
            **kwargs) -> subprocess.CompletedProcess:
    """``python -m flowrl ARGS`` from the repository, one thread, wide output; ``env`` adds variables.

    A ``train ... --num-processes N`` runs its N workers as processes forked from this one
    (:func:`run_forked_workers`) unless ``launcher`` is true: the same workers, without the
    launcher's interpreters (the launcher's own tests start it). Once this process has started
    CUDA (a GPU test before, on a machine with one), a forked child cannot use CUDA, so the real
    launcher runs them."""
    if "--num-processes" in args and not launcher and not kwargs and not torch.cuda.is_initialized():
        at = args.index("--num-processes")
        return run_forked_workers(args[:at] + args[at + 2:], int(args[at + 1]), timeout=timeout, env=env)
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "flowrl", *args], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=timeout, **kwargs,
    )


def run_forked_workers(args: list[str], num_processes: int, timeout: float = 120,
                       env: dict | None = None) -> subprocess.CompletedProcess:
    """``flowrl ARGS`` in ``num_processes`` worker processes forked from this test process
    (:func:`forked_workers.fork_workers`: set up as torchrun sets up its workers, sharing this
    process's imports). Returns what :func:`subprocess.run` would, stdout and stderr of every
    worker in rank order.

    Why: a 2-process test through ``flowrl train --num-processes`` starts three interpreters (the
    launcher, torchrun's agent, the fork server) that import torch and diffusers again, about 11
    CPU-seconds a launch, more than the tiny runs themselves. The workers run flowrl's own code
    path for an external launcher; the launcher itself is tested by the tests that start it
    (tests/train/test_engine_launcher.py and those passing ``launcher=True``)."""
    from forked_workers import fork_workers

    def flowrl_main() -> int:
        import importlib

        from flowrl import cli, plugins
        from flowrl.commands.base import console, err_console

        if (env or {}).get("PYTHONPATH"):  # a plugin put on the path: found as a fresh process would find it
            sys.path[:0] = [p for p in env["PYTHONPATH"].split(os.pathsep) if p]
            importlib.invalidate_caches()
            plugins.reset()

        console.width = err_console.width = 200  # what COLUMNS gives a fresh process
        try:
            cli.main([str(a) for a in args])
        except SystemExit as exc:
            return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        return 0

    return fork_workers(flowrl_main, num_processes, timeout=timeout, env=dict(COLUMNS="200", **(env or {})),
                        cwd=REPO, argv=["flowrl", *map(str, args)])


def two_processes_and_one(recipe: Path, sets: Sequence[str], root: Path, *, two_only: Sequence[str] = (),
                          timeout: float = 600) -> tuple[Path, Path]:
    """``recipe`` with ``sets`` trained by 2 DDP processes (with ``two_only`` as well, e.g. their
    rollout processes) into ``root / "two"`` and by 1 process into ``root / "one"``."""
    two, one = root / "two", root / "one"
    args = [a for s in (*sets, *two_only, "distributed.strategy='ddp'") for a in ("--set", s)]
    proc = run_cli(["train", str(recipe), *args, "-o", str(two), "--num-processes", "2"], timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    from flowrl.train import train

    train(load(recipe, *sets, f"run.output_dir={str(one)!r}"), console=quiet_console())
    return two, one


def assert_same_run(two: Path, one: Path, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    """Every metrics row (but the world size) and the final weights of two runs agree."""
    rec2, rec1 = read_metrics(two), read_metrics(one)
    assert len(rec2) == len(rec1)
    for a, b in zip(rec2, rec1):
        a.pop("world_size", None), b.pop("world_size", None)
        assert_records_close(a, b, rtol=rtol, atol=atol)
    assert_weights_close(final_weights(two), final_weights(one), atol=atol)


class Reader:
    """Collects a pipe's text in a thread, with the time each piece arrived."""

    def __init__(self, pipe):
        self.parts: list[tuple[float, str]] = []
        self.thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self.thread.start()

    def _read(self, pipe):
        for line in iter(pipe.readline, ""):
            self.parts.append((time.monotonic(), line))

    def text(self) -> str:
        return "".join(t for _, t in self.parts)

    def when(self, needle: str) -> float | None:
        return next((t for t, line in self.parts if needle in line), None)


def wait_for(predicate, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


class SimulatedKill(BaseException):
    """A process dying in the middle of a checkpoint write.

    A BaseException (like KeyboardInterrupt) so that no ``except Exception`` on the way up can
    swallow it and carry on writing.
    """


@contextlib.contextmanager
def kill_after_writing(victim: str):
    """Raise :class:`SimulatedKill` right after the checkpoint file ``victim`` is written:
    ``"FILE"`` in any checkpoint, or ``"CHECKPOINT/FILE"`` (``"iter_000004/optimizer.safetensors"``)
    in that one only. Wraps the checkpoint module's two writers; the library has no test hook."""
    from flowrl.train import checkpoint

    def matches(path: Path) -> bool:
        folder = path.parent.name  # .tmp-<checkpoint>-<pid> while it is being written
        return victim == path.name or any(
            victim == f"{name}/{path.name}" for name in (folder, folder.removeprefix(".tmp-").rsplit("-", 1)[0])
        )

    def wrap(write, path_of):
        def wrapped(*args, **kwargs):
            write(*args, **kwargs)
            path = Path(path_of(*args))
            if matches(path):
                raise SimulatedKill(f"simulated kill after writing {path}")
        return wrapped

    with mock.patch.object(checkpoint, "save_tensors", wrap(checkpoint.save_tensors, lambda tensors, path: path)), \
         mock.patch.object(checkpoint, "write_text_atomic", wrap(checkpoint.write_text_atomic, lambda path, text: path)):
        yield
