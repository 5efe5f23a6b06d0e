"""Reference curves (flowrl/reference_curves.py, scripts/reference_curves.py): built from runs of one
recipe over seeds, used only for a run of the same settings (in any clone), drawn behind the
run's evaluation by `flowrl plot` and held against its last evaluation by `flowrl diagnose`."""

from __future__ import annotations

import json

import pytest

from flowrl import reference_curves as rc
from flowrl.errors import FlowrlError

RESOLVED = {"run": {"name": "quick", "seed": 42, "output_dir": "runs/quick", "device": "auto"},
            "model": {"use": "embedded"}, "train": {"iterations": 4, "lr": 1e-4},
            "prompts": {"source": f"{rc.CHECKOUT}/recipes/prompts/shapes.csv", "num_eval": 2},
            "log": {"eval_every": 2, "progress": True}, "checkpoint": {"every": 2},
            "rewards": [{"use": "verifier", "weight": 1.0}]}


def _rows(values, seed_shift=0.0):
    """Training rows 0..4 with evaluations at 0, 2, 4 (and the final row at 4)."""
    rows = []
    for it in range(5):
        row = {"iteration": it, "reward/verifier/mean": 0.5}
        if it % 2 == 0:
            row["eval/verifier/mean"] = values[it // 2] + seed_shift
            row["eval/verifier/sem"] = 0.01
        rows.append(row)
    rows.append({"iteration": 4, "final": True, "eval/verifier/mean": values[-1] + seed_shift, "eval/verifier/sem": 0.01})
    return rows


def _reference():
    runs = [(s, {**RESOLVED, "run": {**RESOLVED["run"], "seed": s}}, _rows([0.4, 0.5, 0.6], d))
            for s, d in ((42, 0.0), (43, 0.02), (44, -0.02))]
    return rc.build_reference(runs, recipe="quick", measured="today")


def test_a_reference_holds_each_iterations_mean_and_range_over_the_seeds():
    ref = _reference()
    curve = ref["metrics"]["eval/verifier/mean"]
    assert ref["seeds"] == [42, 43, 44] and curve["iterations"] == [0, 2, 4]
    assert curve["mean"] == pytest.approx([0.4, 0.5, 0.6]) and curve["low"] == pytest.approx([0.38, 0.48, 0.58])
    assert curve["high"] == pytest.approx([0.42, 0.52, 0.62])
    assert "seed" not in ref["regime"]["run"] and "checkpoint" not in ref["regime"]
    assert ref["regime"]["prompts"]["source"] == "<checkout>/recipes/prompts/shapes.csv"


def test_runs_of_other_settings_or_unfinished_evaluations_make_no_reference():
    other = {**RESOLVED, "train": {**RESOLVED["train"], "lr": 3e-4}}
    with pytest.raises(FlowrlError, match="differs from seed 42's in train.lr"):
        rc.build_reference([(42, RESOLVED, _rows([0.4, 0.5, 0.6])), (43, other, _rows([0.4, 0.5, 0.6]))],
                           recipe="quick", measured="")
    short = _rows([0.4, 0.5, 0.6])[:3]
    with pytest.raises(FlowrlError, match="different iterations"):
        rc.build_reference([(42, RESOLVED, _rows([0.4, 0.5, 0.6])), (43, RESOLVED, short)], recipe="q", measured="")
    with pytest.raises(FlowrlError, match="at least 2 seeds"):
        rc.build_reference([(42, RESOLVED, _rows([0.4, 0.5, 0.6]))], recipe="q", measured="")


def test_a_reference_applies_to_the_same_settings_in_any_clone_and_names_what_differs():
    ref = _reference()
    moved = json.loads(json.dumps(RESOLVED))
    moved["run"].update(seed=7, output_dir="/elsewhere")  # ignored
    moved["log"]["progress"] = False
    moved["prompts"]["embeddings"] = ""  # a key flowrl gained later: taken at its default
    assert rc.applies(ref, moved) == []
    changed = json.loads(json.dumps(RESOLVED))
    changed["train"]["lr"] = 3e-4
    changed["prompts"]["source"] = "/other/clone/shapes.csv"
    assert rc.applies(ref, changed) == ["prompts.source", "train.lr"]


def test_the_last_evaluation_is_held_against_the_seeds_range():
    ref = _reference()
    statuses = {}
    for name, shift in (("below", -0.1), ("within", 0.0), ("above", 0.1)):
        (check,) = rc.reference_checks(_rows([0.4, 0.5, 0.6], shift), ref, "ref.json")
        statuses[name] = (check.status, check.detail)
    assert statuses["below"][0] == "warn" and "below 0.580 to 0.620 over the reference's 3 seeds" in statuses["below"][1]
    assert statuses["within"][0] == "ok" and "within" in statuses["within"][1]
    assert statuses["above"][0] == "ok" and "above" in statuses["above"][1]


def test_a_reference_file_round_trips_and_a_broken_one_is_one_message(tmp_path):
    ref = _reference()
    rc.write_reference(tmp_path / "ref.json", ref)
    assert rc.read_reference(tmp_path / "ref.json") == ref
    with pytest.raises(FlowrlError, match="reference not found"):
        rc.read_reference(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text(json.dumps({**ref, "format": 9}))
    with pytest.raises(FlowrlError, match="is not a reference file"):
        rc.read_reference(tmp_path / "bad.json")


@pytest.fixture
def run_dir(tmp_path):
    from flowrl.recipe import dump_toml

    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.toml").write_text(dump_toml(RESOLVED))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows([0.4, 0.45, 0.5])))
    return run


def test_the_shipped_reference_of_the_runs_recipe_is_found_when_it_applies(run_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(rc, "SHIPPED", tmp_path / "shipped")
    assert rc.reference_for(run_dir) == (None, "")  # none shipped: nothing said
    (tmp_path / "shipped").mkdir()
    rc.write_reference(tmp_path / "shipped" / "quick.json", _reference())
    ref, note = rc.reference_for(run_dir)
    assert ref is not None and note == f"reference: {tmp_path / 'shipped' / 'quick.json'}, 3 seeds (42, 43, 44)"
    text = (run_dir / "recipe.toml").read_text().replace("lr = 0.0001", "lr = 0.0003")
    (run_dir / "recipe.toml").write_text(text)
    ref, note = rc.reference_for(run_dir)
    assert ref is None and "not used: it was measured with other settings (train.lr)" in note


def test_plot_draws_the_reference_behind_the_evaluation_and_diagnose_holds_the_run_against_it(run_dir, tmp_path,
                                                                                               flowrl_cli):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from flowrl.plotting import run_figure
    from flowrl.runlog import read_metrics

    fig = run_figure(read_metrics(run_dir), "run", _reference())
    try:
        (panel,) = [ax for ax in fig.axes if ax.get_title().startswith("evaluation")]
        assert "reference: 3 seeds' mean (dotted), range (hatched)" in [line.get_label() for line in panel.get_lines()]
    finally:
        plt.close(fig)
    rc.write_reference(tmp_path / "ref.json", _reference())
    (plotted, diagnosed) = flowrl_cli.in_process([
        ["plot", str(run_dir), "--reference", str(tmp_path / "ref.json"), "-o", str(tmp_path / "p.png")],
        ["diagnose", str(run_dir), "--reference", str(tmp_path / "ref.json"), "--json"]])
    assert plotted.returncode == 0 and "reference: " in plotted.stdout and (tmp_path / "p.png").is_file(), plotted.stderr
    assert diagnosed.returncode == 0, diagnosed.stderr + diagnosed.stdout
    checks = {c["name"]: c for c in json.loads(diagnosed.stdout)["checks"]}
    assert checks["verifier against the reference"]["status"] == "warn"  # 0.5 at iteration 4, below 0.58


@pytest.fixture
def script():
    from script_modules import script_module

    yield from script_module("reference_curves")


def test_the_script_makes_a_reference_from_a_finished_sweep_that_applies_to_its_runs(script, tmp_path, flowrl_cli):
    """scripts/README.md's two commands on the tiny recipe: 2 seeds, 2 iterations, an evaluation each."""
    from tiny_recipe import CLI, tiny_recipe, write_recipe

    recipe = write_recipe(tmp_path, tiny_recipe(CLI, train={"iterations": 2}, log={"eval_every": 1}))
    (swept,) = flowrl_cli.in_process([["sweep", str(recipe), "--seed-list", "42,43", "-o", str(tmp_path / "sweep")]],
                                     cwd=tmp_path)
    assert swept.returncode == 0, swept.stderr
    assert script.main([str(tmp_path / "sweep"), "-o", str(tmp_path / "ref.json")]) == 0
    ref = rc.read_reference(tmp_path / "ref.json")
    assert ref["seeds"] == [42, 43] and ref["recipe"] == "tiny" and ref["metrics"]["eval/area/mean"]["iterations"] == [0, 1, 2]
    reference, note = rc.reference_for(tmp_path / "sweep" / "runs" / "tiny_seed43", tmp_path / "ref.json")
    assert reference == ref and note.endswith("2 seeds (42, 43)")
    assert script.main([str(tmp_path), "-o", str(tmp_path / "x.json")]) == 2  # not a sweep: one message


def test_an_artefact_measure_warns_above_the_reference_not_below():
    runs = []
    for seed, shift in ((42, 0.0), (43, 0.01)):
        rows = _rows([0.4, 0.5, 0.6], shift)
        for row in rows:
            if "eval/verifier/mean" in row:
                row["eval/hf_share/mean"] = 0.05 + shift
        runs.append((seed, RESOLVED, rows))
    ref = rc.build_reference(runs, recipe="quick", measured="")
    for value, status in ((0.02, "ok"), (0.055, "ok"), (0.2, "warn")):
        rows = _rows([0.4, 0.5, 0.6])
        rows[-1]["eval/hf_share/mean"] = value
        (check,) = [c for c in rc.reference_checks(rows, ref, "ref") if c.name.startswith("hf_share")]
        assert check.status == status, (value, check.detail)
