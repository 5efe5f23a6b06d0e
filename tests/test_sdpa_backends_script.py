"""``benchmarks/sdpa_backends.py`` (the GPU check's attention step) rehearsed on the CPU at tiny
shapes: every backend's process started at once, one line per backend as it ends, and a backend
past its time limit killed and reported without holding up the others."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "sdpa_backends.py"


def _run(*args: str) -> tuple[list[dict], float]:
    started = time.perf_counter()
    out = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", *args], capture_output=True,
                         text=True, timeout=240, check=True)
    return [json.loads(line) for line in out.stdout.splitlines()], time.perf_counter() - started


def test_each_backend_reports_ok_or_its_error_at_tiny_shapes():
    rows, _ = _run("--backends", "math,efficient")
    by_name = {r["backend"]: r for r in rows}
    assert set(by_name) == {"math", "efficient"}
    assert by_name["math"]["ok"] and by_name["math"]["done"][-1] == "flux blocks counted"
    # the CPU has no memory-efficient kernel: that backend's own line says so
    assert not by_name["efficient"]["ok"] and "RuntimeError" in by_name["efficient"]["error"]


def test_a_backend_past_its_limit_is_killed_and_reported():
    rows, seconds = _run("--backends", "math,auto", "--per-backend-s", "1")
    assert sorted(r["backend"] for r in rows) == ["auto", "math"]
    assert all(not r["ok"] and r["error"] == "timed out after 1 s" for r in rows), rows
    assert seconds < 30
