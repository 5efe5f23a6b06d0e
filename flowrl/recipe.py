"""TOML recipes: the schema, loading, ``--set`` overrides and validation.

A recipe is a TOML file. Plain tables (``[run]``, ``[train]``, ``[sampler]``, ``[prompts]``,
``[log]``, ``[checkpoint]``, ``[ema]``, ``[distributed]``, ``[replay]``, ``[data]``, ``[pipeline]``) configure the engine and are documented field by field below.
Component tables name a registered component and give its parameters::

    [chunker]
    use = "explicit"
    sizes = [2, 3, 4, 7]

    [[rewards]]
    use = "verifier"
    weight = 1.0

:func:`load_recipe` validates everything (types, ranges, unknown tables and keys, component
names and their parameters, cross-field rules such as chunk sizes summing to the number of
trainable transitions) before any model is built. ``flowrl validate --explain`` prints every
key's documentation.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Literal

import torch

from .config import fields_of, from_dict, param, to_dict
from .dynamics.profile_file import read_profile, trainable_curve
from .errors import FlowrlError, RecipeError, printable, suggest
from .interfaces import (
    KeepsRolloutMeans,
    KLRegularised,
    NeedsReferenceCopy,
    NeedsReferencePolicy,
    Objective,
    ProfilingChunker,
    TrainsOnData,
    WarpsTime,
)
from .offline import read_offline_rows
from .plugins import Registry, get_registry
from .prompts import TABLE_SUFFIXES, distinct_rows, read_prompts
from .sampling.branching import check_branches, steps_of_highest_dynamics
from .sampling.plans import PlanContext
from .sampling.rollout import make_kernels, trainable_mask

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


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
        "reference KL keeps: [loss].beta > 0, or nft's beta_kl > 0) in CPU memory; its blocks visit "
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
        "The only scaled-dot-product attention backend torch may use (torch.nn.attention.sdpa_kernel) "
        "during rollout, update and evaluation; 'auto' lets torch choose (on CUDA among flash, efficient and "
        "math: cudnn faulted on FLUX.1-dev's attention on an H100 and runs only when named). CPU: math, flash. CUDA: "
        "math, flash, efficient, cudnn (flash and cudnn need fp16/bf16 and a recent GPU).",
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
    branch_steps: list[int] = param(
        [],
        "Branch (tree) rollouts, BranchGRPO-style: the steps at which every live trajectory of a group splits "
        "into branch_factors copies, each drawing its own SDE noise from there on (docs/objectives.md, \"Branch "
        "rollouts\"). A group starts from group_size / prod(branch_factors) roots and the shared prefixes are "
        "computed once. Strictly increasing, in [0, steps). Empty = no branching.",
        min=0, max=10_000,
    )
    branch_factors: list[int] = param(
        [], "Copies made at each of branch_steps (one factor each, >= 1); their product must divide group_size.",
        min=1, max=10_000,
    )
    branch_profile: str = param(
        "", "Choose the branch steps from the temporal dynamics: a profile.json written by `flowrl profile` for "
        "this sampler; the trajectories split in 2 at the branch_count trainable transitions where its l1rel curve "
        "is highest (branch_steps and branch_factors are then filled in, and kept in the run's recipe).", path=True)
    branch_count: int = param(
        0, "With branch_profile: how many splits, each in 2 (2 ** branch_count must divide group_size).", min=0,
        max=30)
    branch_advantage: Literal["leaf", "tree"] = param(
        "leaf", "With branch rollouts: 'leaf' trains every sample's transitions with the sample's own advantage "
        "(a shared prefix once per sample sharing it); 'tree' is BranchGRPO's tree advantage: each transition "
        "gets the advantage of the node it leads into (the leaves below it fused by branch_fusion, standardised "
        "among the group's nodes at that depth) and each distinct transition is trained once (step units).")
    branch_keep: int = param(
        0, "branch_advantage = 'tree': width pruning, BranchGRPO-style: below the last split only the branch_keep "
        "leaves of each group with the largest |advantage| are trained (the others' transitions there get "
        "advantage 0 and cost nothing on-policy); 0 = every leaf.", min=0)
    branch_prune_steps: list[int] = param(
        [], "branch_advantage = 'tree': depth pruning, BranchGRPO-style: the sampling steps whose transitions are "
        "not trained (advantage 0: no forward on-policy); sampling and rewards are unchanged. Strictly "
        "increasing, in [0, steps). Empty = none.", min=0, max=10_000)
    branch_prune_slide: int = param(
        0, "With branch_prune_steps: every this many iterations the pruned steps move one step earlier, until the "
        "earliest is the last of branch_steps (a sliding window over the leaf segment); 0 = they stay.", min=0)
    branch_fusion: Literal["mean", "probability"] = param(
        "mean", "branch_advantage = 'tree': a node's value is the mean of its leaves ('mean'), or at each split "
        "the children weighted by the softmax of their transitions' rollout log-probs ('probability').")

    def __post_init__(self):
        if bool(self.branch_profile) != bool(self.branch_count):
            raise ValueError("branch_profile and branch_count go together: the profile to read and how many splits "
                             "to take from it")
        if self.branch_steps or self.branch_factors:  # the group-size rule: _check_branches
            check_branches(self.branch_steps, self.branch_factors, self.steps, math.prod(self.branch_factors))
        if self.branch_keep and self.branch_advantage != "tree":
            raise ValueError("branch_keep prunes the leaves of a tree advantage: set branch_advantage = 'tree' too, "
                             "or branch_keep = 0")
        if self.branch_prune_steps:
            if self.branch_advantage != "tree":
                raise ValueError("branch_prune_steps prunes depths of a tree advantage: set branch_advantage = 'tree' "
                                 "too, or branch_prune_steps = []")
            p = self.branch_prune_steps
            if any(b <= a for a, b in zip(p, p[1:])) or p[-1] >= self.steps:
                raise ValueError(f"branch_prune_steps must be strictly increasing steps in [0, steps = {self.steps}), "
                                 f"got {p}")
        elif self.branch_prune_slide:
            raise ValueError("branch_prune_slide slides the pruned steps: set branch_prune_steps too, "
                             "or branch_prune_slide = 0")
        if self.branch_advantage == "tree" and not self.branch_steps:
            raise ValueError("branch_advantage = 'tree' needs branch rollouts: set branch_steps and branch_factors, "
                             "or branch_advantage = 'leaf'")
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


# ----------------------------------------------------------------------------- loading


def read_toml(path: str | Path) -> dict[str, Any]:
    """A recipe file's tables; a file the TOML parser cannot read, for any reason, is one
    RecipeError naming the file."""
    path = Path(path)
    if path.is_dir():
        raise RecipeError(f"{path} is a directory, not a recipe file", hint="pass a .toml file (`ls recipes/`)")
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}", hint="check the path (`ls recipes/`)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(f"not a UTF-8 text file ({exc})", where=str(path)) from exc
    except OSError as exc:
        raise RecipeError(f"cannot read the recipe: {exc.strerror or exc}", where=str(path)) from exc
    return parse_toml(text, str(path))


def parse_toml(text: str, where: str) -> dict[str, Any]:
    """``tomllib.loads``, with every way it can fail as one RecipeError at ``where``: a syntax
    error, and nesting so deep that the parser (recursive) runs out of stack."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"TOML syntax error: {exc}", where=where) from exc
    except RecursionError as exc:
        raise RecipeError("arrays or tables nested too deeply for the TOML parser", where=where,
                          hint="a recipe nests a few levels at most: look for a run of '[' or '{'") from exc


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``section.key=value`` (value in TOML syntax, bare words taken as strings)."""
    if "=" not in text:
        raise RecipeError(f"override '{text}' must look like section.key=value", where="--set")
    dotted, raw = text.split("=", 1)
    keys = [k.strip() for k in dotted.strip().split(".")]
    if len(keys) < 2 or not all(keys):
        raise RecipeError(f"override '{text}' must name a section and a key, e.g. train.lr=1e-5", where="--set")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    except RecursionError as exc:
        raise RecipeError(f"the value of override '{dotted.strip()}' is nested too deeply for the TOML parser",
                          where="--set") from exc
    return keys, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``--set`` overrides. ``rewards.0.weight=2`` indexes arrays of tables."""
    for text in overrides:
        keys, value = parse_override(text)
        node: Any = data
        for depth, key in enumerate(keys[:-1]):
            if not isinstance(node, (dict, list)):
                parent = ".".join(keys[:depth])
                raise RecipeError(
                    f"override '{text}': '{parent}' is a value ({node!r}), not a table", where="--set"
                )
            if isinstance(node, list):
                if not key.isdigit() or int(key) >= len(node):
                    raise RecipeError(f"override '{text}': no entry {key} in that list", where="--set")
                node = node[int(key)]
            else:
                node = node.setdefault(key, {})  # unknown tables are reported by validation
        last = keys[-1]
        if not isinstance(node, (dict, list)):
            raise RecipeError(
                f"override '{text}': '{'.'.join(keys[:-1])}' is a value ({node!r}), not a table",
                where="--set",
            )
        if isinstance(node, list):
            raise RecipeError(f"override '{text}' must end with a key, not a list index", where="--set")
        if last == "use" and isinstance(node, dict) and node.get("use") != value:
            # switching component: the old component's parameters do not apply to the new one
            node.clear()
        node[last] = value
    return data


