"""Fast checks of the engine's parts: geometry, seeding, prompt cache, checkpoint files."""

from __future__ import annotations

import json
import types

import pytest
import torch
from engine_helpers import SimulatedKill, kill_after_writing

from flowrl.errors import RecipeError
from flowrl.geometry import resolve_geometry
from flowrl.prompts import prompts_for_iteration
from flowrl.seeding import sample_generators
from flowrl.train.checkpoint import LATEST, latest_checkpoint, load_checkpoint, save_checkpoint
from flowrl.train.collect import initial_noise
from flowrl.train.session import PromptCache


def _train(**kw):
    base = dict(prompts_per_iteration=4, group_size=8, micro_batch_size=4, optimizer_steps_per_update=1,
                updates_per_rollout=1)
    return types.SimpleNamespace(**(base | kw))


def test_geometry_derives_per_process_sizes():
    g = resolve_geometry(_train(), world_size=2)
    assert (g.samples_per_iteration, g.samples_per_process, g.grad_accumulation) == (32, 16, 4)
    assert not g.groups_split_across_processes
    assert list(g.local_sample_range(1)) == list(range(16, 32))
    text = g.describe()
    assert "world size 2" in text and "16 per process" in text and "4 accumulation" in text
    # 4 prompts over 8 processes: each group spans two processes, and the geometry says so
    split = resolve_geometry(_train(micro_batch_size=2), world_size=8)
    assert split.groups_split_across_processes and "split across processes" in split.describe()


@pytest.mark.parametrize("kw, world, match", [
    (dict(), 3, "cannot be shared by 3 processes"),
    (dict(micro_batch_size=3), 1, "do not divide"),
    (dict(micro_batch_size=8, optimizer_steps_per_update=4), 2, "do not divide"),
])
def test_geometry_rejects_what_does_not_divide(kw, world, match):
    with pytest.raises(RecipeError, match=match) as exc:
        resolve_geometry(_train(**kw), world_size=world, source="r.toml")
    assert exc.value.hint and "r.toml" in exc.value.where


def test_noise_is_per_sample_and_layout_free():
    shape = (3, 4)
    whole = initial_noise(1, 5, range(8), 4, shape, same_in_group=False)
    second_rank = initial_noise(1, 5, range(4, 8), 4, shape, same_in_group=False)
    assert torch.equal(whole[4:], second_rank)
    assert not torch.equal(whole[0], whole[1])
    assert not torch.equal(whole, initial_noise(1, 6, range(8), 4, shape, same_in_group=False))
    same = initial_noise(1, 5, range(8), 4, shape, same_in_group=True)
    assert all(torch.equal(same[j], same[0]) for j in range(4)) and not torch.equal(same[0], same[4])
    # SDE generators are keyed by the global index too
    a = sample_generators(1, "rollout", 0, [5])[0]
    b = sample_generators(1, "rollout", 0, range(8))[5]
    assert torch.equal(torch.randn(4, generator=a), torch.randn(4, generator=b))


def test_prompt_order_depends_only_on_seed_and_iteration():
    prompts = [f"p{i}" for i in range(5)]
    epoch = prompts_for_iteration(prompts, 3, 0, 5)
    assert sorted(epoch) == prompts  # an epoch is a permutation
    assert prompts_for_iteration(prompts, 3, 1, 2) == epoch[2:4]


def test_prompt_cache_encodes_each_prompt_once():
    calls = []

    class Model:
        def encode_prompts(self, prompts):
            calls.append(list(prompts))
            x = torch.tensor([[float(len(p))] for p in prompts])
            return {"prompt_embeds": x[:, None, :], "pooled": x}

    cache = PromptCache(Model())
    out = cache.get(["a", "bb", "a"])
    assert out["pooled"].flatten().tolist() == [1.0, 2.0, 1.0] and out["prompt_embeds"].shape == (3, 1, 1)
    cache.get(["bb", "ccc"])
    assert calls == [["a"], ["bb"], ["ccc"]]


def _save(root, name, iteration, **kw):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
    return save_checkpoint(root, name, model={"w": torch.full((2,), float(iteration))}, optimizer=opt.state_dict(),
                           state={"iteration": iteration}, recipe_toml="", **kw)


def test_checkpoint_kill_keeps_previous_latest(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, "iter_000001", 1)
    for victim in ("model.safetensors", "rng.safetensors", "iter_000002/state.json"):
        with pytest.raises(SimulatedKill), kill_after_writing(victim):
            _save(root, "iter_000002", 2)
        assert latest_checkpoint(tmp_path).name == "iter_000001"
    _save(root, "iter_000002", 2)
    assert latest_checkpoint(tmp_path).name == "iter_000002"
    assert not list(root.glob(".tmp-*"))


def test_checkpoint_rewrite_and_fallback(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, "iter_000001", 1)
    _save(root, "iter_000002", 2)
    _save(root, "iter_000002", 2)  # re-written under the same name: moved aside, never half-deleted
    assert load_checkpoint(latest_checkpoint(tmp_path))["model"]["w"].tolist() == [2.0, 2.0]
    assert not list(root.glob(".old-*"))
    # a pointer at a directory that is gone (or half-deleted: no state.json) falls back
    (root / "iter_000002" / "state.json").unlink()
    assert latest_checkpoint(tmp_path).name == "iter_000001"
    (root / LATEST).write_text(json.dumps({"name": "iter_000009"}))
    assert latest_checkpoint(tmp_path).name == "iter_000001"


def test_checkpoint_keeps_last_n(tmp_path):
    root = tmp_path / "checkpoints"
    for i in range(1, 5):
        _save(root, f"iter_{i:06d}", i, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["iter_000003", "iter_000004", LATEST]


def test_unsupported_accelerate_modes_are_refused_not_ignored():
    from flowrl.distributed import check_launch_environment
    from flowrl.errors import FlowrlError

    # settings=None: an engine without a [distributed] strategy (tests/distributed checks the
    # agreement of launcher and recipe)
    check_launch_environment(None, {})  # plain DDP / single process: fine
    check_launch_environment(None, {"ACCELERATE_USE_FSDP": "false"})
    for key, name in (("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed")):
        with pytest.raises(FlowrlError, match=name):
            check_launch_environment(None, {key: "true"})


def test_accelerate_mixed_precision_is_refused_unless_no():
    from flowrl.distributed import check_launch_environment
    from flowrl.errors import FlowrlError

    check_launch_environment(None, {"ACCELERATE_MIXED_PRECISION": "no"})
    with pytest.raises(FlowrlError, match="mixed precision"):
        check_launch_environment(None, {"ACCELERATE_MIXED_PRECISION": "bf16"})


def test_full_finetuning_of_16_bit_weights_is_refused():
    from flowrl.errors import FlowrlError
    from flowrl.train.finetune import prepare_trainable

    class Model:
        denoiser = torch.nn.Linear(4, 4).to(torch.bfloat16)

    class Train:
        finetune = "full"

    with pytest.raises(FlowrlError, match="rounding"):
        prepare_trainable(Model(), Train())


def test_latest_checkpoint_without_pointer_falls_back_to_complete_one(tmp_path):
    from flowrl.train.checkpoint import LATEST, latest_checkpoint, save_checkpoint

    root = tmp_path / "checkpoints"
    save_checkpoint(root, "iter_000002", model={"w": torch.ones(2)}, optimizer={"state": {}, "param_groups": []},
                    state={"iteration": 2}, recipe_toml="")
    (root / LATEST).unlink()  # killed after the rename, before the pointer was written
    assert latest_checkpoint(tmp_path).name == "iter_000002"
    assert latest_checkpoint(tmp_path / "nothing") is None
