"""Where `flowrl sample` writes, what it says, and the evaluation grids' captions.

``flowrl sample --model embedded`` used to write ``samples/embedded`` into the current directory
(a checkout then showed it to git), silently overwrote an earlier sample there (mixing its
images with the new ones when it had more), and named neither ``grid.png`` nor ``compare.png``.
A run's evaluation grids captioned each image with the first reward only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_recipe import CLI, tiny_recipe

from flowrl.recipe import load_recipe

RECIPE = tiny_recipe(CLI, run={"name": "sample_outputs", "seed": 3},
                     rewards=[{"use": "area"}, {"use": "verifier", "weight": 0.5}])

PROMPTS = ["a red circle on a blue background", "a green square on a white background"]


@pytest.fixture(scope="module")
def run_and_grids(tmp_path_factory):
    """A one-iteration run whose image_grid calls are recorded (captions and titles)."""
    import os

    from rich.console import Console

    import flowrl.train.outputs as outputs
    from flowrl.train import train

    root = tmp_path_factory.mktemp("sample_outputs")
    (root / "recipe.toml").write_text(RECIPE, encoding="utf-8")
    drawn = []
    real = outputs.image_grid

    def recording(images, caps, **kwargs):
        drawn.append((list(caps), kwargs.get("title", "")))
        return real(images, caps, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(outputs, "image_grid", recording)
        recipe = load_recipe(root / "recipe.toml", [f"run.output_dir={json.dumps(str(root / 'run'))}"])
        run = train(recipe, console=Console(file=open(os.devnull, "w"), width=200))
    return root, run, drawn


@pytest.fixture(scope="module")
def sampled(run_and_grids, flowrl_cli):
    root, run, _ = run_and_grids
    one = ["--prompt", PROMPTS[0]]
    both = [a for p in PROMPTS for a in ("--prompt", p)]
    model = ["sample", "--model", "embedded", "--set", "model.random_init=true", "--steps", "3"]
    calls = {
        "first": [*model, *both],
        "again": [*model, *one],
        "overwrite": [*model, *one, "--overwrite"],
        "compare": ["sample", str(run), *one, "--steps", "3", "--compare-base", "-o", str(root / "cmp")],
    }
    results = dict(zip(calls, flowrl_cli.in_process(list(calls.values()), cwd=root)))
    return root, results


def test_sample_of_a_model_writes_under_runs_and_names_its_grid(sampled):
    root, results = sampled
    r = results["first"]
    assert r.returncode == 0, r.stderr
    out = root / "runs" / "samples" / "embedded"
    assert not (root / "samples").exists()
    assert (out / "grid.png").is_file() and (out / "samples.jsonl").is_file()
    said = Path("runs", "samples", "embedded")  # relative to the directory it ran in, as given
    assert f"wrote 2 images to {said / 'images'}; the grid: {said / 'grid.png'}" in r.flat_out, r.flat_out


def test_an_earlier_sample_is_refused_without_overwrite_and_replaced_with_it(sampled):
    root, results = sampled
    out = root / "runs" / "samples" / "embedded"
    r = results["again"]
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and sum(line.startswith("error:") for line in r.stderr.splitlines()) == 1
    assert "already holds a sample" in r.flat_err and "--overwrite" in r.flat_err, r.flat_err
    assert results["overwrite"].returncode == 0, results["overwrite"].stderr
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [rec["prompt"] for rec in records] == [PROMPTS[0]]
    assert len(list((out / "images").glob("*.png"))) == 1  # the earlier sample's second image is gone


def test_compare_base_names_compare_png(sampled):
    root, results = sampled
    r = results["compare"]
    assert r.returncode == 0, r.stderr
    assert (root / "cmp" / "compare.png").is_file()
    assert str(root / "cmp" / "compare.png") in r.flat_out and str(root / "cmp" / "grid.png") in r.flat_out, r.flat_out


def test_evaluation_grids_caption_every_reward(run_and_grids):
    _, _, drawn = run_and_grids
    evaluations = [(caps, title) for caps, title in drawn if title.startswith(("evaluation before", "final evaluation"))]
    assert len(evaluations) == 2  # before iteration 0, and the final one
    for caps, title in evaluations:
        assert len(caps) == 2
        for cap in caps:
            lines = cap.split("\n")
            assert lines[0].endswith("background") and [line.split()[0] for line in lines[1:]] == ["area", "verifier"], cap
        assert "mean area " in title and ", verifier " in title, title


def test_a_run_before_its_first_checkpoint_is_refused(tmp_path, flowrl_cli):
    """No trained weights yet: sampling it would draw the base model under the run's name (into
    runs/samples/<run>, its settings saying checkpoint null). Refused, as `flowrl eval` refuses it,
    with the command that samples the base model."""
    run = tmp_path / "early_run"
    run.mkdir()
    (run / "recipe.toml").write_text(tiny_recipe(CLI, run={"name": "early_run"}), encoding="utf-8")
    (result,) = flowrl_cli.in_process([["sample", run, "--prompt", "a red circle", "-o", tmp_path / "out"]])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    flat = " ".join(result.stderr.split())
    assert "has no checkpoint yet, so there are no trained weights to sample" in flat
    assert f"flowrl sample {run / 'recipe.toml'}" in flat
    assert not (tmp_path / "out").exists()
