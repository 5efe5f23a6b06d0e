"""`flowrl sweep`: a real 2 x 2 sweep, a sweep killed by a signal and resumed, and bad input.

Every run is a real `flowrl train` process on the embedded model with 3 sampling steps (T = 2),
1 prompt x 2 samples and 2 evaluation prompts: about 4 s each, mostly the interpreter and torch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_recipe import tiny_recipe

from flowrl.errors import FlowrlError
from flowrl.sweeps import Sweep, parse_grid, parse_variant, plan_runs, split_values
from flowrl.runlog import read_metrics

TINY = tiny_recipe(model={"random_init": None}, sampler={"steps": 3}, chunker={"use": "step", "size": None},
                   selector={"use": "all"}, loss={"use": "clipped", "eps_low": 0.2, "eps_high": 0.2},
                   train={"prompts_per_iteration": 1, "group_size": 2, "lr": 1e-4}, prompts={"num_eval": 2},
                   log={"eval_every": 1}, checkpoint={"every": 1, "keep_last": 1}, rewards=[{"use": "verifier"}])


@pytest.fixture
def tiny(tmp_path):
    (tmp_path / "tiny.toml").write_text(TINY)
    return tmp_path


def _sweep(flowrl_cli, cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(flowrl_cli.script), "sweep", *args], cwd=cwd, env=flowrl_cli.env(),
                          capture_output=True, text=True, timeout=timeout)


def _manifest(sweep_dir: Path) -> dict:
    return json.loads((sweep_dir / "sweep.json").read_text())


def _iterations(run_dir: Path) -> list:
    return [(r["iteration"], bool(r.get("final"))) for r in read_metrics(run_dir)]


# ----------------------------------------------------------------------------- parsing


def test_grid_values_split_at_top_level_commas_only():
    assert split_values("[2,3,4,7],[16]", "--grid") == ["[2,3,4,7]", "[16]"]
    assert split_values('"a,b", \'c\' ,{x = [1, 2]}', "--grid") == ['"a,b"', "'c'", "{x = [1, 2]}"]
    assert parse_grid(["chunker.sizes=[2,3,4,7],[16]", "train.lr=1e-4", "chunker.sizes=[8,8]"]) == {
        "chunker.sizes": ["[2,3,4,7]", "[16]", "[8,8]"], "train.lr": ["1e-4"]}
    assert parse_variant("step:chunker.use=step,selector.fraction=0.5") == (
        "step", ["chunker.use=step", "selector.fraction=0.5"])
    assert parse_variant("base:") == ("base", [])


@pytest.mark.parametrize("text,fragment", [
    ("[2,3", "unclosed '['"), ("[2,3]],[4]", "unbalanced ']'"), ("1,,2", "empty value"), ('"a,b', "unterminated string"),
])
def test_malformed_grid_values(text, fragment):
    with pytest.raises(FlowrlError) as info:
        split_values(text, "--grid")
    assert fragment in info.value.message


def test_plan_crosses_variants_grid_and_seeds():
    runs = plan_runs("tiny", [("a", ["chunker.use=step"]), ("b", [])], {"train.lr": ["1e-3", "2e-3"]}, [7, 8])
    assert len(runs) == 8
    assert runs[0]["variant"] == "a train.lr=1e-3" and runs[0]["overrides"] == ["chunker.use=step", "train.lr=1e-3"]
    assert [(r["variant"], r["seed"]) for r in runs[:5]] == [  # seed by seed
        ("a train.lr=1e-3", 7), ("a train.lr=2e-3", 7), ("b train.lr=1e-3", 7), ("b train.lr=2e-3", 7), ("a train.lr=1e-3", 8)]
    assert len({r["dir"] for r in runs}) == 8
    assert plan_runs("tiny", [], {}, [3])[0]["variant"] == "tiny"


# ----------------------------------------------------------------------------- real sweeps


@pytest.mark.slow
def test_two_by_two_sweep_runs_every_combination_and_compares(tiny, flowrl_cli):
    args = ["tiny.toml", "--grid", "train.lr=1e-4,3e-4", "--seeds", "2", "--jobs", "2", "-o", "sw"]
    proc = _sweep(flowrl_cli, tiny, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = _manifest(tiny / "sw")
    assert m["spec"]["grid"] == {"train.lr": ["1e-4", "3e-4"]} and m["spec"]["seeds"] == [7, 8]
    assert m["status"] == "done"
    assert sorted((r["variant"], r["seed"]) for r in m["runs"]) == [
        ("train.lr=1e-4", 7), ("train.lr=1e-4", 8), ("train.lr=3e-4", 7), ("train.lr=3e-4", 8)]
    for r in m["runs"]:
        assert r["status"] == "done" and r["exit_code"] == 0 and r["attempts"] == 1 and r["wall_time_s"] > 0
        run_dir = tiny / "sw" / r["dir"]
        assert _iterations(run_dir) == [(0, False), (1, False), (2, True)]
        recipe = (run_dir / "recipe.toml").read_text()
        assert f"seed = {r['seed']}" in recipe and f"lr = {float(r['overrides'][0].split('=')[1])!r}" in recipe
        assert (tiny / "sw" / "logs" / f"{r['id']}.out").is_file()

    cmp = flowrl_cli.in_process([["compare", str(tiny / "sw"), "--format", "json"]])[0]
    assert cmp.returncode == 0, cmp.stderr
    result = json.loads(cmp.stdout)
    assert result["metric"] == "eval/verifier/mean" and result["baseline"] == "train.lr=1e-4"
    assert [(v["name"], v["n"]) for v in result["variants"]] == [("train.lr=1e-4", 2), ("train.lr=3e-4", 2)]
    assert result["variants"][1]["paired"]["final"]["n"] == 2
    assert result["variants"][0]["wall_time_s"]["mean"] > 0


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="the killed runs stop through PR_SET_PDEATHSIG (Linux)")
def test_sweep_killed_by_sigkill_resumes_without_repeating_finished_runs(tiny, flowrl_cli):
    # one run at a time: the short run is done before the long one starts
    args = ["tiny.toml", "--variant", "short:", "--variant", "long:train.iterations=10", "-o", "sw"]
    sweep = subprocess.Popen([str(flowrl_cli.script), "sweep", *args], cwd=tiny, env=flowrl_cli.env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    long_dir = tiny / "sw" / "runs" / "long_seed7"
    try:
        _wait_for(lambda: (long_dir / "checkpoints" / "latest.json").is_file(), 90, "the long run's first checkpoint")
    finally:
        sweep.send_signal(signal.SIGKILL)  # no chance to clean up or to update the manifest
        sweep.communicate(timeout=30)
    m = _manifest(tiny / "sw")
    short, long = m["runs"]
    assert short["status"] == "done" and long["status"] == "running"  # as the killed sweep left it
    short_metrics = (tiny / "sw" / short["dir"] / "metrics.jsonl").read_bytes()

    # run the same command again: it waits for the orphaned run to checkpoint, then resumes it
    proc = _sweep(flowrl_cli, tiny, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = _manifest(tiny / "sw")
    short, long = m["runs"]
    assert short["status"] == "done" and short["attempts"] == 1  # not repeated
    assert (tiny / "sw" / short["dir"] / "metrics.jsonl").read_bytes() == short_metrics
    assert long["status"] == "done" and long["attempts"] == 2 and long["exit_code"] == 0
    out = (tiny / "sw" / "logs" / "long_seed7.out").read_text()
    assert "interrupted after" in out and "resumed from" in out
    # one uninterrupted-looking log: every iteration once, then the final evaluation
    assert _iterations(long_dir) == [(i, False) for i in range(10)] + [(10, True)]
    assert "resume at iteration" in proc.stdout


@pytest.mark.skipif(not hasattr(signal, "SIGUSR2"), reason="the parent-death signal is Linux's")
def test_a_dying_sweeps_repeated_death_signals_stop_a_run_once_with_its_checkpoint(tmp_path):
    """The kernel may send a run its parent-death signal once per exiting sweep thread: the run,
    already inside its stop handler, must see one stop request (it checkpoints), never a second
    signal (which aborts without a checkpoint). The slow lane's SIGKILL test caught the run
    aborting when the death signal was SIGHUP, one of the signals a run stops on."""
    script = """
