"""What ``flowrl doctor`` and ``flowrl selftest`` share: a check's result, its printing and its JSON.

A report is a list of :class:`Check`, each in a section. ``doctor`` grades ``ok`` / ``warn`` /
``fail``; ``selftest`` grades ``pass`` / ``skip`` / ``fail``. Either command exits non-zero only
when a check failed: a warning or a skip is something to read, not a broken machine.

Printed one line per check (never a table): a log of a GPU job, piped through ``tee`` or read in
CI, stays greppable (``grep fail``) and is not cut at 80 columns when stdout is not a terminal.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from rich.console import Console
from rich.markup import escape

from ..check_result import STYLES, Check

__all__ = ["STYLES", "Check", "counts", "failed", "format_figures", "print_report", "report_json"]


def failed(checks: list[Check]) -> bool:
    return any(c.status == "fail" for c in checks)


def counts(checks: list[Check]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in checks:
        out[c.status] = out.get(c.status, 0) + 1
    return out


def format_figures(figures: dict[str, Any]) -> str:
    """``12.3 s, 4.1 images/s, peak 0.21 GB (plan 0.30 GB)``: the figures a reader compares."""
    parts = []
    if "seconds" in figures:
        parts.append(f"{figures['seconds']:.1f} s")
    if figures.get("images_per_second") is not None:
        parts.append(f"{figures['images_per_second']:.2f} images/s")
    if "peak_memory_gb" in figures:
        peak = figures["peak_memory_gb"]
        text = "peak memory n/a on the CPU" if peak is None else f"peak {peak:.3f} GB"
        if figures.get("plan_gb") is not None:
            text += f" (plan {figures['plan_gb']:.3f} GB)"
        parts.append(text)
    return ", ".join(parts)


def print_report(console: Console, title: str, checks: list[Check]) -> None:
    """The checks grouped by section, one line each: ``  status  name: detail [figures]``."""
    console.print(f"[bold]{escape(title)}[/bold]")
    section = None
    width = max((len(c.status) for c in checks), default=4)
    for c in checks:
        if c.section != section:
            section = c.section
            console.print(f"[bold]{escape(section)}[/bold]")
        figures = format_figures(c.figures)
        line = f"{escape(c.name)}: {escape(c.detail)}" + (f" [dim]\\[{escape(figures)}][/dim]" if figures else "")
        status = f"[{STYLES[c.status]}]{c.status.ljust(width)}[/{STYLES[c.status]}]"
        # soft_wrap: a long line stays one line in a log (a terminal still wraps it for the eye)
        console.print(f"  {status}  {line}", soft_wrap=True, highlight=False)
    summary = ", ".join(f"{n} {s}" for s, n in counts(checks).items())
    console.print(f"summary: {summary}" + (" - [bold red]FAILED[/bold red]" if failed(checks) else ""))


def report_json(command: str, checks: list[Check], **extra: Any) -> str:
    """The report for machines: every check with its figures, the counts, and whether it failed."""
    return json.dumps({"command": command, **extra, "failed": failed(checks), "counts": counts(checks),
                       "checks": [dataclasses.asdict(c) for c in checks]}, indent=2)
