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
- ``branch``: the same sampled as trees, ``[window] use = "branch"`` with ``steps = [1, 3, 5]``,
  ``factors = [2, 2, 2]`` (one root per group, copied after the forwards of steps 1, 3 and 5: 38 of
  the 72 rollout forwards);
- ``branch_tree``: ``branch`` with ``[advantage] use = "tree"``: each transition the tree shares
  is trained once, with its subtree's fused advantage (36 of the 64 transitions trained);
- ``pipelined``: the same as ``step`` with ``[pipeline] staleness = 1`` (the next rollout drawn by
  a copy of the policy in a worker thread while the update runs, on the same GPU);
- ``fp8_rollout`` (only when ``--variants`` names it: a GPU of compute capability 8.9+ and torchao):
  ``step`` with ``[sampler].rollout_precision = "fp8"`` (the rollout on an FP8 copy of the
  transformer, the trained transitions re-scored in bf16 before the update):
  ``--variants step fp8_rollout`` gives the FP8 rollout's time against bf16 (``phase_seconds``).

An iteration's time is the time between two consecutive metrics rows (iteration 0, warm-up, is
left out); the median over the measured iterations is reported, with the peak of
``torch.cuda.max_memory_allocated`` per variant. Results are written as JSON after each variant.

MFU per variant is the run's own ``speed/mfu`` (:mod:`flowrl.train.throughput`), as the run hands
it to its trackers: ``speed`` holds each measured iteration's ``speed/*`` values and ``mfu`` their
median (null without a known peak: on a CPU, unless ``FLOWRL_PEAK_TFLOPS`` is set), ``hfu`` the
median of ``speed/hfu`` (the recomputed forwards counted too). Note that they divide by the
seconds of the training phases, not by the wall time between rows. ``flops``
holds the run's counted ``F_f``, ``F_fb`` and ``F_fb`` with recompute (``run_info.json``) beside
the hand count of :mod:`flowrl.train.flux_flops` for the same transformer, LoRA, gradient
checkpointing and attention kernel (on a CPU the counter does not see attention, and neither does
that hand count); ``hand_equals_counted`` says whether all three agree exactly. ``F_fb``
(``velocity_forward_backward``, behind ``speed/mfu``) is the model's FLOPs, without the block
forwards that gradient checkpointing recomputes; ``velocity_forward_backward_with_recompute``
(behind ``speed/hfu``) includes them (FLUX.1-dev, LoRA, 512 x 512: 46.4 and 68.2 TFLOP).

GPU (what docs/benchmarks.md reports)::

    python benchmarks/gpu_flux_iteration.py --json OUT.json

A CPU check of the script itself, at one block of each kind and 64 x 64 (``--heads 1``: width
128 instead of 3072, and ``--small-vae``; at full width and with FLUX.1's VAE an iteration takes
minutes on a CPU)::

    OMP_NUM_THREADS=1 python benchmarks/gpu_flux_iteration.py --device cpu --layers 1 1 --heads 1 \\
        --small-vae --size 64 --max-sequence-length 16 --iterations 2
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from flowrl import hookimpl

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

#: FLUX.1's VAE configuration (its vae/config.json).
FLUX_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    layers_per_block=2, norm_num_groups=32, sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159,
    use_quant_conv=False, use_post_quant_conv=False,
)
#: ``--small-vae``: FLUX.1's VAE layout (8x down, 16 latent channels) at 32 channels a block, for a
#: CPU check (its full-size decode takes minutes per iteration there; decoding is not what is measured).
SMALL_VAE = dict(FLUX_VAE, block_out_channels=(32,) * 4, layers_per_block=1)

VARIANTS = {
    "step": [],
    "branch": ["window.use=\"branch\"", "window.steps=[1, 3, 5]", "window.factors=[2, 2, 2]"],
    # the recipe's group_zscore keys are the tree advantage's defaults: the leaves' advantages are unchanged
    "branch_tree": ["window.use=\"branch\"", "window.steps=[1, 3, 5]", "window.factors=[2, 2, 2]",
                    "advantage.use=\"tree\""],
    "pipelined": ["pipeline.staleness=1", "pipeline.overlap=true"],
    # step with FP8 rollouts (flowrl.sampling.precision): a GPU of compute capability 8.9+ and torchao;
    # only when --variants names it
    "fp8_rollout": ["sampler.rollout_precision='fp8'"],
}
#: What runs without --variants (FP8 needs the hardware).
DEFAULT_VARIANTS = ["step", "branch", "branch_tree", "pipelined"]