def load_recipe(
    path: str | Path,
    overrides: list[str] | None = None,
    registry: Registry | None = None,
) -> Recipe:
    """Read, override and validate a recipe file. Raises RecipeError with file and key.

    Relative paths (keys declared with ``param(..., path=...)``) given in the file resolve
    against the file's directory; those given by ``--set`` overrides, against the current
    directory. The recipe then holds absolute paths (and so does the run's saved recipe)."""
    registry = registry or get_registry()
    data = read_toml(path)
    resolve_paths(data, Path(path).resolve().parent, registry, str(path), from_file=True)
    data = apply_overrides(data, overrides or [])
    touched = {tuple(parse_override(text)[0]) for text in overrides or []}
    resolve_paths(data, Path.cwd(), registry, "--set", only=touched)
    return validate(data, source=str(path), registry=registry)


def resolve_paths(data: dict[str, Any], base: Path, registry: Registry, where: str, *,
                  from_file: bool = False, only: set[tuple[str, ...]] | None = None) -> None:
    """Make the relative path values of a parsed recipe absolute against ``base``, in place.
    ``only``: just these key paths (``("prompts", "source")``, ``("rewards", "0", "model")``).
    Malformed tables are left for :func:`validate` to report."""
    tables: list[tuple[tuple[str, ...], Any, type | None]] = []
    for section, cls in SECTIONS.items():
        tables.append(((section,), data.get(section), cls))
    for section, kind in list(COMPONENT_SECTIONS.items()) + list(LIST_SECTIONS.items()):
        value = data.get(section)
        entries = [((section, str(i)), t) for i, t in enumerate(value)] if isinstance(value, list) else [((section,), value)]
        for key, table in entries:
            use = table.get("use") if isinstance(table, dict) else None
            comp = registry.components.get(kind, {}).get(use) if isinstance(use, str) else None
            tables.append((key, table, comp.params if comp is not None else None))
    for key, table, cls in tables:
        if not isinstance(table, dict) or cls is None:
            continue
        for f, _ in fields_of(cls):
            value = table.get(f.name)
            if f.metadata.get("path") and isinstance(value, str) and (only is None or (*key, f.name) in only):
                table[f.name] = resolve_path(value, base, f, f"{where}: {'.'.join((*key, f.name))}", from_file)


def resolve_path(value: str, base: Path, f: dataclasses.Field, where: str, from_file: bool) -> str:
    """One path value made absolute against ``base``; words, empty values, absolute paths and
    (for ``path="hub"`` keys) hub ids stay as they are. A path in a recipe file that exists only
    relative to the current directory is refused: the recipe would mean different files from
    different directories."""
    keep = f.metadata.get("keep", ())
    if not value or value in keep or any(k.endswith(":") and value.startswith(k) for k in keep):
        return value
    p = Path(value).expanduser()
    if p.is_absolute():
        return str(p)
    candidate = Path(os.path.normpath(base / p))
    explicit = value.startswith(("./", "../", ".\\", "..\\"))
    if f.metadata["path"] == "hub" and not (explicit or candidate.exists()) and not (from_file and p.exists()):
        return value  # a hub id
    if from_file and not candidate.exists() and p.exists() and candidate != Path.cwd() / p:
        raise RecipeError(
            f"'{value}' does not exist relative to the recipe's directory ({base}), only relative to the current "
            "directory; paths in a recipe are relative to the recipe file",
            where=where,
            hint=f"write it as {json.dumps(os.path.relpath(p.resolve(), base))} or as an absolute path",
        )
    return str(candidate)


def validate(
    data: dict[str, Any], *, source: str = "<recipe>", registry: Registry | None = None, require_rewards: bool = True
) -> Recipe:
    """Validate a parsed recipe dict and return a :class:`Recipe`.

    ``require_rewards=False`` accepts a recipe without ``[[rewards]]`` (for sampling and
    profiling a model, which score nothing)."""
    registry = registry or get_registry()
    valid_tables = list(SECTIONS) + list(COMPONENT_SECTIONS) + list(LIST_SECTIONS)
    for key, value in data.items():
        if key not in valid_tables:
            raise RecipeError(f"unknown table [{printable(key)}]", where=source, hint=suggest(key, valid_tables))
        is_list = key in LIST_SECTIONS
        if is_list and not (isinstance(value, list) and all(isinstance(v, dict) for v in value)):
            raise RecipeError(f"[[{key}]] must be an array of tables ([[{key}]] entries)", where=source)
        if not is_list and not isinstance(value, dict):
            raise RecipeError(f"'{key}' must be a table ([{key}]), got {type(value).__name__}", where=source)

    plain = {
        name: from_dict(cls, data.get(name, {}), where=f"{source}: [{name}]") for name, cls in SECTIONS.items()
    }
    components = {}
    for section, kind in COMPONENT_SECTIONS.items():
        table = data.get(section)
        if table is None:
            default = registry.default(kind)
            if default is None:
                raise RecipeError(
                    f"table [{section}] is missing and no plugin provides a default {kind}",
                    where=source,
                    hint=f'add [{section}] with use = "<name>"; valid: {", ".join(registry.names(kind))}',
                )
            table = {"use": default}
        components[section] = component_choice(registry, kind, table, f"{source}: [{section}]")

    rewards = [
        component_choice(registry, "reward", t, f"{source}: [[rewards]] #{i + 1}", extra=REWARD_ENTRY_KEYS)
        for i, t in enumerate(data.get("rewards", []))
    ]
    if not rewards and require_rewards:
        raise RecipeError(
            "no reward: add at least one [[rewards]] entry",
            where=source,
            hint=f'valid rewards: {", ".join(registry.names("reward"))}',
        )
    labels = [r.label for r in rewards]
    dupes = sorted({n for n in labels if labels.count(n) > 1})
    if dupes:
        raise RecipeError(
            f"reward '{dupes[0]}' is listed twice",
            where=f"{source}: [[rewards]]",
            hint="give each entry a distinct `name = \"...\"`",
        )
    trackers = [
        component_choice(registry, "tracker", t, f"{source}: [[trackers]] #{i + 1}")
        for i, t in enumerate(data.get("trackers", []))
    ]
    recipe = Recipe(
        **plain, components=components, rewards=rewards, trackers=trackers, source=source
    )
    if require_rewards:
        _check_reward_weights(recipe)
    _cross_check(recipe, registry)
    if recipe.data.enabled and "group_size" in data.get("train", {}):  # after the [loss] agreed with [data]
        raise RecipeError("group_size does not apply to an offline run: a row of the [data] table is one sample",
                          where=f"{source}: [train].group_size",
                          hint="remove it; prompts_per_iteration is the number of rows each iteration trains")
    return recipe


