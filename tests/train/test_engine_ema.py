"""The EMA of the trained weights: its update rule against a float64 recursion, exact resume,
evaluation with it, and `flowrl sample --ema` / `flowrl export --ema`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from engine_helpers import InterruptAt, load, quiet_console
from safetensors.torch import load_file
from tiny_recipe import ENGINE, tiny_recipe, write_recipe

from flowrl.errors import FlowrlError
from flowrl.plugins import temporary_plugin
from flowrl.runlog import read_metrics
from flowrl.train import train
from flowrl.train.checkpoint import latest_checkpoint, load_checkpoint
from flowrl.train.ema import WeightEMA, ema_decay

EMA = {"enabled": True, "decay": 0.9, "warmup_steps": 2}


def test_decay_with_and_without_warm_up():
    assert ema_decay(0.99, 0, 0) == 0.99
    assert ema_decay(0.99, 9, 0) == pytest.approx(1 / 10)  # the common (1 + k) / (10 + k)
    assert ema_decay(0.99, 9, 5) == pytest.approx(6 / 15)
    assert ema_decay(0.99, 9, 10_000) == 0.99


@pytest.mark.parametrize("every, on_cpu", [(1, False), (2, True)])
def test_update_follows_a_float64_recursion(every, on_cpu):
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    config = SimpleNamespace(decay=0.8, warmup_steps=3, every=every, on_cpu=on_cpu)
    ema = WeightEMA(layer, config)
    want = {n: p.detach().double().clone() for n, p in layer.named_parameters()}
    k = 0
    for step in range(1, 8):
        with torch.no_grad():
            for p in layer.parameters():
                p.add_(torch.randn_like(p))
        ema.step()
        if step % every == 0:
            d = min(0.8, (1 + k) / (1 + 3 + k))
            for n, p in layer.named_parameters():
                want[n] = d * want[n] + (1 - d) * p.detach().double()
            k += 1
    assert ema.state() == {"updates": k, "steps": 7}
    for n, e in ema.tensors().items():
        assert e.device.type == "cpu" and e.dtype == torch.float32
        torch.testing.assert_close(e.double(), want[n], rtol=0, atol=1e-6)


def test_swapped_in_puts_the_trained_weights_back_exactly():
    layer = torch.nn.Linear(3, 2)
    ema = WeightEMA(layer, SimpleNamespace(decay=0.5, warmup_steps=0, every=1, on_cpu=False))
    with torch.no_grad():
        layer.weight.add_(1.0)
    ema.update()
    trained = {n: p.detach().clone() for n, p in layer.named_parameters()}
    with ema.swapped_in():
        assert torch.equal(layer.weight, ema.tensors()["weight"])
    for n, p in layer.named_parameters():
        assert torch.equal(p, trained[n])


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ema")
    path = write_recipe(root, tiny_recipe(ENGINE, ema=EMA))
    run_dir = train(load(path, f"run.output_dir={str(root / 'run')!r}"), console=quiet_console())
    return path, run_dir


def test_interrupt_then_resume_keeps_the_ema_bitwise(tmp_path, ema_run):
    path, ref_dir = ema_run
    run_dir = tmp_path / "run"
    with_tracker = write_recipe(tmp_path, tiny_recipe(ENGINE, ema=EMA, trackers=[{"use": "interrupt_at"}]))
    with temporary_plugin(InterruptAt(1), name="interrupt-at-1"):
        with pytest.raises(KeyboardInterrupt):
            train(load(with_tracker, f"run.output_dir={str(run_dir)!r}"), console=quiet_console())
    assert latest_checkpoint(run_dir).name == "iter_000002"
    train(load(path, f"run.output_dir={str(run_dir)!r}"), resume=run_dir, console=quiet_console())
    got, want = load_checkpoint(latest_checkpoint(run_dir)), load_checkpoint(latest_checkpoint(ref_dir))
    assert got["state"]["ema"] == want["state"]["ema"] == {"updates": 16, "steps": 16}  # 4 iterations x 2 x 2 steps
    assert sorted(got["ema"]) == sorted(want["ema"])
    for name in want["ema"]:
        assert torch.equal(got["ema"][name], want["ema"][name]), name
        assert torch.equal(got["model"][name], want["model"][name]), name
    assert not all(torch.equal(want["ema"][n], want["model"][n]) for n in want["ema"])  # an average, not a copy


def test_a_run_without_ema_keeps_its_checkpoint_format(reference_run):
    _, ref_dir, _ = reference_run
    saved = load_checkpoint(latest_checkpoint(ref_dir))
    assert saved["ema"] is None and "ema" not in saved["state"]


@pytest.mark.slow
def test_evaluation_uses_the_ema_when_asked(tmp_path):
    """decay = 1 keeps the EMA at the initial weights: with [ema].evaluate every evaluation then
    scores the untrained policy, while the trained policy's scores move."""
    path = write_recipe(tmp_path, tiny_recipe(ENGINE, prompts={"num_eval": 3}, log={"eval_every": 1},
                                              ema={"enabled": True, "decay": 1.0}))
    frozen = read_metrics(train(load(path, f"run.output_dir={str(tmp_path / 'a')!r}", "ema.evaluate=true"),
                                console=quiet_console()))
    moving = read_metrics(train(load(path, f"run.output_dir={str(tmp_path / 'b')!r}"), console=quiet_console()))
    assert len({r["eval/area/mean"] for r in frozen}) == 1
    assert frozen[0]["eval/area/mean"] == moving[0]["eval/area/mean"]  # before any update: the same weights
    assert len({r["eval/area/mean"] for r in moving}) > 1
    for a, b in zip(frozen, moving):  # training itself is the same with or without EMA evaluation
        assert a.get("reward/area/mean") == b.get("reward/area/mean")
    # the same prompts from the same noise with the same (frozen) weights: the same pictures
    strips = tmp_path / "a" / "images" / "eval" / "strips"
    first = load_png(strips / "iter_000000.png")
    assert all(torch.equal(load_png(p), first) for p in sorted(strips.glob("iter_*.png")))
    assert len(list(strips.glob("iter_*.png"))) == 5  # before iterations 0-3, and the final one


