"""`flowrl compare` on synthetic runs whose statistics are worked out by hand in the comments."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from flowrl.comparison import compare_runs, discover, load_curve

T_975_2 = 4.302653  # t_{0.975, 2}: three seeds


def _write_run(run_dir: Path, ys: list[float], seconds_per_iteration: float, seed: int | None = None,
               metric: str = "eval/verifier/mean") -> None:
    """Evaluations at iterations 0..len(ys)-2 and a final one; each logged iteration costs
    ``seconds_per_iteration`` of train time (split over two phases) plus 5 s of evaluation."""
    run_dir.mkdir(parents=True)
    lines = []
    for i, y in enumerate(ys[:-1]):
        lines.append({"iteration": i, metric: y, "eval/area/mean": 0.1, "time/eval": 5.0,
                      "time/rollout": 0.6 * seconds_per_iteration, "time/update": 0.4 * seconds_per_iteration})
    lines.append({"iteration": len(ys) - 1, "final": True, metric: ys[-1], "eval/area/mean": 0.1})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
    if seed is not None:
        (run_dir / "recipe.toml").write_text(f'[run]\nseed = {seed}\n\n[[rewards]]\nuse = "verifier"\nweight = 1.0\n')


@pytest.fixture
def study(tmp_path):
    """A sweep directory: variant A (1 s per iteration) and B (2 s), seeds 0, 1, 2; C one seed.

    A, seed s: 0.50 0.60 0.70 0.80 (+0.01 s)    B, seed s: 0.50 0.70 0.80 0.90 (+0.02 s)
    """
    sweep = tmp_path / "study"
    runs = []
    for name, ys, secs, step, seeds in [("A", [0.5, 0.6, 0.7, 0.8], 1.0, 0.01, [0, 1, 2]),
                                         ("B", [0.5, 0.7, 0.8, 0.9], 2.0, 0.02, [0, 1, 2]),
                                         ("C", [0.5, 0.5, 0.5, 0.5], 1.0, 0.0, [0])]:
        for s in seeds:
            d = f"runs/{name}_seed{s}"
            _write_run(sweep / d, [y + step * s for y in ys], secs, seed=s)
            runs.append({"id": f"{name}_seed{s}", "variant": name, "seed": s, "dir": d, "status": "done",
                         "wall_time_s": 10.0 + s, "overrides": []})
    runs.append({"id": "D_seed0", "variant": "D", "seed": 0, "dir": "runs/D_seed0", "status": "failed", "overrides": []})
    (sweep / "sweep.json").write_text(json.dumps({"version": 1, "spec": {}, "runs": runs}))
    return sweep


def _variant(result, name):
    return next(v for v in result["variants"] if v["name"] == name)


def test_statistics_by_hand(study):
    notes: list[str] = []
    refs = discover([study], notes)
    assert "left out 1 run(s) not done: D_seed0 (failed)" in notes[0]
    result = compare_runs([load_curve(r, "eval/verifier/mean") for r in refs], "A", at_wall_time=2.5)
    a, b, c = (_variant(result, n) for n in "ABC")
    # final A: 0.80 0.81 0.82 -> mean 0.81, s = 0.01, half = 4.302653 * 0.01 / sqrt(3) = 0.0248414
    assert a["final"]["mean"] == pytest.approx(0.81) and a["final"]["half_width"] == pytest.approx(0.0248414, abs=1e-7)
    # final B: 0.90 0.92 0.94 -> mean 0.92, s = 0.02, half = 4.302653 * 0.02 / sqrt(3) = 0.0496828
    assert b["final"]["mean"] == pytest.approx(0.92) and b["final"]["half_width"] == pytest.approx(0.0496828, abs=1e-7)
    # best = final (the curves rise)
    assert b["best"]["mean"] == pytest.approx(0.92)
    # AUC A, seed 0: trapezoids over x = 0..3: (0.55 + 0.65 + 0.75) / 3 = 0.65; + 0.01 s -> mean 0.66
    # AUC B, seed 0: (0.60 + 0.75 + 0.85) / 3 = 0.733333; + 0.02 s -> mean 0.753333
    assert a["auc"]["mean"] == pytest.approx(0.66) and b["auc"]["mean"] == pytest.approx(0.7533333, abs=1e-7)
    # paired B - A, final: 0.10 0.11 0.12 -> 0.11 +- 0.0248414 over 3 pairs
    d = b["paired"]["final"]
    assert d["n"] == 3 and d["mean"] == pytest.approx(0.11) and d["half_width"] == pytest.approx(0.0248414, abs=1e-7)
    assert a["paired"] is None
    # C has one seed: no interval; its pair with A (seed 0) is one difference: no interval
    assert c["final"]["half_width"] is None and c["paired"]["final"]["n"] == 1 and c["paired"]["final"]["half_width"] is None
    # train time: 3 logged iterations (evaluation time excluded): A 3 s, B 6 s
    assert a["train_time_s"]["mean"] == pytest.approx(3.0) and b["train_time_s"]["mean"] == pytest.approx(6.0)
    assert a["wall_time_s"]["mean"] == pytest.approx(11.0)  # 10, 11, 12 from the manifest
    # at 2.5 s: A's evaluations cost 0, 1, 2, 3 s -> x = 2 (0.70 + 0.01 s); B's cost 0, 2, 4, 6 -> x = 1 (0.70 + 0.02 s)
    assert a["at_wall_time"]["mean"] == pytest.approx(0.71) and b["at_wall_time"]["mean"] == pytest.approx(0.72)
    assert a["at_wall_time_iteration"]["mean"] == 2 and b["at_wall_time_iteration"]["mean"] == 1
    # paired B - A at 2.5 s: 0.00 0.01 0.02 -> 0.01 +- 0.0248414
    assert b["paired"]["at_wall_time"]["mean"] == pytest.approx(0.01)
    assert b["paired"]["at_wall_time"]["half_width"] == pytest.approx(0.0248414, abs=1e-7)
    assert a["at_wall_time_runs_ended_before"] == 0 and c["at_wall_time_runs_ended_before"] == 0


def test_outputs_in_every_format_and_the_figure(study, flowrl_cli, tmp_path):
    out = tmp_path / "out"
    calls = [["compare", str(study), "--baseline", "A", "--metric", "verifier", "--format", f, "--at-wall-time", "2.5"]
             for f in ("json", "md", "csv", "table")]
    calls.append(["compare", str(study), "-b", "A", "-o", str(out)])
    res = flowrl_cli.in_process(calls)
    for r in res:
        assert r.returncode == 0, (r.argv, r.stderr)
    as_json = json.loads(res[0].stdout)
    assert as_json["metric"] == "eval/verifier/mean" and as_json["interval"] == "student-t"
    assert _variant(as_json, "B")["paired"]["final"]["mean"] == pytest.approx(0.11)
    md = res[1].stdout
    assert "| variant | n | final | best | AUC | at 2.5 s | Δ final | Δ AUC | Δ at 2.5 s | train s | wall s |" in md
    assert "| B | 3 | 0.9200 ± 0.0497 |" in md and "+0.1100 ± 0.0248" in md and "| A | 3 |" in md
    assert "| C | 1 | 0.5000 (n/a) |" in md and "| -0.3000 (n/a) |" in md
    assert "Student t interval" in md
    rows = list(csv.DictReader(io.StringIO(res[2].stdout)))
    assert [r["variant"] for r in rows] == ["A", "B", "C"]
    b = rows[1]
    assert float(b["final_mean"]) == pytest.approx(0.92)
    assert float(b["final_lo"]) == pytest.approx(0.92 - 0.0496828, abs=1e-7)
    assert float(b["delta_final_mean"]) == pytest.approx(0.11) and b["delta_final_n"] == "3"
    assert rows[0]["delta_final_mean"] == "" and rows[2]["final_lo"] == ""
    assert "baseline: A" in res[3].flat_out and "0.9200 ± 0.0497" in res[3].flat_out
    for name in ("compare.md", "compare.csv", "compare.json", "compare.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "D_seed0 (failed)" in res[4].flat_err


def test_runs_named_by_directory_group_into_variants(tmp_path, flowrl_cli):
    for name, seed, ys in [("step_seed1", 1, [0.5, 0.6]), ("step_seed2", 2, [0.5, 0.7]), ("gspo-seed1", 1, [0.5, 0.8])]:
        _write_run(tmp_path / name, ys, 1.0, seed=seed)
    (res,) = flowrl_cli.in_process([["compare", str(tmp_path / "step_seed1"), str(tmp_path / "step_seed2"),
                                str(tmp_path / "gspo-seed1"), "-f", "json"]])
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout)
    assert [(v["name"], v["n"], v["seeds"]) for v in result["variants"]] == [("step", 2, [1, 2]), ("gspo", 1, [1])]
    # gspo seed 1 (0.8) - step seed 1 (0.6)
    assert _variant(result, "gspo")["paired"]["final"]["mean"] == pytest.approx(0.2)
    # a directory holding run directories works the same
    (res,) = flowrl_cli.in_process([["compare", str(tmp_path), "-f", "json"]])
    assert [v["name"] for v in json.loads(res.stdout)["variants"]] == ["gspo", "step"]


def test_bad_compare_input_gives_one_message_and_exit_2(study, tmp_path, flowrl_cli):
    (tmp_path / "empty").mkdir()
    gappy = tmp_path / "gappy" / "x_seed1"
    _write_run(gappy, [0.5, 0.6, 0.7], 1.0, seed=1)
    lines = (gappy / "metrics.jsonl").read_text().splitlines()
    (gappy / "metrics.jsonl").write_text("\n".join([lines[0], lines[2]]) + "\n")  # iteration 1 not logged
    late = tmp_path / "late" / "x_seed1"  # the metric only at the final evaluation, after 2 s of training
    _write_run(late, [0.5, 0.6, 0.7], 1.0, seed=1)
    rows = [json.loads(line) for line in (late / "metrics.jsonl").read_text().splitlines()]
    for row in rows[:-1]:
        row.pop("eval/verifier/mean")
    (late / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    calls = {
        "a metric first logged after the budget": (["compare", str(late.parent), "--at-wall-time", "1"],
                                                    ["has no value of the metric within 1 s", "its first is at 2.0 s"]),
        "empty dir": (["compare", str(tmp_path / "empty")], ["no runs in", "no sweep.json"]),
        "missing": (["compare", str(tmp_path / "nope")], ["does not exist"]),
        "unknown metric": (["compare", str(study), "--metric", "clip"], ["no 'eval/clip/mean' values", "available: eval/area/mean, eval/verifier/mean"]),
        "unknown baseline": (["compare", str(study), "--baseline", "Z"], ["no variant named 'Z'", "valid: A, B, C"]),
        "unknown format": (["compare", str(study), "--format", "xls"], ["unknown format 'xls'"]),
        "gaps with a budget": (["compare", str(gappy), "--at-wall-time", "1"], ["did not log every iteration", "[log].every = 1"]),
    }
    results = flowrl_cli.in_process([argv for argv, _ in calls.values()])
    for (name, (_, fragments)), res in zip(calls.items(), results):
        assert res.returncode == 2, (name, res.stdout, res.stderr)
        assert "Traceback" not in res.stderr, name
        assert res.flat_err.count("error:") == 1, (name, res.stderr)
        for f in fragments:
            assert f in res.flat_err, (name, f, res.stderr)


def test_a_table_piped_into_a_log_keeps_every_row_on_one_line(study, flowrl_cli):
    """No terminal and no COLUMNS (a Slurm output file): rich assumed 80 columns and folded the
    cells of this table mid-word; it now takes the width its cells need."""
    import subprocess
    import sys

    from flowrl.comparison import table_rows

    argv = ["compare", str(study), "--baseline", "A", "--metric", "verifier", "--at-wall-time", "2.5"]
    (as_json,) = flowrl_cli.in_process([[*argv, "--format", "json"]])
    env = flowrl_cli.env()
    env.pop("COLUMNS")  # as under Slurm: stdout is a file and nothing says how wide
    piped = subprocess.run([sys.executable, "-m", "flowrl", *argv], cwd=flowrl_cli.repo, env=env,
                           capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0, piped.stderr
    header, rows = table_rows(json.loads(as_json.stdout))
    lines = piped.stdout.splitlines()
    assert max(map(len, lines)) > 80  # wider than rich's assumed terminal: the case that used to fold
    for cells in [header, *rows]:
        assert any(all(cell in line for cell in cells) for line in lines), (cells, piped.stdout)