def _check_reward_weights(recipe: Recipe) -> None:
    """An online run trains on the weighted rewards: with every weight 0 (and every chunk weight,
    where given) every advantage is 0 and the run would learn nothing. An offline run (``[data]``)
    trains on its table, and its rewards only score the evaluation."""
    if recipe.data.enabled or not recipe.rewards:
        return
    if all(not any(r.chunk_weights) if r.chunk_weights else r.weight == 0 for r in recipe.rewards):
        labels = ", ".join(r.label for r in recipe.rewards)
        raise RecipeError(f"every [[rewards]] entry has weight 0 ({labels}): a weight of 0 logs a reward without "
                          "training on it, so every advantage would be 0 and the run would learn nothing",
                          where=f"{recipe.source}: [[rewards]]",
                          hint=f"give the reward to optimise a non-zero weight, e.g. --set rewards.0.weight=1.0 "
                               f"([[rewards]] #1, {recipe.rewards[0].label})")


def component_choice(
    registry: Registry, kind: str, table: dict[str, Any], where: str, extra: tuple[str, ...] = ()
) -> ComponentChoice:
    if "use" not in table:
        raise RecipeError(
            "required key 'use' is missing",
            where=where,
            hint=f'name a registered {kind}: {", ".join(registry.names(kind))}',
        )
    name = table["use"]
    if not isinstance(name, str):
        raise RecipeError(f"key 'use' must be a string, got {name!r}", where=where)
    comp = registry.get(kind, name, where=f"{where}.use")
    where = f"{where} ({kind} '{name}')"
    body = {k: v for k, v in table.items() if k != "use" and k not in extra}
    if comp.params is None:
        if body:
            key = next(iter(body))
            raise RecipeError(
                f"unknown key '{key}': {kind} '{name}' takes no parameters", where=where,
                hint=f"valid: use{', ' + ', '.join(extra) if extra else ''}",
            )
        params = None
    else:
        params = from_dict(comp.params, body, where=where, ignore=("use",) + extra)
    choice = ComponentChoice(use=name, params=params)
    if "weight" in extra:
        entry = from_dict(RewardEntryConfig, {k: table[k] for k in extra if k in table}, where=where)
        if "name" in table and not entry.name:
            raise RecipeError("key 'name' must be a non-empty string, got ''", where=where,
                              hint=RewardEntryConfig.__dataclass_fields__["name"].metadata["help"])
        choice.weight, choice.label, choice.chunk_weights = entry.weight, entry.name or name, list(entry.chunk_weights)
        choice.frames = entry.frames
    return choice


def build_component(recipe: Recipe, registry: Registry, table: str, index: int | None = None) -> Any:
    """Build the component a recipe table chooses (``index``: the entry of a ``[[rewards]]`` or
    ``[[trackers]]`` array), the one way validation and training build components, so that every
    factory's error reads alike: a ``ValueError``/``TypeError`` (a parameter check that only the
    built component can make) or a :class:`FlowrlError` becomes one message naming the table,
    never a traceback. Parameter checks themselves belong in the params dataclass's
    ``__post_init__`` (then :func:`validate` reports them while reading the table)."""
    if index is None:
        kind, choice = COMPONENT_SECTIONS[table], recipe.components[table]
        where = f"{recipe.source}: [{table}] ({kind} '{choice.use}')"
    else:
        kind, choice = LIST_SECTIONS[table], getattr(recipe, table)[index]
        where = f"{recipe.source}: [[{table}]] #{index + 1} ({choice.use})"
    try:
        return registry.get(kind, choice.use).build(choice.params)
    except FlowrlError as exc:
        raise type(exc)(exc.message, where=exc.where or where, hint=exc.hint) from exc
    except (ValueError, TypeError) as exc:
        raise RecipeError(str(exc), where=where) from exc


def plan_context(recipe: Recipe, registry: Registry) -> PlanContext:
    """What the ``[window]`` planner plans with, as training builds it
    (:func:`flowrl.train.session.plan_context`), on a stand-in schedule: trainability does not
    depend on the sigma values, and the schedule's time warp (MixGRPO-Flash's compression needs
    one) is the ``[schedule]``'s own."""
    kernel = build_component(recipe, registry, "kernel")
    s = recipe.sampler
    window = tuple(s.sde_window) if s.sde_window else None
    try:
        kernels = make_kernels(s.steps, kernel, window)
    except ValueError as exc:
        raise RecipeError(str(exc), where=f"{recipe.source}: [sampler]") from exc
    schedule = build_component(recipe, registry, "schedule")
    warp = schedule.sigma_at if isinstance(schedule, WarpsTime) else None
    times = torch.linspace(1.0, 0.0, s.steps + 1, dtype=torch.float64)
    # a warping schedule's sigmas are its warp of uniform time (WarpsTime); others need no exact values here
    sigmas = (torch.as_tensor(warp(times), dtype=torch.float64) if warp is not None else times).to(torch.float32)
    mask = trainable_mask(kernels, sigmas, s.image_from)
    return PlanContext(num_steps=s.steps, sigmas=sigmas, trainable=mask, warp=warp, seed=recipe.run.seed,
                       group_size=recipe.train.group_size, sde_window=tuple(s.sde_window))


def trainable_transitions(recipe: Recipe, registry: Registry, context: PlanContext | None = None) -> int:
    """T for this recipe's sampler, decided by the kernel itself (an ``ode`` kernel or noise 0
    trains nothing; ``cps`` into sigma = 0 is deterministic) and the ``[window]`` planner, exactly
    as the engine decides it (:func:`plan_context`)."""
    context = context or plan_context(recipe, registry)
    planner = build_component(recipe, registry, "window")
    try:
        return int(planner.num_trainable(context))
    except ValueError as exc:
        raise RecipeError(str(exc), where=f"{recipe.source}: [window]") from exc


