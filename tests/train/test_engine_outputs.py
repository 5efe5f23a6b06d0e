"""What a run writes and when: a no-op resume, time-based checkpoints, pictures, run constants,
throughput, and nothing at all when a run is rejected before its first iteration."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from engine_helpers import load, quiet_console
from tiny_recipe import ENGINE, tiny_recipe, write_recipe

from flowrl import hookimpl
from flowrl.errors import FlowrlError
from flowrl.plugins import temporary_plugin
from flowrl.runlog import caption_font, image_grid, read_metrics, wrap_text
from flowrl.train import train
from flowrl.train.outputs import degenerate_note

#: The tiny recipe, evaluating 3 fixed prompts every 2 iterations and drawing a grid every 2.
EVAL = {"prompts": {"num_eval": 3}, "log": {"eval_every": 2, "image_every": 2}}
EVAL_RECIPE = tiny_recipe(ENGINE, EVAL)


class Recorder:
    """A tracker plugin that keeps what it is given (class attributes: the engine builds it)."""

    metrics: list[tuple[int, dict]] = []
    images: list[tuple[int, str, object]] = []

    @hookimpl
    def register_trackers(self, register):
        rec = Recorder

        class Tracker:
            def log_metrics(self, step, metrics):
                rec.metrics.append((step, dict(metrics)))

            def log_image(self, step, name, image):
                rec.images.append((step, name, image))

            def close(self):
                pass

        register("recorder", lambda: Tracker())


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory):
    """A 4-iteration run that evaluates and draws grids, with a recording tracker."""
    root = tmp_path_factory.mktemp("eval_run")
    path = write_recipe(root, tiny_recipe(ENGINE, EVAL, trackers=[{"use": "recorder"}]))
    Recorder.metrics, Recorder.images = [], []
    with temporary_plugin(Recorder(), name="recorder"):
        run_dir = train(load(path, f"run.output_dir={str(root / 'run')!r}"), console=quiet_console())
    return run_dir, list(Recorder.metrics), list(Recorder.images)


def plain_recipe(run_dir, tmp_path):
    """The run's recipe without the recording tracker (trackers may change on resume)."""
    return load(write_recipe(tmp_path, EVAL_RECIPE), f"run.output_dir={str(run_dir)!r}")


# ------------------------------------------------------------------------------ no-op resume


@pytest.mark.slow
def test_resuming_a_finished_run_changes_nothing(eval_run, tmp_path):
    from rich.console import Console

    run_dir, _, _ = eval_run
    files = sorted(p for p in run_dir.rglob("*") if p.is_file())
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in files}
    assert read_metrics(run_dir)[-1]["final"] is True
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        train(plain_recipe(run_dir, tmp_path), resume=run_dir, console=Console(file=f, width=200))
    assert "nothing to do" in out.read_text()
    assert sorted(p for p in run_dir.rglob("*") if p.is_file()) == files
    for p in files:  # byte-identical and not even rewritten
        assert (p.read_bytes(), p.stat().st_mtime_ns) == before[p], p


@pytest.mark.slow
def test_resume_of_a_run_stopped_during_its_final_evaluation_does_it(eval_run, tmp_path):
    import shutil

    run_dir, _, _ = eval_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    lines = (copy / "metrics.jsonl").read_text().splitlines(keepends=True)
    (copy / "metrics.jsonl").write_text("".join(lines[:-1]))  # the final row is missing
    train(plain_recipe(copy, tmp_path), resume=copy, console=quiet_console())
    assert (copy / "metrics.jsonl").read_text() == (run_dir / "metrics.jsonl").read_text()


# ------------------------------------------------------------------------------ time-based checkpoints


@pytest.mark.slow
def test_every_minutes_writes_a_checkpoint_when_the_time_has_passed(tmp_path):
    path = write_recipe(tmp_path)
    run = train(load(path, f"run.output_dir={str(tmp_path / 'run')!r}", "checkpoint.every=100",
                     "checkpoint.keep_last=10", "checkpoint.every_minutes=1e-6"), console=quiet_console())
    names = sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir())
    assert names == ["iter_000001", "iter_000002", "iter_000003", "iter_000004"]
    # a checkpoint after every iteration; each one's seconds are in the next row (metrics.jsonl is
    # only appended to, and the row is on disk before its checkpoint): none in the first row, and
    # the last checkpoint's nowhere (this recipe has no final evaluation row)
    assert ["time/checkpoint" in r for r in read_metrics(run)] == [False, True, True, True]


