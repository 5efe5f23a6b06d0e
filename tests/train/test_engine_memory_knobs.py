"""Memory knobs of the recipe: [train].optimizer = "adamw_8bit" (bitsandbytes) and
[train].reference_on_cpu, on the tiny embedded run; and their refusal where they cannot apply."""

from __future__ import annotations

from importlib.util import find_spec

import pytest
import torch
from engine_helpers import InterruptAt, load, quiet_console
from tiny_recipe import ENGINE, tiny_recipe, write_recipe

from flowrl.errors import FlowrlError
from flowrl.plugins import temporary_plugin
from flowrl.runlog import read_metrics
from flowrl.train import train
from flowrl.train.checkpoint import latest_checkpoint, load_checkpoint

# found, not imported: importing it costs every collecting worker its import time
pytestmark = pytest.mark.skipif(find_spec("bitsandbytes") is None, reason="needs bitsandbytes (the 'quant' extra)")

EIGHT_BIT = "train.optimizer='adamw_8bit'"
KL = ("loss.beta=0.05", "loss.kl='gaussian_exact'")


def _metrics(run_dir):
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in read_metrics(run_dir)]


@pytest.mark.slow
def test_8bit_adamw_trains_stores_8bit_moments_and_resumes_exactly(tmp_path):
    path = write_recipe(tmp_path)
    ref_dir = train(load(path, EIGHT_BIT, f"run.output_dir={str(tmp_path / 'ref')!r}"), console=quiet_console())
    saved = load_checkpoint(latest_checkpoint(ref_dir))
    states = saved["optimizer"]["state"].values()
    quant = [s["__bnb_optimizer_quant_state__"] for s in states]
    # bitsandbytes keeps tensors under 4096 elements in 32 bits; the rest in 8
    big = [q for q in quant if q["state1"].numel() >= 4096]
    assert big and all(q["state1"].dtype == torch.uint8 and q["state2"].dtype == torch.uint8 for q in big)
    fp32 = train(load(path, f"run.output_dir={str(tmp_path / 'fp32')!r}"), console=quiet_console())
    moved = [(saved["model"][k] - v).abs().max() for k, v in load_checkpoint(latest_checkpoint(fp32))["model"].items()]
    assert max(moved) > 0  # a different optimizer, a different trajectory of weights

    run_dir = tmp_path / "run"
    (tmp_path / "t").mkdir()
    with_tracker = write_recipe(tmp_path / "t", tiny_recipe(ENGINE, trackers=[{"use": "interrupt_at"}]))
    with temporary_plugin(InterruptAt(1), name="interrupt-at-1"):
        with pytest.raises(KeyboardInterrupt):
            train(load(with_tracker, EIGHT_BIT, f"run.output_dir={str(run_dir)!r}"), console=quiet_console())
    assert latest_checkpoint(run_dir).name == "iter_000002"
    train(load(path, EIGHT_BIT, f"run.output_dir={str(run_dir)!r}"), resume=run_dir, console=quiet_console())
    assert _metrics(run_dir) == _metrics(ref_dir)
    got = load_checkpoint(latest_checkpoint(run_dir))["model"]
    for name, want in saved["model"].items():
        assert torch.equal(got[name], want), name


@pytest.mark.slow
def test_reference_on_cpu_gives_the_same_run(tmp_path):
    path = write_recipe(tmp_path)
    on_device = train(load(path, *KL, f"run.output_dir={str(tmp_path / 'a')!r}"), console=quiet_console())
    on_cpu = train(load(path, *KL, "train.reference_on_cpu=true", f"run.output_dir={str(tmp_path / 'b')!r}"),
                   console=quiet_console())
    a, b = _metrics(on_device), _metrics(on_cpu)
    kls = [r["kl/gaussian_exact"] for r in a if "kl/gaussian_exact" in r]
    assert a == b and kls and any(k > 0 for k in kls)