def test_sample_and_export_with_ema(tmp_path, ema_run):
    from flowrl.cli import main
    from flowrl.commands.export import export_run

    _, run_dir = ema_run
    ckpt = latest_checkpoint(run_dir)
    ema_weights = load_file(str(ckpt / "ema.safetensors"))
    out = export_run(run_dir, tmp_path / "export", ema=True)
    exported = load_file(str(out / "transformer" / "diffusion_pytorch_model.safetensors"))
    for name, t in ema_weights.items():
        assert torch.equal(exported[name], t), name
    trained_dir = export_run(run_dir, tmp_path / "export_trained")
    trained = load_file(str(trained_dir / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert any(not torch.equal(trained[n], exported[n]) for n in ema_weights)
    for flag in ([], ["--ema"]):
        main(["sample", str(run_dir), "--prompt", "a red circle", "-o", str(tmp_path / f"s{len(flag)}"), *flag])
    a, b = (load_png(tmp_path / f"s{k}" / "images" / "00000_00.png") for k in (0, 1))
    assert not torch.equal(a, b)  # EMA weights draw another picture than the trained ones


def test_ema_flags_on_a_run_without_ema_say_so(reference_run, tmp_path):
    from flowrl.commands.export import export_run

    _, ref_dir, _ = reference_run
    with pytest.raises(FlowrlError, match="holds no EMA weights") as exc:
        export_run(ref_dir, tmp_path / "x", ema=True)
    assert "[ema]" in exc.value.hint


def load_png(path):
    import numpy as np
    from PIL import Image

    return torch.from_numpy(np.array(Image.open(path)))
