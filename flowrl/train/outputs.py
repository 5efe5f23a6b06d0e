"""What a run writes for people, on the main process: the resolved recipe, ``metrics.jsonl``
(one row per iteration), annotated image grids of one group, and the trackers' copies."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..files import write_text_atomic
from ..interfaces import NeedsRunDir, ProfilingChunker
from ..recipe import dump_toml
from ..runlog import MetricsLog, image_grid, with_condition


class RunOutputs:
    """The run directory's human-facing files; on processes other than the main one it does nothing."""

    def __init__(self, run_dir: Path, session, ctx, start_iteration: int):
        self.run_dir = run_dir
        self.enabled = ctx.is_main
        self.trackers = session.components.trackers
        self.metrics: MetricsLog | None = None
        if not self.enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(run_dir / "recipe.toml", dump_toml(session.recipe.to_toml_dict()))
        chunker = session.components.chunker
        if isinstance(chunker, ProfilingChunker) and chunker.needs_model:
            chunker.save_profile(run_dir / "profile.json")  # the profile measured at start
        (run_dir / "images").mkdir(exist_ok=True)
        for tracker in self.trackers:
            if isinstance(tracker, NeedsRunDir):
                tracker.start(run_dir)
        self.metrics = MetricsLog(run_dir / "metrics.jsonl", resume_from=start_iteration)

    def log_iteration(self, record: dict[str, Any], timer, write_row: bool, checkpoint: Callable[[], Any] | None) -> None:
        """Finish one iteration: its metrics row first (on disk before anything else), then the
        checkpoint (timed as ``time/checkpoint``, added to the row in place), then the trackers.

        A process killed at any moment therefore never loses the row of an iteration that a
        checkpoint says is complete: resume drops rows from the checkpoint's iteration on.
        """
        record.update({f"time/{k}": v for k, v in timer.seconds.items()})
        write_row = write_row and self.enabled
        if write_row:
            self.metrics.write(record)
        if checkpoint is not None:
            with timer("checkpoint"):
                checkpoint()
            record["time/checkpoint"] = timer.seconds["checkpoint"]
            if write_row:
                self.metrics.rewrite_last(record)
        if write_row:
            for tracker in self.trackers:
                tracker.log_metrics(record["iteration"], {k: v for k, v in record.items() if isinstance(v, float)})

    def write_row(self, record: dict[str, Any]) -> None:
        """Append a row that is not an iteration's (the final evaluation)."""
        if self.enabled:
            self.metrics.write(record)

    def write_group_grid(self, batch, group_size: int, first_reward: str) -> None:
        """The first group of the batch, each image captioned with its reward and advantage."""
        if not self.enabled:
            return
        n = min(group_size, len(batch.indices))
        finite = batch.advantages is not None
        caps = [
            f"r={batch.rewards[first_reward][i]:.3f}\nA={batch.advantages[i].mean():+.2f}" if finite else "non-finite"
            for i in range(n)
        ]
        grid = image_grid(*with_condition(batch.images[:n], caps, batch.prompts[0]))  # editing: the condition first
        grid.save(self.run_dir / "images" / f"iter_{batch.iteration:06d}.png")
        for tracker in self.trackers:
            tracker.log_image(batch.iteration, "group", grid)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        for tracker in self.trackers:
            tracker.close()