import os, signal, sys
from pathlib import Path
from flowrl.distributed import DistContext
from flowrl.sweeps import PARENT_DEATH_SIGNAL, follow_the_sweep
from flowrl.train.stopping import Aborted, RunStop
os.environ["FLOWRL_SWEEP_PID"] = str(os.getppid())
follow_the_sweep()
said = []
try:
    with RunStop(Path(sys.argv[1]), DistContext(), said.append) as stop:
        for _ in range(3):  # as a dying multi-threaded sweep may send it
            os.kill(os.getpid(), PARENT_DEATH_SIGNAL)
        print(stop.requested, stop.signals, said[0].split(":")[0])
except Aborted:
    print("aborted")
"""
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "1", "Ctrl-C"]  # one stop, taken as the first Ctrl-C
    assert proc.stderr.count("the sweep process died; this run stops after a checkpoint") == 1


@pytest.mark.slow
def test_a_failed_run_is_recorded_and_sigterm_stops_the_sweep_cleanly(tiny, flowrl_cli):
    # The first variant's run fails in the engine (a prompts file is read when the run starts;
    # recipe validation does not open it); the sweep goes on with the second, and SIGTERM then
    # asks that run to checkpoint and stop.
    args = ["tiny.toml", "--variant", "bad:prompts.source=missing_prompts.txt", "--variant", "good:train.iterations=20",
            "-o", "sw"]
    sweep = subprocess.Popen([str(flowrl_cli.script), "sweep", *args], cwd=tiny, env=flowrl_cli.env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_dir = tiny / "sw" / "runs" / "good_seed7"
    try:
        _wait_for(lambda: (run_dir / "checkpoints" / "latest.json").is_file(), 90, "the good run's first checkpoint")
    finally:
        sweep.send_signal(signal.SIGTERM)
        out, _ = sweep.communicate(timeout=60)
    assert sweep.returncode == 128 + signal.SIGTERM, out
    flat = " ".join(out.split())
    assert "FAILED bad_seed7 (exit 2)" in flat and "missing_prompts.txt" in flat
    assert "continue with `flowrl sweep --resume sw`" in flat
    m = _manifest(tiny / "sw")
    bad, good = m["runs"]
    assert m["status"] == "interrupted"
    assert bad["status"] == "failed" and bad["exit_code"] == 2 and "missing_prompts.txt" in bad["stderr_tail"]
    assert good["status"] == "interrupted" and good["exit_code"] == 130 and good["wall_time_s"] > 0
    assert "interrupted after" in (tiny / "sw" / "logs" / "good_seed7.out").read_text()


# ----------------------------------------------------------------------------- bad input


def test_bad_sweep_input_gives_one_message_and_exit_2(tiny, flowrl_cli):
    (tiny / "empty").mkdir()
    calls = {
        "unknown key": (["sweep", "tiny.toml", "--grid", "train.lrr=1,2"],
                        ["variant 'train.lrr=1'", "unknown key 'lrr'", "did you mean 'lr'?"]),
        "bad combination": (["sweep", "tiny.toml", "--variant", "ok:", "--variant", "odd:chunker.use=explicit,chunker.sizes=[1]"],
                            ["variant 'odd'", "chunker.use=explicit chunker.sizes=[1]"]),
        "malformed grid": (["sweep", "tiny.toml", "--grid", "chunker.sizes=[2,3"], ["--grid", "unclosed '['"]),
        "no equals": (["sweep", "tiny.toml", "--grid", "train.lr"], ["must look like KEY=V1,V2"]),
        "reserved key": (["sweep", "tiny.toml", "--grid", "run.seed=1,2"], ["run.seed", "--seeds"]),
        "bad variant": (["sweep", "tiny.toml", "--variant", "no colon"], ["NAME:KEY=V"]),
        "both seeds": (["sweep", "tiny.toml", "--seeds", "2", "--seed-list", "1,2"], ["not both"]),
        "resume empty dir": (["sweep", "--resume", "empty"], ["no sweep.json in empty"]),
        "resume with grid": (["sweep", "--resume", "empty", "--grid", "train.lr=1"], ["give no RECIPE"]),
    }
    results = flowrl_cli.in_process([argv for argv, _ in calls.values()], cwd=tiny)
    for (name, (_, fragments)), res in zip(calls.items(), results):
        assert res.returncode == 2, (name, res.stdout, res.stderr)
        assert "Traceback" not in res.stderr, name
        assert res.flat_err.count("error:") == 1, (name, res.stderr)
        for f in fragments:
            assert f in res.flat_err, (name, f, res.stderr)
    assert not (tiny / "runs").exists()  # validation failed before any run (or directory) was made


class _Bar:
    """What Sweep._show tells rich's progress bar: the last ``completed`` and ``info`` per task."""

    def __init__(self):
        self.shown = {}

    def update(self, task, completed=None, info=None):
        self.shown[task] = completed


def test_the_overall_bar_counts_what_stopped_runs_trained(tmp_path):
    """A sweep stopped by Ctrl-C after two of its runs had checkpointed used to show 0 iterations
    done: only running runs were counted. A stopped (or failed) run counts what its metrics hold."""
    runs = [{"id": "a", "dir": "runs/a", "status": "done", "attempts": 1, "iterations": 4},
            {"id": "b", "dir": "runs/b", "status": "interrupted", "attempts": 1, "iterations": 4},
            {"id": "c", "dir": "runs/c", "status": "pending", "attempts": 0, "iterations": 4}]
    (tmp_path / "runs" / "b").mkdir(parents=True)
    (tmp_path / "runs" / "b" / "metrics.jsonl").write_text('{"iteration": 0}\n{"iteration": 1}\n')
    sweep = Sweep(tmp_path, {"runs": runs}, jobs=1, threads=1, console=None)
    bar = _Bar()
    sweep._show(bar, "overall")
    assert bar.shown["overall"] == 4 + 2  # a's 4, b's 2 (iterations 0 and 1 completed), c's none
