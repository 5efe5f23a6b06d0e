"""Shared test fixtures. Keep this file small: a fixture used by one file lives in that file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

# One thread everywhere: the test machine has 2 cores shared by many processes, and these
# variables are inherited by every subprocess a test starts.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]

# The training tests' helpers (tests/train/engine_helpers.py) are imported by name by tests of
# other directories too (tests/gpu): importable whichever directory is collected first.
if str(REPO / "tests" / "train") not in sys.path:
    sys.path.append(str(REPO / "tests" / "train"))


_SDPA_SWITCHES = ("flash", "mem_efficient", "math", "cudnn")


@pytest.fixture(autouse=True)
def _torch_switches_restored():
    """A run on CUDA sets torch switches for its whole process (cuDNN attention off,
    flowrl.train.accel.default_attention; fp32 convolutions for an fp32 denoiser, exact_float32):
    each test gets them back as they were, so what a test sees does not depend on which run came
    before it in its worker (on an H200, two attention tests failed after a CUDA run in theirs)."""
    sdpa = {name: getattr(torch.backends.cuda, f"{name}_sdp_enabled")() for name in _SDPA_SWITCHES}
    tf32 = torch.backends.cudnn.allow_tf32
    yield
    for name, on in sdpa.items():
        getattr(torch.backends.cuda, f"enable_{name}_sdp")(on)
    torch.backends.cudnn.allow_tf32 = tf32


def _load_hypothesis_profile() -> None:
    """Property tests (hypothesis) are reproducible in CI: the default ``ci`` profile
    derandomizes them (the same 120 examples per test on every run and machine, no example
    database). For a longer local hunt, ``FLOWRL_HYPOTHESIS=long python -m pytest
    tests/test_recipe_fuzz.py`` draws fresh random examples, 2000 per test
    (``FLOWRL_HYPOTHESIS_EXAMPLES=N`` sets the number); a failure prints the example, to be kept
    as an ``@example`` on the test. A property test therefore sets no ``max_examples`` itself."""
    try:
        from hypothesis import settings
    except ImportError:  # the dev extra is not installed: the property tests skip themselves
        return
    settings.register_profile("ci", derandomize=True, database=None, max_examples=120)
    settings.register_profile("long", derandomize=False, print_blob=True,
                              max_examples=int(os.environ.get("FLOWRL_HYPOTHESIS_EXAMPLES", "2000")))
    settings.load_profile(os.environ.get("FLOWRL_HYPOTHESIS", "ci"))


_load_hypothesis_profile()
FLOWRL_BIN = Path(sys.executable).parent / "flowrl"


@dataclass
class CliResult:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def flat_err(self) -> str:
        """stderr with rich's line wrapping undone (whitespace runs become one space)."""
        return " ".join(self.stderr.split())

    @property
    def flat_out(self) -> str:
        return " ".join(self.stdout.split())


