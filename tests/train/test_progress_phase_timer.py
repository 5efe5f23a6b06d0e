"""The phase timer's seconds: a measurement inside a training phase is its own phase."""

from __future__ import annotations

import time

import pytest
import torch

from flowrl.train.compute import ComputeCounter
from flowrl.train.progress import PhaseTimer
from flowrl.train.throughput import Throughput


def test_a_measurement_inside_a_phase_is_timed_apart_and_its_forwards_counted_under_its_name():
    model = torch.nn.Linear(3, 3)
    counter = ComputeCounter(model)
    timer = PhaseTimer(torch.device("cpu"), counter)
    start = time.perf_counter()
    with timer("update"):
        model(torch.zeros(2, 3))
        time.sleep(0.05)
        with counter.measuring("kl_monitor"):
            model(torch.zeros(5, 3))
            time.sleep(0.1)
    total = time.perf_counter() - start
    assert set(timer.seconds) == {"update", "kl_monitor"}
    assert timer.seconds["kl_monitor"] >= 0.1
    assert 0.05 <= timer.seconds["update"] < 0.1  # the measurement's 0.1 s was taken out
    assert abs(timer.seconds["update"] + timer.seconds["kl_monitor"] - total) < 0.01
    assert counter.forward == {"update": 2, "kl_monitor": 5}
    assert counter.current == "other"

    measured = timer.seconds["kl_monitor"]
    with timer("update"):  # a later phase without measurement moves nothing
        time.sleep(0.01)
    assert timer.seconds["kl_monitor"] == measured and counter.take_measured_seconds() == {}


def test_throughput_counts_the_training_phases_not_measurement_or_upkeep():
    speed = object.__new__(Throughput)  # the constants measure() reads, without a run
    speed.samples, speed.steps, speed.passes, speed.peak = 4, 2, 1, None
    speed.forward, speed.forward_backward, speed.forward_backward_with_recompute = 1.0, 3.0, 4.0
    speed.total, speed.first, speed.started = 10, 0, time.monotonic()
    seconds = {"rollout": 1.0, "update": 1.0, "kl_monitor": 6.0, "eval": 5.0, "checkpoint": 3.0}
    trained = torch.ones(4, 2, dtype=torch.bool)
    out = speed.measure(seconds, trained, [1, 1], done=1)
    assert out["speed/images_per_second"] == 4 / 2.0
    assert out["speed/model_tflops_per_second"] == (4 * 2 * 1.0 + 8 * 3.0) / 2.0 / 1e12


def test_the_update_is_broken_down_into_its_parts(tmp_path):
    """time/update/{micro_batches, gradient_sync, optimizer}: the objective's forwards and
    backwards, the gradients' reduction, the optimizer step; parts of time/update (the KL monitor's
    measurement is its own time/kl_monitor, in neither), and not phases: the train time that
    `flowrl compare` sums counts time/update once."""
    from engine_helpers import REPO, load, quiet_console

    from flowrl.comparison import _plain_run, load_curve
    from flowrl.runlog import is_phase_seconds, read_metrics
    from flowrl.train import train

    recipe = load(REPO / "recipes" / "quickstart_step.toml", "train.iterations=2", "prompts.num_eval=2",
                  "log.image_every=0", "loss.kl='gaussian_exact'", "log.kl_every=1",
                  f"run.output_dir={str(tmp_path / 'run')!r}")
    run_dir = train(recipe, console=quiet_console())
    rows = [r for r in read_metrics(run_dir) if "loss" in r]
    for row in rows:
        parts = [row[f"time/update/{p}"] for p in ("micro_batches", "gradient_sync", "optimizer")]
        assert all(p >= 0 for p in parts) and parts[0] > 0 and parts[2] > 0
        assert sum(parts) <= row["time/update"] and row["time/kl_monitor"] > 0
        assert not any(is_phase_seconds(k) for k in row if k.startswith("time/update/"))
    assert is_phase_seconds("time/update") and not is_phase_seconds("time/pipeline/rollout")
    phases = sum(v for r in rows for k, v in r.items() if is_phase_seconds(k) and k != "time/eval")
    assert load_curve(_plain_run(run_dir, "run"), "eval/area/mean").train_time_s == pytest.approx(phases)
