"""``flowrl selftest --gpu``: its steps and budgets (the dry run CI runs), how one step is run,
killed, skipped or failed without stopping the next, and how each step's figures are read from
what the GPU machine's programs write (the recorded H100 and H200 files as inputs)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from flowrl.diagnostics import gpu_check
from flowrl.diagnostics.gpu_check import Setting, Step, StepFailed

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"


def test_dry_run_lists_every_step_with_its_budget_within_eight_minutes(flowrl_cli):
    (result,) = flowrl_cli.in_process([["selftest", "--gpu", "--dry-run"]])
    assert result.returncode == 0, result.stderr
    budgets = {s.name: s.budget_s for s in gpu_check.default_steps()}
    assert list(budgets) == ["doctor", "selftest", "gpu_lane", "quickstart", "flux_iteration", "memory", "attention"]
    assert sum(budgets.values()) <= 8 * 60
    for name, budget in budgets.items():
        assert f"{name}" in result.stdout and f"{budget} s" in result.stdout, (name, result.stdout)
    # the whole suite outlasts the 8 minutes: listed as run on request, not run
    assert "on request (--only suite): suite, 420 s" in result.stdout
    assert "-m 'not slow and not gpu'" not in result.stdout
    # from the checkout, every step has its files: nothing is skipped for a missing lane or script
    assert "skipped here" not in result.stdout, result.stdout
    assert "pytest -m gpu" in result.stdout and "gpu_flux_iteration.py" in result.stdout


def test_gpu_check_without_cuda_is_one_message_and_writes_nothing(flowrl_cli, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    (result,) = flowrl_cli.in_process([["selftest", "--gpu", "--output", str(tmp_path / "out")]])
    assert result.returncode == 2
    assert "needs a CUDA GPU" in result.flat_err and "--dry-run" in result.flat_err
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, expected", [
    (["selftest", "--gpu", "--dry-run", "--only", "doctor,nope"], "no step named 'nope'"),
    (["selftest", "--dry-run"], "belong to the GPU check"),
    # an empty check wrote its report under the whole check's name, over that day's results
    (["selftest", "--gpu", "--dry-run", "--only", "doctor", "--skip", "doctor"], "leave no step to run"),
    (["selftest", "--gpu", "--dry-run", "--only", ","], "--only names no step"),
])
def test_bad_gpu_check_options_are_one_message(flowrl_cli, argv, expected):
    (result,) = flowrl_cli.in_process([argv])
    assert result.returncode == 2 and expected in result.flat_err and "Traceback" not in result.stderr


def test_only_and_skip_choose_steps_in_the_check_order():
    assert [s.name for s in gpu_check.choose("attention,doctor", None)] == ["doctor", "attention"]
    assert "memory" not in [s.name for s in gpu_check.choose(None, "memory")]
    assert "suite" not in [s.name for s in gpu_check.choose(None, None)]
    assert [s.name for s in gpu_check.choose("suite,doctor", None)] == ["doctor", "suite"]


def test_the_suite_step_runs_the_whole_suite_with_its_outcome_log(flowrl_cli):
    (result,) = flowrl_cli.in_process([["selftest", "--gpu", "--dry-run", "--only", "suite"]])
    assert result.returncode == 0, result.stderr
    command = result.stdout.split("suite", 2)[-1]
    assert "1 step(s), 420 s of budgets" in result.stdout
    assert "-m 'not slow and not gpu' -n auto" in command and "-p flowrl.diagnostics.failure_log" in command
    assert "--outcome-log '<scratch>/suite.jsonl'" in command


def _suite_files(directory: Path) -> Path:
    """A tiny test suite: a pass, a failure with a reason, a skip, a set-up error, and a test that
    outlasts any budget the tests give."""
    directory.mkdir()
    (directory / "test_tiny.py").write_text(
        "import time, pytest\n"
        "@pytest.fixture\n"
        "def broken():\n"
        "    raise RuntimeError('fixture could not start')\n"
        "def test_passes():\n    assert True\n"
        "def test_fails():\n    assert 1 + 1 == 3, 'the real reason'\n"
        "def test_skips():\n    pytest.skip('not here')\n"
        "def test_errors(broken):\n    pass\n"
        "def test_zz_hangs():\n    time.sleep(60)\n")
    return directory


def _suite_step(tests: Path, extra: tuple[str, ...] = ()) -> Step:
    return Step("suite", "suite", 60, lambda s: [
        sys.executable, "-m", "pytest", str(tests), "-q", "-p", "no:cacheprovider", "-p", "flowrl.diagnostics.failure_log",
        "--outcome-log", str(s.workdir / "suite.jsonl"), *extra],
        lambda s, out: gpu_check.suite_figures(s.workdir / "suite.jsonl"), on_request=True)


def test_a_suite_cut_at_its_budget_still_says_what_failed_and_why(tmp_path):
    """Under xdist, as the step runs it: the controller writes each worker's outcomes as they come."""
    tests = _suite_files(tmp_path / "suite")
    work = tmp_path / "work"
    work.mkdir()
    result = gpu_check.run_step(_suite_step(tests, ("-n", "2")), Setting(None, work), 15)
    assert result.status == "timeout", result
    figures = result.figures
    assert (figures["passed"], figures["failed"], figures["skipped"]) == (1, 2, 1), figures
    failures = {f["test"].split("::")[-1]: f for f in figures["failures"]}
    assert set(failures) == {"test_fails", "test_errors"}
    assert "the real reason" in failures["test_fails"]["traceback"] and failures["test_fails"]["when"] == "call"
    assert "fixture could not start" in failures["test_errors"]["traceback"] and failures["test_errors"]["when"] == "setup"
    lines = (work / "suite.jsonl").read_text().splitlines()
    assert len(lines) == len({(json.loads(line)["test"], json.loads(line)["when"]) for line in lines})  # none twice


