"""``flowrl selftest --gpu``: one command that proves flowrl on whatever GPU it gets.

A GPU is often lent for minutes, so every step runs in its own process under its own time
budget (a slow or hanging step is killed at its budget and the next one runs), the budgets add
up to at most 8 minutes, and a failing step is recorded with its error, never the end of the
check. The steps, in order:

========================  ====  =====================================================================
step                      s     what it runs and what it reports
========================  ====  =====================================================================
``doctor``                20    ``flowrl doctor --json``: torch build, driver, packages, kernels
``selftest``              75    ``flowrl selftest --device cuda --json``: a tiny FLUX trained,
                                resumed, every attention backend, ``torch.compile``
``gpu_lane``              110   ``pytest -m gpu tests/gpu -n 4`` (the repository's GPU test lane):
                                passed / failed / skipped and the failing tests' names
``quickstart``            35    ``flowrl train recipes/quickstart.toml`` on CUDA: wall seconds and
                                the held-out verifier's rise in standard errors (the README's bar
                                on the CPU is >= 5), the second judge and ``hf_share`` beside it
``flux_iteration``        85    ``benchmarks/gpu_flux_iteration.py``: one full-size FLUX.1-dev
                                LoRA iteration with random weights: seconds, peak GiB, MFU
``memory``                110   ``benchmarks/gpu_memory_check.py``: ``flowrl plan``'s peak against
                                ``torch.cuda.max_memory_allocated`` for FLUX.1-dev LoRA,
                                SD3.5-Medium and Wan 2.1 1.3B at full size, random weights
``attention``             45    ``benchmarks/sdpa_backends.py``: every attention backend once,
                                forward and backward at FLUX.1's head shape, the backends'
                                processes side by side, each stopped at 40 s
========================  ====  =====================================================================

One step runs only when named (``--only suite``), since it alone outlasts the 8 minutes:
``suite`` (420 s), the whole test suite with CUDA visible (``pytest -n auto -m "not slow and not
gpu"``): passed, failed and skipped, and every failing test with the end of its traceback, each
written the moment pytest knows it (:mod:`flowrl.diagnostics.failure_log`), so a suite stopped at
its budget still says what failed and why.

The steps that need the repository (the test lane and the benchmarks) are skipped, with the
reason, when flowrl runs from an installed package without its checkout. Everything measured
goes into one JSON (device, driver, versions, each step's status, seconds, figures and error)
and a Markdown table beside it: ``benchmarks/results/gpu_check_<device>_<date>.json`` and
``.md`` in a checkout (``--output DIR`` elsewhere), which ``scripts/gpu_runs_table.py`` turns
into docs/gpu_runs.md. ``--dry-run`` prints the steps, their budgets and commands and runs
nothing (no GPU needed; CI runs it).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

from .. import __version__
from ..errors import FlowrlError
from ..files import write_text_atomic
from ..runlog import read_metrics
from .failure_log import summarise

#: The whole check's wall-clock budget: the steps' budgets add up to at most this.
TOTAL_BUDGET_S = 480
#: The README's learning bar for the quickstart: held-out rise in standard errors.
QUICKSTART_BAR_SE = 5.0
#: A step that would get fewer seconds than this is skipped as out of time.
LEAST_USEFUL_S = 10


@dataclasses.dataclass
class Setting:
    """Where the steps run: the checkout (None for an installed package), a scratch directory
    for their files, the Python that runs them, and the device."""

    repo: Path | None
    workdir: Path
    python: str = sys.executable
    device: str = "cuda"

    def flowrl(self, *args: str) -> list[str]:
        return [self.python, "-m", "flowrl", *args]


@dataclasses.dataclass(frozen=True)
class Step:
    """One step: ``command`` gives its argv, or a sentence saying why it cannot run here (a skip);
    ``figures`` reads what it measured from its output and files (and may raise
    :class:`StepFailed` when the step ran but what it measured is a failure)."""

    name: str
    title: str
    budget_s: int
    command: Callable[[Setting], list[str] | str]
    figures: Callable[[Setting, str], dict[str, Any]]
    #: Runs only when ``--only`` names it (longer than the whole check's budget).
    on_request: bool = False


class StepFailed(Exception):
    """A step that exited cleanly but whose figures say it failed (the message says how)."""

    def __init__(self, message: str, figures: dict[str, Any] | None = None):
        super().__init__(message)
        self.figures = figures or {}


@dataclasses.dataclass
class StepResult:
    name: str
    title: str
    budget_s: int
    status: str  # pass, fail, skip or timeout
    seconds: float
    error: str | None
    figures: dict[str, Any]
    command: str


# ---------------------------------------------------------------------------------------------
# The steps
# ---------------------------------------------------------------------------------------------


def _in_repo(setting: Setting, relative: str) -> Path | str:
    if setting.repo is None or not (setting.repo / relative).exists():
        return (f"needs {relative} from flowrl's repository checkout (run `flowrl selftest --gpu` "
                "with flowrl installed from its checkout: pip install -e .)")
    return setting.repo / relative


def from_repo(relative: str, build: Callable[[Setting, Path], list[str]]) -> Callable[[Setting], list[str] | str]:
    """A step's command that needs ``relative`` from the checkout: ``build(setting, path)``, or
    the reason it is skipped when flowrl runs without its checkout."""

    def command(setting: Setting) -> list[str] | str:
        path = _in_repo(setting, relative)
        return path if isinstance(path, str) else build(setting, path)

    return command


def _json_stdout(stdout: str) -> dict[str, Any]:
    start = stdout.find("{")
    if start < 0:
        raise StepFailed("printed no JSON report")
    return json.loads(stdout[start:])


def _report_figures(stdout: str) -> dict[str, Any]:
    """Counts of a doctor or selftest report, and the names of the checks that failed."""
    report = _json_stdout(stdout)
    figures: dict[str, Any] = dict(report.get("counts", {}))
    failing = [f"{c['section']}/{c['name']}: {c['detail']}" for c in report.get("checks", []) if c["status"] == "fail"]
    if failing:
        raise StepFailed("; ".join(failing), figures)
    return figures


def doctor_step() -> Step:
    return Step("doctor", "flowrl doctor", 20, lambda s: s.flowrl("doctor", "--json"),
                lambda s, out: _report_figures(out))


def selftest_step() -> Step:
    def figures(setting: Setting, out: str) -> dict[str, Any]:
        report = _json_stdout(out)
        base = {"dtype": report.get("dtype"), **report.get("counts", {})}
        for check in report.get("checks", []):
            if check.get("figures"):
                base[f"{check['section']}/{check['name']}"] = check["figures"]
        failing = [f"{c['section']}/{c['name']}: {c['detail']}" for c in report.get("checks", [])
                   if c["status"] == "fail"]
        if failing:
            raise StepFailed("; ".join(failing), base)
        return base

    return Step("selftest", "flowrl selftest on CUDA (tiny FLUX: train, resume, kernels, compile)", 75,
                lambda s: s.flowrl("selftest", "--device", s.device, "--json"), figures)


def junit_figures(path: Path) -> dict[str, Any]:
    """passed / failed / errors / skipped of a JUnit XML report, and the failing tests' ids."""
    if not path.is_file():
        raise StepFailed(f"pytest wrote no report ({path.name})")
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failing = []
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failing.append(f"{case.get('classname', '')}::{case.get('name', '')}")
    figures = {"passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
               "failed": total["failures"], "errors": total["errors"], "skipped": total["skipped"]}
    if failing:
        figures["failing"] = failing
    if total["tests"] == 0:
        raise StepFailed("the GPU lane collected no test", figures)
    if failing:
        raise StepFailed(f"{len(failing)} test(s) failed: " + ", ".join(failing[:10]), figures)
    return figures