def transformer_config(layers: tuple[int, int] | None = None, heads: int | None = None) -> dict:
    """FLUX.1-dev's transformer/config.json, with ``layers`` (double, single) and ``heads`` (of 128) if given."""
    from memory_plan import FLUX1_DEV  # FLUX.1-dev's transformer/config.json

    config = dict(FLUX1_DEV)
    if layers is not None:
        config["num_layers"], config["num_single_layers"] = layers
    if heads is not None:
        config["num_attention_heads"] = heads
    return config


def flux_dev_random(device: str, layers: tuple[int, int] | None, heads: int | None = None, small_vae: bool = False):
    """A FluxPipeline with FLUX.1-dev's transformer and VAE shapes (random weights, bf16, built on
    ``device``; ``layers`` and ``heads`` as :func:`transformer_config` takes them; ``small_vae``:
    :data:`SMALL_VAE`) and tiny text encoders of FLUX's output widths."""
    from flowrl.compat import ensure_torchvision_importable

    ensure_torchvision_importable()  # before diffusers' models, as the model adapters do
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5Config, T5EncoderModel

    from transformers import CLIPTextConfig

    from flowrl.testing.tiny_pipelines import clip_tokenizer, t5_tokenizer

    config = transformer_config(layers, heads)
    tok, tok2 = clip_tokenizer(), t5_tokenizer()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):  # initialised where it runs: 12B parameters never pass through the CPU
            transformer = FluxTransformer2DModel(**config)
            vae = AutoencoderKL(**(SMALL_VAE if small_vae else FLUX_VAE))
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


class SpeedLog:
    """A tracker plugin that keeps each iteration's ``speed/*`` values, as the run hands them to its
    trackers (they are not written to ``metrics.jsonl``)."""

    def __init__(self):
        self.rows: dict[int, dict[str, float]] = {}

    @hookimpl
    def register_trackers(self, register):
        rows = self.rows

        class Tracker:
            def log_metrics(self, step, metrics):
                if "speed/images_per_second" in metrics:  # an iteration's row
                    rows[step] = {k: v for k, v in metrics.items() if k.startswith("speed/")}

            def log_image(self, step, name, image):
                pass

            def close(self):
                pass

        register("speed_log", lambda: Tracker())


def mfu_of(speeds: list[dict[str, float]], key: str = "speed/mfu") -> float | None:
    """The median of the run's own ``speed/mfu`` (or ``key``: ``speed/hfu``) over ``speeds`` (None
    where the run reported none: no known peak)."""
    values = [r[key] for r in speeds if key in r]
    return statistics.median(values) if values and len(values) == len(speeds) else None


def counted_attention(device: str, backend: str) -> str:
    """How FlopCounterMode sees the run's attention (flowrl.train.flux_flops): the fused GPU kernels
    (backward 2.5x forward), the math kernel (2x), or on a CPU not at all (its fused kernel has no
    FLOP formula in torch)."""
    if backend == "math":
        return "math"
    return "fused" if device.startswith("cuda") else "none"


#: the run's FLOP counts (run_info.json ``flops``) that :func:`hand_flops` counts by hand
COUNTED = ("velocity_forward", "velocity_forward_backward", "velocity_forward_backward_with_recompute")


