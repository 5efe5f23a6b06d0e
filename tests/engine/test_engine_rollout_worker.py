"""The rollout process's helpers (flowrl/train/rollout_worker.py); the process itself runs in
tests/engine/test_engine_pipeline.py and test_engine_launcher.py."""

from __future__ import annotations

import dataclasses
import sys
import types
from multiprocessing import spawn

import torch

from flowrl.train.rollout_worker import _without_main_module, moved, rollout_device


def test_the_rollout_device_is_offset_by_the_local_rank():
    cpu = torch.device("cpu")
    assert rollout_device("", cpu, 3) == cpu
    assert rollout_device("cpu", torch.device("cuda", 0), 1) == cpu
    assert rollout_device("cuda:4", torch.device("cuda", 1), 1) == torch.device("cuda", 5)
    assert rollout_device("cuda", torch.device("cuda", 0), 2) == torch.device("cuda", 2)


def test_a_spawned_rollout_process_does_not_run_the_parents_main_module_again(tmp_path, monkeypatch):
    # a script that calls train() without an `if __name__ == "__main__"` guard would otherwise
    # start a second training run in the child
    script = tmp_path / "train_script.py"
    script.write_text("from flowrl.train import train\n")
    main = types.ModuleType("__main__")
    main.__file__ = str(script)
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert spawn.get_preparation_data("x")["init_main_from_path"] == str(script)  # what spawn would rerun
    with _without_main_module():
        data = spawn.get_preparation_data("x")
    assert "init_main_from_path" not in data and "init_main_from_name" not in data
    assert data["sys_path"]  # the child still finds flowrl


def test_moved_reaches_every_tensor_in_dataclasses_dicts_and_sequences():
    @dataclasses.dataclass(frozen=True)
    class Inner:
        x: torch.Tensor
        names: list

    @dataclasses.dataclass
    class Outer:
        inner: Inner
        table: dict
        rows: range
        pair: tuple

    value = Outer(Inner(torch.ones(2), ["a"]), {"t": torch.zeros(1)}, range(3), (torch.ones(1), 2))
    got = moved(value, torch.device("meta"))
    assert got.inner.x.device.type == got.table["t"].device.type == got.pair[0].device.type == "meta"
    assert got.rows == range(3) and got.inner.names == ["a"] and got.pair[1] == 2
    assert value.inner.x.device.type == "cpu"  # a copy, the original untouched