def gpu_lane_step() -> Step:
    command = from_repo("tests/gpu", lambda s, lane: [s.python, "-m", "pytest", "-m", "gpu", str(lane), "-q", "-n", "4",
                                                      "-p", "no:cacheprovider", "--junitxml", str(s.workdir / "gpu_lane.xml")])
    return Step("gpu_lane", "GPU test lane (pytest -m gpu tests/gpu)", 110, command,
                lambda s, out: junit_figures(s.workdir / "gpu_lane.xml"))


def quickstart_figures(rows: list[dict[str, Any]], bar_se: float = QUICKSTART_BAR_SE) -> dict[str, Any]:
    """The held-out verifier's first and last evaluation, its rise in standard errors (the two
    evaluations' errors combined), the second judge's and ``hf_share``'s first and last."""
    evals = [r for r in rows if "eval/verifier/mean" in r]
    if len(evals) < 2:
        raise StepFailed(f"{len(evals)} evaluation row(s) in metrics.jsonl, need the first and the last")
    first, last = evals[0], evals[-1]
    rise = last["eval/verifier/mean"] - first["eval/verifier/mean"]
    se = math.hypot(first.get("eval/verifier/sem", 0.0), last.get("eval/verifier/sem", 0.0))
    figures = {"verifier_first": round(first["eval/verifier/mean"], 4), "verifier_last": round(last["eval/verifier/mean"], 4),
               "rise_se": round(rise / se, 2) if se > 0 else None}
    for key, label in (("eval/embedded_clip/mean", "second_judge"), ("eval/hf_share/mean", "hf_share")):
        if key in first and key in last:
            figures[f"{label}_first"] = round(first[key], 4)
            figures[f"{label}_last"] = round(last[key], 4)
    if figures["rise_se"] is None or figures["rise_se"] < bar_se:
        raise StepFailed(f"held-out verifier {figures['verifier_first']} -> {figures['verifier_last']}: "
                         f"{figures['rise_se']} standard errors, the CPU's bar is >= {bar_se:g}", figures)
    return figures


