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
seed index, file), ``grid.png`` (prompts in rows, seeds in columns, captions wrapped).

``--ema`` samples the checkpoint's EMA weights (``[ema]`` in the recipe). ``--compare-base``
also samples the base model (no checkpoint) from the same noise into ``base/PPPPP_KK.png`` and
draws ``compare.png``: one row per prompt, base and trained side by side for each seed. The two
models are loaded one after the other, never both at once.

The helpers here (resolving what to sample from, loading its policy, the seeded items,
sharding) are shared by ``flowrl eval`` and ``flowrl export``; the policy itself is loaded by
:class:`flowrl.train.session.Session` and sampled with :func:`flowrl.train.evaluate.ode_sample`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

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

if TYPE_CHECKING:
    from ..recipe import Recipe

# ------------------------------------------------------------------------------------ sources


@dataclasses.dataclass
class Source:
    """What to sample from: a recipe (a run's, a file, or a minimal one for ``--model NAME``),
    and optionally a checkpoint whose trained weights are loaded."""

    recipe: Recipe
    from_recipe: bool  # False for --model NAME (defaults then come from the model, not a recipe)
    checkpoint: Path | None
    run_dir: Path | None
    label: str


def resolve_source(source: Optional[Path], model: Optional[str], overrides: list[str], checkpoint: Optional[Path]) -> Source:
    """A run directory, a checkpoint directory, a recipe file, or ``--model NAME``."""
    from ..recipe import load_recipe
    from ..train.checkpoint import MARKER, latest_checkpoint

    if source is None:
        if model is None:
            raise FlowrlError("give a run directory, a checkpoint, a recipe, or --model NAME",
                              hint="flowrl sample runs/my_run --prompt '...'  or  flowrl sample --model embedded ...")
        if checkpoint is not None:
            raise FlowrlError("--checkpoint needs the run's recipe", where="--checkpoint",
                              hint="pass the run directory (or the checkpoint directory) as SOURCE instead")
        return Source(model_recipe(model, overrides), False, None, None, model)

    source = Path(source)
    if model is not None:
        raise FlowrlError("give either SOURCE or --model, not both", where="--model")
    run_dir = None
    if source.is_dir() and (source / MARKER).is_file() and (source / "recipe.toml").is_file():
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
        if not (ckpt / MARKER).is_file():
            raise FlowrlError(f"{ckpt} is not a checkpoint directory (no {MARKER})", where="--checkpoint")
    recipe = load_recipe(recipe_path, overrides, registry=registry())
    label = source.name if ckpt is None else f"{(run_dir or ckpt).name}/{ckpt.name}"
    return Source(recipe, True, ckpt, run_dir, label)


def model_recipe(model: str, overrides: list[str]) -> Recipe:
    """A minimal recipe for ``--model NAME``: that model (``--set model.KEY=VALUE`` only), the
    default components, no rewards."""
    from ..recipe import apply_overrides, parse_override, validate

    data: dict = {"model": {"use": model}}
    for text in overrides:
        keys, _ = parse_override(text)
        if keys[0] != "model" or len(keys) != 2:
            raise FlowrlError(f"with --model only model.KEY overrides apply, got '{text}'", where="--set")
    apply_overrides(data, overrides)
    return validate(data, source=f"--model {model}", registry=registry(), require_rewards=False)


def load_policy(src: Source, device):
    """The model with the checkpoint's trained weights (when there is one), on ``device``;
    nothing requires grad. Loaded by :class:`flowrl.train.session.Session`, as training loads it."""
    from ..train.session import Session

    session = Session.open(src.recipe, registry(), device=device, rewards=False, trackers=False)
    if src.checkpoint is not None:
        session.load_policy(src.checkpoint)
    return session.model


def base_model_for_hybrid(src: Source, model, device):
    """The base model for hybrid inference: None when ``model`` runs its own base (a LoRA run
    whose adapter can be disabled, :class:`flowrl.interfaces.HasReferencePolicy`); otherwise a
    second copy built without the checkpoint."""
    from ..interfaces import HasReferencePolicy

    if src.recipe.train.finetune == "lora" and isinstance(model, HasReferencePolicy):
        return None
    return load_policy(dataclasses.replace(src, checkpoint=None), device)


