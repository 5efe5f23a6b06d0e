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

Outputs in ``-o DIR`` (default ``RUN_DIR/samples/<checkpoint>``, or ``runs/samples/<name>`` for a
recipe or ``--model NAME``: under ``runs/``, which git ignores): ``images/PPPPP_KK.png``,
``samples.jsonl`` (one line per image: prompt, seed index, file), ``settings.json``, ``grid.png``
(prompts in rows, seeds in columns, captions wrapped). A directory that holds an earlier sample is
refused, as ``flowrl train`` refuses an earlier run, unless ``--overwrite`` (which deletes that
sample's files first); the command ends by naming every file it drew.

``--tables`` (a recipe with ``[[rewards]]``) scores every image with the recipe's rewards (their
weighted sum: the reward training would optimise; entries of weight 0 are left out), adds the
``score`` to each line of ``samples.jsonl`` and writes the two offline tables of
docs/objectives.md, "Offline SFT and DPO": ``best.jsonl`` (per prompt its best image: rejection
sampling's SFT data) and ``pairs.jsonl`` (per prompt its best image as ``chosen`` and its worst as
``rejected``; a prompt whose images all score the same gives no pair).

``--weights EXPORT_DIR`` samples what ``flowrl export`` wrote for a model that is not a diffusers
pipeline (the embedded models: the trained denoiser alone, ``transformer/``): the model is rebuilt
from the ``[model]`` table that ``EXPORT_DIR/flowrl_export.json`` records (``--set model.KEY=VALUE``
on top), then the exported weights are loaded into its denoiser, every key (docs/embedded.md,
"Sampling an export"). It samples as ``--model NAME`` does (the model's own schedule, else the
default one; 28 steps unless ``--steps``).

``--ema`` samples the checkpoint's EMA weights (``[ema]`` in the recipe). ``--compare-base``
also samples the base model (no checkpoint) from the same noise into ``base/PPPPP_KK.png`` and
draws ``compare.png``: one row per prompt, base and trained side by side for each seed. The two
models are loaded one after the other, never both at once.

What to sample from, its policy, the seeded items and their sharding come from
:mod:`flowrl.commands.inference` (shared with ``flowrl eval`` and ``flowrl export``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import FlowrlError, counted
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
)
from .inference import (
    Source,
    barrier,
    check_hybrid_steps,
    check_prompts_scorable,
    generate,
    load_policy,
    make_items,
    prepare,
    read_prompt_list,
    refuse_run_without_checkpoint,
    resolve_sigmas,
    save_clip,
    save_png,
    shard,
)

#: Where the outputs of a source without a run directory (a recipe, ``--model NAME``) go by default:
#: under ``runs/``, as training's outputs, which git ignores, not in the current directory.
UNTRAINED_OUTPUT_ROOT = Path("runs")


def default_output_help(kind: str) -> str:
    """The default of ``-o`` as the help says it, from what :func:`default_output` uses."""
    return (f"RUN_DIR/{kind}/<checkpoint> for a run, {(UNTRAINED_OUTPUT_ROOT / kind).as_posix()}/<name> "
            "for a recipe or --model")


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
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help=f"Output directory (default {default_output_help('samples')}).")] = None,
    grid: Annotated[bool, typer.Option("--grid/--no-grid", help="Write grid.png.")] = True,
    ema: Annotated[bool, typer.Option("--ema", help="Sample the checkpoint's EMA weights (runs with [ema] enabled).")] = False,
    compare_base: Annotated[bool, typer.Option(
        "--compare-base", help="Also sample the base model from the same noise; compare.png shows base | trained.")] = False,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace an earlier sample in the output directory (its files are deleted first).")] = False,
    tables: Annotated[bool, typer.Option(
        "--tables", help="Score the images with the recipe's rewards and write the offline tables best.jsonl (SFT) "
        "and pairs.jsonl (DPO).")] = False,
    weights: Annotated[Optional[Path], typer.Option(
        "--weights", metavar="EXPORT_DIR", help="Sample the full weights `flowrl export` wrote in this folder for a "
        "model that is not a diffusers pipeline (the embedded models' transformer/): the model its flowrl_export.json "
        "names is rebuilt and the weights loaded into it.")] = None,
) -> None:
    """Sample images with fixed per-prompt seeds (ODE), optionally hybrid trained/base."""
    export = None
    if weights is not None:
        export = read_export(weights, source, model)
        model = export["model"]
        set_ = export_overrides(export) + list(set_ or [])

    def labelled(src: Source) -> Source:
        return dataclasses.replace(src, label=Path(weights).resolve().name) if export is not None else src

    def refuse_earlier_sample(src: Source) -> None:
        if export is None:  # a run before its first checkpoint: the base model under the run's name
            refuse_run_without_checkpoint(source, checkpoint, "sample", "flowrl sample {recipe}")
        check_output(output or default_output(labelled(src), "samples"), overwrite)

    src, dev, ctx, policy, base = prepare(source, model, set_, checkpoint, device, hybrid_steps, ema, compare_base,
                                          before_load=refuse_earlier_sample)
    src = labelled(src)
    if export is not None:
        load_exported_weights(policy, Path(weights), export)
    check_tables_source(tables, src)
    plist = read_prompt_list(prompt, prompts, num_prompts, src, policy)
    if tables:  # --tables scores every image with the recipe's rewards: their prompts, checked first
        check_prompts_scorable([r.use for r in src.recipe.rewards if r.weight], plist,
                               where="--prompts" if prompts is not None else "--prompt")
    sigmas = resolve_sigmas(schedule, steps, src, policy).to(dev)
    check_hybrid_steps(hybrid_steps, sigmas)
    base_seed = seed if seed is not None else src.recipe.run.seed
    out = output or default_output(src, "samples")
    clear_for_sample(out, overwrite, ctx)
    items = make_items(plist, seeds)
    mine = shard(items, ctx.rank, ctx.world_size, batch_size)
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
                    "num_images": len(records), "ema": ema, "compare_base": compare_base,
                    "weights": str(weights) if weights is not None else None}
        write_summary(out, records, settings, src, tables=tables, grid=grid, batch_size=batch_size)


