"""A stop reaches every phase: SIGTERM, SIGINT, SIGHUP or the STOP file, sent while a run
is in its rollout, its evaluation, its reward calls or its update, stops it after the model call
under way: no further model call starts, the process exits within a bound, says how to resume,
and ``--resume`` continues exactly (the metrics rows and final weights of an uninterrupted run).

Each run is a real ``flowrl train`` in a subprocess, with a probe plugin on its ``PYTHONPATH``
(:data:`PROBE`, installed as a third party installs one) that slows every model call of one phase
of one iteration to :data:`SECONDS_PER_CALL` and records when each of those calls starts, so that
the test knows the phase is under way and can tell which calls started after the stop. Slowing
changes no number: the runs are compared with an uninterrupted run of the same recipe.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from engine_helpers import (
    REPO,
    Reader,
    assert_records_close,
    assert_weights_close,
    final_weights,
    load,
    quiet_console,
    run_cli,
    wait_for,
)
from tiny_recipe import ENGINE, tiny_recipe, write_recipe

from flowrl.runlog import read_metrics
from flowrl.train import train
from flowrl.train.checkpoint import latest_checkpoint, load_checkpoint
from flowrl.train.stopping import STOP_FILE_POLL

#: Seconds each model call of the probed phase takes (a sleep before it).
SECONDS_PER_CALL = 3.0
#: What exiting may take besides the model call under way: the checkpoint of the last completed
#: iteration, the process group's teardown, the interpreter's exit (and with --num-processes, the
#: agent's and the launcher's); measured 2 to 5 s on a loaded 2-core machine.
EXIT_OVERHEAD = 8.0

#: The tiny recipe, evaluating before every iteration, with a second reward (logged, weight 0) so
#: that an iteration makes two reward calls; checkpoints every 2 iterations.
RECIPE = tiny_recipe(ENGINE, log={"eval_every": 1}, rewards=[{"use": "area"}, {"use": "brightness", "weight": 0.0}],
                     prompts={"num_eval": 3, "eval_seeds": 1})

#: The probe plugin: with STOP_PROBE_PHASE set, every model call of that phase in iteration
#: STOP_PROBE_ITERATION (a denoiser forward of the rollout or the evaluation, a reward call, an
#: update's micro-batch) first appends its start time to STOP_PROBE_DIR/calls.RANK, then sleeps.
PROBE = '''
import os
import time
from pathlib import Path

from flowrl import hookimpl

PHASE = os.environ.get("STOP_PROBE_PHASE", "")
ITERATION = int(os.environ.get("STOP_PROBE_ITERATION", "-1"))
SECONDS = float(os.environ.get("STOP_PROBE_SECONDS", "0"))
CALLS = Path(os.environ.get("STOP_PROBE_DIR", ".")) / f"calls.{os.environ.get('RANK', '0')}"
SAVE_SECONDS = float(os.environ.get("STOP_PROBE_SAVE_SECONDS", "0"))  # the stop's checkpoint write, slowed
probing = [False]
if PHASE:  # this process's pid, for a signal to one process of several
    (CALLS.parent / f"pid.{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))


def model_call():
    if probing[0]:
        with open(CALLS, "a") as f:
            f.write(f"{time.time()}\\n")
        time.sleep(SECONDS)


def probed(fn, phase, iteration_of):
    def call(*args, **kwargs):
        if phase != PHASE or iteration_of(*args, **kwargs) != ITERATION:
            return fn(*args, **kwargs)
        probing[0] = True
        try:
            return fn(*args, **kwargs)
        finally:
            probing[0] = False
    return call


if PHASE:
    from flowrl.objectives.policy_gradient import PolicyGradient
    from flowrl.train import collect, evaluate, overlap, update
    from flowrl_plugins.embedded.adapter import PixelImageAdapter

    collect.sample = probed(collect.sample, "rollout", lambda session, batch, *a, **k: batch.iteration)
    collect.score_rewards = probed(collect.score_rewards, "reward", lambda batch, rewards: batch.iteration)
    evaluate.RunEvaluator.__call__ = probed(evaluate.RunEvaluator.__call__, "eval",
                                            lambda self, iteration, final=False: iteration)
    update.PolicyUpdate.run = probed(update.PolicyUpdate.run, "update", lambda self, batch, *a, **k: batch.iteration)
    velocity, score, backward = PixelImageAdapter.velocity, overlap.score, PolicyGradient.backward

    def slow_velocity(self, *args, **kwargs):  # a denoiser forward
        if PHASE in ("rollout", "eval"):
            model_call()
        return velocity(self, *args, **kwargs)

    def slow_score(*args, **kwargs):  # a reward call
        if PHASE == "reward":
            model_call()
        return score(*args, **kwargs)

    def slow_backward(self, *args, **kwargs):  # an update's micro-batch: its forwards and backward
        if PHASE == "update":
            model_call()
        return backward(self, *args, **kwargs)

    PixelImageAdapter.velocity, overlap.score, PolicyGradient.backward = slow_velocity, slow_score, slow_backward

    if SAVE_SECONDS:
        from flowrl.train import checkpoint

        save = checkpoint.save_checkpoint

        def slow_save(ckpt_root, name, **kwargs):  # the checkpoint of the stopped iteration's predecessor
            if name == f"iter_{ITERATION:06d}":
                time.sleep(SAVE_SECONDS)
            return save(ckpt_root, name, **kwargs)

        checkpoint.save_checkpoint = slow_save


@hookimpl
def register_rewards(register):
    pass
'''


@pytest.fixture(scope="module")
def probe_path(plugin_site):
    return plugin_site("stop_probe", PROBE)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The recipe run uninterrupted, in this process: ``(recipe path, run dir, metrics rows)``."""
    root = tmp_path_factory.mktemp("stop-reference")
    recipe = write_recipe(root, RECIPE)
    run_dir = train(load(recipe, f"run.output_dir={str(root / 'run')!r}"), console=quiet_console())
    return recipe, run_dir, read_metrics(run_dir)


