"""``flowrl sample``: images from a trained run, a recipe, or any registered model.

::

    flowrl sample runs/chunk_grpo_flux --prompts prompts.txt --seeds 4          # latest checkpoint
    flowrl sample runs/x --prompt "a red fox" --steps 50 --hybrid-steps 30     # hybrid inference
    flowrl sample --model embedded --set model.random_init=true --prompt "a red circle on a blue background"
    torchrun --nproc_per_node 8 -m flowrl sample runs/x --prompts p.txt          # sharded, no duplicates

Sampling is deterministic ODE (Euler) sampling along the recipe's schedule (or the model's own,
``--schedule model``). Image ``k`` of a prompt starts from noise seeded by ``(seed, prompt, k)``:
the same prompt and seed give the same image whatever the prompt file, batch size or number of
processes. With ``WORLD_SIZE > 1`` item ``j`` goes to rank ``j mod WORLD_SIZE`` (no padding,
no duplicates); rank 0 merges the manifests and draws the grid.

Hybrid inference (the GCPO paper's evaluation): the first ``k`` of ``n`` steps use the trained
model, the remaining steps the base model (the LoRA disabled, or a fresh copy of the base).

Outputs in ``-o DIR``: ``images/PPPPP_KK.png``, ``samples.jsonl`` (one line per image: prompt,
seed index, file), ``grid.png`` (prompts in rows, seeds in columns).

The helpers here (loading a run's policy, the seeded ODE sampler, sharding) are shared by
``flowrl eval`` and ``flowrl export``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..cli import SetOpt, _registry, app, console
from ..errors import FlowrlError

# ------------------------------------------------------------------------------------ sources


@dataclasses.dataclass
class Source:
    """What to sample from: a model (from a recipe, or named), optionally a checkpoint."""

    recipe: Any | None  # flowrl.recipe.Recipe
    model_name: str
    model_params: Any
    checkpoint: Path | None
    run_dir: Path | None
    label: str


def resolve_source(source: Optional[Path], model: Optional[str], overrides: list[str], checkpoint: Optional[Path]) -> Source:
    """A run directory, a checkpoint directory, a recipe file, or ``--model NAME``."""
    from ..checkpoint import latest_checkpoint
    from ..config import from_dict
    from ..recipe import apply_overrides, load_recipe, parse_override, validate

    registry = _registry()
    if source is None:
        if model is None:
            raise FlowrlError("give a run directory, a checkpoint, a recipe, or --model NAME",
                              hint="flowrl sample runs/my_run --prompt '...'  or  flowrl sample --model embedded ...")
        comp = registry.get("model", model, where="--model")
        table: dict[str, Any] = {}
        for text in overrides:
            keys, value = parse_override(text)
            if keys[0] != "model" or len(keys) != 2:
                raise FlowrlError(f"with --model only model.KEY overrides apply, got '{text}'", where="--set")
            table[keys[1]] = value
        params = from_dict(comp.params, table, where=f"--model {model}") if comp.params else None
        if checkpoint is not None:
            raise FlowrlError("--checkpoint needs the run's recipe", where="--checkpoint",
                              hint="pass the run directory (or the checkpoint directory) as SOURCE instead")
        return Source(None, model, params, None, None, model)

    source = Path(source)
    if model is not None:
        raise FlowrlError("give either SOURCE or --model, not both", where="--model")
    run_dir = None
    if source.is_dir() and (source / "state.json").is_file() and (source / "recipe.toml").is_file():
        ckpt, recipe_path = source, source / "recipe.toml"  # a checkpoint directory
        run_dir = source.parent.parent if source.parent.name == "checkpoints" else None
    elif source.is_dir():
        run_dir = source
        recipe_path = source / "recipe.toml"
        if not recipe_path.is_file():
            raise FlowrlError(f"{source} is not a run directory (no recipe.toml)", where="SOURCE",
                              hint="pass a run directory written by `flowrl train`, a checkpoint, or a recipe file")
        ckpt = latest_checkpoint(source)
        if ckpt is not None:
            recipe_path = ckpt / "recipe.toml"
    elif source.suffix == ".toml":
        recipe_path, ckpt = source, None
    else:
        raise FlowrlError(f"not found: {source}", where="SOURCE",
                          hint="a run directory, a checkpoint directory, or a .toml recipe")
    if checkpoint is not None:
        ckpt = Path(checkpoint)
        if not (ckpt / "state.json").is_file():
            raise FlowrlError(f"{ckpt} is not a checkpoint directory (no state.json)", where="--checkpoint")
    recipe = load_recipe(recipe_path, overrides, registry=registry)
    choice = recipe.components["model"]
    label = source.name if ckpt is None else f"{(run_dir or ckpt).name}/{ckpt.name}"
    return Source(recipe, choice.use, choice.params, ckpt, run_dir, label)


def build_model(src: Source):
    return _registry().get("model", src.model_name).build(src.model_params)


def checkpoint_iteration(ckpt: Path | None) -> int | None:
    if ckpt is None:
        return None
    return int(json.loads((ckpt / "state.json").read_text()).get("iteration", -1))


def load_policy(src: Source, device):
    """Build the model and load the checkpoint's trainable weights (LoRA or full) into it.

    Returns the model on ``device``, in inference mode (nothing requires grad).
    """
    import torch

    from ..finetune import load_trainable_state_dict, prepare_trainable

    model = build_model(src)
    if src.checkpoint is not None:
        from safetensors.torch import load_file

        prepare_trainable(model, src.recipe.train)
        state = load_file(str(src.checkpoint / "model.safetensors"))
        load_trainable_state_dict(model.denoiser, state)
        model.denoiser.requires_grad_(False)
    model.to(torch.device(device))
    return model


# ------------------------------------------------------------------------------------ sampling


def read_prompt_list(prompt: Optional[list[str]], prompts_file: Optional[Path], num_prompts: int, src: Source, model) -> list[str]:
    from ..engine import read_prompts

    if prompt and prompts_file:
        raise FlowrlError("give --prompt or --prompts, not both", where="--prompt")
    if prompt:
        out = list(prompt)
    elif prompts_file is not None:
        out = read_prompts(str(prompts_file), model, "--prompts")
    elif src.recipe is not None:
        pr = src.recipe.prompts
        out = read_prompts(pr.eval_source or pr.source, model, f"{src.recipe.source}: [prompts]")
    else:
        own = model.prompt_source()
        if not own:
            raise FlowrlError("no prompts: the model has no prompt source", where="--prompt",
                              hint="pass --prompt TEXT (repeatable) or --prompts FILE")
        out = list(own)
    return out[:num_prompts] if num_prompts else out


def resolve_sigmas(schedule: str, steps: Optional[int], src: Source, model):
    """The sampling schedule ``[N + 1]``: 'auto' = the recipe's schedule (or, without a recipe,
    the model's own, else the default schedule), 'model' = the model's own, or a schedule name."""
    import torch

    registry = _registry()
    n = steps or (src.recipe.sampler.steps if src.recipe is not None else 28)
    if schedule == "auto":
        if src.recipe is not None:
            choice = src.recipe.components["schedule"]
            sched = registry.get("schedule", choice.use).build(choice.params)
        elif model.sigmas(n) is not None:
            sched = registry.get("schedule", "model").build()
        else:
            sched = registry.get("schedule", registry.default("schedule")).build()
    else:
        sched = registry.get("schedule", schedule, where="--schedule").build()
    return sched.sigmas(n, model).to(torch.float32)


def shard(items: list, rank: int, world_size: int) -> list:
    """Items ``j`` with ``j mod world_size == rank``: every item exactly once over all ranks."""
    return items[rank::world_size]


def noise_for(model, seed: int, prompt: str, k: int):
    """The starting noise of image ``k`` of ``prompt``: independent of batching and sharding."""
    import torch

    from ..seeding import generator

    return torch.randn(model.latent_shape, generator=generator(seed, "sample", prompt, k))


def ode_sample(velocity_for_step, noise, sigmas):
    """Euler ODE sampling; ``velocity_for_step(i)`` gives the velocity function of step ``i``."""
    import torch

    from ..sde import ode_step

    x = noise.to(torch.float32)
    b = x.shape[0]
    with torch.no_grad():
        for i in range(len(sigmas) - 1):
            s, s_next = sigmas[i].expand(b), sigmas[i + 1].expand(b)
            v = velocity_for_step(i)(x, s)
            x = ode_step(v, x, s, s_next).next_sample
    return x


def base_model_for_hybrid(src: Source, model, device):
    """The base model for hybrid inference: the same model with LoRA disabled when it supports
    ``reference_velocity``; otherwise a second copy built without the checkpoint."""
    if src.recipe is not None and src.recipe.train.finetune == "lora" and callable(getattr(model, "reference_velocity", None)):
        return None  # use model.reference_velocity
    import torch

    base = build_model(src)
    base.to(torch.device(device))
    return base


@dataclasses.dataclass
class Item:
    index: int
    prompt_index: int
    prompt: str
    seed_index: int


def generate(model, items: list[Item], sigmas, *, seed: int, batch_size: int, hybrid_steps: int = 0, base=None):
    """Yield ``(batch_items, images [b, 3, H, W])`` for ``items`` in batches of ``batch_size``."""
    import torch

    from ..engine import PromptCache

    cache = PromptCache(model)
    device = sigmas.device
    n = len(sigmas) - 1
    for start in range(0, len(items), batch_size):
        batch = items[start : start + batch_size]
        text = cache.get([it.prompt for it in batch])
        noise = torch.stack([noise_for(model, seed, it.prompt, it.seed_index) for it in batch]).to(device)

        def velocity_for_step(i, text=text):
            if hybrid_steps and i >= hybrid_steps:
                if base is None:
                    return lambda x, s: model.reference_velocity(x, s, text)
                return lambda x, s: base.velocity(x, s, text)
            return lambda x, s: model.velocity(x, s, text)

        if hybrid_steps > n:
            raise FlowrlError(f"--hybrid-steps {hybrid_steps} exceeds the {n} sampling steps", where="--hybrid-steps")
        x = ode_sample(velocity_for_step, noise, sigmas)
        yield batch, model.decode(x).float().cpu()


def make_items(prompts: list[str], seeds: int) -> list[Item]:
    items = []
    for p, prompt in enumerate(prompts):
        for k in range(seeds):
            items.append(Item(len(items), p, prompt, k))
    return items


def dist_context(device):
    from .. import distributed

    return distributed.setup(device)


def barrier(ctx) -> None:
    if ctx.enabled:
        import torch.distributed as dist

        dist.barrier()


def prepare(source, model_name, set_, checkpoint, device, hybrid_steps):
    """Resolve the source, load the policy (and the base for hybrid inference)."""
    from ..engine import resolve_device

    src = resolve_source(source, model_name, list(set_ or []), checkpoint)
    dev_name = device or (src.recipe.run.device if src.recipe is not None else "auto")
    dev = resolve_device(dev_name)
    ctx = dist_context(dev)
    if dev.type == "cuda" and dev.index is None:
        import torch

        dev = torch.device("cuda", ctx.local_rank)
    if hybrid_steps and src.checkpoint is None:
        raise FlowrlError("--hybrid-steps needs a trained checkpoint (a run or checkpoint directory)", where="--hybrid-steps")
    model = load_policy(src, dev)
    base = base_model_for_hybrid(src, model, dev) if hybrid_steps else None
    return src, dev, ctx, model, base


# ------------------------------------------------------------------------------------ command


@app.command()
def sample(
    source: Annotated[Optional[Path], typer.Argument(help="A run directory (latest checkpoint), a checkpoint directory, or a recipe.")] = None,
    set_: SetOpt = None,
    model: Annotated[Optional[str], typer.Option("--model", help="Sample a registered model without a recipe (params via --set model.KEY=VALUE).")] = None,
    checkpoint: Annotated[Optional[Path], typer.Option("--checkpoint", help="A specific checkpoint directory of the run.")] = None,
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", "-p", help="A prompt (repeatable).")] = None,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="A text file, one prompt a line.")] = None,
    num_prompts: Annotated[int, typer.Option("--num-prompts", min=0, help="Use the first N prompts (0 = all).")] = 0,
    seeds: Annotated[int, typer.Option("--seeds", min=1, help="Images per prompt (seed indices 0..K-1).")] = 1,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Base seed (default: the recipe's run.seed, else 42).")] = None,
    steps: Annotated[Optional[int], typer.Option("--steps", min=1, help="Sampling steps (default: the recipe's, else 28).")] = None,
    schedule: Annotated[str, typer.Option("--schedule", help="'auto' (recipe's, else the model's own), 'model', or a schedule name.")] = "auto",
    hybrid_steps: Annotated[int, typer.Option("--hybrid-steps", min=0, help="First K steps from the trained model, the rest from the base model.")] = 0,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Images per batch (results do not depend on it).")] = 8,
    device: Annotated[Optional[str], typer.Option("--device", help="'auto', 'cpu', 'cuda' (default: the recipe's run.device).")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output directory (default RUN_DIR/samples/<checkpoint> or samples/<name>).")] = None,
    grid: Annotated[bool, typer.Option("--grid/--no-grid", help="Write grid.png.")] = True,
) -> None:
    """Sample images with fixed per-prompt seeds (ODE), optionally hybrid trained/base."""
    from ..runlog import image_grid

    src, dev, ctx, policy, base = prepare(source, model, set_, checkpoint, device, hybrid_steps)
    plist = read_prompt_list(prompt, prompts, num_prompts, src, policy)
    sigmas = resolve_sigmas(schedule, steps, src, policy).to(dev)
    base_seed = seed if seed is not None else (src.recipe.run.seed if src.recipe is not None else 42)
    out = output or default_output(src, "samples")
    (out / "images").mkdir(parents=True, exist_ok=True)
    items = make_items(plist, seeds)
    mine = shard(items, ctx.rank, ctx.world_size)
    records = []
    for batch, images in generate(policy, mine, sigmas, seed=base_seed, batch_size=batch_size,
                                  hybrid_steps=hybrid_steps, base=base):
        for it, img in zip(batch, images):
            name = f"images/{it.prompt_index:05d}_{it.seed_index:02d}.png"
            save_png(img, out / name)
            records.append({"index": it.index, "prompt_index": it.prompt_index, "prompt": it.prompt,
                            "seed_index": it.seed_index, "file": name})
    manifest = out / (f"samples.rank{ctx.rank}.jsonl" if ctx.enabled else "samples.jsonl")
    write_jsonl(manifest, records)
    barrier(ctx)
    if ctx.is_main:
        if ctx.enabled:
            records = merge_rank_manifests(out, ctx.world_size)
        settings = {"source": src.label, "checkpoint": str(src.checkpoint) if src.checkpoint else None,
                    "model": src.model_name, "steps": len(sigmas) - 1, "sigmas": sigmas.cpu().tolist(),
                    "seed": base_seed, "seeds_per_prompt": seeds, "hybrid_steps": hybrid_steps,
                    "num_images": len(records)}
        (out / "settings.json").write_text(json.dumps(settings, indent=1))
        if grid and records:
            grid_png(out, records, seeds, image_grid)
        console.print(f"wrote {len(records)} images to {out}")


def default_output(src: Source, kind: str) -> Path:
    if src.run_dir is not None and src.checkpoint is not None:
        return src.run_dir / kind / src.checkpoint.name
    return Path(kind) / src.label.replace("/", "_").removesuffix(".toml")


def save_png(img, path: Path) -> None:
    import torch
    from PIL import Image

    arr = (img.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    Image.fromarray(arr).save(path)


def write_jsonl(path: Path, records: list[dict]) -> None:
    from ..checkpoint import write_text_atomic

    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in records))


def merge_rank_manifests(out: Path, world_size: int) -> list[dict]:
    records = []
    for r in range(world_size):
        part = out / f"samples.rank{r}.jsonl"
        records += [json.loads(line) for line in part.read_text().splitlines() if line.strip()]
        part.unlink()
    records.sort(key=lambda rec: rec["index"])
    write_jsonl(out / "samples.jsonl", records)
    return records


def grid_png(out: Path, records: list[dict], seeds: int, image_grid, max_images: int = 64) -> Path:
    import numpy as np
    import torch
    from PIL import Image

    shown = records[:max_images]
    images = torch.stack([
        torch.from_numpy(np.array(Image.open(out / r["file"]).convert("RGB"))).permute(2, 0, 1).float() / 255
        for r in shown
    ])
    caps = [f"{r['prompt'][:24]}\nseed {r['seed_index']}" for r in shown]
    scale = max(1, 128 // images.shape[-1])
    path = out / "grid.png"
    image_grid(images, caps, columns=min(seeds, 8) if seeds > 1 else min(len(shown), 8), scale=scale).save(path)
    return path