def quickstart_step() -> Step:
    command = from_repo("recipes/quickstart.toml", lambda s, recipe: s.flowrl(
        "train", str(recipe), "--set", f"run.device={s.device}", "--output-dir", str(s.workdir / "quickstart"),
        "--overwrite"))
    return Step("quickstart", "the README's quickstart on CUDA (learns as on the CPU?)", 35, command,
                lambda s, out: quickstart_figures(read_metrics(s.workdir / "quickstart")))


def _benchmark(script: str, *args: str) -> Callable[[Setting], list[str] | str]:
    return from_repo(f"benchmarks/{script}",
                     lambda s, path: [s.python, str(path), *[a.format(work=s.workdir) for a in args]])


def flux_figures(result: dict[str, Any]) -> dict[str, Any]:
    """Seconds per iteration (the median after the warm-up iteration), rollout and update seconds,
    peak GiB, ``compute/ratio`` and MFU of the one variant the check runs."""
    step = result.get("variants", {}).get("step")
    if not isinstance(step, dict):
        raise StepFailed("the benchmark's JSON has no 'step' variant")
    if step.get("error"):
        raise StepFailed(str(step["error"]))
    phases = step.get("phase_seconds", {})
    figures = {"seconds_per_iteration": step.get("median"), "rollout_s": phases.get("time/rollout"),
               "update_s": phases.get("time/update"), "peak_gib": step.get("peak_allocated_gib"),
               "compute_ratio": step.get("compute", {}).get("compute/ratio")}
    figures.update({k: v for k, v in step.items() if "mfu" in k or "flops" in k})
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items() if v is not None}


def flux_step() -> Step:
    return Step("flux_iteration", "FLUX.1-dev iteration (full size, random weights, LoRA r64, 512 x 512)", 85,
                _benchmark("gpu_flux_iteration.py", "--variants", "step", "--iterations", "2",
                           "--json", "{work}/flux_iteration.json"),
                lambda s, out: flux_figures(json.loads((s.workdir / "flux_iteration.json").read_text())))


def memory_figures(result: dict[str, Any]) -> dict[str, Any]:
    """Planned and measured peak GiB per configuration; a configuration that failed fails the step."""
    configurations = result.get("configurations", {})
    if not configurations:
        raise StepFailed("the memory check's JSON lists no configuration")
    figures, errors = {}, []
    items = configurations.items() if isinstance(configurations, dict) else (
        (c.get("name", str(i)), c) for i, c in enumerate(configurations))
    for name, item in items:
        if item.get("error"):
            errors.append(f"{name}: {item['error']}")
            continue
        figures[name] = {k: item.get(k) for k in ("planned_gib", "measured_gib", "ratio", "seconds", "status")
                         if k in item}
    if errors:
        raise StepFailed("; ".join(errors), figures)
    return figures


