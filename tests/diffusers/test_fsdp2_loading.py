"""Under FSDP2 only rank 0 loads the denoiser's weights; the other processes receive them as it is sharded.

Before, every process of a node loaded the whole model into host memory before FSDP2 sharded it:
on 8 processes per node, 8 copies at start-up (for FLUX.1-dev in float32 with a KL reference,
about 900 GB by the plan's own figures). Now a process other than rank 0 builds the denoiser on
the ``meta`` device (its configuration only, no weight file read) and each block gets rank 0's
weights by broadcast just before it is sharded; the KL reference's frozen copy of it likewise.

A plugin installed the way a third party installs one records, in every process of a 2-process
``flowrl train`` (evaluation, images and a checkpoint every iteration, full fine-tuning with a KL
term, as users run): the weight files read, the bytes of real (non-meta) parameters the denoiser
and the reference hold when the strategy receives them, and each process's shards after sharding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, TINY_MODEL  # tests/diffusers/conftest.py

PLUGIN = '''
import json
import os

import safetensors.torch
import torch

from flowrl.train.parallel import Strategy

RECORD = os.environ["FLOWRL_TEST_LOAD_RECORD"]
RANK = int(os.environ.get("RANK", "0"))
facts = {"files": [], "held": {}}
_load_file, _prepare, _prepare_frozen = safetensors.torch.load_file, Strategy.prepare, Strategy.prepare_frozen


def _write():
    with open(os.path.join(RECORD, f"rank{RANK}.json"), "w") as f:
        json.dump(facts, f)


def load_file(filename, *args, **kwargs):
    facts["files"].append(str(filename))
    _write()
    return _load_file(filename, *args, **kwargs)


def _real_bytes(module):
    return sum(p.numel() * p.element_size() for p in module.parameters() if not p.is_meta)


def _shards(module, what):
    local = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().cpu().clone() for n, p in module.named_parameters()}
    torch.save(local, os.path.join(RECORD, f"rank{RANK}_{what}.pt"))


def prepare(self, module, optimizer, blocks=None, **kwargs):
    facts["held"]["denoiser"] = _real_bytes(module)
    _write()
    out = _prepare(self, module, optimizer, blocks, **kwargs)
    _shards(out, "denoiser")
    return out


def prepare_frozen(self, module, on_cpu=False):
    facts["held"]["reference"] = _real_bytes(module)
    _write()
    out = _prepare_frozen(self, module, on_cpu=on_cpu)
    _shards(out, "reference")
    return out


safetensors.torch.load_file = load_file
Strategy.prepare = prepare
Strategy.prepare_frozen = prepare_frozen
'''

SETS = [*TINY_MODEL, "train.iterations=2", "train.prompts_per_iteration=2", "train.group_size=2",
        "train.micro_batch_size=2", "train.optimizer_steps_per_update=1", "rewards.0.use=brightness",
        "log.progress=false", "run.device=cpu", "model.gradient_checkpointing=false",
        f"prompts.source=\"{REPO / 'recipes' / 'prompts' / 'general.txt'}\"",
        "train.finetune=full", "train.lr=0.002", "train.max_grad_norm=0", "loss.beta=0.05",
        "distributed.strategy='fsdp2'", "log.eval_every=1", "prompts.num_eval=2", "log.image_every=1",
        "checkpoint.every=1"]


@pytest.fixture(scope="module")
def plugin_path(plugin_site):
    """A directory holding a one-module distribution with a ``flowrl`` entry point."""
    return plugin_site("load_record_plugin", PLUGIN)


@pytest.mark.slow
def test_only_rank_0_loads_the_denoiser_and_the_shards_are_its_weights(tiny_flux, tmp_path, plugin_path):
    from diffusers import FluxTransformer2DModel

    from flowrl.runlog import read_metrics
    from flowrl.train.checkpoint import latest_checkpoint

    record, out = tmp_path / "record", tmp_path / "run"
    record.mkdir()
    args = [a for s in (f"model.path={tiny_flux}", *SETS) for a in ("--set", s)]
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200", HF_HUB_OFFLINE="1", FLOWRL_TEST_LOAD_RECORD=str(record),
               PYTHONPATH=os.pathsep.join([str(plugin_path), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "flowrl", "train", str(REPO / "recipes" / "chunk_grpo_flux.toml"),
                           *args, "-o", str(out), "--num-processes", "2"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    # the run as users run it: evaluation, images and a sharded checkpoint every iteration
    *rows, final = read_metrics(out)
    assert [r["iteration"] for r in rows] == [0, 1] and final["final"]
    assert all(any(k.startswith("eval/") for k in r) for r in [*rows, final])
    assert list((out / "images").rglob("*.png")) or list((out / "images").rglob("*.jpg"))
    assert (latest_checkpoint(out) / "sharded").is_dir()

    transformer = str(tiny_flux / "transformer")
    facts = [json.loads((record / f"rank{r}.json").read_text()) for r in (0, 1)]
    full = FluxTransformer2DModel.from_pretrained(transformer, torch_dtype=torch.float32).state_dict()
    full_bytes = sum(t.numel() * t.element_size() for t in full.values())
    # rank 0 read the transformer's weights and held them whole; rank 1 read no transformer file
    # and held no real parameter of the denoiser or of its reference until they were sharded
    assert any(f.startswith(transformer) for f in facts[0]["files"])
    assert not any(f.startswith(transformer) for f in facts[1]["files"]), facts[1]["files"]
    assert facts[0]["held"] == {"denoiser": full_bytes, "reference": full_bytes}
    assert facts[1]["held"] == {"denoiser": 0, "reference": 0}

    # each process's shards, put together, are the weights one process loads: bit for bit
    for what in ("denoiser", "reference"):
        shards = [torch.load(record / f"rank{r}_{what}.pt") for r in (0, 1)]
        assert sorted(shards[0]) == sorted(full)
        for name, weight in full.items():
            whole = torch.cat([shards[0][name], shards[1][name]]) if weight.dim() else shards[0][name]
            assert shards[1][name].numel() < weight.numel() or weight.numel() < 2  # a shard, not a copy
            assert torch.equal(whole, weight), (what, name)


# every diffusers adapter: (module, adapter, config, tiny pipeline builder, max_sequence_length)
ADAPTERS = [
    ("flux", "FluxModel", "FluxConfig", "build_tiny_flux", 16),
    ("sd3", "SD3Model", "SD3Config", "build_tiny_sd3", 16),
    ("editing", "FluxKontextModel", "FluxKontextConfig", "build_tiny_flux_kontext", 16),
    ("qwen_image", "QwenImageModel", "QwenImageConfig", "build_tiny_qwen_image", 64),
    ("editing", "QwenImageEditModel", "QwenImageEditConfig", "build_tiny_qwen_image_edit", 64),
    ("flux2", "Flux2KleinModel", "Flux2KleinConfig", "build_tiny_flux2_klein", 48),
    ("zimage", "ZImageModel", "ZImageConfig", "build_tiny_zimage", 64),
]


@pytest.mark.parametrize("module, adapter, config, builder, seq", ADAPTERS, ids=[a[1] for a in ADAPTERS])
def test_every_diffusers_adapter_builds_its_denoiser_empty_where_it_receives_weights(tiny_dir, module, adapter, config,
                                                                                       builder, seq):
    """Inside flowrl.distributed.weights_from_rank_zero (an fsdp2 process other than rank 0) each
    adapter's transformer is built from its configuration on the meta device, in the dtypes and
    shapes the loaded one has, while the text encoders and the VAE load as usual."""
    import importlib

    from flowrl.distributed import weights_from_rank_zero
    from flowrl.testing import tiny_pipelines

    path = tiny_dir / builder
    if not path.exists():
        getattr(tiny_pipelines, builder)(path)
    plugin = importlib.import_module(f"flowrl_plugins.diffusers_models.{module}")
    cfg = getattr(plugin, config)(path=str(path), dtype="fp32", denoiser_dtype="fp32", height=32, width=32,
                                  max_sequence_length=seq)
    loaded = getattr(plugin, adapter)(cfg)
    with weights_from_rank_zero():
        empty = getattr(plugin, adapter)(cfg)
    shapes = {n: (p.shape, p.dtype) for n, p in loaded.denoiser.named_parameters()}
    assert {n: (p.shape, p.dtype) for n, p in empty.denoiser.named_parameters()} == shapes
    assert all(p.is_meta for p in empty.denoiser.parameters())
    frozen = [m for m in (getattr(empty.pipe, n, None) for n in empty.frozen_names) if m is not None]
    assert frozen and not any(p.is_meta for m in frozen for p in m.parameters())
