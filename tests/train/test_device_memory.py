"""``memory/*`` in the metrics rows: the CUDA allocator's high-water marks, read and never reset
(a caller measuring a whole run reads the same peak); nothing on a CPU, whose allocator keeps no
peak."""

from __future__ import annotations

import torch
from engine_helpers import comparable, load, quiet_console
from tiny_recipe import write_recipe

import flowrl.train.outputs as outputs
from flowrl.runlog import read_metrics
from flowrl.train import train
from flowrl.train.device_memory import peak_memory


def test_a_cuda_device_reports_the_allocators_peaks_in_gib_without_resetting_them(monkeypatch):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**30 + 2**29)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 5 * 2**30)

    def reset(*_):
        raise AssertionError("the peaks belong to whoever measures the run: never reset here")

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    assert peak_memory(torch.device("cuda", 0)) == {"memory/peak_allocated_gib": 3.5, "memory/peak_reserved_gib": 5.0}


def test_a_cpu_device_reports_nothing():
    assert peak_memory(torch.device("cpu")) == {}


def test_every_logged_row_carries_the_peaks_of_the_run_so_far(tmp_path, monkeypatch):
    """The loop reads the peaks on the run's own device as it writes each iteration's row; they
    are left out of comparisons between runs (another process, another peak)."""
    seen = []

    def fake(device):
        seen.append(device)
        return {"memory/peak_allocated_gib": float(len(seen)), "memory/peak_reserved_gib": 2.0 * len(seen)}

    monkeypatch.setattr(outputs, "peak_memory", fake)
    run = train(load(write_recipe(tmp_path), f"run.output_dir={str(tmp_path / 'run')!r}"), console=quiet_console())
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert [r["memory/peak_allocated_gib"] for r in rows] == [1.0, 2.0, 3.0, 4.0]
    assert [r["memory/peak_reserved_gib"] for r in rows] == [2.0, 4.0, 6.0, 8.0]
    assert seen and all(d == torch.device("cpu") for d in seen)
    assert not any(k.startswith("memory/") for k in comparable(rows[0]))


def test_a_cpu_run_writes_no_memory_keys(tmp_path):
    run = train(load(write_recipe(tmp_path), f"run.output_dir={str(tmp_path / 'run')!r}"), console=quiet_console())
    assert not any(k.startswith("memory/") for r in read_metrics(run) for k in r)