def hand_flops(recipe, config: dict, size: int, device: str) -> dict:
    """:data:`COUNTED` for the run's transformer by hand (flowrl.train.flux_flops), for the
    recipe's fine-tuning, LoRA targets, gradient checkpointing and attention kernel."""
    from flowrl.train.flux_flops import flux_flops
    from flowrl_plugins.diffusers_models.common import ATTENTION, FEED_FORWARD, preset_targets

    train, model = recipe.train, recipe.components["model"].params
    targets = list(train.lora_targets) or preset_targets(model.lora_preset, ATTENTION, FEED_FORWARD)
    how = {"image_tokens": (size // 16) ** 2, "text_tokens": model.max_sequence_length,
           "finetune": train.finetune, "lora_rank": train.lora_rank if train.finetune == "lora" else 0,
           "lora_targets": targets if train.finetune == "lora" else [],
           "checkpointing": bool(model.gradient_checkpointing),
           "attention": counted_attention(device, train.attention_backend)}
    count = {k: how[k] for k in ("finetune", "lora_rank", "lora_targets", "attention")}
    # model FLOPs (speed/mfu): never the blocks' forwards that gradient checkpointing recomputes
    f, fb = flux_flops(how["image_tokens"], how["text_tokens"], config, **count)
    # what runs (speed/hfu): with them, where the recipe checkpoints
    _, with_recompute = flux_flops(how["image_tokens"], how["text_tokens"], config,
                                   checkpointing=how["checkpointing"], **count)
    return {"velocity_forward": f, "velocity_forward_backward": fb,
            "velocity_forward_backward_with_recompute": with_recompute, **how}


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
    ap.add_argument("--heads", type=int, default=None, help="attention heads of 128 (default 24: width 3072)")
    ap.add_argument("--small-vae", action="store_true", help="a VAE of 32 channels a block (a CPU check)")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--max-sequence-length", type=int, default=512)
    ap.add_argument("--iterations", type=int, default=3, help="iterations per variant (the first is warm-up)")
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    ap.add_argument("--attention", default="auto", help="[train].attention_backend")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="recipe overrides after the benchmark's own (a shorter CPU check: train.group_size=2)")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)

    from pipeline import RowClock, quiet  # benchmarks/pipeline.py's row clock

    from flowrl.plugins import temporary_plugin
    from flowrl.recipe import load_recipe, read_toml
    from flowrl.runlog import is_phase_seconds, read_metrics
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
    original = REPO / "recipes" / "chunk_grpo_flux_lora.toml"
    recipe_text = original.read_text()
    hpsv3 = 'use = "hpsv3"\noffload = true'
    if hpsv3 not in recipe_text:  # the reward to swap for a free one must be found, not silently kept
        raise SystemExit("recipes/chunk_grpo_flux_lora.toml no longer names the hpsv3 reward as expected")
    recipe_text = recipe_text.replace(hpsv3, 'use = "brightness"')
    recipe_text += '\n[[trackers]]\nuse = "row_clock"\n\n[[trackers]]\nuse = "speed_log"\n'
    # the copy lives in the temporary directory (nothing is left in recipes/, even by a killed run);
    # its prompt file, relative to recipes/ in the original, is named by its absolute path
    prompts = Path(read_toml(original)["prompts"]["source"])
    common.append(f"prompts.source={str(prompts if prompts.is_absolute() else original.parent / prompts)!r}")
    with tempfile.TemporaryDirectory() as tmp:
        recipe_path = Path(tmp) / "gpu_flux_bench.toml"
        recipe_path.write_text(recipe_text)
        for name in args.variants:
            clock, speeds = RowClock(), SpeedLog()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            sets = [*common, *VARIANTS[name], *args.set, f"run.output_dir={str(Path(tmp) / name)!r}"]
            with built_in_memory(lambda: flux_dev_random(args.device, args.layers, args.heads, args.small_vae)), \
                    temporary_plugin(clock, name="row-clock"), temporary_plugin(speeds, name="speed-log"):
                recipe = load_recipe(recipe_path, sets)
                run_dir = train(recipe, console=quiet())
            rows = [r for r in read_metrics(run_dir) if "lr" in r]
            steps = [clock.stamps[i] - clock.stamps[i - 1] for i in range(1, args.iterations)]
            measured = [speeds.rows[i] for i in range(1, args.iterations)]
            info = json.loads((run_dir / "run_info.json").read_text())  # the run's constants
            counted = {k: info["flops"][k] for k in COUNTED}
            hand = hand_flops(recipe, transformer_config(args.layers, args.heads), args.size, args.device)
            last = rows[-1]
            entry = {
                "seconds_per_iteration": steps, "median": statistics.median(steps),
                "iteration0_to_first_row": clock.stamps[0] - start,
                "mfu": mfu_of(measured), "hfu": mfu_of(measured, "speed/hfu"), "peak_tflops": info["peak_tflops"],
                "model_tflops_per_second": statistics.median(r["speed/model_tflops_per_second"] for r in measured),
                "speed": measured,
                "flops": {"counted": counted, "hand": hand, "hand_equals_counted": all(
                    hand[k] == v for k, v in counted.items())},
                "compute": {k: v for k, v in last.items() if k.startswith("compute/")},
                "phase_seconds": {k: v for k, v in last.items() if is_phase_seconds(k)},
                "update_seconds": {k: v for k, v in last.items() if k.startswith("time/update/")},
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