@pytest.mark.slow
def test_metrics_jsonl_is_only_appended_to(tmp_path, monkeypatch):
    """Each row is appended to what was on disk before it (never a rewrite of the file, which
    would be quadratic over a long run); a checkpoint's seconds are in the next iteration's row,
    and the final evaluation's row holds the evaluation only (so a resumed run that redoes it
    writes the same row)."""
    from flowrl.runlog import MetricsLog

    before: list[str] = []
    write = MetricsLog.write

    def spying(self, record):
        before.append(self.path.read_text())
        write(self, record)

    monkeypatch.setattr(MetricsLog, "write", spying)
    path = write_recipe(tmp_path, EVAL_RECIPE)
    run = train(load(path, f"run.output_dir={str(tmp_path / 'run')!r}", "checkpoint.every=2"), console=quiet_console())
    text = (run / "metrics.jsonl").read_text()
    assert len(before) == 5 and all(text.startswith(b) for b in before) and len(set(before)) == 5
    rows = read_metrics(run)
    assert rows[-1]["final"] and not any(k.startswith("time/") for k in rows[-1])
    assert ["time/checkpoint" in r for r in rows[:-1]] == [False, False, True, False]  # after iteration 1
    assert rows[2]["time/checkpoint"] > 0


def test_without_every_minutes_only_the_iteration_interval_and_the_end_count(tmp_path):
    path = write_recipe(tmp_path)
    run = train(load(path, f"run.output_dir={str(tmp_path / 'run')!r}", "checkpoint.every=3",
                     "checkpoint.keep_last=10"), console=quiet_console())
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir()) == ["iter_000003", "iter_000004"]


# ------------------------------------------------------------------------------ pictures


@pytest.mark.slow
def test_grids_every_image_every_iterations_and_at_the_last(eval_run):
    run_dir, _, images = eval_run
    assert sorted(p.name for p in (run_dir / "images").glob("iter_*.png")) == [
        "iter_000000.png", "iter_000002.png", "iter_000003.png"]
    assert [(step, name) for step, name, _ in images if name == "group"] == [(0, "group"), (2, "group"), (3, "group")]


@pytest.mark.slow
def test_eval_grids_over_time_and_the_evolution_picture(eval_run):
    from PIL import Image

    run_dir, _, images = eval_run
    eval_dir = run_dir / "images" / "eval"
    # evaluations before iterations 0 and 2, and the final one after 4
    assert sorted(p.name for p in eval_dir.glob("iter_*.png")) == ["iter_000000.png", "iter_000002.png", "iter_000004.png"]
    assert [(step, name) for step, name, _ in images if name == "eval"] == [(0, "eval"), (2, "eval"), (4, "eval")]
    strips = sorted(p.name for p in (eval_dir / "strips").glob("*.json"))
    assert strips == ["iter_000000.json", "iter_000002.json", "iter_000004.json"]
    meta = json.loads((eval_dir / "strips" / "iter_000004.json").read_text())
    rows = read_metrics(run_dir)
    assert len(meta["prompts"]) == 3 and meta["label"] == "area"
    # the strip holds the evaluation's own images: their mean score is the logged eval mean
    assert sum(meta["scores"]) / 3 == pytest.approx(rows[-1]["eval/area/mean"], abs=1e-6)
    evolution = Image.open(eval_dir / "evolution.png")
    assert evolution.width > 3 * 128 and evolution.height > 3 * 128  # 3 evaluations x 3 prompts, readable cells


@pytest.mark.slow
def test_eval_strips_hold_the_same_prompts_each_time(eval_run):
    """The same prompts at every evaluation (that their noise is the same too is checked with a
    frozen EMA in test_engine_ema.py), stored losslessly at their own size."""
    import numpy as np
    from PIL import Image

    run_dir, _, _ = eval_run
    strips = run_dir / "images" / "eval" / "strips"
    first = json.loads((strips / "iter_000000.json").read_text())
    last = json.loads((strips / "iter_000004.json").read_text())
    assert first["prompts"] == last["prompts"]
    a = np.array(Image.open(strips / "iter_000000.png"))
    assert a.shape == (32, 3 * 32, 3)  # three 32x32 images side by side, lossless


def test_a_degenerate_group_is_noted():
    images = torch.full((4, 3, 8, 8), 0.5)
    assert "degenerate group: all 4 images identical, rewards equal (area 0.000)" in degenerate_note(
        images, {"area": torch.zeros(4)})
    images[1] += 0.1
    assert "images identical" not in degenerate_note(images, {"area": torch.zeros(4)})
    assert degenerate_note(images, {"area": torch.tensor([0.0, 0.1, 0.0, 0.0])}) == ""


