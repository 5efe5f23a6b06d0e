"""flowrl/train/parallel.py on torch builds older than flowrl's pin: FSDP2's reduce-scatter of unused
parameters (``FSDPModule.set_reduce_scatter_unused_params``, which torch 2.11 lacks: found on an
H200 image, where the GPU lane's one-process FSDP2 tests failed with an AttributeError)."""

from __future__ import annotations

import pytest
from torch import nn

from flowrl.errors import FlowrlError
from flowrl.train.parallel import _reduce_scatter_unused_params


class _NewerFSDP(nn.Linear):
    def __init__(self):
        super().__init__(2, 2)
        self.asked = []

    def set_reduce_scatter_unused_params(self, value: bool) -> None:
        self.asked.append(value)


def test_a_torch_with_the_switch_turns_it_on_at_any_size():
    for world in (1, 4):
        module = _NewerFSDP()
        _reduce_scatter_unused_params(module, world)
        assert module.asked == [True]


def test_one_process_shards_without_the_switch():
    _reduce_scatter_unused_params(nn.Linear(2, 2), 1)  # nothing to disagree with: no error


def test_several_processes_without_the_switch_are_refused_by_name():
    with pytest.raises(FlowrlError) as caught:
        _reduce_scatter_unused_params(nn.Linear(2, 2), 2)
    assert "set_reduce_scatter_unused_params" in str(caught.value)
    assert caught.value.where == "[distributed].strategy"
