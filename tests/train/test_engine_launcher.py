"""`flowrl train --num-processes 2`: the workers live exactly as long as the launcher, and the run
directory has one writer.

torchrun starts every worker in a session of its own, so a kill of the launcher's process group
used to leave both workers training and writing checkpoints. Each test starts a real 2-process
run of the tiny recipe (long enough that it is still training when it is stopped) and finds every
process of the run by its run directory in /proc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from engine_helpers import REPO, wait_for
from tiny_recipe import write_recipe

from flowrl.train.checkpoint import latest_checkpoint, load_checkpoint
from flowrl.train.run_dir import LOCK_NAME, hold_run_directory

pytestmark = pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="finds the run's processes in /proc")


def run_processes(run_dir: Path, launcher: subprocess.Popen) -> list[int]:
    """Live (not zombie) processes of the run: the launcher (its command line names ``run_dir``)
    and every process it started, at any depth, orphaned or not (each names the launcher in its
    environment, flowrl.launch_agent.run_launch_agent): the torchrun agent, the fork server, the
    workers."""
    marker = f"FLOWRL_LAUNCHER_PID={launcher.pid}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if (str(run_dir).encode() in cmdline or marker in environ) and state != "Z":
            pids.append(int(entry.name))
    return pids


def start_two_process_run(tmp_path: Path, *sets: str) -> tuple[subprocess.Popen, Path]:
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "flowrl", "train", str(recipe), "-o", str(run_dir), "--num-processes", "2",
         "--set", "train.iterations=500", *(a for s in sets for a in ("--set", s))],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its own process group, as a shell gives a job
    )
    metrics = run_dir / "metrics.jsonl"
    try:
        wait_for(lambda: metrics.is_file() and metrics.read_text().count("\n") >= 1 or launcher.poll() is not None,
                 240, "the first metrics row")
    except AssertionError:
        os.killpg(launcher.pid, signal.SIGKILL)
        raise
    assert launcher.poll() is None, launcher.communicate()
    return launcher, run_dir


def stop_everything(run_dir: Path, launcher: subprocess.Popen) -> None:
    for pid in run_processes(run_dir, launcher):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
def test_a_second_writer_is_refused_then_killing_the_launchers_group_leaves_no_process_within_10_s(
        tmp_path, flowrl_cli):
    """One 2-process run for both checks (each needs a launcher that is training): first every
    way of writing to its directory again is refused, then the launcher's process group is
    killed."""
    launcher, run_dir = start_two_process_run(tmp_path)
    try:
        # ---- a second writer is refused while the launcher holds the run directory
        first_row = (run_dir / "metrics.jsonl").read_text().splitlines()[0]
        recipe = str(tmp_path / "tiny.toml")
        # in this process: refused before anything starts, and no interpreter to start meanwhile
        results = flowrl_cli.in_process([
            ["train", recipe, "-o", str(run_dir)],
            ["train", recipe, "-o", str(run_dir), "--overwrite"],
            ["train", "--resume", str(run_dir)],
            ["train", recipe, "-o", str(run_dir), "--num-processes", "2"],
        ])
        still_running = launcher.poll() is None

        # ---- kill the launcher's process group: no flowrl process is left within 10 s
        pids = run_processes(run_dir, launcher)
        assert len(pids) >= 5, pids  # the launcher, the torchrun agent, its fork server and two workers
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(10)
        killed = time.monotonic()
        while run_processes(run_dir, launcher) and time.monotonic() - killed < 10:
            time.sleep(0.05)
        assert run_processes(run_dir, launcher) == [], "workers outlived the killed launcher"
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(10)
        stop_everything(run_dir, launcher)
    assert still_running
    for result in results:
        err = result.flat_err
        assert result.returncode == 2, (result.argv, result.stdout, result.stderr)
        assert err.startswith("error:") and err.count("error:") == 1 and "Traceback" not in err, result.stderr
        assert f"{run_dir} is in use" in err and f"pid {launcher.pid}" in err and "--output-dir" in err, err
        assert "removed the earlier run" not in result.stdout
    # --overwrite was refused before it deleted anything of the running run
    assert (run_dir / "metrics.jsonl").read_text().splitlines()[0] == first_row
    # nothing is written any more, and the dead launcher's lock is free for the next writer
    rows = (run_dir / "metrics.jsonl").read_text()
    time.sleep(2)
    assert (run_dir / "metrics.jsonl").read_text() == rows
    with hold_run_directory(run_dir, main=True):
        assert (run_dir / LOCK_NAME).is_file()


@pytest.mark.slow
def test_ctrl_c_of_the_launcher_stops_the_workers_after_a_checkpoint(tmp_path):
    # a checkpoint every iteration: one is on disk whichever phase the stop lands in
    launcher, run_dir = start_two_process_run(tmp_path, "checkpoint.every=1")
    try:
        launcher.send_signal(signal.SIGINT)  # to the launcher alone: it forwards it to the workers
        out, err = launcher.communicate(timeout=120)
    finally:
        stop_everything(run_dir, launcher)
    assert launcher.returncode == 130, (out, err)
    assert "Ctrl-C: stopping at the next model call" in err and "Traceback" not in out + err, (out, err)
    assert "checkpoint written" in " ".join(out.split())
    assert run_processes(run_dir, launcher) == []
    done = load_checkpoint(latest_checkpoint(run_dir))["state"]["iteration"]
    assert 1 <= done < 500


@pytest.mark.slow
def test_sigterm_of_a_pipelined_launcher_stops_every_process_after_a_checkpoint(tmp_path):
    """SIGTERM to the launcher (Slurm, `docker stop`), on a run with [pipeline] staleness 1 and
    worker = "process": each worker draws the next rollout in a rollout process of its own; the
    stop is forwarded, a rollout still being drawn is abandoned (its process killed: a pending
    rollout is never checkpointed), the behaviour weights are checkpointed, and no process of the
    run (rollout processes included) is left."""
    launcher, run_dir = start_two_process_run(tmp_path, "pipeline.staleness=1", "pipeline.worker='process'",
                                              "checkpoint.every=1")
    try:
        # the launcher, the torchrun agent, its fork server, two workers and their rollout processes
        assert len(run_processes(run_dir, launcher)) >= 7
        launcher.send_signal(signal.SIGTERM)  # to the launcher alone: it forwards it to the workers
        out, err = launcher.communicate(timeout=120)
    finally:
        stop_everything(run_dir, launcher)
    assert launcher.returncode == 130, (out, err)
    assert "SIGTERM: stopping at the next model call" in err and "Traceback" not in out + err, (out, err)
    assert "checkpoint written" in " ".join(out.split())
    assert run_processes(run_dir, launcher) == []
    ckpt = latest_checkpoint(run_dir)
    done = load_checkpoint(ckpt)["state"]["iteration"]
    assert 1 <= done < 500 and (ckpt / "pipeline.safetensors").is_file()
