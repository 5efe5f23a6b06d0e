"""The rollout process's helpers (flowrl/train/rollout_worker.py); the process itself runs in
tests/train/test_engine_pipeline.py and test_engine_launcher.py."""

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


def test_the_rollout_process_draws_under_the_loops_attention_backend(tmp_path, monkeypatch):
    """The worker thread draws inside the loop's ``[train].attention_backend`` context; the rollout
    process must too, or a recipe naming a backend samples with another one there."""
    from engine_helpers import load
    from tiny_recipe import write_recipe

    from flowrl.train import rollout_worker
    from flowrl.train.compute import ComputeCounter

    seen = []

    def collect(run, prompts, iteration, timer):
        seen.append((torch.backends.cuda.math_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()))
        return {"x": torch.ones(1)}

    monkeypatch.setattr(rollout_worker, "collect", collect)
    recipe = load(write_recipe(tmp_path), "train.attention_backend='math'")
    session = types.SimpleNamespace(recipe=recipe, device=torch.device("cpu"))
    batch, seconds, counts = rollout_worker._draw(
        types.SimpleNamespace(session=session), ComputeCounter(torch.nn.Linear(1, 1)), [], 0)
    assert seen == [(True, False)]  # math only, inside the draw
    assert torch.backends.cuda.flash_sdp_enabled()  # and restored after it
    assert batch["x"].device.type == "cpu" and "total" in seconds


def test_a_refusal_in_the_rollout_process_reaches_the_learner_as_the_same_clean_error():
    """A FlowrlError raised while the rollout process builds (a backend or an extra its device
    lacks) is raised in the learner as that error, with its place and hint: the CLI's one clear
    message, not a traceback of the child."""
    import multiprocessing

    import pytest

    from flowrl.errors import RecipeError
    from flowrl.train.rollout_worker import RolloutProcess, _send

    learner_end, child_end = multiprocessing.Pipe()
    handle = object.__new__(RolloutProcess)
    handle.conn, handle.device = learner_end, torch.device("cuda", 1)
    handle.process = types.SimpleNamespace(join=lambda timeout=None: None)
    _send(child_end, ("refused", (RecipeError, "attention_backend = 'efficient' does not exist on device 'cpu'",
                                  "r.toml: [train].attention_backend", "use 'auto'")))
    with pytest.raises(RecipeError) as caught:
        handle._answer("ready")
    assert caught.value.message.startswith("the rollout process on cuda:1: attention_backend = 'efficient'")
    assert caught.value.where == "r.toml: [train].attention_backend" and caught.value.hint == "use 'auto'"
