"""The phase timer's seconds: a measurement inside a training phase is its own phase."""

from __future__ import annotations

import time

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