def memory_step() -> Step:
    return Step("memory", "flowrl plan against max_memory_allocated: FLUX.1-dev LoRA, SD3.5-M, Wan 2.1 1.3B", 110,
                _benchmark("gpu_memory_check.py", "--json", "{work}/memory.json", "--budget-s", "100"),
                lambda s, out: memory_figures(json.loads((s.workdir / "memory.json").read_text())))


#: Backends known to fault at FLUX.1's shapes on Hopper (torch's default picks cuDNN): reported,
#: not failed, since flowrl's own ``auto`` leaves cuDNN out (flowrl/train/accel.py).
KNOWN_FAULTY = ("auto", "cudnn")


def attention_figures(stdout: str) -> dict[str, Any]:
    """Which backends ran (one JSON line each); a fault of a backend in :data:`KNOWN_FAULTY` is
    reported, any other backend's error fails the step."""
    figures, broken = {}, []
    for line in stdout.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        name = row.get("backend", "?")
        ok = bool(row.get("ok"))
        figures[name] = "ok" if ok else f"error: {row.get('error') or row.get('stderr', '')}"[:200]
        if not ok and name not in KNOWN_FAULTY:
            broken.append(name)
    if not figures:
        raise StepFailed("the attention check printed no backend")
    if broken:
        raise StepFailed("attention backend(s) failed: " + ", ".join(broken), figures)
    return figures


def attention_step() -> Step:
    return Step("attention", "every attention backend once (FLUX.1 head shape, forward and backward)", 45,
                _benchmark("sdpa_backends.py", "--per-backend-s", "40"), lambda s, out: attention_figures(out))


def suite_figures(path: Path) -> dict[str, Any]:
    """Counts and failures of the whole suite from its outcome log (complete or cut at the budget)."""
    if not path.is_file():
        raise StepFailed("pytest wrote no outcome: it stopped before any test (the step's output says why)")
    figures = summarise(path)
    if not any(figures[k] for k in ("passed", "failed", "skipped")):
        raise StepFailed("the suite ran no test (the step's output says why)", figures)
    if figures["failed"]:
        names = ", ".join(f["test"] for f in figures["failures"][:10])
        raise StepFailed(f"{figures['failed']} test(s) failed: {names}", figures)
    return figures


def suite_step() -> Step:
    command = from_repo("tests", lambda s, tests: [
        s.python, "-m", "pytest", str(tests), "-m", "not slow and not gpu", "-n", "auto", "-q", "-p", "no:cacheprovider",
        "--continue-on-collection-errors",
        "-p", "flowrl.diagnostics.failure_log", "--outcome-log", str(s.workdir / "suite.jsonl")])
    return Step("suite", "the whole test suite with CUDA visible (pytest -n auto), failures with tracebacks", 420,
                command, lambda s, out: suite_figures(s.workdir / "suite.jsonl"), on_request=True)


def steps() -> list[Step]:
    """The check's steps, in the order they run (those run only on request last)."""
    return [doctor_step(), selftest_step(), gpu_lane_step(), quickstart_step(), flux_step(), memory_step(),
            attention_step(), suite_step()]


def default_steps() -> list[Step]:
    """What ``flowrl selftest --gpu`` runs without ``--only``."""
    return [s for s in steps() if not s.on_request]


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------


def _tail(text: str, lines: int = 12) -> str:
    kept = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