def test_captions_wrap_at_spaces_and_every_line_fits():
    font = caption_font()
    text = "a small red circle on a light blue background, centred"
    lines = wrap_text(text, 128, font)
    assert len(lines) > 1 and " ".join(lines) == text  # cut only at spaces, nothing dropped
    assert all(font.getlength(line) <= 128 for line in lines)
    long_word = "x" * 60
    assert "".join(wrap_text(long_word, 128, font)) == long_word  # a word wider than a cell is cut, kept
    assert wrap_text("r 0.5\nA +1.0", 128, font) == ["r 0.5", "A +1.0"]


def test_small_images_get_readable_cells_and_large_ones_are_shrunk():
    grid = image_grid(torch.rand(2, 3, 32, 32), ["a", "b"])
    assert grid.width >= 2 * 128
    big = image_grid(torch.rand(2, 3, 1024, 512), ["a", "b"])
    assert big.width < 2 * 300 and big.height < 400


@pytest.mark.slow
def test_the_group_grid_names_the_prompt(eval_run):
    """The grid's title carries the group's prompt: the picture is taller than cells and captions."""
    _, _, images = eval_run
    grid = next(img for step, name, img in images if name == "group")
    assert grid.height > 128 + 3 * 16  # title lines above the 128-pixel cells and their captions


# ------------------------------------------------------------------------------ throughput


@pytest.mark.slow
def test_run_info_holds_the_model_flops_and_rows_hold_no_speed(eval_run):
    run_dir, metrics, _ = eval_run
    info = json.loads((run_dir / "run_info.json").read_text())
    f, fb = info["flops"]["velocity_forward"], info["flops"]["velocity_forward_backward"]
    assert f > 0 and 2 * f <= fb <= 4 * f  # a backward costs one to two forwards
    assert info["flops"]["rollout_per_iteration"] == 8 * 5 * f  # 8 samples x 5 steps, one forward each
    assert info["samples_per_process"] == 8 and info["peak_tflops"] is None  # a CPU: no MFU
    assert not any(k.startswith("speed/") for r in read_metrics(run_dir) for k in r)
    speeds = [m for _, m in metrics if "speed/images_per_second" in m]
    assert len(speeds) == 4 and all(m["speed/images_per_second"] > 0 for m in speeds)
    assert speeds[-1]["speed/eta_seconds"] == 0.0 and speeds[0]["speed/eta_seconds"] > 0
    assert "speed/mfu" not in speeds[0]


def test_flop_count_of_a_linear_velocity_matches_the_formula():
    """Second route: a velocity that is one d x d linear layer costs 2 d^2 FLOPs forward and,
    with the input not requiring grad, 2 d^2 more for the weight gradient."""
    from types import SimpleNamespace

    from flowrl.train.throughput import velocity_flops

    d = 24
    layer = torch.nn.Linear(d, d)

    class Model:
        latent_shape = (d,)
        denoiser = layer

        def velocity(self, x, sigma, text):
            return layer(x)

    session = SimpleNamespace(model=Model(), device=torch.device("cpu"),
                              cache=SimpleNamespace(get=lambda prompts, device: {}))
    assert velocity_flops(session, "p") == (2 * d * d, 4 * d * d)
    assert all(p.grad is None for p in layer.parameters())


def test_the_progress_bar_shows_the_phase_that_runs():
    from flowrl.train.progress import RunDisplay

    display = RunDisplay(quiet_console(), True, load_tiny_train(), 0, "area")
    with display.timer(torch.device("cpu"))("rollout"):
        assert display.progress.tasks[0].fields["phase"] == "rollout"
    display.advance({"reward/area/mean": 0.5}, {"speed/images_per_second": 12.0, "speed/eta_seconds": 3.0})
    fields = display.progress.tasks[0].fields
    assert fields["phase"] == "" and fields["speed"] == "12 img/s" and fields["reward"] == "area=0.5000"


def load_tiny_train():
    from types import SimpleNamespace

    return SimpleNamespace(iterations=4)


# ------------------------------------------------------------------------------ rejected before iteration 0


def test_validate_and_train_reject_a_missing_prompt_file_and_leave_nothing(tmp_path, capsys):
    from flowrl.cli import main

    path = write_recipe(tmp_path, tiny_recipe(ENGINE, prompts={"source": "no_such_prompts.txt"}))
    with pytest.raises(SystemExit) as exit_:
        main(["validate", str(path)])
    # recipe-relative paths are reported resolved, on one line (no wrapping inside the path)
    assert exit_.value.code == 2 and f"prompt file not found: {tmp_path / 'no_such_prompts.txt'}" in capsys.readouterr().err
    with pytest.raises(FlowrlError, match="prompt file not found"):
        train(load(path, f"run.output_dir={str(tmp_path / 'run')!r}"), console=quiet_console())
    assert not (tmp_path / "run").exists()