def write_summary(out: Path, records: list[dict], settings: dict, src: Source, *, tables: bool, grid: bool,
                  batch_size: int) -> None:
    """The main process's last outputs: settings.json, the offline tables, grid.png and
    compare.png as asked, and the line that names them."""
    from ..runlog import image_grid

    (out / "settings.json").write_text(json.dumps(settings, indent=1))
    seeds, compare_base = settings["seeds_per_prompt"], settings["compare_base"]
    drawn = []
    if tables:
        drawn.append(f"the offline tables: {', '.join(str(p) for p in write_tables(out, records, src.recipe, batch_size))}")
    if grid and records:
        drawn.append(f"the grid: {grid_png(out, records, seeds, image_grid)}")
    if compare_base and records:
        drawn.append(f"base | trained: {compare_png(out, records, seeds, src.label, image_grid)}")
    console.print(f"wrote {counted(len(records), 'image')} to {out / 'images'}" + "".join(f"; {d}" for d in drawn))


#: Where the weights of each export format ``--weights`` samples lie in ``EXPORT_DIR`` (the formats
#: ``flowrl export`` writes for full weights of a model that is not a diffusers pipeline; the export
#: command's ``SAMPLED_BY_WEIGHTS`` names the same formats).
EXPORTED_WEIGHTS = {"diffusers_model": "transformer/*.safetensors", "state_dict": "denoiser.safetensors"}


def read_export(folder: Path, source, model: str | None) -> dict:
    """``folder/flowrl_export.json``, refused unless ``--weights`` can sample its format."""
    folder = Path(folder)
    if source is not None:
        raise FlowrlError("--weights samples an export on its own: give no run, checkpoint or recipe with it",
                          where="--weights", hint=f"flowrl sample --weights {folder} --prompt '...'")
    info_path = folder / "flowrl_export.json"
    try:
        info = json.loads(info_path.read_text())
    except FileNotFoundError:
        raise FlowrlError(f"{folder} is not a `flowrl export` folder (no flowrl_export.json)", where="--weights",
                          hint="give the folder `flowrl export RUN_DIR [-o OUT]` wrote") from None
    except (OSError, ValueError) as exc:
        raise FlowrlError(f"cannot read {info_path}: {exc}", where="--weights") from None
    if not isinstance(info, dict):
        raise FlowrlError(f"{info_path} holds a JSON {type(info).__name__}, not the object `flowrl export` writes",
                          where="--weights", hint="export the run again: flowrl export RUN_DIR -o OUT --overwrite")
    fmt = info.get("format")
    if fmt not in EXPORTED_WEIGHTS:
        hints = {
            "diffusers_pipeline": f"a whole pipeline: sample it with --model {info.get('model')} "
                                  f"--set model.path={json.dumps(str(folder))}",
            "diffusers_lora": "a LoRA: sample the run directory, or load it with pipe.load_lora_weights",
            "diffusers_model_lora": "a LoRA: sample the run directory, or export the run with --merge for full weights",
            "peft_state_dict": "a LoRA: sample the run directory",
        }
        raise FlowrlError(f"--weights samples full weights of a model that is not a pipeline; {folder} holds "
                          f"format '{fmt}'", where="--weights", hint=hints.get(fmt, "sample the run directory"))
    if "model_table" not in info:
        raise FlowrlError(f"{info_path} does not record the model's [model] table (an export by an older flowrl)",
                          where="--weights", hint=f"export the run again: flowrl export {info.get('run_dir') or 'RUN_DIR'}")
    if model is not None and model != info.get("model"):
        raise FlowrlError(f"--model {model}, but {folder} is an export of '{info.get('model')}'", where="--model",
                          hint="leave --model out: --weights rebuilds the exported model")
    return info


