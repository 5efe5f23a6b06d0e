"""The random-number states a checkpoint keeps (flowrl/train/checkpoint.py ``rng_state``): a CPU run
on a GPU machine asks nothing of CUDA (asking started a CUDA context on every GPU, in every process,
at its first checkpoint: found on an H200), and the GPUs' states come back in index order."""

from __future__ import annotations

import pytest
import torch

from flowrl.train.checkpoint import rng_state, set_rng_state


def test_a_process_that_never_started_cuda_saves_only_the_cpu_state(monkeypatch):
    def refuse():
        raise AssertionError("rng_state started CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", refuse)
    assert set(rng_state()) == {"torch_cpu"}


@pytest.mark.parametrize("devices", [11, 16])
def test_gpu_states_come_back_in_index_order_as_far_as_the_machine_has_gpus(monkeypatch, devices):
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, index: restored.append((index, int(state[0]))))
    saved = {"torch_cpu": torch.get_rng_state(),
             **{f"torch_cuda_{i}": torch.tensor([i], dtype=torch.uint8) for i in range(12)}}
    set_rng_state(saved)
    assert restored == [(i, i) for i in range(min(12, devices))]
