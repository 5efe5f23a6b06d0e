"""A held-out evaluation's warning signs, said while the run goes on.

After each evaluation the run compares it with its first one (:func:`flowrl.run_health.
evaluation_checks`: an optimised reward falling, a judge falling while it rises, the
images' high-frequency share growing) and says each sign once, above the progress bar, the
iteration it first showed at (a judge that fell once more when an optimised reward has risen:
the hacking signature): a hacking run is seen when it starts, not after hours. Everything
it reads is in ``metrics.jsonl`` (on resume, the first evaluation is read back from there), so
it keeps no state of its own; ``flowrl diagnose RUN_DIR`` prints every check.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..run_health import evaluation_checks, is_evaluation, optimised_labels
from ..runlog import read_metrics


class WarningSigns:
    """``signs(record)`` after an evaluation's metrics joined ``record``; ``say`` prints a line
    (None on the processes other than the main one: nothing to do there)."""

    def __init__(self, run_dir: Path, recipe, say: Callable[[str], None] | None):
        self.run_dir, self.say = Path(run_dir), say
        self.optimised = optimised_labels(recipe)
        self.said: set[tuple[str, bool]] = set()
        metrics = self.run_dir / "metrics.jsonl"
        self.first = next((r for r in read_metrics(self.run_dir) if is_evaluation(r)), None) \
            if say is not None and metrics.is_file() else None

    def __call__(self, record: dict[str, Any]) -> None:
        if self.say is None or not is_evaluation(record):
            return
        if self.first is None:
            self.first = dict(record)
            return
        for check in evaluation_checks([self.first, record], self.optimised):
            # a judge that fell is said again when an optimised reward's rise makes it the hacking signature
            sign = (check.name, bool(check.figures.get("hacking")))
            if check.status != "ok" and sign not in self.said:
                self.said.add(sign)
                self.say(f"warning at iteration {record['iteration']}: {check.name}: {check.detail} "
                         f"(every check: flowrl diagnose {self.run_dir})")
