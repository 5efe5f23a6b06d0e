"""The recipe's schema: one dataclass per plain table (``[run]``, ``[train]``, ``[sampler]``, ...),
each field documented and bounded (:func:`flowrl.config.param`), the table names
(:data:`SECTIONS`, :data:`COMPONENT_SECTIONS`, :data:`LIST_SECTIONS`), a validated component
table (:class:`ComponentChoice`) and the validated recipe (:class:`Recipe`).

A field's own checks (a range, a value that excludes another in the same table) live in its
dataclass's ``__post_init__``; rules that span tables are :mod:`flowrl.recipe.validation`'s.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Literal

from ..config import param, to_dict


@dataclasses.dataclass
class RunConfig:
    name: str = param("run", "Run name; used in the default output directory.")
    output_dir: str = param(
        "runs/{name}", "Run directory ({name} is replaced by the run name); relative to the current directory."
    )
    seed: int = param(42, "Global seed: sampling noise, selection and data order derive from it.", min=0, max=2**63 - 1)
    device: str = param("auto", "'auto' (CUDA if available, else CPU), 'cpu', 'cuda' or 'cuda:N'.")

    def __post_init__(self):
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        # a name is one folder of the output directory: "" made it runs/ itself, "x/../.." a folder outside
        if not self.name.strip() or self.name in (".", "..") or "/" in self.name:
            raise ValueError(f"name must be a folder name (no '/', not empty, '.' or '..'), got {self.name!r}")


@dataclasses.dataclass
class TrainConfig:
    iterations: int = param(100, "RL iterations: each is one rollout followed by its updates.", min=1)
    prompts_per_iteration: int = param(
        4, "Prompts per iteration, over ALL processes (global, not per GPU).", min=1
    )
    group_size: int = param(8, "Samples per prompt (G); advantages compare within a group.", min=2)
    updates_per_rollout: int = param(
        1, "Passes over each rollout (inner epochs); the first is exactly on-policy.", min=1
    )
    optimizer_steps_per_update: int = param(
        1,
        "Optimizer steps per pass over the rollout. Gradient accumulation is derived: "
        "samples per process / (micro_batch_size * this).",
        min=1,
    )
    micro_batch_size: int = param(
        8, "Samples per forward/backward on one process during the update.", min=1
    )
    lr: float = param(1e-5, "AdamW learning rate.", min=0.0, exclusive_min=True)
    weight_decay: float = param(1e-4, "AdamW weight decay.", min=0.0)
    adam_betas: list[float] = param([0.9, 0.999], "AdamW betas (beta1, beta2), each in [0, 1).", min=0.0, max=1.0)
    adam_eps: float = param(1e-8, "AdamW epsilon.", min=0.0, exclusive_min=True)
    max_grad_norm: float = param(1.0, "Gradient clipping by global norm (0 disables).", min=0.0)
    lr_schedule: Literal["constant", "cosine", "linear"] = param(
        "constant", "LR schedule over all optimizer steps."
    )
    warmup_steps: int = param(0, "Linear LR warm-up, in optimizer steps.", min=0)
    finetune: Literal["full", "lora"] = param("full", "Train all weights or a LoRA adapter (peft).")
    lora_rank: int = param(64, "LoRA rank r (finetune = 'lora').", min=1)
    lora_alpha: float = param(128.0, "LoRA alpha (scale alpha / r).", min=0.0, exclusive_min=True)
    lora_targets: list[str] = param(
        [], "Module names LoRA attaches to; empty uses the model adapter's default."
    )
    lora_init: Literal["gaussian", "default"] = param(
        "gaussian", "LoRA init of A ('gaussian' as diffusers trainers, or peft 'default'); B is 0."
    )
    same_noise_in_group: bool = param(
        False, "Give all samples of a group the same starting noise (the anchors' default)."
    )
    max_nonfinite_steps: int = param(
        3, "Updates that may be skipped for a non-finite loss or reward; one more stops the run.", min=0
    )
    update_mode: Literal["auto", "lean", "chunk_graph"] = param(
        "auto",
        "How a chunk's gradient is computed off the on-policy point (all modes give the same gradient): "
        "'lean' re-scores the chunk's steps without grad first (memory of one step, k - 1 extra "
        "forwards per chunk of k); 'chunk_graph' keeps one graph over the chunk (one batched forward "
        "and one backward, k times the activation memory, no extra forward); 'auto' takes chunk_graph "
        "when its measured activation memory fits in half the free device memory, else lean.",
    )
    update_group: int = param(
        1,
        "Trainable steps of one chunk forwarded together on the first optimizer step after a rollout (every "
        "ratio 1, [train].fast_path): 1 forwards and "
        "back-propagates each step alone (the least memory); k > 1 batches up to k steps of a chunk into one "
        "forward and one backward (k times the activation memory; under fsdp2 each block gathers its weights "
        "once per group instead of once per step). The same gradient up to float32 rounding; `flowrl plan` "
        "counts the activations it keeps.", min=1, max=10_000,
    )
    fast_path: bool = param(
        True,
        "Before the first optimizer step after a rollout every ratio is 1: back-propagate each selected "
        "step once at ratio 1 (no re-scoring, memory of one step; exact). Disable only to compare.",
    )
    optimizer: Literal["adamw", "adamw_8bit"] = param(
        "adamw",
        "'adamw': torch's AdamW, moments in the trainable dtype. 'adamw_8bit': bitsandbytes' AdamW8bit, "
        "moments stored in 8 bits (2 bytes per trainable parameter instead of 8; pip install "
        "'flowrl-diffusion[quant]'); strategies 'none' and 'ddp' only (its state does not shard).",
    )
    reference_on_cpu: bool = param(
        False,
        "Keep the KL reference (the frozen copy of the denoiser that full fine-tuning with a "
        "reference KL keeps: [loss].beta > 0 or [log].kl_every > 0, or nft's beta_kl > 0) in CPU memory; its blocks visit "
        "the GPU for each reference forward "
        "(fsdp2: its shards are CPU-offloaded). Saves the copy's GPU memory for host-to-device traffic.",
    )
    on_policy_tolerance: float = param(
        1e-6,
        "On-policy check: before the first optimizer step of a rollout, the largest per-step "
        "|log pi_new - log pi_old| must stay below this. bf16 models on a GPU may need ~1e-4.",
        min=0.0,
    )
    # Kernel switches (flowrl/train/accel.py, adamw_impl: flowrl/train/optimizer.py; docs/recipes.md
    # "Compiled and fused kernels").
    compile: Literal["off", "default", "max-autotune-no-cudagraphs"] = param(
        "off",
        "torch.compile the denoiser (in place) for the rollout and the update, with this mode. The "
        "standard choice on GPUs; on a CPU it costs a C++ compiler and minutes of warm-up and does not "
        "pay for the embedded model (docs/benchmarks.md). Rollout (no grad) and update (grad) run "
        "different compiled graphs: measured on-policy deviation 1.2e-7 on the embedded model, as much as "
        "uncompiled (float32 rounding by batch shape); raise on_policy_tolerance if a model's graphs round "
        "differently.",
    )
    attention_backend: Literal["auto", "math", "flash", "efficient", "cudnn"] = param(
        "auto",
        "The scaled-dot-product attention backend (torch.nn.attention.sdpa_kernel) of the denoiser during "
        "rollout, update and evaluation, probed at start to run the model's attention alone; calls it has no kernel "
        "for (text encoders' masked attention, an fp32 VAE, reward models) fall back to math. 'auto' lets torch "
        "choose (on CUDA among flash, efficient and math: cudnn faulted on FLUX.1-dev's attention on an H100 and runs "
        "only when named, after the probe finds it agrees with memory-efficient attention on the run's model). "
        "CPU: math, flash. CUDA: math, flash, efficient, cudnn (flash and cudnn need fp16/bf16 and a recent GPU).",
    )
    adamw_impl: Literal["auto", "for-loop", "foreach", "fused"] = param(
        "auto",
        "AdamW implementation: 'auto' is torch's default (foreach on CUDA, for-loop on CPU), 'fused' "
        "one kernel for all parameters (CUDA, and CPU since torch 2.4; the standard choice on GPUs), "
        "'foreach' multi-tensor ops. All compute the same update up to float rounding.",
    )

    def __post_init__(self):
        if len(self.adam_betas) != 2 or not all(0.0 <= b < 1.0 for b in self.adam_betas):
            raise ValueError(f"adam_betas must be two numbers in [0, 1), got {self.adam_betas}")


@dataclasses.dataclass
class SamplerConfig:
    steps: int = param(16, "Sampling steps N (the schedule has N + 1 sigmas).", min=2, max=10_000)
    image_from: Literal["x0_hat", "final"] = param(
        "x0_hat",
        "Decode the image from the last step's x0_hat (anchors' default; the last transition "
        "is then not trainable) or from the final sample x_N.",
    )
    logprob_reduction: Literal["mean", "sum"] = param(
        "mean", "Reduce a transition's Gaussian log-prob over latent elements by mean or sum."
    )
    batch_size: int = param(
        0,
        "Samples per rollout forward on one process; 0 = all local samples at once (fastest; "
        "lower it when the rollout does not fit in GPU memory).",
        min=0,
    )
    sde_window: list[int] = param(
        [],
        "[start, end): steps that use the SDE kernel; other steps are ODE. Empty = all steps.",
        min=0, max=10_000,
    )
    overlap_rewards: bool = param(
        False,
        "Decode and score each rollout sub-batch (batch_size samples; needs batch_size > 0) in a background "
        "thread while the next one samples; rewards come out in the same order, equal to scoring after the "
        "rollout for rewards that score each image on its own. Pays when the reward runs elsewhere (an http "
        "reward served by `flowrl reward serve`, another GPU): measured 0.58x the sequential time with a "
        "reward as slow as the rollout in another process (docs/benchmarks.md). Off by default: an in-process "
        "reward on the sampler's own device or cores competes with it, and the VAE decode then shares device "
        "memory with sampling.",
    )
    rollout_precision: Literal["train", "fp8"] = param(
        "train",
        "Precision of the rollout's denoiser forwards: 'train' (the training precision) or 'fp8' (a copy of the "
        "denoiser with FP8 linear layers, torchao's float8 activations and weights, made before every rollout; "
        "a GPU of compute capability 8.9+, one process, pip install 'flowrl-diffusion[fp8]'). The trained "
        "weights keep their precision; rollout_correction says how the update accounts for the difference.",
    )
    rollout_correction: Literal["rescore", "importance"] = param(
        "rescore",
        "With rollout_precision = 'fp8': 'rescore' computes the trained transitions' log-probs again with the "
        "trained weights before the update (one forward without grad each; the ratio is then pi_theta / "
        "pi_theta_old, the first step exactly on-policy); 'importance' keeps the FP8 rollout's own log-probs, so the first "
        "step's ratio pi_theta / mu is the importance weight of its samples, clipped like any ratio (no extra "
        "forward; the first step takes the exact off-policy update).",
    )

    def __post_init__(self):
        if self.rollout_precision == "train" and self.rollout_correction != "rescore":
            raise ValueError(f"rollout_correction = '{self.rollout_correction}' corrects FP8 rollouts, and "
                             "rollout_precision is 'train': set rollout_precision = 'fp8', or remove it")
        if self.overlap_rewards and self.batch_size == 0:
            raise ValueError(
                "overlap_rewards = true needs batch_size > 0: the rollout is then run in sub-batches of "
                "batch_size samples, and each is scored while the next samples (with batch_size = 0 there is "
                "one sub-batch and nothing to overlap); set e.g. batch_size = 8"
            )
        if self.sde_window:
            if len(self.sde_window) != 2 or not (0 <= self.sde_window[0] < self.sde_window[1] <= self.steps):
                raise ValueError(
                    f"sde_window must be [start, end) with 0 <= start < end <= steps ({self.steps}),"
                    f" got {self.sde_window}"
                )


@dataclasses.dataclass
class PromptsConfig:
    source: str = param(
        "model",
        "'model' (the model's own prompt source); a text file, one prompt a line; a table with named columns "
        "(.jsonl, .csv, .tsv, .parquet); a Hugging Face datasets directory (save_to_disk, or data files); or "
        "hf:NAME[:CONFIG] from the local datasets cache. Parquet and datasets need flowrl-diffusion[datasets].",
        path=True, keep=("model", "hf:"),
    )
    eval_source: str = param("", "Evaluation prompts: same forms as source; empty = same as source.",
                             path=True, keep=("model", "hf:"))
    num_eval: int = param(0, "Evaluation prompts used per evaluation (0 = no evaluation).", min=0)
    eval_seeds: int = param(1, "Seeds per evaluation prompt.", min=1)
    text_column: str = param("prompt", "Tables and datasets: the column holding the prompt text.")
    condition_column: str = param(
        "", "Tables and datasets: an optional column with a condition image path per row (image editing; relative "
        "paths are taken from the table's directory). Empty = none.",
    )
    split_column: str = param(
        "", "Tables: an optional column naming each row's split; training reads the rows equal to train_split, "
        "evaluation those equal to eval_split. Empty = every row (or separate files via eval_source).",
    )
    balance_column: str = param(
        "", "Tables and datasets: an optional column of categories (e.g. GenEval's tag) to visit equally often: "
        "training draws every category as often as the largest (the rows of smaller ones repeat), and the "
        "evaluation takes its num_eval items round-robin over the categories. Empty = every row alike.",
    )
    train_split: str = param("train", "The split training reads (a split column's value, or a dataset's split).")
    eval_split: str = param("test", "The split evaluation reads (a split column's value, or a dataset's split).")
    embeddings: str = param(
        "", "A directory of prompt embeddings written by `flowrl embed` for this [model] configuration: prompts "
        "are read from it, not encoded, and the diffusers models load no text encoder. Every prompt the run "
        "uses must be in it. Empty = encode prompts as they come.", path=True,
    )

    def __post_init__(self):
        if not self.text_column:
            raise ValueError("text_column is empty: it names the column holding the prompt text (default 'prompt')")


@dataclasses.dataclass
class LogConfig:
    every: int = param(1, "Write metrics every N iterations.", min=1)
    image_every: int = param(10, "Write an annotated image grid of one group every N iterations (0 = never).", min=0)
    eval_every: int = param(5, "Evaluate on the fixed evaluation set every N iterations.", min=1)
    eval_steps: int = param(
        0, "Sampling steps of the evaluation (ODE, the same [schedule]); 0 = [sampler].steps. Rollouts "
        "with few steps and an evaluation with more, as Flow-GRPO does (10 and 40).", min=0, max=10_000,
    )
    progress: bool = param(True, "Show a rich progress bar.")
    kl_every: int = param(
        0, "Log kl/<kind>, the KL of the policy to the reference (the [loss]'s kl kind), every N iterations "
        "also when the loss has no KL term (beta = 0), to watch the drift before choosing a beta: on those "
        "iterations one policy and one reference forward per trained transition, without gradient, after "
        "each micro-batch's backward (nothing trained changes). The reference is the base with the adapter "
        "off under LoRA, a frozen copy of the denoiser under full fine-tuning (flowrl plan counts it). "
        "0 = off (with beta > 0 the KL is logged every iteration anyway).", min=0,
    )


@dataclasses.dataclass
class CheckpointConfig:
    every: int = param(10, "Write a checkpoint every N iterations (and always at the end).", min=1)
    keep_last: int = param(2, "Keep this many most recent checkpoints.", min=1)
    every_minutes: float = param(
        0.0,
        "Also write a checkpoint when this many minutes have passed since the last one (0 = off): "
        "for preemptible clusters, where an iteration-count interval can lose hours.",
        min=0.0,
    )


@dataclasses.dataclass
class EmaConfig:
    enabled: bool = param(False, "Keep an exponential moving average (EMA) of the trained weights.")
    decay: float = param(0.99, "EMA decay d: e <- d e + (1 - d) w after each update.", min=0.0, max=1.0)
    warmup_steps: int = param(
        0, "EMA warm-up: update k uses min(decay, (1 + k) / (1 + warmup_steps + k)); 0 = none, 9 = the "
        "common (1 + k) / (10 + k).", min=0,
    )
    every: int = param(1, "Update the EMA every N optimizer steps.", min=1)
    on_cpu: bool = param(
        False, "Keep the EMA weights in CPU memory instead of on the training device (not with "
        "[distributed].strategy = 'fsdp2', where the EMA is sharded like the weights)."
    )
    evaluate: bool = param(False, "Evaluate the EMA weights (not the trained ones) during training.")


@dataclasses.dataclass
class ReplayConfig:
    """Bounded off-policy reuse (docs/objectives.md, "Replay"): rollouts of recent iterations
    trained on again, re-scored first and importance-weighted against the policy that sampled
    them."""

    size: int = param(0, "Rollouts (whole iterations' samples) kept for replay; 0 = off (on-policy).", min=0)
    max_staleness: int = param(
        1, "Replay a kept rollout only up to this many iterations after it was collected; 0 = off.", min=0)
    per_iteration: int = param(1, "Kept rollouts trained on per iteration, after the iteration's own rollout.", min=1)
    sample: Literal["newest", "uniform"] = param(
        "newest", "Which kept rollouts an iteration replays: the newest, or a uniform draw (seeded by run.seed "
        "and the iteration) among those within max_staleness.")
    weight_level: Literal["unit", "sequence"] = param(
        "unit", "Importance weight per unit (step or chunk: exp of the mean log-ratio over the unit, the "
        "objective's own ratio) or per sample (over its first weight_steps positions).")
    weight_steps: int = param(
        0, "weight_level = 'sequence': the first trainable positions the weight uses (late-step truncation; "
        "0 = all).", min=0)
    truncate: float = param(2.0, "Truncation c of the importance weights: w = min(w, c).", min=1e-6)

    def __post_init__(self):
        if self.weight_steps and self.weight_level != "sequence":
            raise ValueError(f"weight_steps = {self.weight_steps} applies to weight_level = 'sequence' only "
                             f"(weight_level is {self.weight_level!r})")

    @property
    def enabled(self) -> bool:
        return self.size > 0 and self.max_staleness > 0


@dataclasses.dataclass
class DataConfig:
    """Offline training (docs/objectives.md, "Offline SFT and DPO"): a table of images or of
    preference pairs that the ``[loss]`` (``sft`` or ``offline_dpo``) trains on instead of rollouts.
    Each iteration trains ``[train].prompts_per_iteration`` rows of it (a row is one sample:
    ``group_size`` does not apply and may not be given); no rollout and no reward are computed for training (the evaluation still
    scores its held-out prompts with the ``[[rewards]]``)."""

    path: str = param(
        "", "The offline table (.jsonl, .csv, .tsv or .parquet): columns prompt and image (SFT), or prompt, chosen "
        "and rejected (DPO); relative image paths are read against the table's folder. Empty = an online run "
        "(rollouts and rewards).", path=True)
    kind: Literal["auto", "images", "pairs"] = param(
        "auto", "The table's kind: 'images' (prompt, image), 'pairs' (prompt, chosen, rejected), or 'auto' (from "
        "its columns). It must be the kind the [loss] trains on.")

    @property
    def enabled(self) -> bool:
        return bool(self.path)


@dataclasses.dataclass
class PipelineConfig:
    """One-step-off pipelining (docs/objectives.md, "Pipelining"): the rollout of iteration
    i + 1 is drawn by a copy of the policy while iteration i's update runs, and the update
    corrects for its older policy with importance weights."""

    staleness: int = param(
        0, "0: the synchronous loop (each rollout drawn by the current weights); 1: the rollout of iteration "
        "i + 1 is drawn while update i runs, by weights from before update i.", min=0, max=1)
    sync_every: int = param(
        1, "Copy the trained weights to the rollout's policy every k updates (a rollout's policy is then 1 to "
        "k updates old).", min=1)
    overlap: bool = param(
        True, "Draw the next rollout in a worker thread beside the update; false draws it first, in order "
        "(the same result, bit for bit, without the overlap).")
    worker: Literal["thread", "process"] = param(
        "thread", "Where the rollout's policy lives: 'thread', a copy in each training process, drawing in a "
        "thread beside the update; 'process', a rollout process per training process, on `device`, sent the "
        "trained weights at every sync (the thread's run, bit for bit on the CPU, to float32 rounding on a GPU).")
    device: str = param(
        "", "The rollout process's device (worker = 'process'): '' = the training process's, 'cpu', or "
        "'cuda:N', offset by the local rank (learners on GPUs 0..P-1 with 'cuda:P' draw on GPUs P..2P-1).")
    weight_level: Literal["unit", "sequence"] = param(
        "unit", "Importance weight per unit (step or chunk: exp of the mean log-ratio over the unit) or per "
        "sample (over all its trainable positions).")
    truncate: float = param(2.0, "Truncation c of the importance weights: w = min(w, c).", min=1e-6)

    def __post_init__(self):
        if self.device and self.worker != "process":
            raise ValueError("device is the rollout process's: set worker = 'process' too, or leave device empty")
        if self.device and not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be '', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")

    @property
    def enabled(self) -> bool:
        return self.staleness > 0


@dataclasses.dataclass
class RewardEntryConfig:
    """The keys every ``[[rewards]]`` entry takes besides ``use`` and the reward's own parameters."""

    weight: float = param(1.0, "Weight of this reward in the combined advantage (0 = logged, not trained on).")
    name: str = param("", "Name it is logged under (reward/<name>/mean); unset = the `use` name. "
                          "Entries need distinct names (the same reward twice needs a name).")
    chunk_weights: list[float] = param(
        [], "One weight per chunk, in sampling order (high noise first), replacing `weight` chunk by chunk; "
            "empty = `weight` for every chunk."
    )
    frames: Literal["mean", "first", "last", "min"] = param(
        "mean", "Video models: how an image reward's per-frame scores become one score per clip (the mean over "
                "frames, the first or last frame's, or the worst frame's). A reward that scores whole clips "
                "(motion, temporal consistency) ignores it; image models ignore it. docs/video.md."
    )


