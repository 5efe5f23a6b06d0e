"""A slow, logging reward for the fleet tests, built in each replica process by name.

Imported by the replicas LitServe spawns (they inherit the test's sys.path). Every call appends
one JSON line per event to ``LOG_DIR/<pid>.log``: ``start`` (before the delay, with the
prompts and the replica's device) and ``done``. A prompt ``"crash"`` ends the replica process
at once, as a reward that segfaults or runs out of memory would. While ``LOG_DIR/hold`` exists, a
call that has logged ``start`` waits before its delay: a test that must catch a replica in the
middle of a call (to kill it there) holds the replicas, however long the loaded machine takes it
to see the ``start``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from flowrl.interfaces import RewardOutput


def expected(images: torch.Tensor) -> torch.Tensor:
    """The reward's value, computed in-process by the tests: unique to each image."""
    return images.mean((1, 2, 3)) * 100 + images[:, 1, 0, 0]


class SlowReward:
    name = "slow"

    def __init__(self, delay: float, log_dir: str, device: str):
        self.delay, self.log, self.device = delay, Path(log_dir) / f"{os.getpid()}.log", device
        self.hold = Path(log_dir) / "hold"

    def _write(self, **event) -> None:
        with open(self.log, "a") as f:
            f.write(json.dumps(event) + "\n")
            f.flush()

    def __call__(self, images, prompts, metadata=None):
        if "crash" in prompts:
            os._exit(3)
        self._write(event="start", prompts=list(prompts), device=self.device, pid=os.getpid(), t=time.time())
        while self.hold.exists():
            time.sleep(0.01)
        time.sleep(self.delay)
        self._write(event="done", prompts=list(prompts), pid=os.getpid(), t=time.time())
        return RewardOutput(scores=expected(images), extras={"red": images[:, 0].mean((1, 2))})


def build(delay: float, log_dir: str, settings: list[str]) -> SlowReward:
    device = "default"
    for text in settings:
        key, value = text.split("=", 1)
        if key == "device":
            device = json.loads(value)
    return SlowReward(delay, log_dir, device)


def log_positions(log_dir: Path) -> dict[str, int]:
    """How many events each replica's log holds now: pass it to :func:`events` as ``after`` to
    read only the events written since (per file, since replicas append to their own files in
    any order relative to each other)."""
    return {path.name: len(_lines(path)) for path in Path(log_dir).glob("*.log")}


def events(log_dir: Path, after: dict[str, int] | None = None) -> list[dict]:
    """Every event of every replica (only those written since ``after``, a
    :func:`log_positions`), in the order they happened (by their time stamp)."""
    out = []
    for path in sorted(Path(log_dir).glob("*.log")):
        out += [json.loads(line) for line in _lines(path)[(after or {}).get(path.name, 0):]]
    return sorted(out, key=lambda e: e["t"])


def _lines(path: Path) -> list[str]:
    # a replica may be writing its last line right now: only whole lines are events
    text = path.read_text()
    return [line for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]


SERVER = """
import functools, sys
sys.path.insert(0, {helpers!r})
import fleet_helpers
from flowrl.serving.fleet import serve_fleet
serve_fleet(functools.partial(fleet_helpers.build, {delay!r}, {log_dir!r}), [], name="slow", port=0, replicas=2,
            max_batch=4, max_wait=0.05, devices=["cpu:a", "cpu:b"])
"""


def server_command(delay: float, log_dir: Path) -> list[str]:
    return [sys.executable, "-c", SERVER.format(helpers=str(Path(__file__).parent), delay=delay, log_dir=str(log_dir))]
