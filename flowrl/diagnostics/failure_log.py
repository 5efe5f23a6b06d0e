"""A pytest plugin that writes every test's outcome as one JSON line the moment pytest knows it.

JUnit XML is written when the session ends, so a test suite stopped at a time budget (a GPU lent
for minutes) leaves no record of what failed or why. With this plugin each report reaches the file
as it arrives, failures with the end of their traceback::

    pytest -p flowrl.diagnostics.failure_log --outcome-log outcomes.jsonl -n auto

One line per report: ``{"test", "when", "outcome", "seconds"}`` and, for a failure,
``"traceback"`` (its last :data:`TRACEBACK_LINES` lines). Passing tests write their ``call``
report only; a skip or failure in set-up or tear-down writes its own line, and a module that
cannot be collected one with ``"when": "collect"`` (counted as a failure). Under pytest-xdist the
controller writes (the workers' reports reach it), so lines never interleave. ``flowrl selftest
--gpu --only suite`` reads the file with :func:`summarise`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..files import read_jsonl

#: How much of a failure's traceback a line keeps: its end, where the error is.
TRACEBACK_LINES = 30
TRACEBACK_CHARS = 3000


def pytest_addoption(parser: Any) -> None:
    parser.addoption("--outcome-log", default=None, metavar="PATH",
                     help="append one JSON line per test outcome to PATH as the run goes (flowrl.diagnostics.failure_log)")


def pytest_configure(config: Any) -> None:
    path = config.getoption("outcome_log")
    if path and not hasattr(config, "workerinput"):  # an xdist worker's reports reach the controller
        config.pluginmanager.register(OutcomeWriter(Path(path)), "flowrl-outcome-log")


def traceback_tail(text: str, lines: int = TRACEBACK_LINES, chars: int = TRACEBACK_CHARS) -> str:
    kept = "\n".join(text.rstrip().splitlines()[-lines:])
    return kept[-chars:]


class OutcomeWriter:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", buffering=1)  # line-buffered: a killed run keeps every finished line

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when != "call" and report.passed:
            return
        line: dict[str, Any] = {"test": report.nodeid, "when": report.when, "outcome": report.outcome,
                                "seconds": round(report.duration, 3)}
        if report.failed:
            line["traceback"] = traceback_tail(report.longreprtext)
        self.file.write(json.dumps(line) + "\n")

    def pytest_collectreport(self, report: Any) -> None:
        """A module that cannot be collected (an import error: a missing package on this machine)
        fails no test, yet its tests never run: a line of its own, named by the module."""
        if report.failed:
            self.file.write(json.dumps({"test": report.nodeid or "<collection>", "when": "collect", "outcome": "failed",
                                        "seconds": 0.0, "traceback": traceback_tail(report.longreprtext)}) + "\n")

    def pytest_unconfigure(self, config: Any) -> None:
        self.file.close()


def summarise(path: Path) -> dict[str, Any]:
    """Counts of tests passed, failed and skipped (a test is failed if any of its reports failed,
    else skipped if one skipped) and, per failing test, where it failed and its traceback's end."""
    outcome: dict[str, str] = {}
    failures: dict[str, dict[str, str]] = {}
    for line in read_jsonl(path):  # a killed run's cut last line is left out
        test, state = line["test"], line["outcome"]
        if state == "failed":
            outcome[test] = "failed"
            failures.setdefault(test, {"test": test, "when": line["when"], "traceback": line.get("traceback", "")})
        elif state == "skipped" and outcome.get(test) != "failed":
            outcome[test] = "skipped"
        else:
            outcome.setdefault(test, "passed")
    counts = {state: sum(1 for s in outcome.values() if s == state) for state in ("passed", "failed", "skipped")}
    return {**counts, "failures": list(failures.values())}