def _stop(process: subprocess.Popen) -> None:
    """Kill the step and everything it started (its own process group)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        process.kill()
    process.wait()


def run_step(step: Step, setting: Setting, budget_s: float) -> StepResult:
    """Run one step in its own process group, killed at ``budget_s``; never raises."""
    command = step.command(setting)
    if isinstance(command, str):
        return StepResult(step.name, step.title, step.budget_s, "skip", 0.0, command, {}, "")
    shown = shlex.join(command)
    out_path, err_path = setting.workdir / f"{step.name}.out", setting.workdir / f"{step.name}.err"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    started = time.perf_counter()
    with out_path.open("w") as out, err_path.open("w") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, cwd=setting.repo or setting.workdir, env=env,
                                   start_new_session=True)
        try:
            returncode = process.wait(timeout=budget_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            _stop(process)
            returncode, timed_out = None, True
    seconds = round(time.perf_counter() - started, 2)
    stdout, stderr = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    if timed_out:
        return StepResult(step.name, step.title, step.budget_s, "timeout", seconds,
                          f"stopped at its budget of {budget_s:.0f} s; last output:\n{_tail(stderr or stdout)}",
                          _partial_figures(step, setting, stdout), shown)
    try:
        figures = step.figures(setting, stdout)
    except StepFailed as exc:
        return StepResult(step.name, step.title, step.budget_s, "fail", seconds, str(exc), exc.figures, shown)
    except Exception as exc:  # noqa: BLE001 - a step's unreadable output is that step's failure
        error = f"exit status {returncode}: {_tail(stderr or stdout)}" if returncode else \
            f"its output could not be read ({type(exc).__name__}: {exc})"
        return StepResult(step.name, step.title, step.budget_s, "fail", seconds, error, {}, shown)
    if returncode:
        return StepResult(step.name, step.title, step.budget_s, "fail", seconds,
                          f"exit status {returncode}: {_tail(stderr or stdout)}", figures, shown)
    return StepResult(step.name, step.title, step.budget_s, "pass", seconds, None, figures, shown)


def _partial_figures(step: Step, setting: Setting, stdout: str) -> dict[str, Any]:
    """What a step stopped at its budget had measured so far (the suite's outcome log), if anything."""
    try:
        return step.figures(setting, stdout)
    except StepFailed as exc:
        return exc.figures
    except Exception:  # noqa: BLE001 - a cut step's half-written files are no error of their own
        return {}


def device_facts(device: str = "cuda") -> dict[str, Any]:
    """The GPU's name, count, memory, compute capability and driver (from nvidia-smi, if present)."""
    import torch

    index = torch.device(device).index or 0
    props = torch.cuda.get_device_properties(index)
    facts = {"name": props.name, "count": torch.cuda.device_count(), "memory_gib": round(props.total_memory / 1024**3, 1),
             "capability": f"{props.major}.{props.minor}", "driver": None}
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=10, check=False).stdout.split()
            facts["driver"] = out[0] if out else None
        except (OSError, subprocess.SubprocessError):
            pass
    return facts


