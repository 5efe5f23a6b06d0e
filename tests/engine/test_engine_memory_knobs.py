"""Memory knobs of the recipe: [train].optimizer = "adamw_8bit" (bitsandbytes) and
[train].reference_on_cpu, on the tiny embedded run; and their refusal where they cannot apply."""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import TINY_RECIPE, InterruptAt, load, quiet_console, write_recipe

from flowrl.errors import FlowrlError
from flowrl.plugins import temporary_plugin
from flowrl.train import train
from flowrl.train.checkpoint import latest_checkpoint, load_checkpoint

pytest.importorskip("bitsandbytes")

EIGHT_BIT = "train.optimizer='adamw_8bit'"
KL = ("loss.beta=0.05", "loss.kl='gaussian_exact'")


def _metrics(run_dir):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


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
    with_tracker = write_recipe(tmp_path / "t", TINY_RECIPE + '\n[[trackers]]\nuse = "interrupt_at"\n')
    with temporary_plugin(InterruptAt(1), name="interrupt-at-1"):
        with pytest.raises(KeyboardInterrupt):
            train(load(with_tracker, EIGHT_BIT, f"run.output_dir={str(run_dir)!r}"), console=quiet_console())
    assert latest_checkpoint(run_dir).name == "iter_000002"
    train(load(path, EIGHT_BIT, f"run.output_dir={str(run_dir)!r}"), resume=run_dir, console=quiet_console())
    assert _metrics(run_dir) == _metrics(ref_dir)
    got = load_checkpoint(latest_checkpoint(run_dir))["model"]
    for name, want in saved["model"].items():
        assert torch.equal(got[name], want), name


def test_reference_on_cpu_gives_the_same_run(tmp_path):
    path = write_recipe(tmp_path)
    on_device = train(load(path, *KL, f"run.output_dir={str(tmp_path / 'a')!r}"), console=quiet_console())
    on_cpu = train(load(path, *KL, "train.reference_on_cpu=true", f"run.output_dir={str(tmp_path / 'b')!r}"),
                   console=quiet_console())
    a, b = _metrics(on_device), _metrics(on_cpu)
    kls = [r["kl/gaussian_exact"] for r in a if "kl/gaussian_exact" in r]
    assert a == b and kls and any(k > 0 for k in kls)


@pytest.mark.parametrize("overrides, match", [
    (("train.reference_on_cpu=true",), "keeps no reference copy"),                        # beta = 0
    (("train.reference_on_cpu=true", *KL, "train.finetune='lora'"), "keeps no reference copy"),
    ((EIGHT_BIT, "distributed.strategy='fsdp2'"), "cannot hold sharded"),
])
def test_knobs_that_cannot_apply_are_refused_at_validation(tmp_path, overrides, match):
    with pytest.raises(FlowrlError, match=match):
        load(write_recipe(tmp_path), *overrides)
