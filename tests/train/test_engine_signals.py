"""Stopping a run with real signals, in a subprocess: the first Ctrl-C or SIGTERM is announced at
once and checkpoints; a second one aborts with a message and exit status 130, no traceback.

A slow reward (a plugin registered by the driver below) holds the first iteration in its reward
phase for a few seconds, so that "announced at once" can be told apart from "stopped": the
reward call under way is finished first. (A stop in each phase, timed, and in two processes:
tests/train/test_engine_stop_phases.py.)

In this process: a stop that arrives during an evaluation, or after the last iteration, pays for
no rollout and no evaluation after it (a 10 s `docker stop` must end with a checkpoint)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from engine_helpers import REPO, InterruptAt, Reader, load, quiet_console, wait_for
from tiny_recipe import ENGINE, tiny_recipe, write_recipe

from flowrl import hookimpl
from flowrl.plugins import temporary_plugin
from flowrl.runlog import read_metrics
from flowrl.train import train
from flowrl.train.checkpoint import latest_checkpoint, load_checkpoint

#: Runs `flowrl ARGS...` with a reward `slow` that touches MARKER and sleeps SECONDS per call.
DRIVER = """
import sys, time
from pathlib import Path
from flowrl import hookimpl
from flowrl.plugins import temporary_plugin

marker, seconds, args = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]

class Slow:
    @hookimpl
    def register_rewards(self, register):
        def slow(images, prompts):
            marker.touch()
            time.sleep(seconds)
            return images.mean(dim=(1, 2, 3))
        register("slow", slow)

with temporary_plugin(Slow(), name="slow"):
    from flowrl import cli
    cli.main(args)