def export_overrides(info: dict) -> list[str]:
    """``model.KEY=VALUE`` overrides that rebuild the export's base model (its recorded ``[model]``
    table, values in TOML syntax)."""
    from ..recipe import dump_toml

    out = []
    for key, value in info["model_table"].items():
        if key in ("use", "name") or value is None or isinstance(value, dict):
            continue
        out.append(f"model.{key}={dump_toml({'v': value}).strip().removeprefix('v = ')}")
    return out


def load_exported_weights(policy, folder: Path, info: dict) -> None:
    """The export's weights into ``policy.denoiser``: every key, of the same shapes, or one error."""
    from safetensors.torch import load_file

    files = sorted(folder.glob(EXPORTED_WEIGHTS[info["format"]]))
    if not files:
        raise FlowrlError(f"{folder} holds no {EXPORTED_WEIGHTS[info['format']]} (format '{info['format']}')",
                          where="--weights", hint="export the run again into an empty folder")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    try:
        missing, unexpected = policy.denoiser.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # a shape mismatch
        raise FlowrlError(f"the weights in {folder} do not fit the rebuilt '{info['model']}': "
                          f"{str(exc).splitlines()[-1].strip()}", where="--weights") from None
    if missing or unexpected:
        raise FlowrlError(f"the weights in {folder} do not fit the rebuilt '{info['model']}': "
                          f"{len(missing)} of its weights missing (e.g. {missing[:1]}), {len(unexpected)} unexpected "
                          f"(e.g. {unexpected[:1]})", where="--weights")


def check_tables_source(tables: bool, src: Source) -> None:
    """``--tables`` scores the images with the recipe's weighted rewards: a source must name one."""
    if tables and not any(r.weight for r in (src.recipe.rewards if src.from_recipe else [])):
        raise FlowrlError("--tables scores the images with the recipe's [[rewards]]; this source names no reward "
                          "with a weight", where="--tables", hint="sample from a recipe with a [[rewards]] entry")


def write_tables(out: Path, records: list[dict], recipe, batch_size: int) -> tuple[Path, Path]:
    """``--tables``: each image scored with the recipe's rewards (the weighted sum of the entries
    with a weight), the scores added to ``samples.jsonl``, and ``best.jsonl`` and ``pairs.jsonl``
    written (:func:`flowrl.offline.best_rows`, :func:`flowrl.offline.best_worst_rows`)."""
    import torch

    from ..interfaces import scores_latents
    from ..offline import best_rows, best_worst_rows, load_image
    from ..plugins import get_registry
    from ..prompts import reward_metadata
    from ..recipe import build_component
    from ..rewards import score

    if any("video" in r for r in records):
        raise FlowrlError("--tables writes tables of images for offline training ([data]: SFT, DPO), and this "
                          "model makes clips", where="--tables",
                          hint=f"the clips are written in {out}; sample without --tables")
    entries = [(i, r) for i, r in enumerate(recipe.rewards) if r.weight]
    rewards = [(r.label, r.weight, build_component(recipe, get_registry(), "rewards", i)) for i, r in entries]
    for label, _, reward in rewards:
        if scores_latents(reward):
            raise FlowrlError(f"--tables scores images; reward '{label}' scores latents", where="--tables",
                              hint="give the recipe an image reward")
    totals = []
    for start in range(0, len(records), batch_size):
        part = records[start : start + batch_size]
        images = torch.stack([load_image(out / r["file"]) for r in part])  # scored where each reward places itself
        prompts = [r["prompt"] for r in part]
        total = torch.zeros(len(part))
        with torch.no_grad():
            for label, weight, reward in rewards:
                total += weight * score(reward, images, prompts, reward_metadata(prompts, images), name=label).scores
        totals += total.tolist()
    for rec, value in zip(records, totals):
        rec["score"] = value
    write_jsonl(out / "samples.jsonl", records)
    best, pairs = out / "best.jsonl", out / "pairs.jsonl"
    write_jsonl(best, best_rows(records, totals))
    write_jsonl(pairs, best_worst_rows(records, totals))
    return best, pairs