def cli_env(pythonpath: list[Path] | tuple = (), **extra: str) -> dict[str, str]:
    """The environment for a flowrl subprocess: one thread, wide output, extra import paths."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", COLUMNS="250", PYTHONIOENCODING="utf-8")
    env.pop("FLOWRL_DISABLE_PLUGINS", None)
    paths = [str(p) for p in pythonpath] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(extra)
    return env


# Runs several `flowrl` command lines through flowrl.cli.main (what the console script calls) in
# ONE interpreter: torch's import costs 2-3 s per process. An exception that escapes main() is
# printed the way the interpreter would print it, so "Traceback" in stderr means what it means
# for a real process.
_DRIVER = r"""
import contextlib, io, json, os, sys, traceback
calls = json.loads(sys.argv[1])
from flowrl import cli
results = []
for call in calls:
    saved = dict(os.environ)
    os.environ.update(call.get("env", {}))
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.main(call["argv"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    os.environ.clear()
    os.environ.update(saved)
    results.append({"argv": call["argv"], "returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
sys.stdout.write("\n@@RESULTS@@" + json.dumps(results))
"""


def run_cli_batch(calls: list, *, pythonpath=(), cwd: Path = REPO, timeout: float = 120) -> list[CliResult]:
    """Run ``flowrl`` command lines in one subprocess.

    Each call is an argv list, or a dict ``{"argv": [...], "env": {...}}`` (env set for that
    call only). Returns one :class:`CliResult` per call.
    """
    calls = [c if isinstance(c, dict) else {"argv": list(c)} for c in calls]
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, json.dumps(calls)],
        cwd=cwd,
        env=cli_env(pythonpath),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    marker = "\n@@RESULTS@@"
    assert marker in proc.stdout, f"driver failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return [CliResult(**r) for r in json.loads(proc.stdout.split(marker, 1)[1])]


def run_cli_in_process(calls: list, *, cwd: Path = REPO) -> list[CliResult]:
    """The same command lines and results as :func:`run_cli_batch`, run in this process (no
    interpreter to start: torch is imported already). For calls that need nothing of a fresh
    process: no import path of their own, no signal, no process count, no library state read at
    import (``HF_HUB_OFFLINE``, for one, is read when huggingface_hub is first imported). The
    environment, working directory and console widths are restored after each call."""
    import contextlib
    import io
    import traceback

    from flowrl import cli
    from flowrl.commands.base import console, err_console

    results = []
    for call in (c if isinstance(c, dict) else {"argv": list(c)} for c in calls):
        saved_env, saved_cwd, saved_widths = dict(os.environ), os.getcwd(), (console._width, err_console._width)
        os.environ.update(OMP_NUM_THREADS="1", COLUMNS="250", PYTHONIOENCODING="utf-8", **call.get("env", {}))
        os.environ.pop("FLOWRL_DISABLE_PLUGINS", None)
        console.width = err_console.width = 250  # they read COLUMNS once, at import (as a fresh process would now)
        out, err, code = io.StringIO(), io.StringIO(), 0
        try:
            os.chdir(cwd)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    cli.main([str(a) for a in call["argv"]])
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                except Exception:  # printed as the interpreter would print it (see _DRIVER)
                    traceback.print_exc()
                    code = 1
        finally:
            os.chdir(saved_cwd)
            os.environ.clear()
            os.environ.update(saved_env)
            console._width, err_console._width = saved_widths
        results.append(CliResult(argv=call["argv"], returncode=code, stdout=out.getvalue(), stderr=err.getvalue()))
    return results


@pytest.fixture(scope="session")
def flowrl_cli():
    """The one way tests run ``flowrl`` command lines, in two modes: ``.in_process(calls, cwd=...)``
    (see :func:`run_cli_in_process`) where a fresh interpreter adds nothing, ``.batch(calls,
    pythonpath=...)`` (see :func:`run_cli_batch`) in one subprocess where it does; ``.env(pythonpath)``
    for a hand-made subprocess (signals, several processes), ``.script`` (the installed ``flowrl``
    console script) and ``.repo``. Both modes return one :class:`CliResult` per call.

    Use the fixture rather than importing this module: ``conftest`` is not a unique module name.
    """
    return SimpleNamespace(in_process=run_cli_in_process, batch=run_cli_batch, env=cli_env, script=FLOWRL_BIN,
                           repo=REPO)


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory):
    """``plugin_site(module, source) -> directory``: a one-module distribution with a ``flowrl``
    entry point, installed the way a third party installs one (a ``.dist-info`` beside the module);
    put the directory on ``PYTHONPATH`` of the processes that should load it."""

    def make(module: str, source: str) -> Path:
        site = tmp_path_factory.mktemp("site")
        (site / f"{module}.py").write_text(source)
        info = site / f"{module}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[flowrl]\n{module} = {module}\n")
        return site

    return make


@pytest.fixture
def validate(flowrl_cli):
    """``validate(recipe, *overrides) -> (exit code, stderr)``: ``flowrl validate RECIPE --set
    ...`` in this process (``flowrl_cli.in_process``), from the current directory."""

    def run(recipe, *overrides: str) -> tuple[int, str]:
        args = ["validate", str(recipe)]
        for o in overrides:
            args += ["--set", o]
        (result,) = flowrl_cli.in_process([args], cwd=Path.cwd())
        return result.returncode, result.stderr

    return run


def _first_shares(total: int, workers: int) -> list[int]:
    """How many tests pytest-xdist's worksteal scheduler first sends each worker: contiguous
    slices of the collection, in order (``xdist.scheduler.worksteal``, ``check_schedule``)."""
    sizes = []
    for k in range(workers):
        sizes.append(total // (workers - k))
        total -= sizes[-1]
    return sizes


def pytest_collection_modifyitems(config, items):
    """The slow tests (``@pytest.mark.slow``) start first, spread over the workers. Worksteal
    gives each worker a contiguous slice and runs it in order; an idle worker takes from the end
    of another's queue. So a long test that starts late keeps the run going alone. Each worker's
    slice starts with every n-th slow test, then the other tests fill the slices in their
    collected order. Every worker computes the same order. (The default run deselects the slow
    lane after this hook, so this matters for ``pytest -m slow``.)"""
    slow = [item for item in items if item.get_closest_marker("slow")]
    rest = [item for item in items if not item.get_closest_marker("slow")]
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    heads = [slow[k::workers] for k in range(workers)]
    ordered = []
    for head, share in zip(heads, _first_shares(len(items), workers)):
        take = max(0, share - len(head))
        ordered += head + rest[:take]
        rest = rest[take:]
    items[:] = ordered + rest