@dataclasses.dataclass
class DistributedConfig:
    strategy: Literal["auto", "none", "ddp", "fsdp2"] = param(
        "auto",
        "How the trained model is spread over processes: 'none' (one process), 'ddp' (replicated "
        "weights, gradients averaged), 'fsdp2' (weights, gradients and AdamW state sharded, per "
        "transformer block) or 'auto' (fsdp2 when the launcher asks for FSDP, else ddp with several "
        "processes, else none). docs/distributed.md.",
    )
    shard: Literal["full", "hybrid"] = param(
        "full",
        "fsdp2 only: 'full' shards over every process; 'hybrid' shards within a node and replicates "
        "across nodes (a 2-D device mesh, nodes x processes per node).",
    )
    cpu_offload: bool = param(
        False, "fsdp2 only: keep the sharded parameters, gradients and AdamW state in CPU memory (FSDP2 CPUOffloadPolicy)."
    )
    gradient_sync: Literal["auto", "step", "micro_batch"] = param(
        "auto",
        "fsdp2 only: when gradients are reduce-scattered. 'step': once per optimizer step (the fewest "
        "collectives; every process holds a full-size float32 gradient during the update); "
        "'micro_batch': after every backward (gradients stay sharded: 4P/N instead of 4P bytes, for one "
        "reduce-scatter per backward); 'auto': 'step' when `flowrl plan` says it fits the GPU's memory, "
        "else 'micro_batch' (on a CPU: 'step'). docs/distributed.md, \"Gradient memory\".",
    )
    activation_checkpointing: bool = param(
        False, "Recompute each transformer block's activations in the backward instead of storing them."
    )
    mixed_precision: Literal["no", "bf16"] = param(
        "no",
        "'bf16': compute in bfloat16 with float32 master weights, gradients reduced in float32 "
        "(fsdp2: MixedPrecisionPolicy; none/ddp: autocast). Raise [train].on_policy_tolerance "
        "(docs/distributed.md derives it).",
    )
    context_parallel: int = param(
        1,
        "Context (sequence) parallelism through diffusers' ContextParallelConfig: every transformer "
        "forward's tokens are split over this many processes, which share their samples (activation "
        "memory per process falls about in proportion). Groups of this many consecutive processes; "
        "num_processes must be a multiple of it. Its tokens per sample must divide by it, and the "
        "model's attention heads by its Ulysses share (context_parallel / context_parallel_ring). "
        "docs/distributed.md, \"Context parallelism\".",
        min=1,
    )
    context_parallel_ring: int = param(
        1,
        "Of each context-parallel group, the processes that form a ring (ring attention: keys and "
        "values passed around, partial attentions merged by their log-sum-exp); the other factor, "
        "context_parallel / this, splits attention heads (Ulysses). 1: Ulysses only; context_parallel: "
        "ring only, for models whose heads do not divide. A GPU runs it in bf16 or fp16 with the flash "
        "(or cuDNN) kernel.",
        min=1,
    )
    num_processes: int = param(
        1,
        "The number of processes (one per GPU) the recipe is written for. `flowrl plan` estimates "
        "memory at this count unless --num-processes says otherwise, and `flowrl train` warns when a "
        "run has fewer processes. It launches nothing: start them with `flowrl train --num-processes N`, "
        "torchrun or accelerate launch.",
        min=1,
    )

    def __post_init__(self):
        for key, value, default in (("shard", self.shard, "full"), ("cpu_offload", self.cpu_offload, False),
                                    ("gradient_sync", self.gradient_sync, "auto")):
            if value != default and self.strategy != "fsdp2":
                raise ValueError(f"{key} = {value!r} needs strategy = 'fsdp2' (strategy is {self.strategy!r})")


