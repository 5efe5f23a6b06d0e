"""Seconds per iteration on the full-size FLUX.1-dev transformer (random weights, LoRA):
synchronous step GRPO against branch rollouts and one-step-off pipelining, same group size.

The transformer has FLUX.1-dev's published configuration (19 double and 38 single blocks,
width 3072, 12B parameters) with random bf16 weights (compute does not depend on the weights),
and the VAE FLUX.1's (random weights). The text encoders are tiny ones of the right output widths
(T5 4096, CLIP pooled 768): they run once per prompt and are not what is measured. The pipeline
is built in memory and handed to flowrl's ``flux`` adapter in place of ``from_pretrained``
(there are no weights to download on the machines this runs on); everything else is
``flowrl.train.train`` on ``recipes/chunk_grpo_flux_lora.toml`` with these settings:

- 512 x 512 (1024 image tokens, 512 text tokens), 9 sampling steps (8 trainable transitions),
  SDE on all of them, 1 prompt x 8 samples per iteration, LoRA r64 on attention and
  feed-forward, micro-batch 4, one optimizer step per iteration, brightness reward (free to
  compute), no evaluation or images;
- ``step``: step GRPO, every transition of every sample trained (the synchronous loop);
- ``branch``: the same with ``branch_steps = [1, 3, 5]``, ``branch_factors = [2, 2, 2]`` (one
  root per group, copied after the forwards of steps 1, 3 and 5: 38 of the 72 rollout forwards);
- ``branch_tree``: ``branch`` with ``branch_advantage = "tree"``: each transition the tree shares
  is trained once, with its subtree's fused advantage (36 of the 64 transitions trained);
- ``pipelined``: the same as ``step`` with ``[pipeline] staleness = 1`` (the next rollout drawn by
  a copy of the policy in a worker thread while the update runs, on the same GPU).

An iteration's time is the time between two consecutive metrics rows (iteration 0, warm-up, is
left out); the median over the measured iterations is reported, with the peak of
``torch.cuda.max_memory_allocated`` per variant. Results are written as JSON after each variant.

GPU (what docs/benchmarks.md reports)::

    python benchmarks/gpu_flux_iteration.py --json OUT.json

A CPU check of the script itself, at one block of each kind and 64 x 64::

    OMP_NUM_THREADS=1 python benchmarks/gpu_flux_iteration.py --device cpu --layers 1 1 \\
        --size 64 --max-sequence-length 16 --iterations 2
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

#: FLUX.1's VAE configuration (its vae/config.json).
FLUX_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    layers_per_block=2, norm_num_groups=32, sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159,
    use_quant_conv=False, use_post_quant_conv=False,
)

VARIANTS = {
    "step": [],
    "branch": ["sampler.branch_steps=[1, 3, 5]", "sampler.branch_factors=[2, 2, 2]"],
    "branch_tree": ["sampler.branch_steps=[1, 3, 5]", "sampler.branch_factors=[2, 2, 2]",
                    "sampler.branch_advantage=\"tree\""],
    "pipelined": ["pipeline.staleness=1", "pipeline.overlap=true"],
}


def flux_dev_random(device: str, layers: tuple[int, int] | None):
    """A FluxPipeline with FLUX.1-dev's transformer and VAE shapes (random weights, bf16, built on
    ``device``) and tiny text encoders of FLUX's output widths."""
    from flowrl.compat import ensure_torchvision_importable

    ensure_torchvision_importable()  # before diffusers' models, as the model adapters do
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5Config, T5EncoderModel

    from transformers import CLIPTextConfig

    from flowrl.testing.tiny_pipelines import clip_tokenizer, t5_tokenizer
    from memory_plan import FLUX1_DEV  # FLUX.1-dev's transformer/config.json

    config = dict(FLUX1_DEV)
    if layers is not None:
        config["num_layers"], config["num_single_layers"] = layers
    tok, tok2 = clip_tokenizer(), t5_tokenizer()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):  # initialised where it runs: 12B parameters never pass through the CPU
            transformer = FluxTransformer2DModel(**config)
            vae = AutoencoderKL(**FLUX_VAE)
            text_encoder = CLIPTextModel(CLIPTextConfig(  # CLIP-L's width and heads, one layer
                vocab_size=len(tok), hidden_size=768, intermediate_size=256, num_hidden_layers=1,
                num_attention_heads=12, max_position_embeddings=77, projection_dim=768,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
            text_encoder_2 = T5EncoderModel(T5Config(
                vocab_size=len(tok2), d_model=4096, d_ff=256, d_kv=64, num_layers=1, num_heads=2,
                relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=tok2.pad_token_id,
                eos_token_id=tok2.eos_token_id))
    finally:
        torch.set_default_dtype(previous)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
    return FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok,
                        text_encoder_2=text_encoder_2, tokenizer_2=tok2, transformer=transformer)


@contextlib.contextmanager
def built_in_memory(make):
    """The ``flux`` adapter takes ``make()`` instead of loading ``model.path``."""
    from flowrl_plugins.diffusers_models.flux import FluxModel

    had = "_load" in FluxModel.__dict__
    old = FluxModel.__dict__.get("_load")
    FluxModel._load = lambda self: make()
    try:
        yield
    finally:
        if had:
            FluxModel._load = old
        else:
            del FluxModel._load


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, nargs=2, default=None, help="double and single blocks (default 19 38)")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--max-sequence-length", type=int, default=512)
    ap.add_argument("--iterations", type=int, default=3, help="iterations per variant (the first is warm-up)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--attention", default="auto", help="[train].attention_backend")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)

    from pipeline import RowClock, quiet  # benchmarks/pipeline.py's row clock

    from flowrl.plugins import temporary_plugin
    from flowrl.recipe import load_recipe
    from flowrl.runlog import read_metrics
    from flowrl.train import train

    cuda = args.device.startswith("cuda")
    common = [
        "model.path=\"in-memory\"", f"model.height={args.size}", f"model.width={args.size}",
        f"model.max_sequence_length={args.max_sequence_length}", "model.offload_encoders=false",
        "sampler.steps=9", "sampler.batch_size=0", "chunker.use=\"step\"", "selector.fraction=1.0",
        f"train.iterations={args.iterations}", "train.prompts_per_iteration=1", "train.group_size=8",
        "train.micro_batch_size=4", "train.optimizer_steps_per_update=1", "train.max_grad_norm=1.0",
        "prompts.num_eval=0", "log.image_every=0", f"checkpoint.every={args.iterations}",
        "log.progress=false", f"train.attention_backend={args.attention!r}",
    ]
    result: dict = {
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
        "torch": torch.__version__, "args": vars(args), "variants": {},
    }
    recipe_text = (REPO / "recipes" / "chunk_grpo_flux_lora.toml").read_text()
    hpsv3 = 'use = "hpsv3"\noffload = true'
    if hpsv3 not in recipe_text:  # the reward to swap for a free one must be found, not silently kept
        raise SystemExit("recipes/chunk_grpo_flux_lora.toml no longer names the hpsv3 reward as expected")
    recipe_text = recipe_text.replace(hpsv3, 'use = "brightness"')
    recipe_text += '\n[[trackers]]\nuse = "row_clock"\n'
    recipe_path = REPO / "recipes" / f".gpu_flux_bench_{os.getpid()}.toml"
    recipe_path.write_text(recipe_text)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.variants:
                clock = RowClock()
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
                with built_in_memory(lambda: flux_dev_random(args.device, args.layers)), \
                        temporary_plugin(clock, name="row-clock"):
                    sets = [*common, *VARIANTS[name], f"run.output_dir={str(Path(tmp) / name)!r}"]
                    run_dir = train(load_recipe(recipe_path, sets), console=quiet())
                rows = [r for r in read_metrics(run_dir) if "lr" in r]
                steps = [clock.stamps[i] - clock.stamps[i - 1] for i in range(1, args.iterations)]
                last = rows[-1]
                entry = {
                    "seconds_per_iteration": steps, "median": statistics.median(steps),
                    "iteration0_to_first_row": clock.stamps[0] - start,
                    "compute": {k: v for k, v in last.items() if k.startswith("compute/")},
                    "phase_seconds": {k: v for k, v in last.items() if k.startswith("time/")},
                }
                if cuda:
                    entry["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
                    entry["allocated_after_gib"] = torch.cuda.memory_allocated() / 2**30
                result["variants"][name] = entry
                print(name, json.dumps(entry), flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps(result, indent=1))
    finally:
        recipe_path.unlink()
    base = result["variants"].get("step")
    if base:
        result["ratio_to_step"] = {k: v["median"] / base["median"] for k, v in result["variants"].items()}
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
