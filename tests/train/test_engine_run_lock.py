"""One writer per run directory, one process: a second `flowrl train` there is refused while the
first runs; once the first is killed (SIGKILL: no handler runs) its lock is free and --resume
continues the run."""

from __future__ import annotations

import pytest

import os
import signal
import subprocess
import sys

from engine_helpers import REPO, wait_for
from tiny_recipe import write_recipe

from flowrl.runlog import read_metrics
from flowrl.train.checkpoint import latest_checkpoint, load_checkpoint


@pytest.mark.slow
def test_a_second_writer_is_refused_until_the_first_is_killed_then_resume_continues(tmp_path, flowrl_cli):
    recipe, run_dir = write_recipe(tmp_path), tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    first = subprocess.Popen([sys.executable, "-m", "flowrl", "train", str(recipe), "-o", str(run_dir),
                              "--set", "train.iterations=500"], cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: latest_checkpoint(run_dir) is not None or first.poll() is not None, 240, "a checkpoint")
        # the second writer and the resume run in this process: the lock is the first process's
        (second,) = flowrl_cli.in_process([["train", str(recipe), "-o", str(run_dir), "--overwrite"]])
        assert first.poll() is None, "the first run was still training"
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    err = " ".join(second.stderr.split())
    assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr
    assert f"{run_dir} is in use: another flowrl process (pid {first.pid})" in err, err
    assert "removed the earlier run" not in second.stdout and latest_checkpoint(run_dir) is not None

    done = load_checkpoint(latest_checkpoint(run_dir))["state"]["iteration"]
    (resumed,) = flowrl_cli.in_process([["train", "--resume", str(run_dir), "--set", f"train.iterations={done + 1}"]])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert read_metrics(run_dir)[-1]["iteration"] == done
    assert not (run_dir / ".lock").exists()  # given back (and removed) at the end of the run


def test_a_refused_writer_writes_nothing_and_names_the_holder(tmp_path, capsys):
    """Another holder of RUN_DIR/.lock (here an flock taken by the test itself): the train
    command is refused with one message, and the directory holds nothing new."""
    import fcntl

    from flowrl.cli import main

    recipe, run_dir = write_recipe(tmp_path), tmp_path / "run"
    run_dir.mkdir()
    fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b"4242\n")
        try:
            main(["train", str(recipe), "-o", str(run_dir)])
            code = 0
        except SystemExit as exc:
            code = exc.code
    finally:
        os.close(fd)
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and err.startswith("error: --output-dir:") and "Traceback" not in err, err
    assert f"{run_dir} is in use: another flowrl process (pid 4242)" in err and "kill -INT 4242" in err, err
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]
