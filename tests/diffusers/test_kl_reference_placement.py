"""The KL reference of a diffusers model is placed by the engine, like the engine's own copy.

A diffusers adapter keeps its own frozen copy for ``reference_velocity`` (full fine-tuning). Before,
only the engine's copy went through ``Strategy.prepare_frozen``, so the adapter's stayed whole on
every GPU whatever the recipe said: ``[train].reference_on_cpu`` validated and planned but did
nothing, and under FSDP2 each GPU held a whole bf16 copy that ``flowrl plan`` counts as sharded
(for FLUX.1-dev about 23.8 GB against 5.5 planned). Now the adapter's copy is what the strategy
places; ``prepare_frozen`` itself (sharding under FSDP2, CPU offload) is tested on the engine's
copy in tests/engine/test_engine_fsdp2.py and tests/engine/test_engine_memory_knobs.py.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from conftest import _FULL, _train  # tests/diffusers/conftest.py

KL = ["loss.beta=0.05", "loss.kl='gaussian_exact'"]


@pytest.mark.parametrize("on_cpu", [False, True], ids=["on_device", "reference_on_cpu"])
def test_the_adapters_reference_copy_is_placed_by_the_strategy(tiny_flux, tmp_path, on_cpu):
    from flowrl.train.parallel import Strategy

    placed: list[tuple[torch.nn.Module, bool]] = []
    original = Strategy.prepare_frozen

    def recording(self, module, on_cpu=False):
        out = original(self, module, on_cpu=on_cpu)
        placed.append((out, on_cpu))
        return out

    holders = []
    from flowrl_plugins.diffusers_models.common import DiffusersAdapter

    original_snapshot = DiffusersAdapter.snapshot_reference

    def snapshot(self):
        holders.append(self)
        return original_snapshot(self)

    with mock.patch.object(Strategy, "prepare_frozen", recording), \
         mock.patch.object(DiffusersAdapter, "snapshot_reference", snapshot):
        run = _train("chunk_grpo_flux.toml", tiny_flux, [*_FULL, *KL, f"train.reference_on_cpu={str(on_cpu).lower()}"],
                     tmp_path / "run")

    (adapter,) = holders
    assert len(placed) == 1 and placed[0][1] is on_cpu  # placed once, as the recipe asks
    assert adapter.reference_module is placed[0][0]  # and the adapter runs the placed module
    assert not any(p.requires_grad for p in adapter.reference_module.parameters())
    assert (run / "metrics.jsonl").is_file()
