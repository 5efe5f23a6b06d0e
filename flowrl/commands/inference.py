"""What ``flowrl sample``, ``flowrl eval`` and ``flowrl export`` share: resolving what to sample
from (a run, a checkpoint, a recipe or a registered model), loading its policy (and the base
model for hybrid inference), the prompts, the sigmas, the seeded items and their sharding over
processes, and generating and saving their images.

The policy itself is loaded by :class:`flowrl.train.session.Session` and sampled with
:func:`flowrl.sampling.rollout.ode_sample`. No command module imports another: what they share
lives here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from ..errors import FlowrlError
from .base import registry

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


def refuse_run_without_checkpoint(source: Optional[Path], checkpoint: Optional[Path], verb: str,
                                  base_command: str) -> None:
    """A run directory before its first checkpoint has no trained weights: to ``verb`` it
    (evaluate, sample) would use the base model under the run's name. ``base_command``: how to
    do it with the base model instead, ``{recipe}`` standing for the run's recipe."""
    from ..train.checkpoint import MARKER, latest_checkpoint

    if source is None or checkpoint is not None:
        return
    path = Path(source)
    if not path.is_dir() or (path / MARKER).is_file() or not (path / "recipe.toml").is_file():
        return
    if latest_checkpoint(path) is None:
        raise FlowrlError(
            f"{path} has no checkpoint yet, so there are no trained weights to {verb}", where="SOURCE",
            hint=f"wait for its first checkpoint ([checkpoint].every), or {verb} the base model with "
                 f"`{base_command.format(recipe=path / 'recipe.toml')}`",
        )


def resolve_source(source: Optional[Path], model: Optional[str], overrides: list[str], checkpoint: Optional[Path]) -> Source:
    """A run directory, a checkpoint directory, a recipe file, or ``--model NAME``."""
    from ..recipe import load_recipe
    from ..train.checkpoint import MARKER, checkpoint_damage, damaged_file_error, latest_checkpoint

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
        what = "not found" if not source.exists() else "is a file but not a .toml recipe"
        raise FlowrlError(f"{source}: {what}", where="SOURCE",
                          hint="a run directory, a checkpoint directory, or a .toml recipe")
    if checkpoint is not None:
        ckpt = Path(checkpoint)
        if not (ckpt / MARKER).is_file():
            raise FlowrlError(f"{ckpt} is not a checkpoint directory (no {MARKER})", where="--checkpoint")
    damage = checkpoint_damage(ckpt) if ckpt is not None else None
    if damage is not None:  # before any model loads or anything is written
        raise damaged_file_error(*damage)
    # Sampling, evaluation and export load the text encoders and encode prompts as they come, from
    # a run that trained from a prompt store too: their prompts (--prompt, a suite) need not be in
    # it, and an exported pipeline needs its encoders.
    recipe = load_recipe(recipe_path, [*overrides, "prompts.embeddings=''"], registry=registry())
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


def check_prompts_scorable(uses: list[str], prompts: list[str], where: str = "--prompt") -> None:
    """Every reward among ``uses`` that declares which prompts it can score (``accepts_prompt``,
    :mod:`flowrl.hookspecs`) accepts each prompt: checked before any image is sampled (as
    ``flowrl validate`` checks a recipe's prompt files), not at the first reward call."""
    reg = registry()
    for use in dict.fromkeys(uses):
        accepts = getattr(reg.get("reward", use).factory, "accepts_prompt", None)
        for prompt in dict.fromkeys(map(str, prompts)) if accepts is not None else ():
            try:
                accepts(prompt)
            except ValueError as exc:
                raise FlowrlError(f"reward '{use}' cannot score the prompt {prompt!r}: {exc}", where=where,
                                  hint=f"give prompts that '{use}' can score, or another --reward") from exc


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


def shard(items: list, rank: int, world_size: int, batch_size: int = 1) -> list:
    """This rank's items: a contiguous share of whole batches of ``batch_size`` (as a training
    run's evaluation shares them, :func:`flowrl.train.evaluate.evaluation_share`), so that every
    batch holds the items one process would put in it, and so gives the same numbers; every item
    exactly once over all ranks."""
    from ..train.evaluate import evaluation_share

    share = evaluation_share(len(items), batch_size, rank, world_size)
    return items[share.start * batch_size : share.stop * batch_size]


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


def check_hybrid_steps(hybrid_steps: int, sigmas) -> None:
    """``--hybrid-steps`` must not exceed the sampling steps (checked before anything is written)."""
    n = len(sigmas) - 1
    if hybrid_steps > n:
        raise FlowrlError(f"--hybrid-steps {hybrid_steps} exceeds the {n} sampling steps", where="--hybrid-steps",
                          hint=f"give at most {n}, or more --steps")