"""

SLOW_RECIPE = tiny_recipe(ENGINE, rewards=[{"use": "slow"}])


def start_slow_run(tmp_path, seconds: float):
    marker = tmp_path / "scoring"
    recipe = write_recipe(tmp_path, SLOW_RECIPE)
    env = {"OMP_NUM_THREADS": "1", "COLUMNS": "200", "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(marker), str(seconds), "train", str(recipe), "-o", str(tmp_path / "run")],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    return proc, marker, Reader(proc.stdout), Reader(proc.stderr)


@pytest.mark.slow
def test_first_ctrl_c_is_announced_at_once_and_checkpoints(tmp_path):
    proc, marker, out, err = start_slow_run(tmp_path, seconds=6.0)  # longer than the 5 s "at once"
    try:
        wait_for(marker.is_file, 180, "the first reward call")
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        wait_for(lambda: err.when("stopping at the next model call") is not None, 5, "the stop message")
        assert proc.poll() is None, "the run is still finishing its reward call"
        assert err.when("stopping at the next model call") - sent < 5.0
        proc.wait(timeout=180)
    finally:
        proc.kill()
    out.thread.join(5), err.thread.join(5)
    assert proc.returncode == 130, (out.text(), err.text())
    assert ("Ctrl-C: stopping at the next model call; the unfinished iteration is redone on resume "
            "(Ctrl-C again to abort)") in err.text()
    assert "Traceback" not in out.text() + err.text()
    assert "--resume" in out.text()
    # stopped after the reward call of iteration 0, before its update: it is redone on resume
    assert load_checkpoint(latest_checkpoint(tmp_path / "run"))["state"]["iteration"] == 0


@pytest.mark.slow
def test_second_ctrl_c_aborts_with_a_message(tmp_path):
    proc, marker, out, err = start_slow_run(tmp_path, seconds=60.0)
    try:
        wait_for(marker.is_file, 180, "the first reward call")
        proc.send_signal(signal.SIGINT)
        wait_for(lambda: err.when("stopping at the next model call") is not None, 5, "the stop message")
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        assert time.monotonic() - sent < 30, "aborted at once, not after the 60 s reward"
    finally:
        proc.kill()
    out.thread.join(5), err.thread.join(5)
    text = out.text() + err.text()
    assert proc.returncode == 130, text
    assert "Traceback" not in text
    assert "aborted: stopped at once, no checkpoint written; the run resumes from the start" in " ".join(text.split())


def test_sigterm_stops_like_the_first_ctrl_c_and_resumes_exactly(tmp_path, reference_run):
    """Slurm preemption or `docker stop`: SIGTERM checkpoints the last completed iteration (or,
    landing in an update, leaves the latest checkpoint), says how to resume, and the command it
    suggests (the run directory's resolved recipe) continues the run exactly."""
    from engine_helpers import assert_records_close, assert_weights_close, final_weights

    recipe_path, ref_dir, ref = reference_run
    run_dir = tmp_path / "run"
    env = {"OMP_NUM_THREADS": "1", "COLUMNS": "200", "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "flowrl", "train", str(recipe_path), "-o", str(run_dir)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        wait_for(lambda: metrics.is_file() and metrics.read_text().count("\n") >= 1, 180, "the first iteration")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 130, (out, err)
    assert "SIGTERM: stopping at the next model call" in err and "Traceback" not in out + err
    done, ckpt = len(read_metrics(run_dir)), latest_checkpoint(run_dir)
    resumes_at = load_checkpoint(ckpt)["state"]["iteration"] if ckpt else 0
    assert 1 <= done < 4
    if "in the update of iteration" in out:  # its weights part-way through: the latest checkpoint stays
        assert resumes_at <= done and "no checkpoint written" in out
    else:
        assert resumes_at == done and "checkpoint written" in out
    saved = run_dir / "recipe.toml"
    assert f"flowrl train {saved} --resume {run_dir}" in " ".join(out.split()), out
    train(load(saved), resume=run_dir, console=quiet_console())
    records = read_metrics(run_dir)
    assert [r["iteration"] for r in records] == [r["iteration"] for r in ref]
    for got, want in zip(records, ref):
        assert_records_close(got, want)
    assert_weights_close(final_weights(run_dir), final_weights(ref_dir))


# ------------------------------------------------------------------ a stop before evaluation or rollout

#: The evaluation scores its 3 prompts (one image each) in one call; a rollout scores the 2 x 4
#: samples of an iteration, never 3 at once. So a call's size says which phase made it.
EVAL_IMAGES = 3
CHECKED = {"rewards": [{"use": "probe"}], "checkpoint": {"every": 4}, "log": {"eval_every": 1},
           "prompts": {"num_eval": 3, "eval_seeds": 1}}
CHECKED_RECIPE = tiny_recipe(ENGINE, CHECKED)


class Probe:
    """A reward ``probe`` that records the size of every call and sends this process SIGINT
    during the evaluation call number ``stop_at_eval`` (counting from 1)."""

    def __init__(self, stop_at_eval: int):
        self.sizes: list[int] = []
        self.sizes_at_signal: int | None = None
        self.stop_at_eval = stop_at_eval

    @hookimpl
    def register_rewards(self, register):
        def probe(images, prompts):
            self.sizes.append(len(images))
            if len(images) == EVAL_IMAGES and self.sizes.count(EVAL_IMAGES) == self.stop_at_eval:
                self.sizes_at_signal = len(self.sizes)
                os.kill(os.getpid(), signal.SIGINT)
            return images.mean(dim=(1, 2, 3))

        register("probe", probe)


def stopped_run(tmp_path, stop_at_eval: int) -> tuple[Probe, Path]:
    probe, run_dir = Probe(stop_at_eval), tmp_path / "run"
    with temporary_plugin(probe, name="probe"), pytest.raises(KeyboardInterrupt):
        train(load(write_recipe(tmp_path, CHECKED_RECIPE), f"run.output_dir={str(run_dir)!r}"), console=quiet_console())
    return probe, run_dir


@pytest.mark.slow
def test_a_stop_during_evaluation_skips_the_rollout_and_checkpoints(tmp_path):
    probe, run_dir = stopped_run(tmp_path, stop_at_eval=3)  # the evaluation before iteration 2
    assert probe.sizes_at_signal is not None
    assert len(probe.sizes) == probe.sizes_at_signal, f"rewards scored after the stop: {probe.sizes}"
    assert [r["iteration"] for r in read_metrics(run_dir)] == [0, 1]
    ckpt = latest_checkpoint(run_dir)  # not due (every 4): written because of the stop
    assert ckpt.name == "iter_000002" and load_checkpoint(ckpt)["state"]["iteration"] == 2


@pytest.mark.slow
def test_a_stop_after_the_last_iteration_skips_the_final_evaluation_which_resume_runs(tmp_path):
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path, tiny_recipe(ENGINE, CHECKED, trackers=[{"use": "interrupt_at"}]))
    probe = Probe(stop_at_eval=0)  # scores, never stops: the tracker presses Ctrl-C after iteration 3 is logged
    with temporary_plugin(probe, name="probe"), temporary_plugin(InterruptAt(3), name="interrupt-at-3"):
        with pytest.raises(KeyboardInterrupt):
            train(load(recipe, f"run.output_dir={str(run_dir)!r}"), console=quiet_console())
    rows = read_metrics(run_dir)
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3] and not any(r.get("final") for r in rows)
    assert load_checkpoint(latest_checkpoint(run_dir))["state"]["iteration"] == 4
    resumed, without_tracker = Probe(stop_at_eval=0), write_recipe(tmp_path, CHECKED_RECIPE)
    with temporary_plugin(resumed, name="probe"):
        train(load(without_tracker, f"run.output_dir={str(run_dir)!r}"), resume=run_dir, console=quiet_console())
    assert resumed.sizes == [EVAL_IMAGES]  # only the final evaluation was left to do
    assert read_metrics(run_dir)[-1]["final"]