def write_images(batches, out: Path, folder: str) -> list[dict]:
    """Save every generated image as ``folder/PPPPP_KK.png``; the manifest records. A video
    model's clip is saved as its filmstrip PNG (what the grids show) and as ``PPPPP_KK.gif``
    (and ``.mp4`` with the ``video`` extra), named in the record's ``video``."""
    (out / folder).mkdir(parents=True, exist_ok=True)
    records = []
    for batch, images in batches:
        for it, img in zip(batch, images):
            name = f"{folder}/{it.prompt_index:05d}_{it.seed_index:02d}.png"
            save_png(img, out / name)
            videos = {}
            if img.ndim == 4:  # a clip [F, 3, H, W]
                files = save_clip(img, (out / name).with_suffix(""))
                videos = {"video": [str(f.relative_to(out)) for f in files]}
            records.append({"index": it.index, "prompt_index": it.prompt_index, "prompt": it.prompt,
                            "seed_index": it.seed_index, "file": name, **videos, **condition_record(it.prompt)})
    return records


def default_output(src: Source, kind: str) -> Path:
    """``RUN_DIR/<kind>/<checkpoint>`` for a trained run; else ``runs/<kind>/<name>``
    (:data:`UNTRAINED_OUTPUT_ROOT`). :func:`default_output_help` says the same in words."""
    if src.run_dir is not None and src.checkpoint is not None:
        return src.run_dir / kind / src.checkpoint.name
    return UNTRAINED_OUTPUT_ROOT / kind / src.label.replace("/", "_").removesuffix(".toml")


#: What one sample writes in its directory, and the folders of its images (their files: in the manifest).
SAMPLE_FILES = ("samples.jsonl", "settings.json", "grid.png", "compare.png", "best.jsonl", "pairs.jsonl")
SAMPLE_FOLDERS = ("images", "base")


def earlier_sample(out: Path) -> bool:
    """A finished sample is in ``out``: the main process writes its manifest and settings last.
    (Images alone are not one: the other processes of this very sample may be writing theirs.)"""
    return (out / "samples.jsonl").is_file() or (out / "settings.json").is_file()


def check_output(out: Path, overwrite: bool) -> None:
    """Refuse to mix with, or silently replace, an earlier sample in ``out`` (as ``flowrl train``
    refuses an earlier run): ``--overwrite`` replaces it."""
    from ..files import ensure_writable

    ensure_writable(out, where="--output", directory=True)
    if not overwrite and earlier_sample(out):
        raise FlowrlError(f"{out} already holds a sample; a new one would overwrite it", where="--output",
                          hint="pass another -o DIR, or replace it with --overwrite (deletes the earlier sample's files)")


def clear_for_sample(out: Path, overwrite: bool, ctx) -> None:
    """``out`` ready for this sample: with ``--overwrite`` the earlier sample's files gone (once
    every process has looked for it, before any writes), its image folder made."""
    barrier(ctx)
    if overwrite and ctx.is_main:
        remove_earlier_sample(out)
    barrier(ctx)
    (out / "images").mkdir(parents=True, exist_ok=True)


def remove_earlier_sample(out: Path) -> None:
    """The files an earlier sample wrote in ``out``, nothing else there: its manifest names its
    images and clips (and their ``base/`` twins of ``--compare-base``); other files in ``images/``
    stay."""
    from ..files import read_jsonl

    manifest = out / "samples.jsonl"
    own: set[str] = set()
    for record in read_jsonl(manifest) if manifest.is_file() else []:
        for name in [record.get("file"), *(record.get("video") or [])]:
            if isinstance(name, str) and name.startswith(f"{SAMPLE_FOLDERS[0]}/"):
                own |= {name, name.replace(SAMPLE_FOLDERS[0], SAMPLE_FOLDERS[1], 1)}
    root = out.resolve()
    for name in own:
        path = (out / name).resolve()
        if path.parent.parent == root and path.parent.name in SAMPLE_FOLDERS:  # never outside its folders
            path.unlink(missing_ok=True)
    for name in SAMPLE_FILES:
        (out / name).unlink(missing_ok=True)
    for part in out.glob("samples.rank*.jsonl"):
        part.unlink()


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