#: Plain tables and their dataclasses.
SECTIONS: dict[str, type] = {
    "run": RunConfig,
    "train": TrainConfig,
    "sampler": SamplerConfig,
    "prompts": PromptsConfig,
    "log": LogConfig,
    "checkpoint": CheckpointConfig,
    "ema": EmaConfig,
    "distributed": DistributedConfig,
    "replay": ReplayConfig,
    "data": DataConfig,
    "pipeline": PipelineConfig,
}
#: Component tables (one component each) and their kinds.
COMPONENT_SECTIONS: dict[str, str] = {
    "model": "model",
    "schedule": "schedule",
    "kernel": "kernel",
    "chunker": "chunker",
    "selector": "selector",
    "advantage": "advantage",
    "loss": "loss",
    "likelihood": "likelihood",
    "window": "window",
}
#: Arrays of component tables and their kinds.
LIST_SECTIONS: dict[str, str] = {"rewards": "reward", "trackers": "tracker"}
#: Keys of a [[rewards]] entry that belong to the entry, not to the reward.
REWARD_ENTRY_KEYS = tuple(f.name for f in dataclasses.fields(RewardEntryConfig))


@dataclasses.dataclass
class ComponentChoice:
    """A validated component table: the component's name and its params dataclass."""

    use: str
    params: Any
    #: rewards only: the weight in the combined advantage.
    weight: float = 1.0
    #: rewards only: the name it is logged under (defaults to ``use``).
    label: str = ""
    #: rewards only: one weight per chunk, replacing ``weight`` chunk by chunk (empty = none).
    chunk_weights: list[float] = dataclasses.field(default_factory=list)
    #: rewards only: how a video run aggregates an image reward's per-frame scores.
    frames: str = "mean"

    def as_table(self) -> dict[str, Any]:
        table: dict[str, Any] = {"use": self.use}
        if self.label and self.label != self.use:
            table["name"] = self.label
        if self.chunk_weights:
            table["chunk_weights"] = list(self.chunk_weights)
        if self.frames != "mean":
            table["frames"] = self.frames
        if self.params is not None:
            table.update(to_dict(self.params))
        return table