def test_a_module_that_cannot_be_collected_is_a_failure_with_its_import_error(tmp_path):
    tests = _suite_files(tmp_path / "suite")
    (tests / "test_tiny.py").write_text((tests / "test_tiny.py").read_text().replace("time.sleep(60)", "pass"))
    (tests / "test_needs_a_package.py").write_text("import no_such_package_here\n\ndef test_x():\n    pass\n")
    work = tmp_path / "work"
    work.mkdir()
    result = gpu_check.run_step(_suite_step(tests, ("-n", "2")), Setting(None, work), 60)
    assert result.status == "fail" and result.figures["failed"] == 3, result
    (collect,) = [f for f in result.figures["failures"] if f["when"] == "collect"]
    assert collect["test"].endswith("test_needs_a_package.py") and "no_such_package_here" in collect["traceback"]


def test_a_finished_suite_with_failures_fails_the_step_with_their_names(tmp_path):
    tests = _suite_files(tmp_path / "suite")
    (tests / "test_tiny.py").write_text((tests / "test_tiny.py").read_text().replace("time.sleep(60)", "pass"))
    work = tmp_path / "work"
    work.mkdir()
    result = gpu_check.run_step(_suite_step(tests), Setting(None, work), 60)
    assert result.status == "fail" and result.error.startswith("2 test(s) failed:") and "test_fails" in result.error
    assert result.figures["passed"] == 2
    table = gpu_check.markdown(gpu_check.report([result], {"name": "GPU"}, {}, 60, 1.0, "2026-12-01T00:00:00Z"))
    assert "failures: 2" in table and "the real reason" not in table  # tracebacks stay in the JSON


def _python_step(name: str, code: str, figures=lambda s, out: {"said": out.strip()}, budget: int = 30) -> Step:
    return Step(name, name, budget, lambda s: [sys.executable, "-c", code], figures)


def test_a_step_that_passes_reports_its_figures(tmp_path):
    result = gpu_check.run_step(_python_step("ok", "print('hello')"), Setting(repo=None, workdir=tmp_path), 30)
    assert result.status == "pass" and result.figures == {"said": "hello"} and result.error is None


def test_a_step_that_exits_non_zero_fails_with_the_end_of_its_output(tmp_path):
    code = "import sys; print('line one', file=sys.stderr); print('the real reason', file=sys.stderr); sys.exit(3)"
    result = gpu_check.run_step(_python_step("bad", code, figures=lambda s, out: {}), Setting(None, tmp_path), 30)
    assert result.status == "fail" and "exit status 3" in result.error and "the real reason" in result.error


def test_a_step_whose_figures_say_failed_keeps_its_figures(tmp_path):
    def figures(setting, out):
        raise StepFailed("too slow", {"seconds_per_iteration": 99.0})

    result = gpu_check.run_step(_python_step("slow", "pass", figures=figures), Setting(None, tmp_path), 30)
    assert result.status == "fail" and result.error == "too slow" and result.figures == {"seconds_per_iteration": 99.0}


def test_a_step_past_its_budget_is_killed_with_everything_it_started(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; "
            f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pid_file)!r}, 'w').write(str(child.pid)); print('started', flush=True); time.sleep(60)")
    started = time.perf_counter()
    result = gpu_check.run_step(_python_step("hang", code, budget=60), Setting(None, tmp_path), 3)
    assert time.perf_counter() - started < 20
    assert result.status == "timeout" and "budget of 3 s" in result.error
    child = int(pid_file.read_text())
    for _ in range(50):  # the kill is delivered; the child is reaped by init
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        if Path(f"/proc/{child}/stat").exists() and Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the step's child process {child} outlived the step")