def test_validate_and_train_reject_a_tracker_whose_extra_is_missing(tmp_path, capsys, monkeypatch):
    from flowrl.cli import main

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if `flowrl-diffusion[tensorboard]` were not installed
    path = write_recipe(tmp_path, tiny_recipe(ENGINE, trackers=[{"use": "tensorboard"}]))
    with pytest.raises(SystemExit) as exit_:
        main(["validate", str(path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and 'pip install "flowrl-diffusion[tensorboard]"' in err and "[[trackers]] #1" in err
    with pytest.raises(FlowrlError, match="tensorboard"):
        train(load(path, f"run.output_dir={str(tmp_path / 'run')!r}"), console=quiet_console())
    assert not (tmp_path / "run").exists()


class FailingStart:
    """A tracker plugin whose start() fails (a service that cannot be reached, say)."""

    @hookimpl
    def register_trackers(self, register):
        class Tracker:
            def start(self, run_dir):
                raise FlowrlError("cannot reach the tracking server")

            def log_metrics(self, step, metrics):
                pass

            def log_image(self, step, name, image):
                pass

            def close(self):
                pass

        register("failing_start", lambda: Tracker())


def test_a_tracker_failing_to_start_leaves_no_run_directory(tmp_path):
    path = write_recipe(tmp_path, tiny_recipe(ENGINE, trackers=[{"use": "failing_start"}]))
    with temporary_plugin(FailingStart(), name="failing-start"):
        with pytest.raises(FlowrlError, match="cannot reach"):
            train(load(path, f"run.output_dir={str(tmp_path / 'run')!r}"), console=quiet_console())
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------ flowrl sample


def test_sample_compare_base_draws_base_and_trained_from_the_same_noise(reference_run, tmp_path):
    import numpy as np
    from PIL import Image

    from flowrl.cli import main

    recipe_path, run_dir, _ = reference_run
    prompts = ["a red circle on a green background", "a blue square on a white background"]
    args = [a for p in prompts for a in ("--prompt", p)]
    main(["sample", str(run_dir), *args, "--compare-base", "-o", str(tmp_path / "cmp")])
    main(["sample", str(recipe_path), *args, "-o", str(tmp_path / "base")])  # the recipe alone: the base model
    cmp, base = tmp_path / "cmp", tmp_path / "base"
    settings = json.loads((cmp / "settings.json").read_text())
    assert settings["compare_base"] is True and settings["ema"] is False
    for k in range(2):
        name = f"{k:05d}_00.png"
        same_base = np.array(Image.open(cmp / "base" / name)), np.array(Image.open(base / "images" / name))
        assert (same_base[0] == same_base[1]).all()  # the base model from the same noise
        assert not (np.array(Image.open(cmp / "images" / name)) == same_base[0]).all()  # trained differs
    compare = Image.open(cmp / "compare.png")
    assert compare.width > 2 * 128 and compare.height > 2 * 128  # 2 prompts x (base, trained), readable cells


def test_sample_compare_base_needs_a_checkpoint(reference_run, capsys):
    from flowrl.cli import main

    recipe_path, _, _ = reference_run
    with pytest.raises(SystemExit) as exit_:
        main(["sample", str(recipe_path), "--prompt", "a red circle", "--compare-base"])
    assert exit_.value.code == 2 and "--compare-base needs a trained checkpoint" in capsys.readouterr().err


def test_resume_drops_a_metrics_record_cut_by_the_stop(tmp_path):
    """A run killed while writing a row leaves its last line without a newline: resuming keeps the
    rows before the resumed iteration, byte for byte, and drops the cut one (it was a traceback)."""
    from flowrl.runlog import MetricsLog

    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"iteration": i, "loss": 0.1 * i}) + "\n" for i in range(3)]
    path.write_text("".join(rows) + '{"iteration": 3, "lo')
    log = MetricsLog(path, resume_from=2)
    log.close()
    assert path.read_text() == "".join(rows[:2])
    path.write_text(rows[0] + '{"iteration": 1, "lo\n' + rows[2])  # damage inside the file: one message
    with pytest.raises(FlowrlError, match="line 2 is not JSON"):
        MetricsLog(path, resume_from=2)
