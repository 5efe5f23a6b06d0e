"""What ``flowrl train`` would otherwise refuse only after building the model, checked without
building it (:func:`check_startable`; ``flowrl validate`` and ``flowrl train`` both call it):
the CUDA devices the recipe names exist on this machine (:func:`check_devices`), the prompt
files, offline table and profiles it reads exist and fit the run, every required key holds a
value, every input path exists and every tracker can be built.

:func:`cuda_device_count` is the one place validation asks PyTorch how many GPUs there are:
tests set ``flowrl.recipe.startable.cuda_device_count``.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import torch

from ..distributed import choose_strategy, flag_setting, resolve_device
from ..dynamics.profile_file import read_profile
from ..errors import FlowrlError, RecipeError
from ..embeddings import open_store
from ..offline import read_offline_rows
from ..plugins import Registry, get_registry
from ..prompts import TABLE_SUFFIXES, distinct_rows, evaluation_prompts, import_extra, read_prompts
from ..sampling.precision import check_rollout_precision
from .schema import SECTIONS, ComponentChoice, Recipe
from .validation import DATA_HINT, build_component, check_launched_strategy, data_kind, plan_context, window_plans


def check_startable(recipe: Recipe, registry: Registry | None = None, *, devices: bool = True) -> None:
    """What ``flowrl train`` would otherwise reject only after building the model, checked
    without building it (``flowrl validate`` and ``flowrl train`` both call this): every CUDA
    device the recipe names exists on this machine (``devices``; :func:`check_devices`), every
    prompt file exists and holds a prompt, ``source = "model"`` names a model that ships prompts,
    every key declared required holds a value, every input path exists, every reward that
    declares which prompts it scores accepts the prompt files', and every tracker can be built (a
    tracker checks its extra when it is built). Under a launcher (``devices``), what ``strategy =
    "auto"`` became is checked as if the recipe had named it (:func:`check_launched_strategy`)."""
    registry = registry or get_registry()
    if devices:
        check_devices(recipe)
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)  # a launched process: the launcher's choice
        check_launched_strategy(recipe, registry, choose_strategy(
            recipe.distributed.strategy, world, bool(flag_setting(os.environ, "ACCELERATE_USE_FSDP"))))
        if recipe.sampler.rollout_precision != "train":
            check_rollout_precision(recipe.sampler.rollout_precision, resolve_device(recipe.run.device), world,
                                    where=f"{recipe.source}: [sampler].rollout_precision")
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
        if source.startswith("hf:") or path.is_dir():  # a Hugging Face dataset: read by _check_prompt_tables
            import_extra("datasets", "datasets", where)
            continue
        if not path.is_file():
            raise RecipeError(f"prompt file not found: {path}", where=where,
                              hint="give an existing text file (one prompt a line), a table (.csv, .jsonl, .parquet), "
                                   "a datasets folder, hf:DATASET, or 'model'")
        if not any(line.strip() for line in path.read_text(encoding="utf-8", errors="replace").splitlines()):
            raise RecipeError(f"prompt file {path} holds no prompt", where=where)
    _check_required_params(recipe)
    _check_input_paths(recipe)
    _check_prompt_columns(recipe)
    _check_prompt_tables(recipe, registry)
    _check_profiles(recipe, registry)
    _check_data_table(recipe, registry)
    _check_embeddings(recipe, registry)
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


def read_here(source: str) -> bool:
    """Whether validation reads this prompt source as training will: a local file or datasets
    folder; not the model's own prompts, nor a hub dataset (loading it may download)."""
    return source != "model" and not source.startswith("hf:") and (Path(source).is_file() or Path(source).is_dir())


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
        if not read_here(source):
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


