"""Write docs/hardware.md: `flowrl plan`'s estimate for every shipped recipe at the world sizes it
is meant for.

    python scripts/hardware_table.py            # regenerate docs/hardware.md
    python scripts/hardware_table.py --check    # exit 1 when docs/hardware.md is stale

Each row is what ``flowrl plan RECIPE --num-processes N`` prints (the same public functions,
:func:`flowrl.memory_plan.estimate` and :func:`flowrl.memory_plan.peak`). Planning needs no GPU, no
weights and no network: the Hugging Face hub is switched to offline mode here, so a recipe whose
model configuration is not built into flowrl (or in a local directory) is listed as not planned,
with the reason, instead of fetching anything. tests/test_hardware_doc.py fails when the page is
not what this script writes.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
PAGE = REPO / "docs" / "hardware.md"
COMMAND = "python scripts/hardware_table.py"
GPU_SIZES_GB = (24, 40, 80)

#: The world sizes (processes = GPUs) each shipped recipe is meant for, from its header comment.
#: A new recipe must be added here (tests/test_hardware_doc.py says so).
WORLD_SIZES: dict[str, tuple[int, ...]] = {
    # The GCPO paper's FLUX.1-dev settings: "2 prompts per GPU on 8 GPUs", `--num-processes 8`.
    "chunk_grpo_flux.toml": (8,),
    # "Identical to recipes/chunk_grpo_flux.toml" except the selector / chunker / ratio.
    "chunk_grpo_flux_ws.toml": (8,),
    "fixed_chunk_flux.toml": (8,),
    "gspo_flux.toml": (8,),
    "dance_grpo_flux.toml": (8,),
    # SD3.5-M port of the paper's setting: `--num-processes 8` in its header.
    "chunk_grpo_sd3.toml": (8,),
    # Flow-GRPO-style LoRA recipes after Flow-Factory: `--num-processes 8` in their headers.
    "qwen_image_lora.toml": (8,),
    "qwen_image_edit_lora.toml": (8,),
    "flux2_klein_lora.toml": (8,),
    "zimage_lora.toml": (8,),
    "kontext_edit_lora.toml": (8,),
    # Single-GPU recipes: "on ONE 80 GB GPU", "One consumer GPU (24 GB)".
    "lora_single_gpu_sd3.toml": (1,),
    "chunk_grpo_flux_lora.toml": (1,),  # "on ONE GPU": the flagship with LoRA
    "flux2_klein_nf4_24gb.toml": (1,),
    # The embedded tiny model: meant for one CPU process; the estimate is what a GPU would hold.
    "quickstart.toml": (1,),
    "quickstart_dynamics.toml": (1,),
    "quickstart_fixed.toml": (1,),
    "quickstart_gspo.toml": (1,),
    "quickstart_hacking.toml": (1,),
    "quickstart_step.toml": (1,),
    # The objectives' quickstart variants (docs/objectives.md): the same embedded model and geometry.
    "quickstart_diversity.toml": (1,),
    "quickstart_fast.toml": (1,),
    "quickstart_gardo.toml": (1,),
    "quickstart_guard.toml": (1,),
    "quickstart_mixgrpo.toml": (1,),
    "quickstart_mixgrpo_flash.toml": (1,),
    "quickstart_nft.toml": (1,),
    "study_embedded.toml": (1,),
}


@dataclass
class Row:
    recipe: str
    model: str
    finetune: str
    strategy: str
    processes: int
    peak_gb: float | None = None
    phase: str = ""
    reason: str = ""  # why it could not be planned (then there is no peak)


def recipe_files() -> list[str]:
    return sorted(p.name for p in RECIPES.glob("*.toml"))


def _model_name(recipe) -> str:
    choice = recipe.components["model"]
    path = str(getattr(choice.params, "path", "") or "")  # a hub id, or a directory resolved to an absolute path
    if path.startswith(str(REPO) + os.sep):  # no machine's checkout path in the page
        path = Path(path).relative_to(REPO).as_posix()
    return f"{choice.use} ({path})" if path else choice.use


def _strategy(recipe, world_size: int) -> str:
    from flowrl.distributed import choose_strategy

    chosen = recipe.distributed.strategy
    resolved = choose_strategy(chosen, world_size)  # as `flowrl plan` does: no launcher settings
    return resolved if chosen == resolved else f"{chosen} ({resolved})"


def plan_row(name: str, world_size: int, registry) -> Row:
    """One recipe at one world size, as `flowrl plan` estimates it."""
    from flowrl.errors import FlowrlError
    from flowrl.memory_plan import GB, estimate, peak
    from flowrl.recipe import load_recipe

    recipe = load_recipe(RECIPES / name, [], registry=registry)
    row = Row(name, _model_name(recipe), recipe.train.finetune, recipe.distributed.strategy, world_size)
    try:
        row.strategy = _strategy(recipe, world_size)
        _, _, lines = estimate(recipe, registry, world_size)
    except FlowrlError as exc:  # e.g. a model configuration that only the hub has, or a geometry
        row.reason = " ".join(str(exc).split())
        return row
    total, row.phase = peak(lines)
    row.peak_gb = total / GB
    return row


def build_rows() -> list[Row]:
    from flowrl.plugins import get_registry

    names = recipe_files()
    unlisted = [n for n in names if n not in WORLD_SIZES]
    if unlisted:
        raise SystemExit(f"recipes without a world size in WORLD_SIZES of scripts/hardware_table.py: {unlisted}; "
                         "add each with the number of GPUs its header says it is meant for")
    registry = get_registry()
    return [plan_row(n, ws, registry) for n in names for ws in WORLD_SIZES[n]]


def render(rows: list[Row]) -> str:
    planned = [r for r in rows if r.peak_gb is not None]
    unplanned = [r for r in rows if r.peak_gb is None]
    sizes = " | ".join(f"fits {g} GB" for g in GPU_SIZES_GB)
    out = [
        "# Hardware per recipe",
        "",
        f"<!-- Generated by `{COMMAND}` from `flowrl plan`; do not edit by hand. -->",
        "",
        "What `flowrl plan RECIPE --num-processes N` estimates for every recipe in `recipes/`, at",
        "the number of processes (one per GPU) the recipe's header says it is meant for. Peak is GB",
        "(2^30 bytes) per GPU: everything held for the whole run plus the largest phase's transients",
        "(the phase named). The estimate needs no GPU, weights or network; it leaves out allocator",
        "fragmentation beyond a fixed 1.5 GB, so check the real peak in the first iterations",
        "(`torch.cuda.max_memory_allocated`). How it is made: `flowrl/memory_plan.py`; per-line",
        "breakdown and other world sizes or overrides: `flowrl plan RECIPE --num-processes N --set KEY=VALUE`.",
        "Strategy is the recipe's `[distributed].strategy`, with what `auto` becomes at that number",
        "of processes in brackets (docs/distributed.md).",
        "",
        f"| recipe | model | finetune | strategy | processes | peak GB per GPU | peaking phase | {sizes} |",
        "|---|---|---|---|---|---|---|" + "---|" * len(GPU_SIZES_GB),
    ]
    for r in planned:
        # as `flowrl plan --gpu-memory G` decides: the unrounded peak against G x 2^30 bytes
        fits = " | ".join("yes" if r.peak_gb <= g else "no" for g in GPU_SIZES_GB)
        out.append(f"| `{r.recipe}` | {r.model} | {r.finetune} | {r.strategy} | {r.processes} | "
                   f"{r.peak_gb:.1f} | {r.phase} | {fits} |")
    out += [
        "",
        "The `quickstart*` and `study_embedded` recipes train the embedded tiny model and are meant",
        "for one CPU process; their row is what one GPU would hold.",
        "",
    ]
    if unplanned:
        out += ["## Not planned", ""]
        out += [f"- `{r.recipe}` at {r.processes} process(es): {r.reason}" for r in unplanned]
        out.append("")
    else:
        out += ["Every recipe was planned offline, from flowrl's built-in copies of the public model",
                "configurations.", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    # Before flowrl (and through it huggingface_hub, which reads these once) is imported: never
    # reach the network. Run as a script, nothing has imported them yet.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/hardware.md is stale; write nothing")
    args = parser.parse_args(argv)
    text = render(build_rows())
    if args.check:
        current = PAGE.read_text(encoding="utf-8") if PAGE.exists() else ""
        if current != text:
            diff = difflib.unified_diff(current.splitlines(), text.splitlines(), "docs/hardware.md", "regenerated", lineterm="")
            print("\n".join(list(diff)[:60]), file=sys.stderr)
            print(f"docs/hardware.md is stale; regenerate it with `{COMMAND}`", file=sys.stderr)
            return 1
        print("docs/hardware.md is up to date")
        return 0
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