def versions() -> dict[str, Any]:
    from importlib import metadata

    import torch

    found: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "flowrl": __version__,
                             "python": sys.version.split()[0]}
    for name in ("diffusers", "transformers", "peft", "accelerate"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def slug(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``h100_80gb_hbm3``: a file name's device part."""
    name = re.sub(r"^nvidia\s+", "", name.strip(), flags=re.IGNORECASE)
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "gpu"


def run_check(setting: Setting, chosen: list[Step], total_budget_s: float = TOTAL_BUDGET_S,
              say: Callable[[str], None] = lambda text: None, least_useful_s: float = LEAST_USEFUL_S) -> list[StepResult]:
    """Every chosen step in order, each within its budget and what is left of the total; a step
    that would get under ``least_useful_s`` is skipped as out of time."""
    started = time.perf_counter()
    results = []
    for step in chosen:
        left = total_budget_s - (time.perf_counter() - started)
        if left < least_useful_s:
            results.append(StepResult(step.name, step.title, step.budget_s, "skip", 0.0,
                                      f"out of time: {max(left, 0):.0f} s left of the check's budget", {}, ""))
            say(f"{step.name}: skipped, out of time")
            continue
        say(f"{step.name}: {step.title} (budget {min(step.budget_s, left):.0f} s)")
        result = run_step(step, setting, min(step.budget_s, left))
        say(f"{step.name}: {result.status} in {result.seconds:.1f} s")
        results.append(result)
    return results


def report(results: list[StepResult], device: dict[str, Any], found_versions: dict[str, Any],
           total_budget_s: float, seconds: float, date: str) -> dict[str, Any]:
    return {"kind": "flowrl-gpu-check", "version": 1, "date": date, "device": device, "versions": found_versions,
            "budget_s": total_budget_s, "seconds": round(seconds, 2),
            "steps": [dataclasses.asdict(r) for r in results]}


def _figures_text(figures: dict[str, Any]) -> str:
    parts = []
    for key, value in figures.items():
        if isinstance(value, dict):
            inner = ", ".join(f"{k} {v}" for k, v in value.items() if v is not None)
            parts.append(f"{key}: {inner}")
        elif isinstance(value, list):
            parts.append(f"{key}: {len(value)}")
        elif value is not None:
            parts.append(f"{key} {value}")
    return "; ".join(parts)


def markdown(result: dict[str, Any]) -> str:
    """The report as a Markdown table (what docs/gpu_runs.md and docs/benchmarks.md include)."""
    device, found = result["device"], result["versions"]
    title = (f"**{device['name']}** ({device.get('memory_gib')} GiB, driver {device.get('driver') or 'not recorded'}), "
             f"{result['date']}, torch {found.get('torch')}, diffusers {found.get('diffusers')}, "
             f"flowrl {found.get('flowrl')}: `flowrl selftest --gpu`, {result['seconds']:.0f} s of "
             f"{result['budget_s']:.0f} s.")
    lines = [title, "",
             "| step | status | seconds (budget) | figures | error |", "|---|---|---|---|---|"]
    for step in result["steps"]:
        error = (step["error"] or "").replace("\n", " ").replace("|", "\\|")
        figures = _figures_text(step["figures"]).replace("|", "\\|")
        lines.append(f"| {step['name']} | {step['status']} | {step['seconds']:.1f} ({step['budget_s']}) | {figures} | "
                     f"{error[:300]} |")
    return "\n".join(lines) + "\n"


def write_report(result: dict[str, Any], directory: Path, part: list[str] | None = None) -> tuple[Path, Path]:
    """``gpu_check_<device>_<date>.json`` and ``.md``, each published atomically; a check of only
    some steps (``part``, their names) is ``gpu_check_<device>_<date>_only-<steps>``, so that running
    the failed steps again the same day does not replace the whole check's results."""
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"gpu_check_{slug(result['device']['name'])}_{result['date'][:10]}"
    if part:
        stem += "_only-" + "-".join(part)
    json_path, md_path = directory / f"{stem}.json", directory / f"{stem}.md"
    write_text_atomic(json_path, json.dumps(result, indent=2) + "\n")
    write_text_atomic(md_path, markdown(result))
    return json_path, md_path


def choose(names: str | None, skip: str | None) -> list[Step]:
    """The steps ``--only`` and ``--skip`` leave, in the check's order (a step run only on request
    only when ``--only`` names it); an unknown name is an error."""
    every = steps()
    known = [s.name for s in every]
    for option, value in (("--only", names), ("--skip", skip)):
        for name in (value or "").split(","):
            if name.strip() and name.strip() not in known:
                raise FlowrlError(f"no step named {name.strip()!r}", where=option,
                                  hint="the steps are " + ", ".join(known))
    only = {n.strip() for n in (names or "").split(",") if n.strip()}
    skipped = {n.strip() for n in (skip or "").split(",") if n.strip()}
    if names is not None and not only:
        raise FlowrlError("--only names no step", where="--only", hint="the steps are " + ", ".join(known))
    chosen = [s for s in every if (s.name in only if only else not s.on_request) and s.name not in skipped]
    if not chosen:  # an empty check would still write a report, under the whole check's file name
        raise FlowrlError("--only and --skip leave no step to run", where="--skip",
                          hint="skip fewer steps; the steps are " + ", ".join(known))
    return chosen


def find_repo(start: Path | None = None) -> Path | None:
    """The checkout holding ``benchmarks/`` and ``tests/gpu`` next to this package, if any."""
    for candidate in ([start] if start else []) + [Path(__file__).resolve().parents[2], Path.cwd()]:
        if candidate and (candidate / "benchmarks").is_dir() and (candidate / "flowrl").is_dir():
            return candidate
    return None


def today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