@dataclasses.dataclass
class Recipe:
    """A fully validated recipe. ``source`` is the file it came from."""

    run: RunConfig
    train: TrainConfig
    sampler: SamplerConfig
    prompts: PromptsConfig
    log: LogConfig
    checkpoint: CheckpointConfig
    ema: EmaConfig
    components: dict[str, ComponentChoice]
    rewards: list[ComponentChoice]
    trackers: list[ComponentChoice]
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    replay: ReplayConfig = dataclasses.field(default_factory=ReplayConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
    source: str = "<recipe>"
    #: T, the number of trainable transitions of the sampler (set by validation).
    num_trainable: int = 0

    @property
    def group_size(self) -> int:
        """Samples per prompt in the batch geometry: ``[train].group_size``, or 1 for an offline
        run (``[data]``), whose table row is one sample."""
        return 1 if self.data.enabled else self.train.group_size

    @property
    def output_dir(self) -> Path:
        return Path(self.run.output_dir.replace("{name}", self.run.name))

    def to_toml_dict(self) -> dict[str, Any]:
        """The resolved recipe, every default filled in (written into the run directory)."""
        out: dict[str, Any] = {name: to_dict(getattr(self, name)) for name in SECTIONS}
        if self.data.enabled:  # an offline run has no groups (validation refuses the key)
            del out["train"]["group_size"]
        for section, choice in self.components.items():
            out[section] = choice.as_table()
        out["rewards"] = [dict(r.as_table(), weight=r.weight) for r in self.rewards]
        if self.trackers:
            out["trackers"] = [t.as_table() for t in self.trackers]
        return out