def generate(model, items: list[Item], sigmas, *, seed: int, batch_size: int, hybrid_steps: int = 0, base=None,
             noise_of=None, with_latents: bool = False):
    """Yield ``(batch_items, images [b, 3, H, W])`` (with ``with_latents``, ``(batch_items, images,
    latents [b, *L])``: the clean latents, for rewards that score them) for ``items`` in batches of ``batch_size``:
    the first ``hybrid_steps`` steps (all, when 0) with ``model``, the rest with ``base`` (or,
    when ``base`` is None, with ``model.reference_velocity``). ``noise_of(item)`` gives an
    item's starting noise (default: :func:`noise_for`, keyed by seed, prompt and seed index)."""
    import torch

    from ..sampling.rollout import ode_sample
    from ..train.session import PromptCache

    cache, device = PromptCache(model), sigmas.device
    check_hybrid_steps(hybrid_steps, sigmas)
    late = (model.reference_velocity if base is None else base.velocity) if hybrid_steps else None
    for start in range(0, len(items), batch_size):
        batch = items[start : start + batch_size]
        text = cache.get([it.prompt for it in batch], device)  # on the model's device: not every adapter moves it
        noise = torch.stack([noise_of(it) if noise_of else noise_for(model, seed, it.prompt, it.seed_index)
                             for it in batch]).to(device)

        def velocity_at(i, x, s, text=text):
            return (late if hybrid_steps and i >= hybrid_steps else model.velocity)(x, s, text)

        latents = ode_sample(velocity_at, noise, sigmas)
        images = model.decode(latents).float().cpu()
        yield (batch, images, latents) if with_latents else (batch, images)


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


def prepare(source, model_name, set_, checkpoint, device, hybrid_steps, ema: bool = False, compare_base: bool = False,
            before_load=None):
    """Resolve the source, start the processes, load the policy (its EMA weights with ``ema``;
    and the base for hybrid inference). ``before_load(src)``: a check that refuses before any
    model loads (and before any process is started)."""
    from .. import distributed
    from ..train.accel import default_attention

    src = resolve_source(source, model_name, list(set_ or []), checkpoint)
    if before_load is not None:
        before_load(src)
    dev = distributed.resolve_device(device or src.recipe.run.device, where="--device" if device else "[run].device")
    ctx = dist_context(dev)
    dev = distributed.process_device(dev, ctx)
    default_attention(dev)  # [train].attention_backend's 'auto' (no cuDNN attention on CUDA)
    for flag, wanted in (("--hybrid-steps", hybrid_steps), ("--ema", ema), ("--compare-base", compare_base)):
        if wanted and src.checkpoint is None:
            raise FlowrlError(f"{flag} needs a trained checkpoint (a run or checkpoint directory)", where=flag)
    model = load_policy(src, dev)
    if ema:
        from ..train.ema import load_ema_weights

        load_ema_weights(model.denoiser, src.checkpoint)
    base = base_model_for_hybrid(src, model, dev) if hybrid_steps else None
    d = src.recipe.distributed
    if src.from_recipe and d.mixed_precision == "bf16" and d.strategy != "fsdp2":
        # the run's policy computed under accelerate's bf16 autocast (none / ddp; FSDP2 casts its
        # sharded weights instead): so does this one (its evaluation reproduced)
        from ..train.parallel import autocast_like_accelerate

        for denoiser in (model.denoiser, *([base.denoiser] if base is not None else [])):
            autocast_like_accelerate(denoiser, dev)
    return src, dev, ctx, model, base


def save_png(img, path: Path) -> None:
    """An image ``[3, H, W]`` as a PNG; a clip ``[F, 3, H, W]`` as its filmstrip (frames left to
    right), so grids drawn from the PNGs show clips too."""
    import torch
    from PIL import Image

    from ..video import filmstrip

    if img.ndim == 4:
        img = filmstrip(img.unsqueeze(0))[0]
    arr = (img.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    Image.fromarray(arr).save(path)


def save_clip(clip, stem: Path) -> list[Path]:
    """A clip ``[F, 3, H, W]`` as ``stem.gif`` (always) and ``stem.mp4`` (with the ``video``
    extra), each frame enlarged to at least 128 pixels; the files written."""
    from ..video import mp4_available, write_gif, write_mp4

    scale = max(1, -(-128 // clip.shape[-1]))
    big = [f.repeat_interleave(scale, dim=-1).repeat_interleave(scale, dim=-2) for f in clip.float().clamp(0, 1)]
    files = [write_gif(big, stem.with_suffix(".gif"))]
    if mp4_available():
        files.append(write_mp4(list(clip.float().clamp(0, 1)), stem.with_suffix(".mp4"), scale=scale))
    return files
