"""Trainable weights load only into tensors of their own shape (flowrl.train.finetune): a
checkpoint of another LoRA rank, read by ``sample``/``eval``/``export`` with ``--set
train.lora_rank=...`` or ``--checkpoint`` of another run, was a RuntimeError traceback from
``copy_``, and a saved tensor of size 1 along a dimension was broadcast into the model silently."""

from __future__ import annotations

import pytest
import torch

from flowrl.errors import FlowrlError
from flowrl.train.finetune import load_trainable_state_dict


def _module():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def test_a_tensor_of_another_shape_is_one_message_and_nothing_is_copied():
    model = _module()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    state["0.weight"] = torch.zeros(1, 4)  # copy_ would broadcast it over the 3 rows
    with pytest.raises(FlowrlError, match=r"1 tensors of another shape \(e.g. 0.weight: \[1, 4\] in the checkpoint, "
                                          r"\[3, 4\] in the model\)"):
        load_trainable_state_dict(model, state)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_weights_of_the_models_shapes_load():
    model, other = _module(), _module()
    for p in other.parameters():
        torch.nn.init.normal_(p)
    load_trainable_state_dict(model, dict(other.named_parameters()))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