# ------------------------------------------------------------------------------------ sampling


def read_prompt_list(prompt: Optional[list[str]], prompts_file: Optional[Path], num_prompts: int, src: Source, model) -> list[str]:
    from ..prompts import read_prompts

    if prompt and prompts_file:
        raise FlowrlError("give --prompt or --prompts, not both", where="--prompt")
    if prompt:
        out = list(prompt)
    elif prompts_file is not None:  # a table's columns (and eval split) as the recipe names them
        out = read_prompts(str(prompts_file), model, "--prompts", src.recipe.prompts if src.from_recipe else None,
                           role="eval")
    elif src.from_recipe:
        pr = src.recipe.prompts
        out = read_prompts(pr.eval_source or pr.source, model, f"{src.recipe.source}: [prompts]", pr, role="eval")
    else:
        own = model.prompt_source()
        if not own:
            raise FlowrlError("no prompts: the model has no prompt source", where="--prompt",
                              hint="pass --prompt TEXT (repeatable) or --prompts FILE")
        out = list(own)
    return list(out[:num_prompts] if num_prompts else out)


def resolve_sigmas(schedule: str, steps: Optional[int], src: Source, model):
    """The sampling schedule ``[N + 1]``: 'auto' = the recipe's schedule (or, without a recipe,
    the model's own, else the default schedule), 'model' = the model's own, or a schedule name."""
    import torch

    reg = registry()
    n = steps or (src.recipe.sampler.steps if src.from_recipe else 28)
    if schedule == "auto":
        if src.from_recipe:
            choice = src.recipe.components["schedule"]
            sched = reg.get("schedule", choice.use).build(choice.params)
        elif model.sigmas(n) is not None:
            sched = reg.get("schedule", "model").build()
        else:
            sched = reg.get("schedule", reg.default("schedule")).build()
    else:
        sched = reg.get("schedule", schedule, where="--schedule").build()
    return sched.sigmas(n, model).to(torch.float32)


def shard(items: list, rank: int, world_size: int) -> list:
    """Items ``j`` with ``j mod world_size == rank``: every item exactly once over all ranks."""
    return items[rank::world_size]


def noise_for(model, seed: int, prompt: str, k: int):
    """The starting noise of image ``k`` of ``prompt``: independent of batching and sharding."""
    import torch

    from ..seeding import generator

    return torch.randn(model.latent_shape, generator=generator(seed, "sample", prompt, k))


@dataclasses.dataclass
class Item:
    index: int
    prompt_index: int
    prompt: str
    seed_index: int


def generate(model, items: list[Item], sigmas, *, seed: int, batch_size: int, hybrid_steps: int = 0, base=None,
             noise_of=None):
    """Yield ``(batch_items, images [b, 3, H, W])`` for ``items`` in batches of ``batch_size``:
    the first ``hybrid_steps`` steps (all, when 0) with ``model``, the rest with ``base`` (or,
    when ``base`` is None, with ``model.reference_velocity``). ``noise_of(item)`` gives an
    item's starting noise (default: :func:`noise_for`, keyed by seed, prompt and seed index)."""
    import torch

    from ..train.evaluate import ode_sample
    from ..train.session import PromptCache

    cache, device, n = PromptCache(model), sigmas.device, len(sigmas) - 1
    if hybrid_steps > n:
        raise FlowrlError(f"--hybrid-steps {hybrid_steps} exceeds the {n} sampling steps", where="--hybrid-steps")
    late = (model.reference_velocity if base is None else base.velocity) if hybrid_steps else None
    for start in range(0, len(items), batch_size):
        batch = items[start : start + batch_size]
        text = cache.get([it.prompt for it in batch])
        noise = torch.stack([noise_of(it) if noise_of else noise_for(model, seed, it.prompt, it.seed_index)
                             for it in batch]).to(device)

        def velocity_at(i, x, s, text=text):
            return (late if hybrid_steps and i >= hybrid_steps else model.velocity)(x, s, text)

        yield batch, model.decode(ode_sample(velocity_at, noise, sigmas)).float().cpu()