def window_plans(recipe: Recipe, registry: Registry, context: PlanContext) -> bool:
    """Whether the ``[window]`` planner plans its own windows (a RolloutPlan), as the first
    rollout asks it: what a plan can only find then (a compression without a time warp) is
    refused here, before any model loads."""
    planner = build_component(recipe, registry, "window")
    try:
        return planner.plan(0, list(range(recipe.train.group_size)), context) is not None
    except ValueError as exc:
        raise RecipeError(str(exc), where=f"{recipe.source}: [window]") from exc


def _uses_units(recipe: Recipe, registry: Registry) -> bool:
    """False when the ``[loss]`` is an objective that trains without trajectory log-probs
    (DiffusionNFT): then the sampler may leave nothing trainable and the chunk layout is unused."""
    loss = build_component(recipe, registry, "loss")
    return not (isinstance(loss, Objective) and not loss.uses_units)


def _cross_check(recipe: Recipe, registry: Registry) -> None:
    """Rules that span tables, checked by building the light components (kernel, chunker)."""
    context = plan_context(recipe, registry)
    T = trainable_transitions(recipe, registry, context)
    recipe.num_trainable = T
    plans = window_plans(recipe, registry, context)
    where = f"{recipe.source}: [chunker]"
    _check_sharding(recipe)
    _check_data(recipe, registry)
    _check_reference_copy_needed(recipe, registry)
    _check_memory_knobs(recipe, registry)  # every objective's (NFT's too, which trains no units)
    _check_replay(recipe, registry, T)
    _check_pipeline(recipe, registry)
    _branches_from_profile(recipe, T)
    _check_branches(recipe, registry, context.trainable, plans)
    _check_group_can_differ(recipe, T)
    if recipe.log.eval_steps == 1:
        raise RecipeError("eval_steps = 1: a sampling schedule needs at least 2 steps",
                          where=f"{recipe.source}: [log].eval_steps", hint="use 0 (the sampler's steps) or >= 2")
    if not _uses_units(recipe, registry):
        return
    if T < 1:
        raise RecipeError(
            "the sampler leaves no trainable transition",
            where=f"{recipe.source}: [sampler]",
            hint="use a stochastic kernel with noise > 0, more steps or a wider sde_window "
            "(with image_from = 'x0_hat' the last step is not trainable)",
        )
    if recipe.train.micro_batch_size > recipe.train.prompts_per_iteration * recipe.train.group_size:
        raise RecipeError(
            f"micro_batch_size ({recipe.train.micro_batch_size}) exceeds the samples per iteration "
            f"({recipe.train.prompts_per_iteration} x {recipe.train.group_size})",
            where=f"{recipe.source}: [train].micro_batch_size",
        )
    chunker = build_component(recipe, registry, "chunker")
    if isinstance(chunker, ProfilingChunker) and chunker.needs_model:
        return  # boundaries come from profiling the model at start
    try:
        sizes = chunker.sizes(T)
    except FlowrlError as exc:  # a profile's own message: located in this recipe
        raise type(exc)(exc.message, where=located(recipe, exc.where or "[chunker]"), hint=exc.hint) from exc
    except (ValueError, FileNotFoundError) as exc:
        raise RecipeError(
            f"{exc} (the sampler has T = {T} trainable transitions: steps = {recipe.sampler.steps}, "
            f"image_from = '{recipe.sampler.image_from}')",
            where=where,
        ) from exc
    for i, reward in enumerate(recipe.rewards):
        if reward.chunk_weights and len(reward.chunk_weights) != len(sizes):
            raise RecipeError(
                f"chunk_weights has {len(reward.chunk_weights)} entries but the chunker makes "
                f"{len(sizes)} chunks {list(sizes)}",
                where=f"{recipe.source}: [[rewards]] #{i + 1} ({reward.label}).chunk_weights",
                hint=f"give one weight per chunk, in sampling order (high noise first): {len(sizes)} numbers",
            )


def located(recipe: Recipe, where: str) -> str:
    """``where`` within the recipe file: a component's bare ``[chunker].profile`` becomes
    ``recipes/x.toml: [chunker].profile``."""
    return f"{recipe.source}: {where}" if where.startswith("[") else where


def data_kind(recipe: Recipe, registry: Registry) -> str | None:
    """The kind of offline table the ``[loss]`` trains on (:class:`flowrl.interfaces.TrainsOnData`:
    ``"images"`` or ``"pairs"``), or None for a loss that trains on rollouts."""
    loss = build_component(recipe, registry, "loss")
    return loss.data_kind if isinstance(loss, TrainsOnData) else None


#: how to fix a recipe whose [data] and [loss] disagree
DATA_HINT = ("an offline run names its table in [data] path = \"TABLE.jsonl\" and trains it with [loss] use = 'sft' "
             "(a table of prompt, image) or 'offline_dpo' (prompt, chosen, rejected); docs/objectives.md, "
             "\"Offline SFT and DPO\"")


def _check_data(recipe: Recipe, registry: Registry) -> None:
    """``[data]`` and the ``[loss]`` go together: an offline loss needs a table, a table needs an
    offline loss of its kind, and a row is one sample (``group_size = 1``). The table itself is
    read by :func:`check_startable` (a run's recipe stays loadable after its table is gone)."""
    data, name = recipe.data, recipe.components["loss"].use
    wants = data_kind(recipe, registry)
    if not data.enabled:
        if wants is not None:
            raise RecipeError(f"loss '{name}' trains on an offline table of {wants}, and the recipe names none "
                              "(no [data] path)", where=f"{recipe.source}: [data].path", hint=DATA_HINT)
        return
    if wants is None:
        raise RecipeError(f"[data] names an offline table, but loss '{name}' trains on rollouts and their rewards",
                          where=f"{recipe.source}: [loss]",
                          hint=f"use loss 'sft' or 'offline_dpo' with [data], or remove [data] for an online run")
    if data.kind not in ("auto", wants):
        raise RecipeError(f"kind = '{data.kind}', but loss '{name}' trains on a table of {wants}",
                          where=f"{recipe.source}: [data].kind", hint=DATA_HINT)


def _check_data_table(recipe: Recipe, registry: Registry) -> None:
    """The ``[data]`` table exists, is of the kind the ``[loss]`` trains on (and ``kind`` states),
    every image it names exists, and it holds at least an iteration's rows."""
    data = recipe.data
    if not data.enabled:
        return
    where, name = f"{recipe.source}: [data].path", recipe.components["loss"].use
    if not Path(data.path).is_file():
        raise RecipeError(f"offline data not found: {data.path}", where=where,
                          hint=f"build it from the model's own samples of the TRAINING prompts: `flowrl sample {recipe.source} "
                               "--prompts FILE --seeds 8 --tables -o DIR` writes DIR/best.jsonl and DIR/pairs.jsonl "
                               "(docs/objectives.md, \"Offline SFT and DPO\")")
    try:
        table = read_offline_rows(data.path, where)
    except FlowrlError as exc:
        raise RecipeError(exc.message, where=where, hint=exc.hint or DATA_HINT) from exc
    wants = data_kind(recipe, registry)
    if table.kind != wants or data.kind not in ("auto", table.kind):
        raise RecipeError(f"{data.path} is a table of {table.kind}, but loss '{name}' trains on a table of {wants}"
                          + (f" (and [data].kind = '{data.kind}')" if data.kind != "auto" else ""),
                          where=where, hint=DATA_HINT)
    for column, paths in table.images.items():
        for i, p in enumerate(paths):
            if not p.is_file():
                raise RecipeError(f"{data.path}: row {i + 1}: {column} image not found: {p}", where=where,
                                  hint="relative image paths are read against the table's folder")
    if len(table) < recipe.train.prompts_per_iteration:
        raise RecipeError(f"{data.path} holds {len(table)} rows, fewer than an iteration trains "
                          f"(prompts_per_iteration = {recipe.train.prompts_per_iteration})",
                          where=f"{recipe.source}: [train].prompts_per_iteration",
                          hint=f"at most {len(table)}, or a larger table")