def _check_embeddings(recipe: Recipe, registry: Registry) -> None:
    """The ``[prompts] embeddings`` store is one for this ``[model]`` configuration
    (:mod:`flowrl.embeddings`), the prompts carry no condition image (the store keys text only),
    and it holds every prompt the local prompt files give training and the evaluation."""
    p = recipe.prompts
    if not p.embeddings:
        return
    where = f"{recipe.source}: [prompts].embeddings"
    model = recipe.components["model"].use
    task = getattr(registry.get("model", model).factory, "task", "text-to-image")
    if p.condition_column or not task.startswith("text-to-"):
        raise RecipeError(f"prompt embeddings are kept per prompt text, and the prompts of this run carry condition images "
                          f"({'[prompts].condition_column' if p.condition_column else f'model {model!r} is {task}'})",
                          where=where, hint="leave [prompts].embeddings empty: the conditions are encoded as they come")
    if not Path(p.embeddings).is_dir():
        raise RecipeError(f"prompt embeddings not found: {p.embeddings}", where=where,
                          hint=f"write them with `flowrl embed {recipe.source} -o DIR` (relative to the recipe file)")
    try:
        store = open_store(recipe)
    except FlowrlError as exc:
        raise RecipeError(exc.message, where=where, hint=exc.hint) from exc
    used: list[str] = []
    for key, source, role in [("source", p.source, "train")] + ([("eval_source", p.eval_source or p.source, "eval")]
                                                                 if p.num_eval else []):
        if not read_here(source):
            continue  # the engine checks these once it has read them (flowrl.train.session.PromptCache)
        rows = [str(r) for r in read_prompts(source, None, f"{recipe.source}: [prompts].{key}", p, role=role)]
        used += rows if role == "train" else evaluation_prompts(rows, recipe.run.seed, p.num_eval)
    if recipe.data.enabled:  # an offline run trains on its table's prompts (the table is checked above)
        used += read_offline_rows(recipe.data.path, f"{recipe.source}: [data].path").prompts
    missing = store.missing(used)
    if missing:
        raise RecipeError(f"{len(missing)} prompt(s) the run uses are not in {p.embeddings}, e.g. {missing[0]!r}",
                          where=where, hint=f"write the store again with them: `flowrl embed {recipe.source} -o NEW_DIR` "
                                            "embeds the recipe's training and evaluation prompts")


def profile_keys(recipe: Recipe) -> list[tuple[str, str]]:
    """Every temporal-dynamics profile the recipe reads, as ``(where, path)``: each component
    parameter named ``profile`` or ``*_profile`` that is an input path (the ``dynamics`` chunker's,
    the ``weighted`` selector's, the ``branch`` window's)."""
    keys = []
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


def _check_model_encodes_images(recipe: Recipe, registry: Registry) -> None:
    """An offline table holds prompts and images: the model must generate images from text alone
    (no clips, no condition image) and encode images into its latents."""
    model = recipe.components["model"].use
    factory = registry.get("model", model).factory
    task = getattr(factory, "task", "text-to-image")

    def suits(f) -> bool:  # a text-to-image flowrl.interfaces.EncodesImages, read from the class
        return (getattr(f, "task", "text-to-image") == "text-to-image" and callable(getattr(f, "encode_images", None))
                and hasattr(f, "image_size"))

    if not suits(factory):
        encoders = [n for n in registry.names("model") if suits(registry.get("model", n).factory)]
        why = (f"its task is {task}, the table's text-to-image" if task != "text-to-image"
               else "its adapter cannot turn images into latents (no encode_images and image_size)")
        raise RecipeError(f"model '{model}' cannot train on an offline table of images: {why}",
                          where=f"{recipe.source}: [data]",
                          hint=f"an offline run ([data]) trains a text-to-image model that encodes images: "
                               f"{', '.join(encoders)}; or remove [data] and [loss] '{recipe.components['loss'].use}' "
                               "for an online run")


def _check_data_table(recipe: Recipe, registry: Registry) -> None:
    """The ``[data]`` table exists, is of the kind the ``[loss]`` trains on (and ``kind`` states),
    every image it names exists, and it holds at least an iteration's rows; and the model turns
    images into latents (:class:`~flowrl.interfaces.EncodesImages`) of a text-to-image task."""
    data = recipe.data
    if not data.enabled:
        return
    where, name = f"{recipe.source}: [data].path", recipe.components["loss"].use
    _check_model_encodes_images(recipe, registry)
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
