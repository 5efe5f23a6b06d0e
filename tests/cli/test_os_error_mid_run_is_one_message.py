"""An OS error mid-run (a full disk, a quota, a read-only path) at a checkpoint or metrics write is
one message naming the path and the error, exit status 2, no traceback; the previous checkpoint
and the metrics already written stay intact (checkpoints are committed atomically: flowrl.files),
so the run continues with `flowrl train --resume`.

The errors are injected into a two-iteration run of the tiny CLI recipe at its second
iteration's write: the OS calls every write goes through (``os.replace`` for the atomic writes,
``os.fsync`` for the metrics lines) raise as a full disk or a read-only filesystem would.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import pytest
from tiny_recipe import CLI, tiny_recipe

from flowrl.runlog import read_metrics


def _fail_second(monkeypatch, name: str, matches, error) -> None:
    """Make ``os.<name>`` raise ``error(path)`` the second time it is called on a path that
    ``matches`` (the second iteration's write of that file), and behave as usual otherwise."""
    real = getattr(os, name)
    seen = []

    def fake(*args, **kwargs):
        path = os.readlink(f"/proc/self/fd/{args[0]}") if name == "fsync" else str(args[-1])
        if matches(path):
            seen.append(path)
            if len(seen) == 2:
                raise error(path)
        return real(*args, **kwargs)

    monkeypatch.setattr(os, name, fake)


CASES = {
    # the checkpoint directory renamed into place: a full disk (no file named: the run directory is)
    "checkpoint_disk_full": ("replace", lambda p: "/checkpoints/" in p and p.rsplit("/", 1)[-1].startswith("iter"),
                             lambda p: OSError(errno.ENOSPC, "No space left on device"),
                             "No space left on device", "cannot write into"),
    # checkpoints/latest.json on a filesystem that became read-only
    "checkpoint_read_only": ("replace", lambda p: p.endswith("latest.json"),
                             lambda p: OSError(errno.EROFS, "Read-only file system", p),
                             "Read-only file system", "latest.json"),
    # a line of metrics.jsonl over the quota
    "metrics_quota": ("fsync", lambda p: p.endswith("metrics.jsonl"),
                      lambda p: OSError(errno.EDQUOT, "Disk quota exceeded"),
                      "Disk quota exceeded", "cannot write into"),
}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")
@pytest.mark.parametrize("case", list(CASES))
def test_an_os_error_at_a_write_mid_run_is_one_message_and_keeps_the_previous_checkpoint(case, tmp_path, flowrl_cli,
                                                                                        monkeypatch):
    from flowrl.train.checkpoint import checkpoint_iteration, latest_checkpoint, load_checkpoint

    name, matches, error, reason, names = CASES[case]
    recipe = tmp_path / "tiny.toml"
    recipe.write_text(tiny_recipe(CLI, run={"name": f"os_error_{case}", "seed": 3}), encoding="utf-8")
    run_dir = tmp_path / "run"
    _fail_second(monkeypatch, name, matches, error)
    (result,) = flowrl_cli.in_process([["train", str(recipe), "-o", str(run_dir), "--set", "train.iterations=2"]],
                                      cwd=Path.cwd())
    monkeypatch.undo()
    code, err = result.returncode, result.stderr

    assert code == 2, err
    assert err.startswith("error:") and err.count("\nerror:") == 0 and "Traceback" not in err, err
    flat = " ".join(err.split())
    assert "the run stopped: cannot write" in flat and reason in flat and names in flat, flat
    assert str(run_dir.resolve()) in flat and f"flowrl train --resume {run_dir}" in flat, flat
    # what was written before the failure is whole: iteration 1's checkpoint and metrics line
    latest = latest_checkpoint(run_dir)
    assert latest is not None and checkpoint_iteration(latest) == 1, latest
    load_checkpoint(latest)
    assert read_metrics(run_dir)  # every line whole (a torn line would not parse)


@pytest.mark.parametrize("exc, inside", [
    (ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), True),   # a reward server, not a write
    (OSError(errno.ENOSPC, "No space left on device", "/elsewhere/cache.bin"), False),  # not the run's file
    (OSError(errno.ENOENT, "No such file or directory", "RUN/x"), True),          # not a write refusal
])
def test_other_os_errors_are_not_reported_as_a_failed_write(exc, inside, tmp_path):
    from flowrl.errors import os_write_error

    if isinstance(exc.filename, str) and exc.filename.startswith("RUN/"):
        exc.filename = str(tmp_path / exc.filename[4:])
    assert os_write_error(exc, tmp_path, where="[run].output_dir", resume="flowrl train --resume X") is None


@pytest.mark.parametrize("code, fix", [(errno.ENOSPC, "free space"), (errno.EDQUOT, "free space"),
                                       (errno.EROFS, "writable"), (errno.EACCES, "writable"), (errno.EIO, "device")])
def test_each_write_refusal_names_the_path_the_error_and_the_fix(code, fix, tmp_path):
    from flowrl.errors import os_write_error

    path = tmp_path / "checkpoints" / "latest.json"
    error = os_write_error(OSError(code, os.strerror(code), str(path)), tmp_path, where="--output-dir",
                           resume=f"flowrl train --resume {tmp_path}")
    text = error.format()
    assert str(path) in text and os.strerror(code) in text and fix in text and "--resume" in text, text