def no_reference_copy_because(recipe: Recipe, registry: Registry | None = None) -> tuple[str, str, str] | None:
    """Why the run keeps no frozen copy of the denoiser as its KL reference, as ``(key, reason,
    how to get one)``, or None when it keeps one: as :class:`flowrl.objectives.kl.KLSettings` and
    :class:`~flowrl.objectives.kl.ReferencePolicy` decide it (a reference only with a loss of
    ``beta > 0`` and a reference KL kind, or an objective that runs one itself and says so,
    :class:`flowrl.interfaces.NeedsReferencePolicy`: DiffusionNFT with ``beta_kl > 0``; a copy
    only without LoRA, whose reference is the base with the adapter off)."""
    loss = recipe.components["loss"].params
    if isinstance(loss, KLRegularised):
        wants = float(loss.beta or 0.0) > 0 and loss.kl != "old_policy_k3"
    else:  # the built objective says whether it runs a reference of its own
        built = build_component(recipe, registry or get_registry(), "loss")
        wants = isinstance(built, NeedsReferencePolicy) and built.needs_reference()
    if not wants:
        return ("[loss].beta", "the [loss] has no KL term to a reference model (beta = 0 or kl = 'old_policy_k3'; "
                "nft: beta_kl = 0)", "give the [loss] beta > 0 and kl = 'flow_grpo' or 'gaussian_exact' (nft: beta_kl > 0)")
    if recipe.train.finetune != "full":
        return ("[train].finetune", f"finetune = '{recipe.train.finetune}': the reference is the base with the "
                "adapter off, not a copy of the weights", "use finetune = 'full'")
    return None


def keeps_reference_copy(recipe: Recipe, registry: Registry | None = None) -> bool:
    """True when training keeps a frozen copy of the denoiser as its KL reference."""
    return no_reference_copy_because(recipe, registry) is None


def _check_reference_copy_needed(recipe: Recipe, registry: Registry) -> None:
    """An objective that declares it needs the reference as a frozen copy
    (:class:`flowrl.interfaces.NeedsReferenceCopy`: GARDO's reference reset) refuses, in its
    ``prepare``, a run that keeps none: only after the model has loaded. Refused here from the
    declaration and the recipe, for every such objective."""
    loss = build_component(recipe, registry, "loss")
    if not (isinstance(loss, NeedsReferenceCopy) and loss.needs_reference_copy):
        return
    why = no_reference_copy_because(recipe, registry)
    if why is None:
        return
    key, reason, fix = why
    name = recipe.components["loss"].use
    raise RecipeError(
        f"loss '{name}' needs its KL reference as a frozen copy of the denoiser (it resets the reference to "
        f"the current weights), and this recipe keeps none: {reason}",
        where=f"{recipe.source}: {key}", hint=f"{fix} with this loss, or use another [loss]",
    )


def _check_memory_knobs(recipe: Recipe, registry: Registry) -> None:
    """[train].reference_on_cpu and .optimizer only where they apply (never silently ignored)."""
    t = recipe.train
    if t.reference_on_cpu:
        if not keeps_reference_copy(recipe, registry):
            raise RecipeError(
                "reference_on_cpu = true, but this recipe keeps no reference copy (only full fine-tuning with a "
                "KL term to a reference does: [loss].beta > 0 and a reference KL kind, or nft's beta_kl > 0; "
                "LoRA's reference is the base with the adapter off)",
                where=f"{recipe.source}: [train].reference_on_cpu", hint="remove it",
            )


def _check_replay(recipe: Recipe, registry: Registry, T: int) -> None:
    """``[replay]`` only where a replayed rollout can be re-weighted exactly (:func:`_refuse_off_policy`);
    a sequence weight no longer than the sampler's T."""
    r, where = recipe.replay, f"{recipe.source}: [replay]"
    if not r.enabled:
        return
    _refuse_off_policy(recipe, registry, "[replay]", f"{where}.size", "set size = 0", "the replay buffer")
    if r.weight_steps > T > 0:
        raise RecipeError(f"weight_steps = {r.weight_steps} exceeds the sampler's T = {T} trainable transitions",
                          where=f"{where}.weight_steps", hint=f"at most {T}; 0 = all")


def _check_pipeline(recipe: Recipe, registry: Registry) -> None:
    """``[pipeline]`` with staleness 1 trains on rollouts of an older policy, corrected like a
    replayed one: refused where replay is refused; and not together with ``[replay]`` (a kept
    rollout's staleness would count iterations, not the policy versions that drew it)."""
    if not recipe.pipeline.enabled:
        return
    where = f"{recipe.source}: [pipeline].staleness"
    _refuse_off_policy(recipe, registry, "[pipeline] staleness = 1", where, "set staleness = 0",
                       "the rollout policy's weights")
    if recipe.replay.enabled:
        raise RecipeError("[pipeline] staleness = 1 and [replay] cannot be combined yet", where=where,
                          hint="set pipeline.staleness = 0 or replay.size = 0")


def _refuse_off_policy(recipe: Recipe, registry: Registry, what: str, where: str, off: str, kept: str) -> None:
    """Training on a rollout sampled by an older policy (``[replay]``, ``[pipeline]``) corrects it
    by re-scoring and importance weights, which needs a ratio-based ``[loss]`` (a plain policy
    loss, which trains through the chunk ratio) whose only memory of the rollout is its
    log-probs (not GRPO-Guard's proposal means), and an unsharded run (its checkpoint keeps
    ``kept``). One message each, naming ``what`` and how to turn it ``off``."""
    loss = build_component(recipe, registry, "loss")
    name = recipe.components["loss"].use
    if isinstance(loss, Objective):
        raise RecipeError(f"{what} needs a ratio-based policy loss; loss '{name}' owns its update "
                          "(its own old policy or anchors, not the rollout's log-probs)", where=where,
                          hint=f"use loss 'clipped', or {off}")
    if isinstance(loss, KeepsRolloutMeans) and loss.keep_means:
        raise RecipeError(f"{what} cannot re-weight loss '{name}': its step ratio uses the rollout's proposal "
                          "means, which an off-policy update would have to re-sample", where=where,
                          hint=f"use loss 'clipped', or {off}")
    if recipe.distributed.strategy == "fsdp2":
        raise RecipeError(f"{what} is not supported with strategy = 'fsdp2' (its sharded checkpoint cannot hold "
                          f"{kept} yet)", where=where, hint="use strategy 'ddp' or 'none'")