@pytest.mark.slow
def test_gardos_reset_reference_on_cpu_gives_the_same_run(tmp_path):
    """GARDO resets its reference to the current weights; kept in CPU memory by accelerate's
    cpu_offload the reference's parameters are meta, so the reset (and the checkpoint that saves
    the reset reference) goes to the CPU tensors the offloaded forwards read: the same run and the
    same saved reference as on the device. (The checkpoint used to fail: no data in a meta tensor.)"""
    from engine_helpers import REPO

    recipe = REPO / "recipes" / "quickstart_gardo.toml"
    sets = ("train.iterations=3", "train.prompts_per_iteration=2", "train.group_size=4", "train.micro_batch_size=8",
            "prompts.num_eval=2", "log.image_every=0", "checkpoint.every=1", "loss.reset_every=1", "sampler.steps=9",
            "chunker.sizes=[2, 2, 4]")
    on_device = train(load(recipe, *sets, f"run.output_dir={str(tmp_path / 'a')!r}"), console=quiet_console())
    on_cpu = train(load(recipe, *sets, "train.reference_on_cpu=true", f"run.output_dir={str(tmp_path / 'b')!r}"),
                   console=quiet_console())
    assert _metrics(on_device) == _metrics(on_cpu)
    a, b = (load_checkpoint(latest_checkpoint(run))["objective"] for run in (on_device, on_cpu))
    assert sorted(a) == sorted(b) and any(k.startswith("reference.") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_nfts_reference_on_cpu_is_placed_there_and_gives_the_same_run(tmp_path):
    """DiffusionNFT's velocity KL (``beta_kl > 0``, flowrl.interfaces.NeedsReferencePolicy) runs the
    engine's frozen reference: [train].reference_on_cpu now validates for it and keeps that copy in
    CPU memory (Strategy.prepare_frozen with on_cpu), as for the ratio family's KL term; on this
    CPU the run is the same. Without a velocity KL it is refused like any recipe without a copy."""
    from unittest import mock

    from engine_helpers import REPO

    from flowrl.train.parallel import Strategy

    recipe = REPO / "recipes" / "quickstart_nft.toml"
    sets = ("train.iterations=2", "train.prompts_per_iteration=2", "train.group_size=4", "train.micro_batch_size=8",
            "prompts.num_eval=2", "log.image_every=0", "checkpoint.every=1", "loss.beta_kl=0.01")
    placed, original = [], Strategy.prepare_frozen

    def recording(self, module, on_cpu=False):
        placed.append(on_cpu)
        return original(self, module, on_cpu=on_cpu)

    on_device = train(load(recipe, *sets, f"run.output_dir={str(tmp_path / 'a')!r}"), console=quiet_console())
    with mock.patch.object(Strategy, "prepare_frozen", recording):
        on_cpu = train(load(recipe, *sets, "train.reference_on_cpu=true", f"run.output_dir={str(tmp_path / 'b')!r}"),
                       console=quiet_console())
    assert placed == [True]
    a, b = _metrics(on_device), _metrics(on_cpu)
    assert a == b and any(r.get("nft/kl_ref", 0) > 0 for r in a)
    with pytest.raises(FlowrlError, match="keeps no reference copy"):
        load(recipe, *sets[:-1], "train.reference_on_cpu=true")  # beta_kl = 0: no reference at all


@pytest.mark.parametrize("overrides, match", [
    (("train.reference_on_cpu=true",), "keeps no reference copy"),                        # beta = 0
    (("train.reference_on_cpu=true", *KL, "train.finetune='lora'"), "keeps no reference copy"),
    ((EIGHT_BIT, "distributed.strategy='fsdp2'"), "cannot hold sharded"),
])
def test_knobs_that_cannot_apply_are_refused_at_validation(tmp_path, overrides, match):
    with pytest.raises(FlowrlError, match=match):
        load(write_recipe(tmp_path), *overrides)


@pytest.mark.parametrize("sets, message", [
    (("pipeline.staleness=1",), "[pipeline] staleness = 1 is not supported with strategy = 'fsdp2'"),
    (("replay.size=2", "replay.max_staleness=2"), "[replay] is not supported with strategy = 'fsdp2'"),
    ((EIGHT_BIT,), "optimizer = 'adamw_8bit' cannot hold sharded (DTensor) parameters"),
])
def test_what_fsdp2_refuses_is_refused_when_the_launcher_makes_auto_fsdp2(tmp_path, monkeypatch, sets, message):
    """strategy = 'auto' validates; an accelerate FSDP2 config then makes it fsdp2 at launch, and
    the same refusals apply before anything loads, naming why."""
    from engine_helpers import REPO

    from flowrl.recipe import check_startable

    recipe = load(REPO / "recipes" / "quickstart_step.toml", *sets)
    assert recipe.distributed.strategy == "auto"
    check_startable(recipe)  # one process, no launcher: fine
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(FlowrlError, match=r"strategy = 'auto' became 'fsdp2'") as err:
        check_startable(recipe)
    assert message in err.value.message and "launch without FSDP" in err.value.hint


def test_a_run_measuring_kl_resumes_without_it_and_its_reference(tmp_path):
    """A run whose only KL reference is [log] kl_every's, kept in CPU memory, resumed with
    kl_every = 0: validation refuses reference_on_cpu without a reference, so it must be dropped
    too, and where the reference is kept may change on resume (it computes nothing else)."""
    from engine_helpers import REPO

    recipe = REPO / "recipes" / "quickstart_step.toml"
    sets = ["train.iterations=1", "prompts.num_eval=2", "log.image_every=0", "checkpoint.every=1",
            "loss.kl='gaussian_exact'", f"run.output_dir={str(tmp_path / 'run')!r}"]
    run_dir = train(load(recipe, *sets, "log.kl_every=1", "train.reference_on_cpu=true"), console=quiet_console())
    with pytest.raises(FlowrlError, match="keeps no reference copy"):
        load(recipe, *sets, "train.reference_on_cpu=true")  # kl_every = 0: no reference to keep
    resumed = load(recipe, *[s for s in sets if not s.startswith("train.iterations")], "train.iterations=2")
    train(resumed, resume=run_dir, console=quiet_console())
    rows = [r for r in read_metrics(run_dir) if "loss" in r]
    assert [("kl/gaussian_exact" in r) for r in rows] == [True, False]