def start(recipe: Path, run_dir: Path, probe_path: Path, phase: str, iteration: int, *args: str,
          save_seconds: float = 0.0) -> tuple:
    """``flowrl train RECIPE -o RUN_DIR ARGS`` with the probe slowing ``phase`` of ``iteration``
    (and by ``save_seconds`` the write of checkpoint ``iteration``);
    ``(process, stdout reader, stderr reader, probe directory)``. Its own session, as a shell
    gives a job, so that a signal sent to it reaches it alone."""
    probe_dir = run_dir.parent / f"probe-{run_dir.name}"
    probe_dir.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200",
               PYTHONPATH=os.pathsep.join([str(probe_path), os.environ.get("PYTHONPATH", "")]),
               STOP_PROBE_PHASE=phase, STOP_PROBE_ITERATION=str(iteration), STOP_PROBE_SECONDS=str(SECONDS_PER_CALL),
               STOP_PROBE_DIR=str(probe_dir), STOP_PROBE_SAVE_SECONDS=str(save_seconds))
    proc = subprocess.Popen([sys.executable, "-m", "flowrl", "train", str(recipe), "-o", str(run_dir), *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    return proc, Reader(proc.stdout), Reader(proc.stderr), probe_dir


def call_starts(probe_dir: Path) -> list[float]:
    """When each probed model call started (every process's), in time order."""
    return sorted(float(line) for path in probe_dir.glob("calls.*") for line in path.read_text().split())


def stop_during(proc, err: Reader, probe_dir: Path, how) -> tuple[float, float]:
    """Wait until the probed phase is in its first model call, then ``how()`` (send the signal or
    write the STOP file). ``(wall-clock time it was sent, seconds until the process exited)``."""
    try:
        wait_for(lambda: call_starts(probe_dir) or proc.poll() is not None, 240, "the probed phase")
        assert proc.poll() is None, f"the run ended before the probed phase: {err.text()[-3000:]}"
        time.sleep(0.5)  # well inside the first call, which lasts SECONDS_PER_CALL
        sent, start = time.time(), time.monotonic()
        how()
        proc.wait(timeout=120)
        return sent, time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def check_stopped(proc, out: Reader, err: Reader, probe_dir: Path, sent: float, seconds: float, run_dir: Path,
                  rows: list[int], resumes_at: int, announced: str) -> str:
    """The stop's promises: status 130 without a traceback, announced; no model call started after
    it; exited within the bound; the rows of the completed iterations and no other; the checkpoint
    the run resumes from; the resume command printed. Returns stdout."""
    out.thread.join(5), err.thread.join(5)
    stdout, stderr = out.text(), err.text()
    assert proc.returncode == 130, (stdout, stderr)
    assert announced in stderr and "Traceback" not in stdout + stderr, (stdout, stderr)
    assert [t for t in call_starts(probe_dir) if t > sent] == [], "a model call started after the stop"
    assert seconds < SECONDS_PER_CALL + EXIT_OVERHEAD, f"exited {seconds:.1f} s after the stop"
    assert [r["iteration"] for r in read_metrics(run_dir)] == rows
    assert load_checkpoint(latest_checkpoint(run_dir))["state"]["iteration"] == resumes_at
    flat = " ".join(stdout.split())
    assert f"flowrl train {run_dir / 'recipe.toml'} --resume {run_dir}" in flat, stdout
    return flat


def assert_resumes_exactly(run_dir: Path, reference) -> None:
    """The command the run printed (here in this process) continues it as the uninterrupted run."""
    _, ref_dir, ref_rows = reference
    train(load(run_dir / "recipe.toml"), resume=run_dir, console=quiet_console())
    rows = read_metrics(run_dir)
    assert [r.get("iteration") for r in rows] == [r.get("iteration") for r in ref_rows]
    for got, want in zip(rows, ref_rows):
        assert_records_close(got, want)
    assert_weights_close(final_weights(run_dir), final_weights(ref_dir))


@pytest.mark.slow
@pytest.mark.parametrize("phase, sig, name", [
    ("rollout", signal.SIGTERM, "SIGTERM"),
    ("eval", signal.SIGINT, "Ctrl-C"),
    ("reward", signal.SIGHUP, "SIGHUP"),
], ids=["rollout-SIGTERM", "eval-SIGINT", "reward-SIGHUP"])
def test_a_stop_before_the_update_abandons_the_iteration_and_checkpoints_the_last_completed_one(
        tmp_path, probe_path, reference, phase, sig, name):
    """Iteration 3 is stopped in its evaluation (before its rollout), rollout or reward calls:
    the three completed iterations are checkpointed (the latest periodic checkpoint was 2) and the
    resume redoes iteration 3, its evaluation included."""
    recipe, run_dir = reference[0], tmp_path / "run"
    proc, out, err, probe_dir = start(recipe, run_dir, probe_path, phase, 3)
    sent, seconds = stop_during(proc, err, probe_dir, lambda: proc.send_signal(sig))
    flat = check_stopped(proc, out, err, probe_dir, sent, seconds, run_dir, [0, 1, 2], 3,
                         f"{name}: stopping at the next model call")
    assert "interrupted after 3 completed iterations; checkpoint written" in flat
    if phase == "reward":  # the second reward of iteration 3 was never called
        assert len(call_starts(probe_dir)) == 1
    assert_resumes_exactly(run_dir, reference)


@pytest.mark.slow
def test_a_stop_in_the_update_writes_no_checkpoint_of_its_part_way_weights(tmp_path, probe_path, reference):
    """Iteration 3 is stopped in its update: the weights are part-way through it, so nothing is
    written; the run resumes from its latest checkpoint (2 iterations), redoing iteration 2 (whose
    metrics row is dropped) and 3, and ends as the uninterrupted run."""
    recipe, run_dir = reference[0], tmp_path / "run"
    proc, out, err, probe_dir = start(recipe, run_dir, probe_path, "update", 3)
    sent, seconds = stop_during(proc, err, probe_dir, lambda: proc.send_signal(signal.SIGTERM))
    flat = check_stopped(proc, out, err, probe_dir, sent, seconds, run_dir, [0, 1, 2], 2,
                         "SIGTERM: stopping at the next model call")
    assert "interrupted in the update of iteration 3" in flat and "no checkpoint written" in flat
    assert "the run resumes from its latest checkpoint (2 iterations)" in flat
    assert_resumes_exactly(run_dir, reference)


@pytest.mark.slow
def test_the_stop_file_stops_two_processes_together(tmp_path, probe_path, reference):
    """``flowrl train --num-processes 2``: only the main process reads RUN_DIR/STOP, written during
    the rollout of iteration 3; both processes stop at their next denoiser forward (they agree at
    each), the STOP file is removed, and the resume (2 processes) ends as an uninterrupted
    2-process run."""
    recipe, run_dir = reference[0], tmp_path / "run"
    proc, out, err, probe_dir = start(recipe, run_dir, probe_path, "rollout", 3, "--num-processes", "2")
    sent, seconds = stop_during(proc, err, probe_dir, lambda: (run_dir / "STOP").write_text(""))
    assert {p.name for p in probe_dir.glob("calls.*")} == {"calls.0", "calls.1"}  # both were in the rollout
    flat = check_stopped(proc, out, err, probe_dir, sent, seconds, run_dir, [0, 1, 2], 3,
                         f"{run_dir / 'STOP'} found: stopping at the next model call")
    assert "interrupted after 3 completed iterations; checkpoint written" in flat
    assert not (run_dir / "STOP").exists(), "the STOP file was honoured once: a resume must not stop"
    resumed = run_cli(["train", str(run_dir / "recipe.toml"), "--resume", str(run_dir), "--num-processes", "2"],
                      timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    whole = run_cli(["train", str(recipe), "-o", str(tmp_path / "whole"), "--num-processes", "2"], timeout=300)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    rows, want = read_metrics(run_dir), read_metrics(tmp_path / "whole")
    assert [r.get("iteration") for r in rows] == [r.get("iteration") for r in want]
    for got, row in zip(rows, want):
        assert_records_close(got, row)
    assert_weights_close(final_weights(run_dir), final_weights(tmp_path / "whole"))


@pytest.mark.slow
def test_a_signal_to_the_main_process_alone_still_gets_the_stops_checkpoint_written(tmp_path, probe_path, reference):
    """``flowrl train --num-processes 2``, SIGTERM to the main worker only (a scheduler that
    signals one process) during iteration 3's rollout, and the stop's checkpoint slow to write
    (3 s): the other worker waits for the write before it exits. It used to leave at once with
    status 130, which torchrun takes for a failure: it sent the main worker a SIGTERM, its
    second signal, which aborted the write, and the run resumed from iteration 2 instead of 3."""
    recipe, run_dir = reference[0], tmp_path / "run"
    proc, out, err, probe_dir = start(recipe, run_dir, probe_path, "rollout", 3, "--num-processes", "2",
                                      save_seconds=3.0)
    main_pid = lambda: int((probe_dir / "pid.0").read_text())  # noqa: E731
    stop_during(proc, err, probe_dir, lambda: os.kill(main_pid(), signal.SIGTERM))
    out.thread.join(5), err.thread.join(5)
    stdout, stderr = out.text(), err.text()
    assert proc.returncode == 130 and "Traceback" not in stdout + stderr, (stdout, stderr)
    flat = " ".join(stdout.split())
    assert "interrupted after 3 completed iterations; checkpoint written" in flat, (stdout, stderr)
    assert load_checkpoint(latest_checkpoint(run_dir))["state"]["iteration"] == 3


@pytest.mark.slow
def test_a_stop_during_a_shared_ddp_evaluation_stops_both_processes(tmp_path, probe_path, reference):
    """``--num-processes 2`` under ddp, the evaluation's 12 images in 2 batches, one a process:
    SIGTERM to the launcher (which passes it to both workers) during iteration 3's evaluation.
    Each process abandons its own share at its next forward, they agree at the gather of the
    scores, and the three completed iterations are checkpointed; the resume completes the run."""
    recipe, run_dir = reference[0], tmp_path / "run"
    sets = ["--set", "prompts.eval_seeds=4", "--set", "distributed.strategy='ddp'"]
    proc, out, err, probe_dir = start(recipe, run_dir, probe_path, "eval", 3, "--num-processes", "2", *sets)
    sent, seconds = stop_during(proc, err, probe_dir, lambda: proc.send_signal(signal.SIGTERM))
    assert {p.name for p in probe_dir.glob("calls.*")} == {"calls.0", "calls.1"}  # both were evaluating
    flat = check_stopped(proc, out, err, probe_dir, sent, seconds, run_dir, [0, 1, 2], 3,
                         "SIGTERM: stopping at the next model call")
    assert "interrupted after 3 completed iterations; checkpoint written" in flat
    resumed = run_cli(["train", str(run_dir / "recipe.toml"), "--resume", str(run_dir), "--num-processes", "2"],
                      timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    rows = read_metrics(run_dir)
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3, 4] and rows[-1]["final"]
    assert all("eval/area/mean" in r for r in rows)


@pytest.mark.slow
def test_the_stop_file_stops_a_shared_ddp_evaluation_at_the_next_forward(tmp_path, probe_path, reference):
    """The STOP file, which only the main process reads, written during a ddp evaluation whose
    shares the two processes make without agreeing in between: the other process learns of it
    through the process group's store at its next forward (it used to finish its whole share,
    one forward per sampling step, first)."""
    recipe, run_dir = reference[0], tmp_path / "run"
    sets = ["--set", "prompts.eval_seeds=4", "--set", "distributed.strategy='ddp'"]
    proc, out, err, probe_dir = start(recipe, run_dir, probe_path, "eval", 3, "--num-processes", "2", *sets)
    sent, seconds = stop_during(proc, err, probe_dir, lambda: (run_dir / "STOP").write_text(""))
    out.thread.join(5), err.thread.join(5)
    stdout, stderr = out.text(), err.text()
    assert proc.returncode == 130 and "Traceback" not in stdout + stderr, (stdout, stderr)
    # the main process sees the file at its next forward, the other at its next one after that
    assert seconds < 2 * SECONDS_PER_CALL + STOP_FILE_POLL + EXIT_OVERHEAD, f"exited {seconds:.1f} s after the stop"
    late = [t for t in call_starts(probe_dir) if t > sent + SECONDS_PER_CALL + STOP_FILE_POLL]
    assert late == [], "a model call started well after the stop"
    assert "interrupted after 3 completed iterations; checkpoint written" in " ".join(stdout.split())
