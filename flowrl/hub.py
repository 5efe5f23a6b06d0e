"""Publishing an exported run on the Hugging Face hub: the model card and the upload.

``flowrl export RUN_DIR --push-to-hub OWNER/NAME`` exports the checkpoint (:mod:`flowrl.commands.export`),
adds what a reader of the hub page needs next to the weights, and uploads the folder:

- ``README.md``: the model card. Its YAML header names the base model (when it is a hub id), the
  library and tags; the text says which algorithm trained it and cites the paper, lists the
  rewards and their weights, the evaluation numbers at the first and last evaluation, how to
  load the weights, and embeds the resolved recipe;
- ``rewards.png``: the reward curves of ``flowrl plot`` (when matplotlib is installed);
- ``recipe.toml``: the recipe the checkpoint was trained with.

The upload goes through ``huggingface_hub.HfApi`` (``create_repo`` then ``upload_folder``), so
the token (``huggingface-cli login`` or ``HF_TOKEN``) and the endpoint (``HF_ENDPOINT``) are
the hub client's own.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import FlowrlError
from .plotting import plot_run
from .plugins import get_registry
from .recipe import Recipe, dump_toml, uses_units
from .runlog import read_metrics

def algorithm_of(recipe: Recipe) -> tuple[str, str]:
    """``(algorithm, paper)`` of a recipe, as its components describe themselves: a loss that owns
    its update names the algorithm (``algorithm``, e.g. DiffusionNFT); otherwise the chunker (or a
    likelihood other than the trajectory's) names the GRPO family member (its ``algorithm``),
    refined by the window, selector, advantage and loss that say what they add (``variant``, e.g.
    MixGRPO's window, E-GRPO's selector, GRPO-Guard's loss)."""
    registry = get_registry()
    loss = registry.get("loss", recipe.components["loss"].use).factory
    if getattr(loss, "algorithm", None):
        return loss.algorithm
    chunker = recipe.components["chunker"].use
    name, paper = getattr(registry.get("chunker", chunker).factory, "algorithm", None) or (
        f"GRPO-family policy optimisation (chunker '{chunker}')", "")
    likelihood = recipe.components.get("likelihood")
    if likelihood is not None:  # an estimator other than the trajectory's names the family (no chunks)
        name, paper = getattr(registry.get("likelihood", likelihood.use).factory, "algorithm", None) or (name, paper)
    for table in ("window", "selector", "advantage", "loss"):  # each refines the name with its ``variant``
        words, cited = _variant_of(registry, table, recipe.components[table])
        name += words
        if cited and cited not in paper:
            paper = f"{paper}; {cited}" if paper else cited
    return name, paper


def _variant_of(registry, kind: str, choice) -> tuple[str, str]:
    """What a component adds to the model card's algorithm: its factory's ``variant``, a
    ``(words, paper)`` pair or a function of its params returning one; ``("", "")`` if none."""
    variant = getattr(registry.get(kind, choice.use).factory, "variant", None)
    return (variant(choice.params) if callable(variant) else variant) or ("", "")


def components_used(recipe: Recipe) -> list[str]:
    """The component tables the run consults, in the card's order: the chunk layout (chunker,
    selector) only under an objective with units, the likelihood only when it is not the
    trajectory's (the default)."""
    registry = get_registry()
    units = uses_units(recipe, registry)
    likelihood = recipe.components.get("likelihood")
    return [table for table in ("kernel", "window", "chunker", "selector", "advantage", "likelihood", "loss")
            if table in recipe.components and (units or table not in ("chunker", "selector"))
            and (table != "likelihood" or likelihood.use != registry.default("likelihood"))]


def _batch_of(recipe: Recipe) -> str:
    if recipe.data.enabled:  # an offline run trains on rows of its table, not on groups
        return f"{recipe.train.prompts_per_iteration} rows of its dataset per iteration"
    return f"{recipe.train.prompts_per_iteration} prompts x {recipe.train.group_size} samples per iteration"


def task_of(recipe: Recipe) -> str:
    """The hub's pipeline tag of the recipe's model: its adapter's ``task`` (text-to-image unless
    it says text-to-video or image-to-image)."""
    factory = get_registry().get("model", recipe.components["model"].use).factory
    return getattr(factory, "task", "text-to-image")


def is_hub_id(path: str | None) -> bool:
    return bool(path) and path.count("/") == 1 and not path.startswith((".", "/", "~")) and not Path(path).exists()


def eval_summary(run_dir: Path | None) -> list[str]:
    """Markdown rows: every evaluation reward at the first and the last evaluation of the run."""
    if run_dir is None or not (Path(run_dir) / "metrics.jsonl").is_file():
        return []
    rows = [r for r in read_metrics(run_dir) if any(k.startswith("eval/") for k in r)]
    if not rows:
        return []
    first, last = rows[0], rows[-1]
    labels = sorted({k.split("/")[1] for k in last if k.startswith("eval/") and k.endswith("/mean")})
    out = [f"| reward | iteration {first['iteration']} | iteration {last['iteration']} |", "|---|---|---|"]
    for label in labels:
        cells = [f"{r.get(f'eval/{label}/mean', float('nan')):.4f} ± {r.get(f'eval/{label}/sem', float('nan')):.4f}"
                 for r in (first, last)]
        out.append(f"| {label} | {cells[0]} | {cells[1]} |")
    return out


#: diffusers' LoRA file of a pipeline's transformer, and the name flowrl gives a second transformer's
#: (Wan 2.2 A14B's low-noise expert, loaded with ``load_into_transformer_2=True``)
DEFAULT_LORA_FILE = "pytorch_lora_weights.safetensors"
SECOND_TRANSFORMER_LORA_FILE = "pytorch_lora_weights_transformer_2.safetensors"


def how_to_load(info: dict, repo: str) -> list[str]:
    """Markdown: how to load the uploaded weights, by export format."""
    fmt, base = info["format"], info.get("base") or "BASE_MODEL"
    if fmt == "diffusers_lora":
        # the files the export wrote: a two-transformer pipeline's (Wan 2.2 A14B) second LoRA, or
        # its only one when only the low-noise expert trained, goes into transformer_2
        files = info.get("weights") or [DEFAULT_LORA_FILE]
        loads = [f'pipe.load_lora_weights("{repo}")' if name == DEFAULT_LORA_FILE else
                 f'pipe.load_lora_weights("{repo}", weight_name="{name}", load_into_transformer_2=True)'
                 if name == SECOND_TRANSFORMER_LORA_FILE else f'pipe.load_lora_weights("{repo}", weight_name="{name}")'
                 for name in files]
        return ["```python", "from diffusers import DiffusionPipeline", "",
                f'pipe = DiffusionPipeline.from_pretrained("{base}")', *loads, "```"]
    if fmt == "diffusers_pipeline":
        return ["```python", "from diffusers import DiffusionPipeline", "",
                f'pipe = DiffusionPipeline.from_pretrained("{repo}")', "```"]
    where = {
        "diffusers_model_lora": "`pytorch_lora_weights.safetensors`: the denoiser's LoRA in diffusers' model format "
                                "(`load_lora_adapter` of the base model's denoiser)",
        "diffusers_model": "`transformer/`: the trained denoiser, written by its `save_pretrained` "
                           "(load it with the same class's `from_pretrained(..., subfolder=\"transformer\")`)",
        "peft_state_dict": "`lora.safetensors`: the LoRA as a peft state dict",
        "state_dict": "`denoiser.safetensors`: the denoiser's state dict",
    }.get(fmt, f"format `{fmt}`")
    return [f"The weights: {where}. `flowrl_export.json` records the run, checkpoint and format."]


def model_card(repo: str, info: dict, recipe: Recipe, run_dir: Path | None, has_plot: bool) -> str:
    """README.md of the hub repository (YAML header + Markdown)."""
    algorithm, paper = algorithm_of(recipe)
    base = info.get("base")
    task = task_of(recipe)
    header = ["---", "library_name: diffusers" if info["format"].startswith("diffusers_") else "library_name: flowrl",
              f"pipeline_tag: {task}", "tags:", "- flowrl", "- reinforcement-learning",
              *(["- grpo"] if "GRPO" in algorithm else []), f"- {task}"]
    if info.get("finetune") == "lora" and not info.get("merged"):
        header.append("- lora")
    if is_hub_id(base):
        header.append(f"base_model: {base}")
    header.append("---")
    rewards = [f"- `{r.label}` (`{r.use}`), weight {r.weight:g}" for r in recipe.rewards]
    body = [
        f"# {repo.split('/')[-1]}", "",
        f"`{info['model']}`{f' ({base})' if base else ''} fine-tuned with reinforcement learning by "
        f"flowrl using **{algorithm}**{f' ({paper})' if paper else ''}.", "",
        "## Training", "",
        f"- base model: {base or info['model']}",
        f"- fine-tuning: {info['finetune']}" + (f" (LoRA rank {info['lora']['rank']}, alpha {info['lora']['alpha']:g})" if "lora" in info else ""),
        f"- checkpoint: iteration {info['iteration']} of {recipe.train.iterations}",
        f"- {_batch_of(recipe)}, {recipe.sampler.steps} sampling steps; "
        + ", ".join(f"{table} `{recipe.components[table].use}`" for table in components_used(recipe)),
        "- rewards:", *[f"  {r}" for r in rewards], "",
    ]
    table = eval_summary(run_dir)
    if table:
        body += ["## Evaluation", "", "Fixed prompts and noise, ODE sampling (mean ± standard error):", "", *table, ""]
    if has_plot:
        body += ["![reward curves](rewards.png)", ""]
    body += ["## Use", "", *how_to_load(info, repo), "", "## Recipe", "",
             "The resolved recipe (`recipe.toml` in this repository):", "", "```toml",
             dump_toml(recipe.to_toml_dict()).rstrip(), "```", ""]
    return "\n".join(header + [""] + body)


def write_card(out: Path, repo: str, recipe: Recipe, run_dir: Path | None) -> list[str]:
    """Write README.md, recipe.toml and (with matplotlib) rewards.png into the export folder;
    returns the names written."""
    info = json.loads((out / "flowrl_export.json").read_text())
    written = []
    has_plot = False
    if run_dir is not None and (Path(run_dir) / "metrics.jsonl").is_file():
        try:
            plot_run(Path(run_dir), out / "rewards.png")
            has_plot, written = True, ["rewards.png"]
        except FlowrlError:  # matplotlib is missing: the card goes without the figure
            pass
    (out / "recipe.toml").write_text(dump_toml(recipe.to_toml_dict()))
    (out / "README.md").write_text(model_card(repo, info, recipe, run_dir, has_plot))
    return written + ["recipe.toml", "README.md"]


def push_folder(folder: Path, repo: str, *, private: bool, message: str) -> str:
    """Create ``repo`` (if needed) and upload ``folder`` to it; returns the commit URL."""
    from huggingface_hub import HfApi
    from huggingface_hub import errors as hub_errors

    if repo.count("/") != 1 or not all(repo.split("/")):
        raise FlowrlError(f"'{repo}' is not a hub repository id", where="--push-to-hub", hint="give OWNER/NAME, e.g. me/flux-chunk-grpo")
    api = HfApi()
    try:
        api.create_repo(repo, private=private, exist_ok=True, repo_type="model")
        commit = api.upload_folder(folder_path=str(folder), repo_id=repo, repo_type="model", commit_message=message)
    except (hub_errors.HfHubHTTPError, hub_errors.LocalTokenNotFoundError, OSError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise FlowrlError(
            f"pushing {folder} to the hub repository '{repo}' failed: {type(exc).__name__}: {first}",
            where="--push-to-hub",
            hint="log in with `huggingface-cli login` (or set HF_TOKEN) with write access to the repository; "
                 "the folder is complete on disk, push it later or inspect it first with --dry-run",
        ) from exc
    return str(getattr(commit, "commit_url", commit))
