"""The KL reference of a diffusers model is placed by the engine, like the engine's own copy.

A diffusers adapter keeps its own frozen copy for ``reference_velocity`` (full fine-tuning). Before,
only the engine's copy went through ``Strategy.prepare_frozen``, so the adapter's stayed whole on
every GPU whatever the recipe said: ``[train].reference_on_cpu`` validated and planned but did
nothing, and under FSDP2 each GPU held a whole bf16 copy that ``flowrl plan`` counts as sharded
(for FLUX.1-dev about 23.8 GB against 5.5 planned). Now the adapter's copy is what the strategy
places; ``prepare_frozen`` itself (sharding under FSDP2, CPU offload) is tested on the engine's
copy in tests/train/test_engine_fsdp2.py and tests/train/test_engine_memory_knobs.py.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from conftest import _FULL, _RUN_GEOMETRY, REPO, TINY_MODEL, _train  # tests/diffusers/conftest.py

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


def _storage_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


@pytest.mark.parametrize(("strategy", "world"), [("none", 1), ("fsdp2", 8)])
@pytest.mark.parametrize(("dtype", "denoiser_dtype"), [("bf16", "fp32"), ("fp32", "auto")],
                         ids=["fp32_master_bf16_compute", "fp32"])
def test_the_plan_counts_the_reference_copy_the_adapter_holds(tiny_flux, strategy, world, dtype, denoiser_dtype):
    """What ``flowrl plan`` counts for the KL reference is what the adapter's copy holds: the
    flagship keeps fp32 master weights and computes in bf16, and the adapter's copy is in bf16
    (it never trains), half of what the plan counted before (for FLUX.1-dev under FSDP2 x 8,
    5.54 GiB per GPU counted against 2.77 held). Under fsdp2 the copy is sharded over the
    processes, so the plan counts its share."""
    from flowrl.memory_plan import estimate
    from flowrl.plugins import get_registry
    from flowrl.recipe import load_recipe
    from flowrl.train.session import build_components

    registry = get_registry()
    recipe = load_recipe(REPO / "recipes" / "chunk_grpo_flux.toml", [
        f"model.path={tiny_flux}", *TINY_MODEL, *_RUN_GEOMETRY, *_FULL, *KL, f"model.dtype={dtype}",
        f"model.denoiser_dtype={denoiser_dtype}", f"distributed.strategy={strategy}",
        f"train.prompts_per_iteration={world}"], registry=registry)
    _, mm, lines = estimate(recipe, registry, world)
    planned = {line.item: line.bytes for line in lines}["reference copy (KL)"]
    model = build_components(recipe, registry, rewards=False, trackers=False).model
    assert model.snapshot_reference() == "frozen_copy"
    held = _storage_bytes(model.reference_module)
    assert planned * world == pytest.approx(held)
    # the copy is in the compute dtype; the trained denoiser keeps its storage dtype
    assert {p.dtype for p in model.reference_module.parameters()} == {torch.bfloat16 if dtype == "bf16" else torch.float32}
    assert _storage_bytes(model.denoiser) == pytest.approx(held * (2 if denoiser_dtype == "fp32" else 1))