def _branches_from_profile(recipe: Recipe, T: int) -> None:
    """``[sampler].branch_profile``: fill in ``branch_steps`` (the ``branch_count`` trainable
    transitions where the profile's l1rel curve is highest, in step order) and ``branch_factors``
    (2 each). A recipe that already names them (the run's own resolved recipe) must name these."""
    s = recipe.sampler
    if not s.branch_profile:
        return
    where = f"{recipe.source}: [sampler].branch_profile"
    data = read_profile(s.branch_profile, where=where)
    curve = trainable_curve(data, "l1rel", T, source=s.branch_profile, where=where)
    positions = [i for i, t in enumerate(data["trainable"]) if t]
    if s.branch_count > len(positions):
        raise RecipeError(f"branch_count = {s.branch_count} exceeds the sampler's {len(positions)} trainable "
                          "transitions", where=f"{recipe.source}: [sampler].branch_count")
    steps = steps_of_highest_dynamics(curve, positions, s.branch_count)
    factors = [2] * s.branch_count
    if (s.branch_steps or s.branch_factors) and (list(s.branch_steps), list(s.branch_factors)) != (steps, factors):
        raise RecipeError(f"branch_steps {list(s.branch_steps)} and branch_factors {list(s.branch_factors)} are not "
                          f"what branch_profile gives ({steps}, {factors})", where=where,
                          hint="give branch_profile or branch_steps, not both")
    s.branch_steps, s.branch_factors = steps, factors


def _check_group_can_differ(recipe: Recipe, T: int) -> None:
    """A rollout with no stochastic step (T = 0: an ODE window) makes a group's samples differ only
    by their starting noise; with the same noise for the whole group they are one image, every
    advantage is 0 and nothing would train."""
    if T == 0 and recipe.train.same_noise_in_group and not recipe.data.enabled:
        raise RecipeError("same_noise_in_group = true with a rollout that adds no noise (no stochastic step): "
                          "every sample of a group would be the same image, so every advantage would be 0",
                          where=f"{recipe.source}: [train].same_noise_in_group",
                          hint="set same_noise_in_group = false (each sample from its own noise)")


def _check_branches(recipe: Recipe, registry: Registry, trainable: torch.Tensor, plans: bool) -> None:
    """Branch rollouts split whole groups on one process, sampled in whole-group sub-batches with
    the sampler's own kernels (not a ``[window]`` plan); a split must leave the copies a
    stochastic step that reaches the image, or they stay one image; and the tree's pruning must
    leave something to train and do what it says (``trainable``: the sampler's trainable steps)."""
    s, G = recipe.sampler, recipe.train.group_size
    if not s.branch_steps:
        return
    where = f"{recipe.source}: [sampler].branch_factors"
    if G % math.prod(s.branch_factors):
        raise RecipeError(
            f"the product of branch_factors ({math.prod(s.branch_factors)}) must divide group_size ({G}): "
            "a group starts from group_size / product roots", where=where)
    if s.batch_size % G:
        raise RecipeError(f"batch_size ({s.batch_size}) must be 0 or a multiple of group_size ({G}) with "
                          "branch rollouts: a group's tree is sampled in one sub-batch",
                          where=f"{recipe.source}: [sampler].batch_size")
    if plans:
        window = recipe.components["window"].use
        raise RecipeError(f"branch rollouts sample with the sampler's kernels and [sampler].sde_window; [window] "
                          f"'{window}' plans its own windows for each rollout", where=f"{recipe.source}: [window]",
                          hint="use [window] use = 'fixed' (with sde_window for the stochastic steps), or drop "
                               "branch_steps")
    steps = [i for i, t in enumerate(trainable.tolist()) if t]
    splits = [b for b, f in zip(s.branch_steps, s.branch_factors) if f > 1]
    if splits and (not steps or splits[-1] > steps[-1]):
        last = (f"the sampler's last stochastic step that reaches the image is step {steps[-1]}" if steps else
                "the sampler has no stochastic step that reaches the image")
        raise RecipeError(
            f"branch step {splits[-1]} splits where no noise is drawn any more: {last}, so the copies "
            "would stay one image (the group's samples would repeat each other)",
            where=f"{recipe.source}: [sampler].branch_steps",
            hint=(f"branch at steps <= {steps[-1]}" if steps else "use a stochastic kernel (e.g. 'flow')")
            + " (image_from = 'x0_hat' leaves the last step's noise out of the image; sde_window bounds the "
              "stochastic steps)")
    if s.branch_keep >= G:
        raise RecipeError(f"branch_keep = {s.branch_keep} keeps every leaf of a group of {G} (width pruning "
                          "would prune nothing)", where=f"{recipe.source}: [sampler].branch_keep",
                          hint=f"keep fewer than group_size = {G} leaves, or branch_keep = 0 for every leaf")
    prune, stop = list(s.branch_prune_steps), max(s.branch_steps)
    if prune and s.branch_prune_slide and prune[0] <= stop:
        raise RecipeError(f"branch_prune_slide = {s.branch_prune_slide} slides the pruned steps earlier until the "
                          f"first is the last branch step ({stop}); branch_prune_steps starts at step {prune[0]}, "
                          "so it would never move", where=f"{recipe.source}: [sampler].branch_prune_slide",
                          hint=f"start branch_prune_steps after step {stop}, or branch_prune_slide = 0")
    # the pruned steps at every position the slide takes them to (pruned_steps in training)
    shifts = range(max(0, prune[0] - stop) + 1 if s.branch_prune_slide else 1) if prune else range(0)
    for shift in shifts:
        if set(steps) <= {p - shift for p in prune}:
            moved = f" (slid {shift} step{'s' if shift != 1 else ''} earlier)" if shift else ""
            raise RecipeError(f"branch_prune_steps{moved} prunes every trainable transition of the sampler "
                              f"(steps {steps[0]} to {steps[-1]}): no transition would be trained",
                              where=f"{recipe.source}: [sampler].branch_prune_steps",
                              hint="prune some of the steps after the last split only")
    if s.branch_advantage == "tree":
        where = f"{recipe.source}: [sampler].branch_advantage"
        if recipe.components["chunker"].use != "step":
            raise RecipeError("branch_advantage = 'tree' gives each transition its own advantage: it needs step "
                              f"units, not chunker '{recipe.components['chunker'].use}'", where=where,
                              hint="set chunker.use = 'step', or branch_advantage = 'leaf'")
        if any(any(r.chunk_weights) for r in recipe.rewards):
            raise RecipeError("branch_advantage = 'tree' fuses one reward per leaf; a reward with chunk_weights "
                              "gives one per chunk", where=where, hint="drop chunk_weights, or branch_advantage = 'leaf'")


def _check_sharding(recipe: Recipe) -> None:
    """What cannot work beside sharded (DTensor) weights, refused before any model loads; the
    optimizer and :meth:`flowrl.train.ema.WeightEMA.attach` would refuse it only after. (With
    strategy 'auto' a launcher may still choose fsdp2: training checks again then.)"""
    if recipe.distributed.strategy != "fsdp2":
        return
    if recipe.train.optimizer == "adamw_8bit":
        raise RecipeError(
            "optimizer = 'adamw_8bit' cannot hold sharded (DTensor) parameters",
            where=f"{recipe.source}: [train].optimizer",
            hint="use 'adamw' with strategy = 'fsdp2' (its AdamW state is sharded already), or strategy 'ddp'/'none'",
        )
    if recipe.ema.enabled and recipe.ema.on_cpu:
        raise RecipeError(
            "[ema] on_cpu = true is not supported with strategy = 'fsdp2': the EMA is sharded like the weights "
            "and lives next to them",
            where=f"{recipe.source}: [ema].on_cpu",
            hint="set on_cpu = false (each process then holds 1/N of the EMA), or use strategy 'ddp'",
        )


