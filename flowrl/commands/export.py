"""``flowrl export``: a run's latest checkpoint in diffusers' formats, optionally on the hub.

::

    flowrl export runs/chunk_grpo_sd3                 # LoRA run -> pytorch_lora_weights.safetensors
    flowrl export runs/chunk_grpo_sd3 --merge         # LoRA merged into the base -> full pipeline
    flowrl export runs/chunk_grpo_flux -o flux_rl     # full fine-tuning -> save_pretrained pipeline
    flowrl export runs/x --push-to-hub me/flux-rl --private   # + model card, uploaded (flowrl.hub)

- LoRA: ``pytorch_lora_weights.safetensors`` in diffusers' layout (``transformer.`` prefixed
  peft keys, plus the adapter's rank / alpha / targets in the safetensors metadata), so::

      pipe = FluxPipeline.from_pretrained("black-forest-labs/FLUX.1-dev")
      pipe.load_lora_weights("OUT")

- Full fine-tuning (or ``--merge``): the whole pipeline via ``save_pretrained`` (the adapter's
  ``save_pretrained``), loadable with ``Pipeline.from_pretrained("OUT")``; for a model that is
  not a diffusers pipeline (the embedded models), the denoiser's ``save_pretrained`` in
  ``OUT/transformer/`` (the trained part only: no pipeline to load), or a plain safetensors file.
  ``flowrl sample --weights OUT`` samples either: it rebuilds the model the export names (its
  recipe table is in ``flowrl_export.json``) and loads the exported weights into its denoiser.

``--ema`` exports the checkpoint's EMA weights (runs trained with ``[ema] enabled = true``)
instead of the trained weights, in the same formats.

``OUT/flowrl_export.json`` records the run, checkpoint, iteration, format, whether the EMA
weights were exported, and the recipe's ``[model]`` table (``model_table``: what ``flowrl sample
--weights OUT`` rebuilds). The checkpoint's own recipe rebuilds the model (``--set
model.path=...`` if the base weights moved).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import FlowrlError
from .base import SetOpt, app, console


def export_run(run_dir: Path, out: Path | None = None, *, checkpoint: Path | None = None,
               overrides: list[str] | None = None, merge: bool = False, ema: bool = False,
               overwrite: bool = False) -> Path:
    """Export a run's checkpoint (the latest by default); returns the output directory. A folder
    that holds an earlier export is refused unless ``overwrite`` (then that export's own entries
    are deleted once the new weights are loaded: an export's model card, weights and recipe must
    all be one export's; :func:`check_earlier_export`)."""
    import shutil

    from ..files import ensure_writable, file_identities, give_ordinary_mode_since
    from ..interfaces import HasLoraTargets
    from ..train.checkpoint import checkpoint_iteration
    from .inference import load_policy, resolve_source

    src = resolve_source(Path(run_dir), None, list(overrides or []), checkpoint)
    if src.checkpoint is None:
        raise FlowrlError(f"{run_dir} has no checkpoint yet", where="RUN_DIR",
                          hint="checkpoints appear every [checkpoint].every iterations and at the end of training")
    finetune = src.recipe.train.finetune
    if merge and finetune != "lora":
        raise FlowrlError(
            f"--merge merges a LoRA into its base model, but this run fine-tuned all weights (finetune = '{finetune}'): "
            "there is nothing to merge", where="--merge",
            hint="export without --merge: the full weights are exported as they are",
        )
    quantised = getattr(src.recipe.components["model"].params, "quantize", "none")
    if merge and quantised not in (None, "none"):
        raise FlowrlError(_QUANTISED_MERGE.format(kind=quantised), where="--merge", hint=_QUANTISED_MERGE_HINT)
    named = out is not None
    out = Path(out) if named else (src.run_dir or src.checkpoint.parent.parent) / "export" / src.checkpoint.name
    where = "--output" if named else "the export folder"
    replaced = check_earlier_export(out, overwrite, where)
    ensure_writable(out, where=where, directory=True)
    model = load_policy(src, "cpu")
    if ema:
        from ..train.ema import load_ema_weights

        load_ema_weights(model.denoiser, src.checkpoint)
    # only now, with the weights in hand: a refused or failed export leaves the earlier one, and
    # no empty folder, behind
    for name in replaced:
        entry = out / name
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    present = set(os.listdir(out))
    before = file_identities(out)
    if finetune == "lora" and not merge:
        fmt = _save_lora(model, out)
    else:
        if finetune == "lora":
            _merge_lora(model)
        fmt = _save_full(model, out)
    give_ordinary_mode_since(out, before)  # safetensors writes 0600, whoever calls it (flowrl.files)
    info = {
        "run_dir": str(src.run_dir) if src.run_dir else None,
        "checkpoint": str(src.checkpoint),
        "iteration": checkpoint_iteration(src.checkpoint),
        "model": src.recipe.components["model"].use,
        "base": src.recipe.components["model"].as_table().get("path"),
        "finetune": finetune,
        "merged": bool(merge and finetune == "lora"),
        "format": fmt,
        "ema": ema,
        "model_table": src.recipe.components["model"].as_table(),
    }
    info["weights"] = sorted(p.name for p in out.glob("*.safetensors"))  # what a loader names (the model card)
    if finetune == "lora":
        t = src.recipe.train
        info["lora"] = {"rank": t.lora_rank, "alpha": t.lora_alpha,
                        "targets": list(t.lora_targets) or (list(model.lora_targets) if isinstance(model, HasLoraTargets) else [])}
    # what this export wrote, so that a later --overwrite deletes exactly that (and the model card)
    info["entries"] = sorted((set(os.listdir(out)) - present) | {"flowrl_export.json"})
    (out / "flowrl_export.json").write_text(json.dumps(info, indent=1))
    return out


#: What ``--push-to-hub`` writes beside an export's weights (:func:`flowrl.hub.write_card`).
CARD_FILES = ("README.md", "recipe.toml", "rewards.png")


def check_earlier_export(out: Path, overwrite: bool, where: str) -> set[str]:
    """The entries of an earlier export in ``out`` that this one replaces (none when there is
    none); refused without ``overwrite``, and when ``out`` holds other files beside it."""
    if not (out / "flowrl_export.json").is_file():
        return set()
    if not overwrite:
        raise FlowrlError(f"{out} already holds an export; a new one would mix with its files", where=where,
                          hint="pass another -o DIR, or replace it with --overwrite (deletes that export's files)")
    replaced = earlier_export_entries(out)
    strangers = sorted(set(os.listdir(out)) - replaced)
    if strangers:
        raise FlowrlError(f"{out} holds an earlier export and other files ({', '.join(strangers[:5])}"
                          f"{', ...' if len(strangers) > 5 else ''}): --overwrite replaces an export, nothing else",
                          where=where, hint="export to another -o DIR")
    return replaced


def earlier_export_entries(out: Path) -> set[str]:
    """The top-level names the export in ``out`` wrote: its record's ``entries``; for an export
    made before that record existed, its weights, a saved pipeline's folders and the model card."""
    try:
        info = json.loads((out / "flowrl_export.json").read_text())
    except (OSError, ValueError):
        info = {}
    info = info if isinstance(info, dict) else {}
    if isinstance(info.get("entries"), list):
        names = {str(n) for n in info["entries"]}
    else:
        names = {str(n) for n in info.get("weights", [])} | {"transformer", "denoiser.safetensors", "model_index.json"}
        try:
            index = json.loads((out / "model_index.json").read_text())
            names |= {k for k in index if not k.startswith("_")} if isinstance(index, dict) else set()
        except (OSError, ValueError):
            pass
    # only names that are entries of the folder itself: a record can never reach outside it
    return (names | set(CARD_FILES) | {"flowrl_export.json"}) & set(os.listdir(out))


#: A Hugging Face hub repository id, OWNER/NAME, as the hub accepts them (checked before the
#: export's minutes, not by the upload after them).
_HUB_PART = r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
HUB_REPO = re.compile(rf"(?!.*(--|\.\.)){_HUB_PART}/{_HUB_PART}")

#: The export formats that ``flowrl sample --weights OUT`` loads into a rebuilt model: full weights
#: of a denoiser not saved as a whole pipeline (``flowrl.commands.sample.EXPORTED_WEIGHTS`` says
#: where in ``OUT`` each keeps them; a command module imports no other, hence the two names).
SAMPLED_BY_WEIGHTS = ("diffusers_model", "state_dict")


def _class_name(folder: Path) -> str:
    """The diffusers class ``save_pretrained`` recorded in ``folder/config.json``."""
    try:
        return json.loads((folder / "config.json").read_text()).get("_class_name") or "ModelClass"
    except (OSError, ValueError):
        return "ModelClass"


def _save_lora(model, out: Path) -> str:
    from ..interfaces import DiffusersLoraModule, SavesLora

    if isinstance(model, SavesLora):
        model.save_lora(out)  # diffusers pipeline format: pipe.load_lora_weights(out)
        return "diffusers_lora"
    denoiser = model.denoiser
    if isinstance(denoiser, DiffusersLoraModule):
        denoiser.save_lora_adapter(str(out))  # diffusers model format: model.load_lora_adapter(out)
        return "diffusers_model_lora"
    from safetensors.torch import save_file

    from ..train.finetune import trainable_state_dict

    save_file({k: v.float().contiguous() for k, v in trainable_state_dict(denoiser).items()}, str(out / "lora.safetensors"))
    return "peft_state_dict"


_QUANTISED_MERGE = ("the base is quantised ({kind}): merging the LoRA into it would bake the quantisation into the "
                    "exported model")
_QUANTISED_MERGE_HINT = "export the LoRA without --merge and load it onto the unquantised base (pipe.load_lora_weights)"


def _merge_lora(model) -> None:
    from ..interfaces import DiffusersLoraModule

    denoiser = model.denoiser
    if not isinstance(denoiser, DiffusersLoraModule):
        raise FlowrlError("--merge needs a diffusers denoiser (fuse_lora / unload_lora)", where="--merge",
                          hint="export the LoRA without --merge")
    held = sorted({str(p.dtype) for p in denoiser.parameters() if not p.is_floating_point()})
    if held:  # a quantised base that no recipe key named (a third-party adapter's)
        raise FlowrlError(_QUANTISED_MERGE.format(kind=", ".join(held)), where="--merge", hint=_QUANTISED_MERGE_HINT)
    denoiser.fuse_lora()
    denoiser.unload_lora()


def _save_full(model, out: Path) -> str:
    from ..interfaces import SavesPretrained

    if isinstance(model, SavesPretrained):
        model.save_pretrained(out)
        return "diffusers_pipeline"
    denoiser = model.denoiser
    if isinstance(denoiser, SavesPretrained):
        denoiser.save_pretrained(str(out / "transformer"))
        return "diffusers_model"
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in denoiser.state_dict().items()}, str(out / "denoiser.safetensors"))
    return "state_dict"


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (its latest checkpoint is exported).")],
    set_: SetOpt = None,
    checkpoint: Annotated[Optional[Path], typer.Option("--checkpoint", help="Export this checkpoint directory instead of the latest.")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output directory (default RUN_DIR/export/<checkpoint>).")] = None,
    merge: Annotated[bool, typer.Option("--merge", help="LoRA runs: merge the LoRA into the base and save full weights.")] = False,
    push_to_hub: Annotated[Optional[str], typer.Option("--push-to-hub", metavar="OWNER/NAME", help="Also write a model card "
                           "(README.md, reward curves, recipe) and upload the folder to this Hugging Face hub repository.")] = None,
    private: Annotated[bool, typer.Option("--private", help="With --push-to-hub: create the repository private.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="With --push-to-hub: write the folder and its model card, upload nothing.")] = False,
    ema: Annotated[bool, typer.Option("--ema", help="Export the checkpoint's EMA weights (runs with [ema] enabled).")] = False,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace an earlier export in the output folder (its files are deleted; other files are refused).")] = False,
) -> None:
    """Export the trained weights: LoRA for pipe.load_lora_weights, or a full save_pretrained pipeline."""
    if (private or dry_run) and push_to_hub is None:
        raise FlowrlError(f"{'--private' if private else '--dry-run'} applies to --push-to-hub", where="flowrl export",
                          hint="flowrl export RUN_DIR --push-to-hub OWNER/NAME [--private] [--dry-run]")
    if push_to_hub is not None and not HUB_REPO.fullmatch(push_to_hub):
        raise FlowrlError(f"{push_to_hub!r} is not a hub repository name", where="--push-to-hub",
                          hint="OWNER/NAME: letters, digits, '-', '_' and '.', at most 96 characters each, "
                               "e.g. me/flux-chunk-grpo")
    out = export_run(run_dir, output, checkpoint=checkpoint, overrides=list(set_ or []), merge=merge, ema=ema,
                     overwrite=overwrite)
    info = json.loads((out / "flowrl_export.json").read_text())
    console.print(f"exported {info['checkpoint']} ({info['format']}) to {out}")
    if info["format"] == "diffusers_lora":
        console.print(f"load it with: pipe.load_lora_weights({str(out)!r})")
    elif info["format"] == "diffusers_pipeline":
        console.print(f"load it with: Pipeline.from_pretrained({str(out)!r})")
    elif info["format"] in SAMPLED_BY_WEIGHTS:
        console.print(f"sample it with: flowrl sample --weights {out} --prompt '...'", highlight=False)
        if info["format"] == "diffusers_model":
            console.print(f"or load the denoiser with diffusers (the rest of the model is not in the export): "
                          f"{_class_name(out / 'transformer')}.from_pretrained({str(out / 'transformer')!r}), after "
                          "flowrl.compat.ensure_torchvision_importable() (docs/embedded.md)", highlight=False)
    if push_to_hub is not None:
        publish(out, push_to_hub, run_dir, checkpoint, list(set_ or []), private=private, dry_run=dry_run)


def publish(out: Path, repo: str, run_dir: Path, checkpoint, overrides: list[str], *, private: bool, dry_run: bool) -> None:
    """The model card beside the exported weights, then the upload (flowrl.hub)."""
    from ..hub import push_folder, write_card
    from .inference import resolve_source

    src = resolve_source(Path(run_dir), None, overrides, checkpoint)
    written = write_card(out, repo, src.recipe, src.run_dir)
    console.print(f"wrote {', '.join(written)} to {out}")
    if dry_run:
        console.print(f"--dry-run: would push {out} to {repo}{' (private)' if private else ''}")
        return
    info = json.loads((out / "flowrl_export.json").read_text())
    url = push_folder(out, repo, private=private, message=f"flowrl export of {src.label} (iteration {info['iteration']})")
    console.print(f"pushed to {repo}: {url}")
