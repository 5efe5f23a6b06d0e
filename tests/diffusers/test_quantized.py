"""A quantised frozen base for LoRA (bitsandbytes NF4 / int8, flowrl-diffusion[quant]) on the CPU: the
conformance suite, the on-policy deviation it adds (none beyond the compute dtype's), the
quantised bytes `flowrl plan` counts against what the layers really hold, the 24 GB recipe
trained for 2 iterations, and the refusals (full fine-tuning, a merged export, a missing extra)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.util import find_spec

import pytest
import torch

from flowrl.errors import FlowrlError
from flowrl.runlog import read_metrics
from flowrl.testing.conformance import ConformanceOptions, check_adapter, check_on_policy_ratio

# found, not imported: importing it costs every collecting worker its import time
pytestmark = pytest.mark.skipif(find_spec("bitsandbytes") is None, reason="needs bitsandbytes (the 'quant' extra)")

RECIPE = "recipes/flux2_klein_nf4_24gb.toml"
FLUX_RECIPE = "recipes/flux_nf4_24gb.toml"  # FLUX.1-dev, the same scheme of fitting
WAN_RECIPE = "recipes/wan21_14b_nf4_32gb.toml"  # Wan 2.1 T2V 14B on a 32 GB card


@pytest.fixture(scope="module")
def tiny_klein(tiny_dir):
    from flowrl.testing.tiny_pipelines import build_tiny_flux2_klein

    return build_tiny_flux2_klein(tiny_dir / "klein_quant")


@pytest.fixture(scope="module")
def make(tiny_klein):
    from flowrl_plugins.diffusers_models.flux2 import Flux2KleinConfig, Flux2KleinModel

    base = dict(path=str(tiny_klein), dtype="fp32", height=32, width=32, max_sequence_length=16)
    return lambda **kw: Flux2KleinModel(Flux2KleinConfig(**{**base, **kw}))


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_quantised_base_conforms(make, kind):
    import bitsandbytes as bnb

    model = make(quantize=kind)
    layer = bnb.nn.Linear4bit if kind == "nf4" else bnb.nn.Linear8bitLt
    blocks = [n for n, m in model.denoiser.named_modules() if isinstance(m, layer)]
    assert blocks and all(".0." in n for n in blocks)  # the block stacks' Linear layers
    assert not isinstance(model.denoiser.x_embedder, layer)  # the input projection stays in dtype
    notes = {r.name: r.message for r in check_adapter(model).results}
    assert notes["reference_model"] == "reference = lora_disabled (quantised base: LoRA only)"


def _trained_lora_deviation(model) -> float:
    """Largest on-policy |log ratio| over 3 rollouts (re-scored in 3 batch compositions) with a
    LoRA attached and moved away from zero, as in training."""
    from flowrl.recipe import TrainConfig
    from flowrl.train.finetune import prepare_trainable

    prepare_trainable(model, TrainConfig(finetune="lora", lora_rank=4, lora_alpha=8.0, lora_init="gaussian"))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.denoiser.named_parameters():
            if "lora_B" in n:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    notes = [check_on_policy_ratio(model, ConformanceOptions(ratio_tol=1.0, seed=s, num_steps=6)) for s in range(3)]
    return max(float(n.rpartition("=")[2]) for n in notes)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, tolerance", [("fp32", 1e-6), ("bf16", 1e-4)])
def test_quantisation_adds_no_on_policy_deviation_beyond_the_compute_dtype(make, dtype, tolerance):
    # The quantised weights are the same in the rollout and in re-scoring; only the compute
    # dtype's batch-dependent rounding remains. Measured (docs/models.md): fp32 none 6e-8,
    # nf4 1.2e-7, int8 2.4e-7; bf16 0 for all three.
    deviations = {kind: _trained_lora_deviation(make(dtype=dtype, quantize=kind)) for kind in ("none", "nf4", "int8")}
    assert all(d <= tolerance for d in deviations.values()), deviations


def test_plan_counts_the_bytes_bitsandbytes_holds(make, tiny_klein):
    import bitsandbytes as bnb

    from flowrl_plugins.diffusers_models.flux2 import Flux2KleinConfig
    from flowrl_plugins.diffusers_models.quantize import layer_bytes

    for kind in ("nf4", "int8"):
        model = make(quantize=kind)
        layer = bnb.nn.Linear4bit if kind == "nf4" else bnb.nn.Linear8bitLt
        quantised = [m for m in model.denoiser.modules() if isinstance(m, layer)]
        ids = {id(p) for m in quantised for p in m.parameters()}
        # what the quantised layers hold (weights, statistics, biases) plus every other parameter
        held = sum(layer_bytes(m) + (m.bias.numel() * m.bias.element_size() if m.bias is not None else 0)
                   for m in quantised)
        held += sum(p.numel() * p.element_size() for p in model.denoiser.parameters() if id(p) not in ids)
        held += sum(b.numel() * b.element_size() for b in model.denoiser.buffers())
        planned = Flux2KleinConfig(path=str(tiny_klein), dtype="fp32", height=32, width=32, max_sequence_length=16,
                                   quantize=kind).memory_spec().denoiser_weight_bytes
        assert planned == pytest.approx(held, rel=0.002), (kind, planned, held)


def _held_bytes(denoiser, layer) -> int:
    """What a denoiser holds: its quantised layers' storage (weights, statistics, biases) plus
    every other parameter and buffer."""
    from flowrl_plugins.diffusers_models.quantize import layer_bytes

    quantised = [m for m in denoiser.modules() if isinstance(m, layer)]
    ids = {id(p) for m in quantised for p in m.parameters()}
    held = sum(layer_bytes(m) + (m.bias.numel() * m.bias.element_size() if m.bias is not None else 0)
               for m in quantised)
    held += sum(p.numel() * p.element_size() for p in denoiser.parameters() if id(p) not in ids)
    return held + sum(b.numel() * b.element_size() for b in denoiser.buffers())


VIDEO_FRAMES = dict(dtype="fp32", height=32, width=32, num_frames=5, max_sequence_length=16)
# the adapters model.quantize reached after the image ones: (module, adapter, config, tiny builder, settings)
MORE_ADAPTERS = [
    ("wan", "WanModel", "WanConfig", "build_tiny_wan", VIDEO_FRAMES),
    ("wan_a14b", "Wan22A14BModel", "Wan22A14BConfig", "build_tiny_wan22_a14b", {**VIDEO_FRAMES, "flow_shift": 5.0}),
    ("ltx", "LTXModel", "LTXConfig", "build_tiny_ltx", {**VIDEO_FRAMES, "width": 64, "num_frames": 9}),
    ("sd3", "SD3Model", "SD3Config", "build_tiny_sd3", dict(dtype="fp32", height=32, width=32, max_sequence_length=16)),
]


@pytest.mark.parametrize("module, adapter, config, builder, settings", MORE_ADAPTERS, ids=[a[1] for a in MORE_ADAPTERS])
def test_video_and_sd3_adapters_take_a_quantised_base(tiny_dir, module, adapter, config, builder, settings):
    """Wan 2.1 / 2.2 (both A14B experts, the frozen one too), LTX-Video and SD3 quantise their
    block stacks, pass the conformance suite over the quantised base, and the plan counts the
    bytes the layers hold."""
    import importlib

    import bitsandbytes as bnb

    from flowrl.testing import tiny_pipelines

    path = tiny_dir / f"{builder}_quant"
    if not path.exists():
        getattr(tiny_pipelines, builder)(path)
    plugin = importlib.import_module(f"flowrl_plugins.diffusers_models.{module}")
    cfg = getattr(plugin, config)(path=str(path), quantize="nf4", **settings)
    model = getattr(plugin, adapter)(cfg)
    blocks = [n for n, m in model.denoiser.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert blocks and all(".0." in n or ".1." in n for n in blocks)
    if module == "wan_a14b":
        assert {n.split(".")[0] for n in blocks} == {"transformer", "transformer_2"}
    notes = {r.name: r.message for r in check_adapter(model).results}
    assert notes["reference_model"] == "reference = lora_disabled (quantised base: LoRA only)"
    planned = cfg.memory_spec().denoiser_weight_bytes
    assert planned == pytest.approx(_held_bytes(model.denoiser, bnb.nn.Linear4bit), rel=0.002)


def test_a_quantised_base_is_not_sharded_by_fsdp2(module_cli):
    """FSDP2 would shard the weights away from bitsandbytes' statistics (the forward then fails
    deep inside bitsandbytes): refused before anything loads, with the strategies that work."""
    code, out = module_cli.merged("validate", FLUX_RECIPE, "--set", "distributed.strategy=fsdp2", "--set",
                                  "ema.on_cpu=false")
    assert code == 2, out
    assert "a quantised base (model.quantize) cannot be sharded by FSDP2" in out and "strategy = 'ddp'" in out
    assert "Traceback" not in out


@pytest.mark.slow
@pytest.mark.parametrize("recipe, gpu", [(RECIPE, 24), (FLUX_RECIPE, 24), (WAN_RECIPE, 32)])
def test_full_size_plan_fits_a_consumer_card(request, recipe, gpu):
    out = subprocess.run([sys.executable, "-m", "flowrl", "plan", recipe, "--num-processes", "1", "--gpu-memory", str(gpu)],
                         capture_output=True, text=True, cwd=request.config.rootpath, env={"COLUMNS": "250",
                         "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "quantised base (nf4, bitsandbytes)" in out.stdout and f"fits in {gpu} GB" in out.stdout, out.stdout


def test_full_finetuning_and_merged_export_are_refused(make, tmp_path):
    from flowrl.recipe import TrainConfig
    from flowrl.train.finetune import prepare_trainable

    model = make(quantize="nf4")
    with pytest.raises(FlowrlError, match="full fine-tuning needs floating-point weights") as err:
        prepare_trainable(model, TrainConfig(finetune="full"))
    assert 'finetune = "lora"' in err.value.hint
    with pytest.raises(FlowrlError, match="the base is quantised"):
        model.save_pretrained(tmp_path / "merged")
    from flowrl.commands.export import _merge_lora

    with pytest.raises(FlowrlError, match=r"the base is quantised \(torch.uint8\)"):  # before fuse_lora fails inside peft
        _merge_lora(model)
    with pytest.raises(FlowrlError, match="denoiser_dtype must be 'auto'"):
        make(quantize="nf4", denoiser_dtype="bf16")


def test_missing_bitsandbytes_names_the_extra(make):
    code = ("import sys; sys.modules['bitsandbytes'] = None\n"
            "from flowrl_plugins.diffusers_models.quantize import bitsandbytes\n"
            "from flowrl.errors import MissingDependencyError\n"
            "try:\n    bitsandbytes('[model].quantize')\nexcept MissingDependencyError as e:\n"
            "    print(e.where, '|', e.hint)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == '[model].quantize | pip install "flowrl-diffusion[quant]"', out.stdout + out.stderr


def _assert_trained_a_lora_two_iterations(run) -> None:
    """Two iterations, each on-policy at fp32 rounding, and a checkpoint holding only a LoRA that moved."""
    from safetensors.torch import load_file

    records = [r for r in read_metrics(run) if "trained_units" in r]
    assert [r["iteration"] for r in records] == [0, 1]
    assert all(r["on_policy/max_abs_log_ratio"] <= 1e-6 for r in records)
    state = load_file(str(run / "checkpoints" / "iter_000002" / "model.safetensors"))
    assert state and all("lora_" in k for k in state)
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in state.items()), "LoRA B never moved"


def test_the_24gb_recipe_trains_two_iterations(tiny_klein, tmp_path, request, monkeypatch):
    from rich.console import Console
    from safetensors.torch import load_file

    from flowrl.recipe import load_recipe
    from flowrl.train import train

    monkeypatch.chdir(request.config.rootpath)
    recipe = load_recipe(RECIPE)
    assert recipe.components["model"].params.quantize == "nf4" and recipe.train.finetune == "lora"
    sets = [f"model.path={tiny_klein}", "model.height=32", "model.width=32", "model.max_sequence_length=16",
            "model.dtype=fp32", "model.vae_batch_size=8", "model.gradient_checkpointing=false",
            "train.iterations=2", "train.prompts_per_iteration=1", "train.group_size=2", "train.micro_batch_size=2",
            "train.optimizer_steps_per_update=1", "rewards.0.use=brightness", "log.progress=false",
            "log.image_every=0", "run.device=cpu", "sampler.batch_size=1", "train.lora_rank=4",
            "train.lora_alpha=8.0", "train.lr=0.05", "train.max_grad_norm=0", f'run.output_dir="{tmp_path / "run"}"']
    run = train(load_recipe(RECIPE, sets), console=Console(quiet=True))
    records = read_metrics(run)
    assert [r["iteration"] for r in records] == [0, 1]
    assert all(r["on_policy/max_abs_log_ratio"] <= 1e-6 for r in records)
    state = load_file(str(run / "checkpoints" / "iter_000002" / "model.safetensors"))
    assert state and all("lora_" in k for k in state)
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in state.items()), "LoRA B never moved"


def test_the_flux_24gb_recipe_trains_two_iterations(tiny_flux, tiny_overrides, tmp_path, request, monkeypatch):
    """Flow-GRPO's PickScore run on an NF4 FLUX.1-dev base, shrunk to the tiny FLUX pipeline: its
    sampler, kernel, EMA and LoRA targets as shipped, the blocks quantised; only the LoRA trains."""
    from rich.console import Console

    from flowrl.recipe import load_recipe
    from flowrl.train import train

    monkeypatch.chdir(request.config.rootpath)
    recipe = load_recipe(FLUX_RECIPE)
    assert recipe.components["model"].params.quantize == "nf4" and recipe.train.finetune == "lora"
    sets = [f"model.path={tiny_flux}", *tiny_overrides, "model.gradient_checkpointing=false", "train.iterations=2",
            "train.prompts_per_iteration=1", "train.group_size=2", "train.micro_batch_size=2",
            "train.optimizer_steps_per_update=1", "rewards.0.use=brightness", "log.progress=false",
            "log.image_every=0", "prompts.num_eval=2", "run.device=cpu", "sampler.batch_size=1", "train.lora_rank=4",
            "train.lora_alpha=8.0", "train.lr=0.05", f'run.output_dir="{tmp_path / "run"}"']
    _assert_trained_a_lora_two_iterations(train(load_recipe(FLUX_RECIPE, sets), console=Console(quiet=True)))


def test_the_wan_32gb_recipe_trains_two_iterations(tiny_dir, tmp_path, module_cli):
    """Chunk-GRPO on an NF4 Wan 2.1 14B, shrunk to the tiny Wan pipeline: the recipe's sampler,
    chunks, CFG and LoRA targets as shipped, the blocks quantised; only the LoRA trains, and its
    export is a LoRA (a merged export is refused)."""
    from flowrl.recipe import load_recipe
    from flowrl.testing.tiny_pipelines import build_tiny_wan

    recipe = load_recipe(WAN_RECIPE)
    assert recipe.components["model"].params.quantize == "nf4" and recipe.train.finetune == "lora"
    tiny = build_tiny_wan(tiny_dir / "wan_quant_recipe")
    sets = [f"model.path={tiny}", "model.height=32", "model.width=32", "model.num_frames=5",
            "model.max_sequence_length=16", "model.dtype=fp32", "model.gradient_checkpointing=false",
            "train.iterations=2", "train.prompts_per_iteration=1", "train.group_size=2", "train.micro_batch_size=2",
            "train.optimizer_steps_per_update=1", "rewards.0.use=brightness", "log.progress=false",
            "log.image_every=1", "log.eval_every=1", "prompts.num_eval=2", "checkpoint.every=1", "run.device=cpu",
            "sampler.batch_size=1", "train.lora_rank=4", "train.lora_alpha=8.0", "train.lr=0.05",
            "train.max_grad_norm=0", "train.on_policy_tolerance=1e-6"]
    run = tmp_path / "run"
    code, text = module_cli.merged("train", WAN_RECIPE, *[a for s in sets for a in ("--set", s)], "-o", run)
    assert code == 0, text
    _assert_trained_a_lora_two_iterations(run)
    code, text = module_cli.merged("export", run, "-o", tmp_path / "merged", "--merge")
    assert code == 2 and "the base is quantised (nf4)" in text and "Traceback" not in text, text
    assert not (tmp_path / "merged").exists()  # refused before anything is loaded or written
    code, text = module_cli.merged("export", run, "-o", tmp_path / "lora")
    assert code == 0, text
    assert json.loads((tmp_path / "lora" / "flowrl_export.json").read_text())["format"] == "diffusers_lora"


@pytest.mark.slow
def test_a_quantised_base_trains_under_ddp_on_two_processes(tiny_flux, tiny_overrides, tmp_path, request):
    """Two processes, each holding the NF4 base, average the LoRA's gradients: evaluation, images
    and a checkpoint every iteration, as users run; both processes end with the same LoRA."""
    from safetensors.torch import load_file

    sets = [f"model.path={tiny_flux}", *tiny_overrides, "model.gradient_checkpointing=false", "train.iterations=2",
            "train.prompts_per_iteration=2", "train.group_size=2", "train.micro_batch_size=2",
            "train.optimizer_steps_per_update=1", "rewards.0.use=brightness", "log.progress=false",
            "log.image_every=1", "log.eval_every=1", "prompts.num_eval=2", "checkpoint.every=1", "run.device=cpu",
            "sampler.batch_size=1", "train.lora_rank=4", "train.lora_alpha=8.0", "train.lr=0.05",
            "distributed.strategy=ddp"]
    run = tmp_path / "run"
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "COLUMNS": "200"}
    out = subprocess.run([sys.executable, "-m", "flowrl", "train", FLUX_RECIPE, *[a for s in sets for a in ("--set", s)],
                          "-o", str(run), "--num-processes", "2"], capture_output=True, text=True, timeout=900,
                         cwd=request.config.rootpath, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    *rows, final = read_metrics(run)
    assert [r["iteration"] for r in rows] == [0, 1] and final["final"]
    assert all(any(k.startswith("eval/") for k in r) for r in [*rows, final])
    assert list((run / "images").rglob("*.png")) or list((run / "images").rglob("*.jpg"))
    state = load_file(str(run / "checkpoints" / "iter_000002" / "model.safetensors"))
    assert state and all("lora_" in k for k in state)
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in state.items()), "LoRA B never moved"


def test_the_start_up_transient_is_the_base_before_quantisation():
    """The base is loaded in dtype and quantised in CPU memory before it moves to the GPU, so the
    host's start-up transient holds the bf16 transformer, not the NF4 one (which the GPU holds)."""
    from flowrl.commands.base import load, registry
    from flowrl.memory_plan import estimate, host_lines

    recipe = load(WAN_RECIPE, [])
    _, mm, lines = estimate(recipe, registry(), 1)
    assert mm.offload_frozen  # so the transient is the transformer alone
    (loading,) = [l for l in host_lines(recipe, mm, lines, 1) if l.phase == "loading"]
    assert loading.bytes == mm.denoiser_params * 2 and "quantised there" in loading.note
    gpu = next(l.bytes for l in lines if l.item == "denoiser weights")
    assert gpu == mm.denoiser_weight_bytes < loading.bytes / 3


