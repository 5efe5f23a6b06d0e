"""`flowrl diagnose RUN_DIR` (flowrl/run_health.py): the signs of an unhealthy run,
read from its metrics. The hacking lesson's recorded metrics (tests/fixtures/reference: the area
reward rises, the verifier judge falls) must be flagged; the other signs on rows built to cross
each threshold, and to stay just inside it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from flowrl.run_health import (
    CLIP_ACTIVE,
    EQUAL_GROUPS,
    HF_SHARE_RISE,
    SPREAD_COLLAPSE,
    run_health,
)
from flowrl.files import read_jsonl

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "tests" / "fixtures" / "reference"


def _status(checks, name):
    (check,) = [c for c in checks if c.name == name]
    return check.status, check.detail


def _rows(n=8, **late):
    """``n`` training rows (an evaluation in the first and the last), healthy unless ``late``
    sets a key's value in the last quarter; ``eval_first`` / ``eval_last`` override the evaluations."""
    first_eval = {"eval/r/mean": 0.5, "eval/r/sem": 0.01, "eval/judge/mean": 0.5, "eval/judge/sem": 0.01,
                  "eval/hf_share/mean": 0.06, "eval/hf_share/sem": 0.001}
    last_eval = dict(first_eval, **{"eval/r/mean": 0.6, "eval/judge/mean": 0.51})
    first_eval.update(late.pop("eval_first", {}))
    last_eval.update(late.pop("eval_last", {}))
    rows = []
    for i in range(n):
        row = {"iteration": i, "loss": 0.1, "reward/r/mean": 0.5 + 0.01 * i, "reward/r/std": 0.2,
               "groups/all_equal_fraction": 0.0, "clip_fraction": 0.05, "nonfinite_steps": 0}
        if i >= n - n // 4:
            row.update(late)
        rows.append(row)
    rows[0].update(first_eval)
    rows.append({"iteration": n, "final": True, **last_eval})
    return rows


def test_a_healthy_run_is_all_ok():
    checks = run_health(_rows(), ["r"])
    assert all(c.status == "ok" for c in checks), [(c.name, c.detail) for c in checks if c.status != "ok"]
    assert _status(checks, "r (optimised)")[1].startswith("0.5000 -> 0.6000 (+7.1 SE)")


def test_the_hacking_lessons_recorded_metrics_show_the_hacking_signature():
    """The area reward rose 0.235 -> 0.584 on held-out prompts while the verifier (logged, not
    optimised) fell 0.851 -> 0.472: flagged, with the optimised reward named."""
    checks = run_health(read_jsonl(REFERENCE / "quickstart_metrics.jsonl"), ["area"])
    assert _status(checks, "area (optimised)")[0] == "ok"
    status, detail = _status(checks, "verifier (judge, not optimised)")
    assert status == "warn" and "fell while area rose: the reward-hacking signature" in detail, detail
    assert "-7.7 SE" in detail


@pytest.mark.parametrize("late, check, warns", [
    ({"eval_last": {"eval/r/mean": 0.45}}, "r (optimised)", True),            # -3.5 SE
    ({"eval_last": {"eval/r/mean": 0.475}}, "r (optimised)", False),          # -1.8 SE: the noise
    ({"eval_last": {"eval/judge/mean": 0.45}}, "judge (judge, not optimised)", True),
    ({"eval_last": {"eval/hf_share/mean": 0.12}}, "high-frequency share", True),    # 2x and +0.06
    ({"eval_last": {"eval/hf_share/mean": 0.06 + HF_SHARE_RISE - 0.001}}, "high-frequency share", False),
    ({"eval_first": {"eval/hf_share/mean": 0.02}, "eval_last": {"eval/hf_share/mean": 0.05}},
     "high-frequency share", False),  # 2.5x, but +0.03: base-model noise, not a texture
    ({"groups/all_equal_fraction": EQUAL_GROUPS}, "equal-reward groups", True),
    ({"groups/all_equal_fraction": EQUAL_GROUPS - 0.01}, "equal-reward groups", False),
    ({"reward/r/std": 0.2 * SPREAD_COLLAPSE * 0.99}, "r spread", True),
    ({"clip_fraction": CLIP_ACTIVE}, "clip", True),
    ({"clip_fraction": CLIP_ACTIVE - 0.01}, "clip", False),
    ({"nonfinite_steps": 2}, "non-finite steps", True),
])
def test_each_sign_warns_past_its_threshold_and_not_before(late, check, warns):
    checks = run_health(_rows(**late), ["r"])
    names = [c.name for c in checks]
    if check == "r spread" and not warns:
        assert check not in names
        return
    status, detail = _status(checks, check)
    assert status == ("warn" if warns else "ok"), detail
    others = [c for c in checks if c.name != check and c.status != "ok"]
    assert not others, [(c.name, c.detail) for c in others]