def check_startable(recipe: Recipe, registry: Registry | None = None, *, devices: bool = True) -> None:
    """What ``flowrl train`` would otherwise reject only after building the model, checked
    without building it (``flowrl validate`` and ``flowrl train`` both call this): every CUDA
    device the recipe names exists on this machine (``devices``; :func:`check_devices`), every
    prompt file exists and holds a prompt, ``source = "model"`` names a model that ships prompts,
    every key declared required holds a value, every input path exists, every reward that
    declares which prompts it scores accepts the prompt files', and every tracker can be built (a
    tracker checks its extra when it is built)."""
    registry = registry or get_registry()
    if devices:
        check_devices(recipe)
    p = recipe.prompts
    model = recipe.components["model"].use
    for key, source in (("source", p.source), ("eval_source", p.eval_source)):
        if source == "model" and getattr(registry.get("model", model).factory, "ships_prompts", True) is False:
            raise RecipeError(f"model '{model}' has no prompt source of its own", where=f"{recipe.source}: [prompts].{key}",
                              hint="give a prompt file (one prompt a line), a table (.csv, .jsonl, .parquet) or hf:DATASET")
        if not source or source == "model":
            continue
        path = Path(source)
        where = f"{recipe.source}: [prompts].{key}"
        if not path.is_file():
            raise RecipeError(f"prompt file not found: {path}", where=where,
                              hint="give an existing text file (one prompt a line), or 'model'")
        if not any(line.strip() for line in path.read_text(encoding="utf-8", errors="replace").splitlines()):
            raise RecipeError(f"prompt file {path} holds no prompt", where=where)
    _check_required_params(recipe)
    _check_input_paths(recipe)
    _check_prompt_columns(recipe)
    _check_prompt_tables(recipe, registry)
    _check_profiles(recipe, registry)
    _check_data_table(recipe, registry)
    for i in range(len(recipe.trackers)):
        build_component(recipe, registry, "trackers", i)


#: A device value naming a CUDA device: ``cuda`` or ``cuda:N``.
CUDA_DEVICE = re.compile(r"cuda(?::(\d+))?")


def component_tables(recipe: Recipe) -> list[tuple[str, str, ComponentChoice]]:
    """Every component table of the recipe as ``(where, --set prefix, choice)``: ``("[model]",
    "model", ...)``, then each entry of ``[[rewards]]`` and ``[[trackers]]`` (``("[[rewards]] #1
    (geneval)", "rewards.0", ...)``)."""
    tables = [(f"[{section}]", section, choice) for section, choice in recipe.components.items()]
    tables += [(f"[[{section}]] #{i + 1} ({c.use})", f"{section}.{i}", c)
               for section, choices in (("rewards", recipe.rewards), ("trackers", recipe.trackers))
               for i, c in enumerate(choices)]
    return tables


def device_keys(recipe: Recipe) -> list[tuple[str, str, str, bool]]:
    """Every device-valued key of the recipe as ``(where, value, --set key, offset)``:
    ``[run].device``, ``[pipeline].device`` and every component parameter named ``device`` (the
    model-backed rewards' placement). ``offset``: an indexed CUDA device is offset by the
    process's local rank (the rollout process's, :func:`flowrl.train.rollout_worker.rollout_device`)."""
    keys = [(f"[{name}].device", getattr(recipe, name).device, f"{name}.device", name == "pipeline")
            for name in ("run", "pipeline")]
    for where, prefix, choice in component_tables(recipe):
        value = getattr(choice.params, "device", None) if dataclasses.is_dataclass(choice.params) else None
        if isinstance(value, str):
            keys.append((f"{where}.device", value, f"{prefix}.device", False))
    return keys