def make_items(prompts: list[str], seeds: int) -> list[Item]:
    items = []
    for p, prompt in enumerate(prompts):
        for k in range(seeds):
            items.append(Item(len(items), p, prompt, k))
    return items


def barrier(ctx) -> None:
    if ctx.enabled:
        import torch.distributed as dist

        dist.barrier()


def dist_context(device):
    """Join the process group when launched with several processes (torchrun, accelerate)."""
    from .. import distributed

    return distributed.setup(device)


def prepare(source, model_name, set_, checkpoint, device, hybrid_steps, ema: bool = False, compare_base: bool = False):
    """Resolve the source, start the processes, load the policy (its EMA weights with ``ema``;
    and the base for hybrid inference)."""
    from .. import distributed

    src = resolve_source(source, model_name, list(set_ or []), checkpoint)
    dev = distributed.resolve_device(device or src.recipe.run.device)
    ctx = dist_context(dev)
    dev = distributed.process_device(dev, ctx)
    for flag, wanted in (("--hybrid-steps", hybrid_steps), ("--ema", ema), ("--compare-base", compare_base)):
        if wanted and src.checkpoint is None:
            raise FlowrlError(f"{flag} needs a trained checkpoint (a run or checkpoint directory)", where=flag)
    model = load_policy(src, dev)
    if ema:
        from ..train.ema import load_ema_weights

        load_ema_weights(model.denoiser, src.checkpoint)
    base = base_model_for_hybrid(src, model, dev) if hybrid_steps else None
    return src, dev, ctx, model, base


# ------------------------------------------------------------------------------------ command


@app.command()
def sample(
    source: SourceArg = None,
    set_: SetOpt = None,
    model: Annotated[Optional[str], typer.Option("--model", help="Sample a registered model without a recipe (params via --set model.KEY=VALUE).")] = None,
    checkpoint: CheckpointOpt = None,
    prompt: PromptOpt = None,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="A text file, one prompt a line.")] = None,
    num_prompts: NumPromptsOpt = 0,
    seeds: Annotated[int, typer.Option("--seeds", min=1, help="Images per prompt (seed indices 0..K-1).")] = 1,
    seed: SeedOpt = None,
    steps: Annotated[Optional[int], typer.Option("--steps", min=1, help="Sampling steps (default: the recipe's, else 28).")] = None,
    schedule: ScheduleOpt = "auto",
    hybrid_steps: Annotated[int, typer.Option("--hybrid-steps", min=0, help="First K steps from the trained model, the rest from the base model.")] = 0,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Images per batch (results do not depend on it).")] = 8,
    device: DeviceOpt = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output directory (default RUN_DIR/samples/<checkpoint> or samples/<name>).")] = None,
    grid: Annotated[bool, typer.Option("--grid/--no-grid", help="Write grid.png.")] = True,
    ema: Annotated[bool, typer.Option("--ema", help="Sample the checkpoint's EMA weights (runs with [ema] enabled).")] = False,
    compare_base: Annotated[bool, typer.Option(
        "--compare-base", help="Also sample the base model from the same noise; compare.png shows base | trained.")] = False,
) -> None:
    """Sample images with fixed per-prompt seeds (ODE), optionally hybrid trained/base."""
    from ..runlog import image_grid

    src, dev, ctx, policy, base = prepare(source, model, set_, checkpoint, device, hybrid_steps, ema, compare_base)
    plist = read_prompt_list(prompt, prompts, num_prompts, src, policy)
    sigmas = resolve_sigmas(schedule, steps, src, policy).to(dev)
    base_seed = seed if seed is not None else src.recipe.run.seed
    out = output or default_output(src, "samples")
    (out / "images").mkdir(parents=True, exist_ok=True)
    items = make_items(plist, seeds)
    mine = shard(items, ctx.rank, ctx.world_size)
    records = write_images(generate(policy, mine, sigmas, seed=base_seed, batch_size=batch_size,
                                    hybrid_steps=hybrid_steps, base=base), out, "images")
    if compare_base:
        del policy, base  # one model in memory at a time
        base_model = load_policy(dataclasses.replace(src, checkpoint=None), dev)
        write_images(generate(base_model, mine, sigmas, seed=base_seed, batch_size=batch_size), out, "base")
    manifest = out / (f"samples.rank{ctx.rank}.jsonl" if ctx.enabled else "samples.jsonl")
    write_jsonl(manifest, records)
    barrier(ctx)
    if ctx.is_main:
        if ctx.enabled:
            records = merge_rank_manifests(out, ctx.world_size)
        settings = {"source": src.label, "checkpoint": str(src.checkpoint) if src.checkpoint else None,
                    "model": src.recipe.components["model"].use, "steps": len(sigmas) - 1, "sigmas": sigmas.cpu().tolist(),
                    "seed": base_seed, "seeds_per_prompt": seeds, "hybrid_steps": hybrid_steps,
                    "num_images": len(records), "ema": ema, "compare_base": compare_base}
        (out / "settings.json").write_text(json.dumps(settings, indent=1))
        if grid and records:
            grid_png(out, records, seeds, image_grid)
        if compare_base and records:
            compare_png(out, records, seeds, src.label, image_grid)
        console.print(f"wrote {len(records)} images to {out}")