def test_a_judge_that_falls_alone_is_not_called_hacking():
    checks = run_health(_rows(eval_last={"eval/r/mean": 0.5, "eval/judge/mean": 0.45}), ["r"])
    status, detail = _status(checks, "judge (judge, not optimised)")
    assert status == "warn" and detail.endswith("fell") and "hacking" not in detail


def test_a_run_without_two_evaluations_says_so():
    rows = [r for r in _rows() if not any(k.startswith("eval/") for k in r)]
    assert _status(run_health(rows, ["r"]), "evaluations") == (
        "ok", "none logged: nothing held out to judge the run by ([prompts].num_eval, [log].eval_every)")
    one = _rows()[:-1]  # the final evaluation not written yet
    assert _status(run_health(one, ["r"]), "evaluations") == ("ok", "one so far: nothing to compare yet")


@pytest.fixture
def reference_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(REFERENCE / "quickstart_metrics.jsonl", run / "metrics.jsonl")
    shutil.copy(REFERENCE / "quickstart.toml", run / "recipe.toml")
    return run


def test_the_command_reports_warns_and_exits_by_strictness(flowrl_cli, reference_run, tmp_path):
    plain, strict, as_json, not_a_run = flowrl_cli.in_process([
        ["diagnose", reference_run], ["diagnose", reference_run, "--strict"],
        ["diagnose", reference_run, "--json"], ["diagnose", tmp_path]])
    assert plain.returncode == 0 and "warn  verifier (judge, not optimised)" in plain.stdout, plain.stdout + plain.stderr
    assert "summary: 5 ok, 1 warn" in plain.stdout
    assert strict.returncode == 1
    report = json.loads(as_json.stdout, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert report["command"] == "diagnose" and report["counts"] == {"ok": 5, "warn": 1}
    assert not_a_run.returncode == 2 and "is not a run directory (no metrics.jsonl)" in not_a_run.stderr
    assert "Traceback" not in not_a_run.stderr


def test_the_diagnosis_page_shows_the_hacking_runs_output(flowrl_cli):
    """docs/diagnosis.md's example is `flowrl diagnose` on the hacking lesson's recorded metrics."""
    import re

    page = (REPO / "docs" / "diagnosis.md").read_text(encoding="utf-8")
    shown = re.search(r"```console\n\$ flowrl diagnose runs/quickstart_hacking\n(.*?)```", page, re.S).group(1)
    (result,) = flowrl_cli.in_process([["diagnose", "tests/fixtures/hacking_run"]], cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.replace("tests/fixtures/hacking_run", "runs/quickstart_hacking") == shown
    assert shown.count("  warn  ") == 2


def test_train_ends_with_the_warnings_and_the_command_that_shows_every_check():
    from flowrl.commands.base import load
    from flowrl.commands.train import warning_signs

    run = REPO / "tests" / "fixtures" / "hacking_run"
    lines = warning_signs(load(run / "recipe.toml"), run)
    assert lines[0] == f"warning signs (all checks: flowrl diagnose {run}):"
    assert [line.split(":")[0].strip() for line in lines[1:]] == ["verifier (judge, not optimised)",
                                                                   "high-frequency share"]
    assert warning_signs(load(run / "recipe.toml"), REPO / "benchmarks") == []  # no metrics.jsonl there: nothing


def test_what_a_run_optimises_counts_chunk_weights_and_nothing_offline():
    """A reward with weight 0 but chunk weights is trained on, not a judge; an offline run (SFT /
    DPO on a table) trains on no reward, so every evaluated one is a judge, and a falling one is
    not called hacking."""
    from flowrl.recipe import load_recipe
    from flowrl.run_health import optimised_labels

    hacking = load_recipe(REPO / "tests" / "fixtures" / "hacking_run" / "recipe.toml")
    assert optimised_labels(hacking) == ["area"]
    chunked = load_recipe(REPO / "tests" / "fixtures" / "hacking_run" / "recipe.toml",
                          ["rewards.0.weight=0.0", "rewards.0.chunk_weights=[1.0, 1.0, 0.5, 0.0]"])
    assert optimised_labels(chunked) == ["area"]
    offline = load_recipe(REPO / "recipes" / "offline_sft.toml")
    assert offline.data.enabled and optimised_labels(offline) == []
    checks = run_health(_rows(eval_last={"eval/r/mean": 0.4, "eval/judge/mean": 0.45}), optimised_labels(offline))
    assert _status(checks, "r (judge, not optimised)")[1].endswith("fell")