def test_a_failing_step_does_not_stop_the_next_and_time_runs_out_as_a_skip(tmp_path):
    chosen = [_python_step("first", "import sys; sys.exit(1)", figures=lambda s, out: {}),
              _python_step("second", "print('ran')"),
              Step("missing", "missing", 30, lambda s: "needs tests/gpu from the checkout", lambda s, out: {}),
              _python_step("sleeper", "import time; time.sleep(60)", budget=60),
              _python_step("after", "print('never')")]
    results = gpu_check.run_check(Setting(None, tmp_path), chosen, total_budget_s=6, least_useful_s=2)
    assert [r.status for r in results] == ["fail", "pass", "skip", "timeout", "skip"]
    assert "out of time" in results[4].error


def test_junit_report_gives_counts_and_the_failing_tests(tmp_path):
    xml = tmp_path / "gpu_lane.xml"
    xml.write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="4" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.gpu.test_engine" name="test_ok"/>'
        '<testcase classname="tests.gpu.test_engine" name="test_resume"><failure message="x"/></testcase>'
        '<testcase classname="tests.gpu.test_engine" name="test_skip"><skipped/></testcase>'
        '<testcase classname="tests.gpu.test_engine" name="test_two"/></testsuite></testsuites>')
    with pytest.raises(StepFailed) as caught:
        gpu_check.junit_figures(xml)
    assert caught.value.figures == {"passed": 2, "failed": 1, "errors": 0, "skipped": 1,
                                    "failing": ["tests.gpu.test_engine::test_resume"]}
    assert "test_resume" in str(caught.value)


def _eval(mean: float, sem: float, **more) -> dict:
    return {"iteration": 0, "eval/verifier/mean": mean, "eval/verifier/sem": sem, **more}


def test_quickstart_learns_by_the_readme_bar_or_fails_with_its_numbers():
    rows = [_eval(0.83, 0.01, **{"eval/embedded_clip/mean": 0.5, "eval/hf_share/mean": 0.1}), {"loss": 1.0},
            _eval(0.91, 0.01, **{"eval/embedded_clip/mean": 0.52, "eval/hf_share/mean": 0.1})]
    figures = gpu_check.quickstart_figures(rows)
    assert figures["rise_se"] == pytest.approx(0.08 / (0.01 * 2 ** 0.5), abs=0.01)
    assert figures["second_judge_last"] == 0.52
    with pytest.raises(StepFailed, match="the CPU's bar is >= 5"):
        gpu_check.quickstart_figures([_eval(0.83, 0.02), _eval(0.85, 0.02)])


def test_flux_figures_read_the_recorded_h200_iteration():
    recorded = json.loads((RESULTS / "gpu_flux_iteration_h200.json").read_text())
    figures = gpu_check.flux_figures(recorded)
    assert figures["seconds_per_iteration"] == pytest.approx(22.7068, abs=1e-3)
    assert figures["peak_gib"] == pytest.approx(34.1375, abs=1e-3) and figures["compute_ratio"] == 1.0


def test_attention_figures_read_the_recorded_h100_backends():
    recorded = (RESULTS / "sdpa_backends_h100.jsonl").read_text()
    figures = gpu_check.attention_figures(recorded)  # torch's default (cuDNN) faulted there: reported, known
    assert figures["flash"] == "ok" and figures["auto"].startswith("error")
    broken = recorded.replace('"backend": "flash", "ok": true', '"backend": "flash", "ok": false')
    with pytest.raises(StepFailed, match="flash"):
        gpu_check.attention_figures(broken)


def test_memory_figures_fail_on_a_configuration_that_failed():
    good = {"configurations": {"flux": {"planned_gib": 40.0, "measured_gib": 36.0, "ratio": 1.11, "seconds": 20}}}
    assert gpu_check.memory_figures(good)["flux"]["ratio"] == 1.11
    with pytest.raises(StepFailed, match="wan: CUDA out of memory"):
        gpu_check.memory_figures({"configurations": {**good["configurations"], "wan": {"error": "CUDA out of memory"}}})


def test_the_report_is_written_as_json_and_a_markdown_table(tmp_path):
    results = gpu_check.run_check(Setting(None, tmp_path), [_python_step("ok", "print('x')")], 60)
    device = {"name": "NVIDIA H100 80GB HBM3", "count": 1, "memory_gib": 79.1, "capability": "9.0", "driver": "580"}
    report = gpu_check.report(results, device, {"torch": "2.11.0+cu130"}, 480, 1.5, "2026-11-29T08:00:00Z")
    json_path, md_path = gpu_check.write_report(report, tmp_path / "results")
    assert json_path.name == "gpu_check_h100_80gb_hbm3_2026-11-29.json"
    saved = json.loads(json_path.read_text())
    assert saved["kind"] == "flowrl-gpu-check" and saved["steps"][0]["status"] == "pass"
    table = md_path.read_text()
    assert "| ok | pass |" in table and "NVIDIA H100 80GB HBM3" in table
    # the failed steps run again the same day leave the whole check's files alone
    again, _ = gpu_check.write_report(report, tmp_path / "results", ["gpu_lane", "memory"])
    assert again.name == "gpu_check_h100_80gb_hbm3_2026-11-29_only-gpu_lane-memory.json" and json_path.is_file()
