"""``flowrl eval``: score a checkpoint's samples with reward plugins; JSON beside the checkpoint.

::

    flowrl eval runs/chunk_grpo_flux                           # latest checkpoint, the recipe's rewards
    flowrl eval runs/x --reward pickscore --reward clip        # any registered rewards (default params)
    flowrl eval runs/x --steps 50 --hybrid-steps 30 --prompts hpd_test.txt --seeds 4
    flowrl eval recipes/chunk_grpo_flux.toml -o base_eval.json  # the untrained base model

Images are sampled exactly as ``flowrl sample`` does (deterministic ODE, noise seeded by
``(seed, prompt, k)``, optional hybrid inference) and scored by each reward in batches. With
``WORLD_SIZE > 1`` each rank samples and scores its shard and rank 0 gathers the scores: every
image is scored once. The result goes to ``RUN_DIR/checkpoints/<checkpoint>.<name>.json``
(beside the checkpoint directory, so pruning old checkpoints keeps it), or ``-o PATH``::

    {"checkpoint": ..., "iteration": 10, "rewards": {"hpsv3": {"mean": .., "sem": .., "std": ..,
     "min": .., "max": .., "n": ..}}, "per_image": [{"prompt": .., "seed_index": .., "scores": {..}}],
     "settings": {steps, sigmas, seed, seeds_per_prompt, hybrid_steps, ...}}
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import FlowrlError
from .base import (
    CheckpointOpt,
    DeviceOpt,
    NumPromptsOpt,
    PromptOpt,
    ScheduleOpt,
    SeedOpt,
    SetOpt,
    SourceArg,
    app,
    console,
    registry,
)


def build_rewards(src, names: list[str]):
    """``[(label, reward)]``: the named rewards with default params, else the recipe's rewards."""
    reg = registry()
    if names:
        return [(n, reg.get("reward", n, where="--reward").build(None)) for n in names]
    if not src.from_recipe:
        raise FlowrlError("no rewards to evaluate with", where="--reward",
                          hint="pass --reward NAME (repeatable; see `flowrl plugins`), or a run/recipe with [[rewards]]")
    return [(c.label, reg.get("reward", c.use).build(c.params)) for c in src.recipe.rewards]


def summarize(values: list[float]) -> dict[str, float]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    std = math.sqrt(var)
    return {"mean": mean, "std": std, "sem": std / math.sqrt(n), "min": min(values), "max": max(values), "n": n}


def gather_records(records: list[dict], ctx) -> list[dict]:
    if not ctx.enabled:
        return records
    import torch.distributed as dist

    parts: list = [None] * ctx.world_size
    dist.all_gather_object(parts, records)
    return sorted((r for part in parts for r in part), key=lambda r: r["index"])


def default_eval_path(src, name: str) -> Path:
    if src.checkpoint is None:
        raise FlowrlError("without a checkpoint there is nowhere beside it to write", where="-o",
                          hint="pass -o results.json")
    return src.checkpoint.parent / f"{src.checkpoint.name}.{name}.json"


@app.command("eval")
def evaluate(
    source: SourceArg = None,
    set_: SetOpt = None,
    model: Annotated[Optional[str], typer.Option("--model", help="Evaluate a registered model without a recipe (needs --reward).")] = None,
    checkpoint: CheckpointOpt = None,
    reward: Annotated[Optional[list[str]], typer.Option("--reward", "-r", help="A registered reward with default params (repeatable); default: the recipe's rewards.")] = None,
    prompt: PromptOpt = None,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="A text file, one prompt a line (default: the recipe's eval prompts).")] = None,
    num_prompts: NumPromptsOpt = 0,
    seeds: Annotated[int, typer.Option("--seeds", min=1, help="Images per prompt.")] = 1,
    seed: SeedOpt = None,
    steps: Annotated[Optional[int], typer.Option("--steps", min=1, help="Sampling steps (default: the recipe's).")] = None,
    schedule: ScheduleOpt = "auto",
    hybrid_steps: Annotated[int, typer.Option("--hybrid-steps", min=0, help="First K steps from the trained model, the rest from the base.")] = 0,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Images per batch (scores do not depend on it).")] = 8,
    device: DeviceOpt = None,
    name: Annotated[str, typer.Option("--name", help="Result name: <checkpoint>.<name>.json.")] = "eval",
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="JSON path (default: beside the checkpoint).")] = None,
    save_images: Annotated[Optional[Path], typer.Option("--save-images", help="Also write the PNGs to this directory.")] = None,
) -> None:
    """Sample with fixed seeds and score with reward plugins; write JSON beside the checkpoint."""
    from ..interfaces import score
    from .sample import generate, make_items, prepare, read_prompt_list, resolve_sigmas, save_png, shard

    start_time = time.perf_counter()
    src, dev, ctx, policy, base = prepare(source, model, set_, checkpoint, device, hybrid_steps)
    path = output or default_eval_path(src, name)
    rewards = build_rewards(src, list(reward or []))
    plist = read_prompt_list(prompt, prompts, num_prompts, src, policy)
    sigmas = resolve_sigmas(schedule, steps, src, policy).to(dev)
    base_seed = seed if seed is not None else src.recipe.run.seed
    items = make_items(plist, seeds)
    if save_images is not None:
        Path(save_images).mkdir(parents=True, exist_ok=True)
    records = []
    for batch, images in generate(policy, shard(items, ctx.rank, ctx.world_size), sigmas, seed=base_seed,
                                  batch_size=batch_size, hybrid_steps=hybrid_steps, base=base):
        batch_prompts = [it.prompt for it in batch]
        scores = {label: score(r, images, batch_prompts).scores.tolist() for label, r in rewards}
        for j, it in enumerate(batch):
            records.append({"index": it.index, "prompt_index": it.prompt_index, "prompt": it.prompt,
                            "seed_index": it.seed_index, "scores": {k: v[j] for k, v in scores.items()}})
            if save_images is not None:
                save_png(images[j], Path(save_images) / f"{it.prompt_index:05d}_{it.seed_index:02d}.png")
    records = gather_records(records, ctx)
    if not ctx.is_main:
        return
    from ..files import write_text_atomic
    from ..train.checkpoint import checkpoint_iteration

    result = {
        "source": src.label,
        "checkpoint": str(src.checkpoint) if src.checkpoint else None,
        "iteration": checkpoint_iteration(src.checkpoint),
        "rewards": {label: summarize([r["scores"][label] for r in records]) for label, _ in rewards},
        "settings": {
            "model": src.recipe.components["model"].use, "steps": len(sigmas) - 1, "sigmas": sigmas.cpu().tolist(),
            "seed": base_seed, "seeds_per_prompt": seeds, "num_prompts": len(plist),
            "hybrid_steps": hybrid_steps, "world_size": ctx.world_size,
        },
        "per_image": records,
        "elapsed_s": time.perf_counter() - start_time,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(result, indent=1))
    for label, stats in result["rewards"].items():
        console.print(f"{label}: {stats['mean']:.4f} +- {stats['sem']:.4f} (n = {stats['n']})")
    console.print(f"wrote {path}")