def write_images(batches, out: Path, folder: str) -> list[dict]:
    """Save every generated image as ``folder/PPPPP_KK.png``; the manifest records."""
    (out / folder).mkdir(parents=True, exist_ok=True)
    records = []
    for batch, images in batches:
        for it, img in zip(batch, images):
            name = f"{folder}/{it.prompt_index:05d}_{it.seed_index:02d}.png"
            save_png(img, out / name)
            records.append({"index": it.index, "prompt_index": it.prompt_index, "prompt": it.prompt,
                            "seed_index": it.seed_index, "file": name, **condition_record(it.prompt)})
    return records


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
    from ..files import write_text_atomic

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


def condition_record(prompt) -> dict:
    """``{"condition": path}`` for a prompt that carries a condition image (image editing), else ``{}``."""
    from ..prompts import condition_of

    path = condition_of(prompt)
    return {"condition": path} if path else {}


def read_png(path: Path):
    """An image file as a ``[3, H, W]`` float tensor in [0, 1]."""
    import numpy as np
    import torch
    from PIL import Image

    return torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1).float() / 255


def grid_png(out: Path, records: list[dict], seeds: int, image_grid, max_images: int = 64) -> Path:
    """``grid.png``: the first ``max_images`` images, each captioned with its whole prompt
    (wrapped at spaces) and seed; for image editing, each prompt's condition image first in its row."""
    import torch

    from ..prompts import PromptRow
    from ..runlog import with_condition

    shown = records[:max_images]
    images = torch.stack([read_png(out / r["file"]) for r in shown])
    caps = [f"{r['prompt']}\nseed {r['seed_index']}" for r in shown]
    columns = min(seeds, 8) if seeds > 1 else min(len(shown), 8)
    if any("condition" in r for r in shown) and seeds > 1:  # editing: each prompt's condition first in its row
        parts = [with_condition(images[i : i + seeds], caps[i : i + seeds],
                                PromptRow(shown[i]["prompt"], shown[i].get("condition")))
                 for i in range(0, len(shown), seeds)]
        images, caps, columns = torch.cat([im for im, _ in parts]), sum((c for _, c in parts), []), min(seeds, 8) + 1
    path = out / "grid.png"
    image_grid(images, caps, columns=columns).save(path)
    return path


def compare_png(out: Path, records: list[dict], seeds: int, label: str, image_grid, max_prompts: int = 16) -> Path:
    """``compare.png``: one row per prompt (its text on the left), base and trained side by side
    for each seed, from the same starting noise."""
    import torch

    shown = [r for r in records if r["prompt_index"] < max_prompts]
    tiles, caps = [], []
    for r in shown:
        tiles += [read_png(out / r["file"].replace("images/", "base/", 1)), read_png(out / r["file"])]
        caps += [f"base, seed {r['seed_index']}", f"trained, seed {r['seed_index']}"]
    prompts = list(dict.fromkeys(r["prompt"] for r in shown))
    path = out / "compare.png"
    image_grid(torch.stack(tiles), caps, columns=2 * seeds, row_labels=prompts,
               title=f"base model vs trained ({label}): the same prompt and starting noise in each pair").save(path)
    return path
