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


#: The tests that take longest, with their seconds on one worker of the 2-core CI machine (from
#: ``pytest --durations`` of a clean-clone ``.ci/run``, 2026-11-26): a whole module where its tests
#: share a module-scoped fixture (a 2-process launch, a served fleet) that a split module would
#: pay for twice, else single tests (their parametrisations together).
LONG = {
    "tests/test_quickstart.py::test_quickstart_variant_trains": 70,
    "tests/engine/test_engine_objectives_resume.py::test_objective_state_resumes_bitwise": 65,
    "tests/engine/test_engine_fsdp2.py::test_fsdp2_run_with_a_sharded_ema_resumes_exactly_and_exports": 55,
    "tests/rewards/test_reward_fleet.py": 54,
    "tests/engine/test_engine_launcher.py": 50,
    "tests/test_readme_quickstart.py": 44,
    "tests/test_cli_ux.py": 41,
    "tests/sweep/test_sweep.py::test_sweep_killed_by_sigkill_resumes_without_repeating_finished_runs": 38,
    "tests/sweep/test_sweep.py::test_two_by_two_sweep_runs_every_combination_and_compares": 38,
    "tests/engine/test_engine_memory_knobs.py": 37,
    "tests/engine/test_engine_objectives_parallel.py": 33,
    "tests/test_doctor_selftest.py": 32,
    "tests/test_quiet_output.py": 27,
    "tests/engine/test_engine_fsdp2.py::test_fsdp2_two_processes_equal_one": 26,
    "tests/test_reference_metrics.py::test_quickstart_metrics_equal_the_pre_redesign_reference": 23,
    "tests/engine/test_engine_signals.py::test_first_ctrl_c_is_announced_at_once_and_checkpoints": 20,
    "tests/test_hardware_doc.py": 20,
    "tests/rewards/test_serve_stops_quietly.py": 20,
    "tests/test_reference_metrics.py::test_quickstart_with_the_fast_path_stays_on_the_reference": 19,
    "tests/sweep/test_sweep.py::test_a_failed_run_is_recorded_and_sigterm_stops_the_sweep_cleanly": 17,
    "tests/engine/test_engine_distributed.py": 15,
    "tests/engine/test_engine_fsdp2.py::test_fsdp2_diffusion_nft_with_evaluation_equals_one_process": 15,
    "tests/engine/test_engine_signals.py::test_sigterm_stops_like_the_first_ctrl_c_and_resumes_exactly": 14,
    "tests/diffusers/test_fsdp2_loading.py": 14,
}


def _long_key(nodeid: str) -> str | None:
    test = nodeid.split("[")[0]
    return test if test in LONG else nodeid.split("::")[0] if nodeid.split("::")[0] in LONG else None


def _first_shares(total: int, workers: int) -> list[int]:
    """How many tests pytest-xdist's worksteal scheduler first sends each worker: contiguous
    slices of the collection, in order (``xdist.scheduler.worksteal``, ``check_schedule``)."""
    sizes = []
    for k in range(workers):
        sizes.append(total // (workers - k))
        total -= sizes[-1]
    return sizes


def pytest_collection_modifyitems(config, items):
    """The long tests start first, spread over the workers. Worksteal gives each worker a
    contiguous slice and runs it in order; an idle worker takes from the end of another's queue.
    So a long test that starts late keeps the run going alone, and long tests that share a
    slice run one after another while the other workers run out of work. Each long test goes
    to the head of the slice with the least long work so far (longest first), then the other
    tests fill the slices in their collected order. Every worker computes the same order."""
    long: dict[str, list] = {}
    rest = []
    for item in items:
        key = _long_key(item.nodeid)
        (long.setdefault(key, []) if key else rest).append(item)
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    heads: list[list] = [[] for _ in range(workers)]
    load = [0] * workers
    for key in sorted(long, key=lambda key: -LONG[key]):
        k = min(range(workers), key=lambda k: load[k])
        heads[k] += long[key]
        load[k] += LONG[key]
    ordered = []
    for head, share in zip(heads, _first_shares(len(items), workers)):
        take = max(0, share - len(head))
        ordered += head + rest[:take]
        rest = rest[take:]
    items[:] = ordered + rest