def test_fsdp2_chosen_by_the_launcher_is_refused_too(module_cli, monkeypatch, tiny_flux, tiny_overrides, tmp_path):
    """strategy = 'auto' passes validation; an accelerate FSDP2 config then picks fsdp2 at launch,
    and the strategy refuses the quantised base with the same message before sharding it."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    sets = [f"model.path={tiny_flux}", *tiny_overrides, "train.iterations=1", "train.prompts_per_iteration=1",
            "train.group_size=2", "train.micro_batch_size=2", "train.optimizer_steps_per_update=1",
            "rewards.0.use=brightness", "log.progress=false", "run.device=cpu", "train.lora_rank=4", "prompts.num_eval=2",
            "ema.on_cpu=false", "sampler.batch_size=1"]
    code, text = module_cli.merged("train", FLUX_RECIPE, *[a for s in sets for a in ("--set", s)], "-o", tmp_path / "run")
    assert code == 2 and "a quantised base (model.quantize) cannot be sharded by FSDP2" in text, text
    assert "[distributed].strategy" in text and "Traceback" not in text


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_gradient_checkpointing_over_a_quantised_base_trains_the_same_lora(tiny_flux, tiny_overrides, tmp_path, kind):
    """The shipped quantised recipes checkpoint the transformer's blocks: recomputing bitsandbytes'
    layers in the backward gives the LoRA the same gradients, so the same weights, as keeping
    the activations."""
    from rich.console import Console
    from safetensors.torch import load_file

    from flowrl.recipe import load_recipe
    from flowrl.train import train

    sets = [f"model.path={tiny_flux}", *tiny_overrides, f"model.quantize={kind}", "train.iterations=2",
            "train.prompts_per_iteration=1", "train.group_size=2", "train.micro_batch_size=2",
            "train.optimizer_steps_per_update=1", "rewards.0.use=brightness", "log.progress=false", "log.image_every=0",
            "prompts.num_eval=2", "run.device=cpu", "sampler.batch_size=1", "train.lora_rank=4", "train.lora_alpha=8.0",
            "train.lr=0.05"]
    weights = []
    for checkpointing in ("true", "false"):
        run = train(load_recipe(FLUX_RECIPE, [*sets, f"model.gradient_checkpointing={checkpointing}",
                                              f'run.output_dir="{tmp_path / checkpointing}"']), console=Console(quiet=True))
        weights.append(load_file(str(run / "checkpoints" / "iter_000002" / "model.safetensors")))
    on, off = weights
    assert sorted(on) == sorted(off) and all(torch.equal(on[k], off[k]) for k in on)
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in on.items())
