"""`[train] compile` where it meets LoRA and a quantised base, on the tiny FLUX: the denoiser with
peft's LoRA layers (switched off for the KL reference) and with bitsandbytes' NF4 blocks is traced
by dynamo, the rollout and the update agree within the on-policy tolerance, and the checkpoint and
the exported LoRA carry no compiled module's names. Dynamo's ``aot_eager`` backend stands in for
inductor (it traces and builds the forward and backward graphs; generating C++ takes minutes on
this CPU), as tests/train/test_engine_kernels.py does for the embedded model."""

from __future__ import annotations

from importlib.util import find_spec

import pytest
import torch

from flowrl.runlog import read_metrics
from flowrl.train.checkpoint import latest_checkpoint, read_model_weights

SETS = ["train.iterations=1", "train.prompts_per_iteration=1", "train.group_size=2", "train.micro_batch_size=2",
        "train.optimizer_steps_per_update=1", "rewards.0.use=brightness", "log.progress=false", "log.image_every=0",
        "prompts.num_eval=0", "run.device=cpu", "train.lora_rank=4", "train.lora_alpha=8.0", "train.lr=0.05",
        "train.compile='default'", "model.gradient_checkpointing=false"]


@pytest.fixture
def aot_eager(monkeypatch):
    """Module.compile with the aot_eager backend; yields the count of graphs dynamo compiles."""
    from torch._dynamo.utils import counters

    original = torch.nn.Module.compile

    def compile_without_codegen(self, *args, **kwargs):
        kwargs.pop("mode", None)
        return original(self, *args, backend="aot_eager", **kwargs)

    monkeypatch.setattr(torch.nn.Module, "compile", compile_without_codegen)
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    yield lambda: counters["stats"]["unique_graphs"] - before
    torch._dynamo.reset()


def _train(recipe, sets, tmp_path):
    from rich.console import Console

    from flowrl.recipe import load_recipe
    from flowrl.train import train

    return train(load_recipe(recipe, [*sets, f'run.output_dir="{tmp_path / "run"}"']), console=Console(quiet=True))


def _check(run_dir, graphs: int) -> None:
    rows = read_metrics(run_dir)
    assert graphs >= 1, "compile = 'default' compiled no graph: the run trained uncompiled"
    assert rows[0]["on_policy/max_abs_log_ratio"] <= 1e-6 and rows[0]["grad_norm"] > 0
    weights = read_model_weights(latest_checkpoint(run_dir))
    assert weights and all("lora" in k and "_orig_mod" not in k for k in weights), sorted(weights)[:4]


@pytest.mark.slow
def test_a_compiled_lora_denoiser_with_a_kl_reference_trains(tiny_flux, tiny_overrides, tmp_path, aot_eager, request,
                                                            monkeypatch):
    """The LoRA recipe with a KL term: the reference is the base with the LoRA switched off, on
    the same compiled module."""
    monkeypatch.chdir(request.config.rootpath)
    run = _train("recipes/chunk_grpo_flux_lora.toml",
                 [f"model.path={tiny_flux}", *tiny_overrides, *SETS, "loss.beta=0.01"], tmp_path)
    _check(run, aot_eager())
    assert any(k.startswith("kl/") for k in read_metrics(run)[0])  # the reference ran


@pytest.mark.slow
@pytest.mark.skipif(find_spec("bitsandbytes") is None, reason="needs bitsandbytes (the 'quant' extra)")
def test_a_compiled_denoiser_over_a_quantised_base_trains(tiny_flux, tiny_overrides, tmp_path, aot_eager, request,
                                                         monkeypatch):
    monkeypatch.chdir(request.config.rootpath)
    run = _train("recipes/flux_nf4_24gb.toml", [f"model.path={tiny_flux}", *tiny_overrides, *SETS,
                                                 "sampler.batch_size=1"], tmp_path)
    _check(run, aot_eager())