def cuda_device_count() -> int:
    """The CUDA devices PyTorch sees on this machine; 0 where it sees none (no GPU, no driver, or a
    PyTorch built without CUDA). What validation decides by, in one place (tests set it)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_devices(recipe: Recipe, local_rank: int | None = None) -> None:
    """Every CUDA device the recipe names is one this machine has: a run that asks for a GPU the
    machine lacks is one message before anything is built, not ``AssertionError: Torch not
    compiled with CUDA enabled`` (or an invalid device ordinal) once the model, a reward or the
    rollout process is placed. A bare ``cuda`` is this process's GPU (``cuda:LOCAL_RANK``);
    ``cuda:N`` of a key offset by the local rank (``[pipeline].device``) is ``cuda:(N +
    LOCAL_RANK)``. ``auto`` is never refused (it takes the CPU where there is no GPU: ``flowrl
    validate`` and ``flowrl train`` check the CPU's RAM for it)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0) if local_rank is None else local_rank
    for label, value, key, offset in device_keys(recipe):
        match = CUDA_DEVICE.fullmatch(value)
        if match is None:
            continue
        where = f"{recipe.source}: {label}"
        fix = f"--set {key}=cpu" + (" (or '' for the training process's device)" if key == "pipeline.device" else
                                    " (or 'auto': the GPU where there is one)")
        count = cuda_device_count()
        if not count:
            raise RecipeError(f"device = '{value}' names a CUDA device, and this machine has none "
                              "(torch.cuda.is_available() is false: no GPU, no driver, or a PyTorch built without CUDA)",
                              where=where, hint=f"train on the CPU with {fix}, or on a machine with a GPU")
        named = int(match.group(1) or 0)
        index = named + (local_rank if offset or match.group(1) is None else 0)
        if index >= count:
            shifted = f" (offset by this process's local rank {local_rank})" if index != named else ""
            has = f"cuda:0 to cuda:{count - 1}" if count > 1 else "cuda:0"
            raise RecipeError(f"device = '{value}' is cuda:{index}{shifted}, and this machine has {count} CUDA "
                              f"device{'s' if count != 1 else ''} ({has})", where=where,
                              hint=f"name a device it has, e.g. --set {key}=cuda:{count - 1}; or {fix}")


def _check_required_params(recipe: Recipe) -> None:
    """Every key declared ``param(..., required=True)``, in a plain table or in any component's
    parameters, holds a value: an empty one would stop the run only when the component is built
    (the rewards after the model has loaded)."""
    tables = [(f"[{name}]", name, getattr(recipe, name)) for name in SECTIONS]
    tables += [(where, prefix, choice.params) for where, prefix, choice in component_tables(recipe)]
    for where, prefix, params in tables:
        if not dataclasses.is_dataclass(params):
            continue
        for f in dataclasses.fields(params):
            value = getattr(params, f.name)
            if f.metadata.get("required") and isinstance(value, (str, list, tuple)) and not value:
                raise RecipeError(f"key '{f.name}' is required, and it is empty", where=f"{recipe.source}: {where}.{f.name}",
                                  hint=f"{f.metadata.get('help', '')} Set it in the recipe, or with "
                                       f"--set {prefix}.{f.name}=VALUE".strip())


def _check_input_paths(recipe: Recipe) -> None:
    """Every component's local input file (a param declared ``path=True``: weights, profiles,
    checkpoints) exists, so a mistyped path is one message at validation, not a failure once the
    component is built."""
    for where, _, choice in component_tables(recipe):
        if not dataclasses.is_dataclass(choice.params):
            continue
        for f in dataclasses.fields(choice.params):
            value = getattr(choice.params, f.name)
            if f.metadata.get("path") is True and isinstance(value, str) and value and not Path(value).exists():
                raise RecipeError(f"{f.name} not found: {value}", where=f"{recipe.source}: {where}.{f.name}",
                                  hint="give an existing path (relative to the recipe file), or leave it empty "
                                       "for the default")


def has_columns(source: str) -> bool:
    """Whether a prompt source has named columns: a table (.jsonl, .csv, .tsv, .parquet) or a
    datasets source; not a text file (one prompt a line) nor the model's own prompts."""
    if source == "model":
        return False
    return source.startswith("hf:") or Path(source).is_dir() or Path(source).suffix.lower() in TABLE_SUFFIXES


def _check_prompt_columns(recipe: Recipe) -> None:
    """A key that names a column of the prompt table (split_column, condition_column, a
    text_column other than 'prompt') needs a source with columns: a text file or the model's own
    prompts would ignore it, and a split_column that selects nothing would evaluate on the
    training prompts."""
    p = recipe.prompts
    sources = [p.source] + ([p.eval_source] if p.eval_source else [])
    if any(has_columns(source) for source in sources):
        return
    keys = [("split_column", p.split_column, ""), ("condition_column", p.condition_column, ""),
            ("text_column", p.text_column, "prompt")]
    for key, value, default in keys:
        if value != default:
            kinds = list(dict.fromkeys("the model's own prompts" if x == "model" else f"the text file {x} (one "
                                       "prompt a line)" for x in sources))
            fix = ("give a table with the column (.csv, .jsonl, .parquet) as source" +
                   (", or separate train and evaluation files (source and eval_source)" if key == "split_column" else ""))
            raise RecipeError(f"{key} = {value!r} names a column of a prompt table, and the prompts come from "
                              f"{' and '.join(kinds)}, with no columns", where=f"{recipe.source}: [prompts].{key}",
                              hint=f"{fix}; or {key} = {default!r}")


def _check_prompt_tables(recipe: Recipe, registry: Registry) -> None:
    """Every local prompt file (a model's own prompts and hub datasets are not read here) as
    training and evaluation read it: its columns and splits select at least one prompt, the
    evaluation's pool holds the num_eval prompts it is asked for, and every reward that declares
    which prompts it can score (``accepts_prompt``, :mod:`flowrl.hookspecs`) accepts each one
    (otherwise training fails at its first reward call, after the model loads)."""
    checks = [(r.label, getattr(registry.get("reward", r.use).factory, "accepts_prompt", None)) for r in recipe.rewards]
    checks = [(label, accepts) for label, accepts in checks if accepts is not None]
    p = recipe.prompts
    roles = [("source", p.source, "train")] + ([("eval_source" if p.eval_source else "source",
                                                 p.eval_source or p.source, "eval")] if p.num_eval else [])
    for key, source, role in roles:
        if source == "model" or source.startswith("hf:") or not Path(source).is_file():
            continue
        where = f"{recipe.source}: [prompts].{key}"
        rows = distinct_rows(read_prompts(source, None, where, p, role=role))
        if role == "eval" and p.num_eval > len(rows) and not p.balance_column:  # balanced: round-robin repeats
            split = f" (split = {p.eval_split!r})" if p.split_column else ""
            raise RecipeError(f"num_eval = {p.num_eval}, and the evaluation reads {len(rows)} prompts from "
                              f"{source}{split}", where=f"{recipe.source}: [prompts].num_eval",
                              hint=f"at most {len(rows)} (eval_seeds draws several images of each), or more "
                                   "evaluation prompts")
        for prompt in rows if checks else ():
            for label, accepts in checks:
                try:
                    accepts(str(prompt))
                except ValueError as exc:
                    raise RecipeError(
                        f"reward '{label}' cannot score the prompt {str(prompt)!r} of {source}: {exc}", where=where,
                        hint=f"give prompts that '{label}' can score (with the embedded model: source = \"model\"), "
                             f"or another reward",
                    ) from exc


def profile_keys(recipe: Recipe) -> list[tuple[str, str]]:
    """Every temporal-dynamics profile the recipe reads, as ``(where, path)``:
    ``[sampler].branch_profile`` and each component parameter named ``profile`` or ``*_profile``
    that is an input path (the ``dynamics`` chunker's, the ``weighted`` selector's)."""
    keys = [("[sampler].branch_profile", recipe.sampler.branch_profile)]
    for where, _, choice in component_tables(recipe):
        if dataclasses.is_dataclass(choice.params):
            keys += [(f"{where}.{f.name}", getattr(choice.params, f.name)) for f in dataclasses.fields(choice.params)
                     if f.metadata.get("path") is True and (f.name == "profile" or f.name.endswith("_profile"))]
    return [(where, path) for where, path in keys if isinstance(path, str) and path]


def _check_profiles(recipe: Recipe, registry: Registry) -> None:
    """Each profile the recipe reads describes this sampler: its steps, and its trainable
    transitions (the steps and their number T). A profile of another sampler has another curve
    per transition: its chunks, weights or branch points would belong to other steps; the
    ``weighted`` selector would otherwise find it only at the first update."""
    context = plan_context(recipe, registry)
    steps = [i for i, t in enumerate(context.trainable.tolist()) if t]
    T = recipe.num_trainable or len(steps)
    plans = window_plans(recipe, registry, context)
    for key, path in profile_keys(recipe):
        where = f"{recipe.source}: {key}"
        data = read_profile(path, where=where)
        theirs = [i for i, t in enumerate(data["trainable"]) if t]
        about = (f"{path} profiles a sampler of {len(data['trainable'])} steps with T = {len(theirs)} trainable "
                 f"transitions ({_step_span(theirs)}), and this run samples {recipe.sampler.steps} steps with T = {T}")
        if len(data["trainable"]) != recipe.sampler.steps or len(theirs) != T or (not plans and theirs != steps):
            raise RecipeError(f"{about} ({_step_span(steps)})" if not plans else about, where=where,
                              hint="profile the recipe you train with: `flowrl profile RECIPE -o DIR` (steps, "
                                   "image_from and sde_window decide the trainable transitions)")


def _step_span(steps: list[int]) -> str:
    """``steps 0 to 15`` (or the list, where they are not consecutive)."""
    if not steps:
        return "none"
    if steps == list(range(steps[0], steps[-1] + 1)):
        return f"steps {steps[0]} to {steps[-1]}"
    return f"steps {steps}"


# ----------------------------------------------------------------------------- writing


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def dump_toml(data: dict[str, Any]) -> str:
    """Write a recipe dict (tables of scalars/lists, arrays of tables) as TOML."""
    lines: list[str] = []
    for key, value in data.items():
        if isinstance(value, dict):
            lines.append(f"[{key}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in value.items()]
            lines.append("")
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for entry in value:
                lines.append(f"[[{key}]]")
                lines += [f"{k} = {_toml_value(v)}" for k, v in entry.items()]
                lines.append("")
        else:
            lines.insert(0, f"{key} = {_toml_value(value)}")
    return "\n".join(lines)
