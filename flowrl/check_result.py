"""One check's result: the line ``flowrl doctor``, ``selftest`` and ``diagnose`` print (their report:
:mod:`flowrl.diagnostics.report`). Here, below every layer that produces checks, so that the
training loop can grade its own (``flowrl.run_health``) without importing the commands' side."""

from __future__ import annotations

import dataclasses
from typing import Any

STYLES = {"ok": "green", "pass": "green", "warn": "yellow", "skip": "yellow", "fail": "bold red"}


@dataclasses.dataclass
class Check:
    """One line of a report. ``figures``: measured numbers (``seconds``, ``images_per_second``,
    ``peak_memory_gb``, ``plan_gb``, ...), printed after the detail and kept as numbers in JSON."""

    section: str
    name: str
    status: str
    detail: str
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.status not in STYLES:
            raise ValueError(f"unknown check status {self.status!r} (one of {', '.join(STYLES)})")
