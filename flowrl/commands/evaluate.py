"""``flowrl eval``: score a checkpoint's samples with reward plugins; JSON beside the checkpoint.

::

    flowrl eval runs/chunk_grpo_flux                           # latest checkpoint, the recipe's rewards
    flowrl eval runs/x --reward pickscore --reward clip        # any registered rewards (default params)
    flowrl eval runs/x --steps 50 --hybrid-steps 30 --prompts hpd_test.txt --seeds 4
    flowrl eval recipes/chunk_grpo_flux.toml -o base_eval.json  # the untrained base model
    flowrl eval runs/x --suite ocr                             # a benchmark: ocr, drawbench, geneval

By default a run, checkpoint or recipe is evaluated exactly as training evaluates it: the run's
fixed evaluation prompts (``[prompts].num_eval`` of the pool, chosen by ``[run].seed``), its
``eval_seeds`` images per prompt, the same noise per item (:func:`flowrl.train.evaluate.evaluation_noise`)
and the same batch size, so the mean equals the ``eval/<reward>/mean`` that the run logged for
that checkpoint (``--seed`` draws other noise for the same prompts). Passing ``--prompt``,
``--prompts``, ``--num-prompts`` or ``--seeds`` (or a recipe without evaluation) samples as
``flowrl sample`` does instead: those prompts, noise seeded by ``(seed, prompt, k)``. Both use
deterministic ODE sampling and optional hybrid inference, and score in batches. With
``WORLD_SIZE > 1`` each rank samples and scores its shard and rank 0 gathers the scores: every
image is scored once. The result goes to ``RUN_DIR/checkpoints/<checkpoint>.<name>.json``
(beside the checkpoint directory, so pruning old checkpoints keeps it), or ``-o PATH``. An
ad-hoc evaluation (other prompts, seeds, noise, steps, rewards or ``--set``) without ``--name``
or ``-o`` goes to the next free ``<checkpoint>.adhoc-N.json``, so it never replaces the run's own
``<checkpoint>.eval.json``. A run directory without a checkpoint is refused (it has no trained
weights); its recipe file evaluates the base model::

    {"checkpoint": ..., "iteration": 10, "rewards": {"hpsv3": {"mean": .., "sem": .., "std": ..,
     "min": .., "max": .., "n": ..}}, "per_image": [{"prompt": .., "seed_index": .., "scores": {..}}],
     "settings": {steps, sigmas, seed, seeds_per_prompt, hybrid_steps, ...}}

``--suite NAME`` evaluates a benchmark instead (:mod:`flowrl.suites`; ``run_suite``): the suite the
model carries by that name, else flowrl's (a prompt set scored by a reward), with its own prompts,
images per prompt, steps and table, written to ``<checkpoint>.<suite>.json``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import FlowrlError
from .base import CheckpointOpt, DeviceOpt, PromptOpt, ScheduleOpt, SeedOpt, SetOpt, SourceArg, app, console, registry


def build_rewards(src, names: list[str]):
    """``[(label, reward)]``: the named rewards with default params, else the recipe's rewards
    (an image reward scores a video model's clips frame by frame: :func:`flowrl.rewards.for_clips`)."""
    from ..rewards import for_clips

    reg = registry()
    if names:
        return [(n, for_clips(reg.get("reward", n, where="--reward").build(None))) for n in names]
    if not src.from_recipe:
        raise FlowrlError("no rewards to evaluate with", where="--reward",
                          hint="pass --reward NAME (repeatable; see `flowrl plugins`), or a run/recipe with [[rewards]]")
    return [(c.label, for_clips(reg.get("reward", c.use).build(c.params), c.frames)) for c in src.recipe.rewards]


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


def default_eval_path(src, name: str | None, custom: list[str]) -> Path:
    """``<checkpoint>.<name>.json`` beside the checkpoint (``eval`` when unnamed); an unnamed
    ad-hoc evaluation (``custom``: the options that make it one) takes the next free
    ``<checkpoint>.adhoc-N.json`` instead, so the run's own evaluation is never replaced."""
    if src.checkpoint is None:
        raise FlowrlError("without a checkpoint there is nowhere beside it to write", where="-o",
                          hint="pass -o results.json")
    if name is not None and (not name.strip() or any(c in name for c in "/\\\0") or name in (".", "..")):
        raise FlowrlError(f"--name {name!r} is not a file name part (no slashes, not empty)", where="--name",
                          hint="a word such as 'geneval' gives <checkpoint>.geneval.json; -o PATH writes elsewhere")
    if name is not None or not custom:
        return src.checkpoint.parent / f"{src.checkpoint.name}.{name or 'eval'}.json"
    n = 1
    while (path := src.checkpoint.parent / f"{src.checkpoint.name}.adhoc-{n}.json").exists():
        n += 1
    return path


def custom_options(given: dict[str, bool]) -> list[str]:
    """The flags given (``{flag: given}``) that make this evaluation differ from the run's own:
    its numbers then are not the ones the run logged."""
    return [flag for flag, was_given in given.items() if was_given]


def refuse_suite_options(reward_set, suite_prompts, limit) -> None:
    """The options of ``--suite`` without it."""
    suite_only = [flag for flag, given in (("--reward-set", bool(reward_set)),
                                           ("--suite-prompts", suite_prompts is not None),
                                           ("--limit", limit is not None)) if given]
    if suite_only:
        raise FlowrlError(f"{', '.join(suite_only)} only appl{'ies' if len(suite_only) == 1 else 'y'} with --suite",
                          where=suite_only[0], hint="add --suite NAME (ocr, drawbench, geneval), or drop them")


def check_arguments(source, model, reward, output) -> None:
    """Every missing argument at once (not one per attempt)."""
    missing = []
    if source is None and model is None:
        missing.append("SOURCE or --model NAME (what to evaluate: a run directory, a checkpoint directory, "
                       "a recipe file, or a registered model)")
    if model is not None and source is None and not reward:
        missing.append("--reward NAME (a model alone brings no rewards)")
    no_checkpoint = (model is not None and source is None) or (source is not None and Path(source).suffix == ".toml")
    if output is None and no_checkpoint:
        missing.append("-o PATH (without a checkpoint there is nowhere beside it to write the result)")
    if missing:
        raise FlowrlError(
            f"eval is missing {len(missing)} argument(s): " + "; ".join(missing), where="flowrl eval",
            hint="flowrl eval runs/my_run  or  flowrl eval recipes/x.toml -o base.json  or  "
                 "flowrl eval --model embedded --reward area -o results.json (pass -o where there is no checkpoint)",
        )


@dataclasses.dataclass
class EvalPlan:
    """What is sampled: the items, how their noise is drawn, and how many per batch."""

    protocol: str  # "run": the run's own evaluation; "explicit": prompts and seeds given
    prompts: list[str]
    seeds: int
    items: list
    batch_size: int
    noise_of: Callable | None  # None: flowrl sample's noise, keyed by (seed, prompt, k)


def plan_evaluation(prompt, prompts, num_prompts, seeds, batch_size, src, policy, seed: int) -> EvalPlan:
    """The run's own evaluation set, unless prompts or seeds are given (or there is none)."""
    from ..train.evaluate import evaluation_items, evaluation_noise, evaluation_set
    from .inference import Item, make_items, read_prompt_list

    explicit = bool(prompt) or prompts is not None or num_prompts is not None or seeds is not None
    run_prompts = [] if explicit or not src.from_recipe else evaluation_set(src.recipe, policy)
    if not run_prompts:
        plist = read_prompt_list(prompt, prompts, num_prompts or 0, src, policy)
        k = seeds or 1
        return EvalPlan("explicit", plist, k, make_items(plist, k), batch_size or 8, None)
    recipe = src.recipe
    k = recipe.prompts.eval_seeds
    n = len(run_prompts)  # item j is prompt j mod n with seed index j // n
    items = [Item(j, j % n, p, s) for j, (p, s) in enumerate(evaluation_items(run_prompts, k))]
    shape = policy.latent_shape

    def noise_of(item):
        return evaluation_noise(shape, seed, [item.index])[0]

    # training evaluates in batches of 4 micro-batches; the same batches give the same numbers
    return EvalPlan("run", run_prompts, k, items, batch_size or recipe.train.micro_batch_size * 4, noise_of)


@app.command("eval")
def evaluate(
    source: SourceArg = None,
    set_: SetOpt = None,
    model: Annotated[Optional[str], typer.Option("--model", help="Evaluate a registered model without a recipe (needs --reward).")] = None,
    checkpoint: CheckpointOpt = None,
    reward: Annotated[Optional[list[str]], typer.Option("--reward", "-r", help="A registered reward with default params (repeatable); default: the recipe's rewards. With --suite drawbench: the one reward that scores it (default pickscore).")] = None,
    prompt: PromptOpt = None,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="A text file, one prompt a line (default: the run's own evaluation prompts).")] = None,
    num_prompts: Annotated[Optional[int], typer.Option("--num-prompts", min=0, help="Use the first N prompts of the pool (0 = all; default: the run's own evaluation prompts).")] = None,
    seeds: Annotated[Optional[int], typer.Option("--seeds", min=1, help="Images per prompt (default: the run's eval_seeds, else 1); with --suite, passes over the suite's images, each from new noise (default 1).")] = None,
    seed: SeedOpt = None,
    steps: Annotated[Optional[int], typer.Option("--steps", min=1, help="Sampling steps (default: the recipe's [log].eval_steps, else its [sampler].steps).")] = None,
    schedule: ScheduleOpt = "auto",
    hybrid_steps: Annotated[int, typer.Option("--hybrid-steps", min=0, help="First K steps from the trained model, the rest from the base.")] = 0,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", min=1, help="Images per batch (default: the run's evaluation batch, else 8).")] = None,
    device: DeviceOpt = None,
    name: Annotated[Optional[str], typer.Option("--name", help="Result name: <checkpoint>.<name>.json (default: eval; other prompts, seeds or settings: the next <checkpoint>.adhoc-N.json).")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="JSON path (default: beside the checkpoint).")] = None,
    save_images: Annotated[Optional[Path], typer.Option("--save-images", help="Also write the PNGs to this directory.")] = None,
    suite: Annotated[Optional[str], typer.Option("--suite", help="A benchmark: ocr, drawbench, geneval (flowrl.suites), or one the model carries (embedded_compose: geneval); its prompts, images per prompt, steps and scorer, tabulated per category and overall.")] = None,
    reward_set: Annotated[Optional[list[str]], typer.Option("--reward-set", help="With --suite: a parameter of the suite's reward, key=value (TOML value; repeatable), e.g. --reward-set detector=models/owlv2.")] = None,
    suite_prompts: Annotated[Optional[Path], typer.Option("--suite-prompts", help="With --suite: the suite's prompt file in place of its default (drawbench: the fetched data/prompts/drawbench.csv).")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="With --suite: only its first N prompts (smoke runs); the result is named <suite>-firstN.")] = None,
) -> None:
    """Score a checkpoint as the run evaluates it (or given prompts and seeds); JSON beside it."""
    from .inference import check_prompts_scorable, prepare, refuse_run_without_checkpoint, resolve_sigmas

    start_time = time.perf_counter()
    if suite is not None:
        return run_suite(suite, source, set_, model, checkpoint, seed, steps, schedule, batch_size, device, name,
                         output, save_images, seeds or 1, conflicting={"--reward": bool(reward), "--prompt": bool(prompt),
                                                           "--prompts": prompts is not None,
                                                           "--num-prompts": num_prompts is not None,
                                                           "--hybrid-steps": hybrid_steps > 0},
                         start_time=start_time, reward=list(reward or []), reward_set=list(reward_set or []),
                         suite_prompts=suite_prompts, limit=limit)
    refuse_suite_options(reward_set, suite_prompts, limit)
    check_arguments(source, model, reward, output)
    refuse_run_without_checkpoint(source, checkpoint, "evaluate", "flowrl eval {recipe} -o base_eval.json")
    custom = custom_options({
        "--prompt": bool(prompt), "--prompts": prompts is not None, "--num-prompts": num_prompts is not None,
        "--seeds": seeds is not None, "--seed": seed is not None, "--steps": steps is not None,
        "--schedule": schedule != "auto", "--hybrid-steps": hybrid_steps > 0, "--reward": bool(reward),
        "--batch-size": batch_size is not None, "--set": bool(set_)})
    check = functools.partial(check_outputs_of, output=output, name=name, custom=custom, save_images=save_images)
    src, dev, ctx, policy, base = prepare(source, model, set_, checkpoint, device, hybrid_steps, before_load=check)
    ema = evaluated_ema(src, policy)
    path = output or default_eval_path(src, name, custom)
    rewards = build_rewards(src, list(reward or []))
    if steps is None and src.from_recipe and src.recipe.log.eval_steps:
        steps = src.recipe.log.eval_steps  # the run's own evaluation, reproduced
    sigmas = resolve_sigmas(schedule, steps, src, policy).to(dev)
    base_seed = seed if seed is not None else src.recipe.run.seed
    plan = plan_evaluation(prompt, prompts, num_prompts, seeds, batch_size, src, policy, base_seed)
    check_prompts_scorable(reward or [c.use for c in src.recipe.rewards], plan.prompts)  # before sampling
    records = score_items(plan, policy, base, sigmas, rewards, ctx, base_seed, hybrid_steps, save_images)
    if not ctx.is_main:
        return
    from ..artefacts import ARTEFACT_MEASURES
    from ..train.checkpoint import checkpoint_iteration

    write_result(Path(path), {
        "source": src.label,
        "checkpoint": str(src.checkpoint) if src.checkpoint else None,
        "iteration": checkpoint_iteration(src.checkpoint),
        "rewards": {label: summarize([r["scores"][label] for r in records]) for label, _ in rewards},
        "artefacts": {label: summarize([r["scores"][label] for r in records]) for label in ARTEFACT_MEASURES},
        "settings": {
            "model": src.recipe.components["model"].use, "steps": len(sigmas) - 1, "sigmas": sigmas.cpu().tolist(),
            "protocol": plan.protocol, "seed": base_seed, "seeds_per_prompt": plan.seeds,
            "num_prompts": len(plan.prompts), "batch_size": plan.batch_size,
            "hybrid_steps": hybrid_steps, "world_size": ctx.world_size, "ema": ema,
            "mixed_precision": src.recipe.distributed.mixed_precision,
        },
        "per_image": records,
        "elapsed_s": time.perf_counter() - start_time,
    })
    if output is None and name is None and custom:
        console.print(f"an ad-hoc evaluation ({', '.join(custom)}), kept apart from the run's own "
                      f"{src.checkpoint.name}.eval.json (written by `flowrl eval` without these options)")


def check_outputs_of(src, *, output, name, custom, save_images) -> None:
    """:func:`check_outputs` for the source's default result path: before the model loads."""
    check_outputs(Path(output or default_eval_path(src, name, custom)), output is not None, save_images)


def check_outputs(path: Path, named: bool, save_images: Path | None) -> None:
    """The result's file and the images' folder can be written: one message now, not a traceback
    after the evaluation."""
    from ..files import ensure_writable

    ensure_writable(path, where="--output" if named else "the evaluation's file beside the checkpoint", directory=False)
    if save_images is not None:
        ensure_writable(Path(save_images), where="--save-images", directory=True)


def evaluated_ema(src, policy) -> bool:
    """Load the checkpoint's EMA weights into ``policy`` when the run evaluated them (``[ema]
    evaluate = true``), so that its evaluation here is the run's own; whether it did."""
    if not (src.checkpoint is not None and src.from_recipe and src.recipe.ema.enabled and src.recipe.ema.evaluate):
        return False
    from ..train.ema import load_ema_weights

    load_ema_weights(policy.denoiser, src.checkpoint)
    return True


def score_items(plan: EvalPlan, policy, base, sigmas, rewards, ctx, seed: int, hybrid_steps: int, save_images) -> list[dict]:
    """Sample this process's share of the items, score them with every reward; all records on
    the main process, in item order."""
    from ..artefacts import ARTEFACT_MEASURES
    from ..interfaces import scores_latents
    from ..prompts import reward_metadata
    from ..rewards import score
    from .inference import generate, save_png, shard

    if save_images is not None:
        Path(save_images).mkdir(parents=True, exist_ok=True)
    records = []
    mine = shard(plan.items, ctx.rank, ctx.world_size, plan.batch_size)
    for batch, images, latents in generate(policy, mine, sigmas, seed=seed,
                                  batch_size=plan.batch_size, hybrid_steps=hybrid_steps, base=base,
                                  noise_of=plan.noise_of, with_latents=True):
        batch_prompts = [it.prompt for it in batch]
        metadata = reward_metadata(batch_prompts, images)  # condition images, as the run's evaluation gives them
        scores = {label: score(r, latents if scores_latents(r) else images, batch_prompts, metadata,
                               name=label).scores.tolist()
                  for label, r in rewards}
        scores.update({label: measure(images).tolist() for label, measure in ARTEFACT_MEASURES.items()})
        for j, it in enumerate(batch):
            records.append({"index": it.index, "prompt_index": it.prompt_index, "prompt": it.prompt,
                            "seed_index": it.seed_index, "scores": {k: v[j] for k, v in scores.items()}})
            if save_images is not None:
                save_png(images[j], Path(save_images) / f"{it.prompt_index:05d}_{it.seed_index:02d}.png")
    return gather_records(records, ctx)


def write_result(path: Path, result: dict) -> None:
    from ..files import write_text_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(result, indent=1))
    console.print("mean +- standard error of the mean, over n images:")
    for label, stats in (result["rewards"] | result.get("artefacts", {})).items():
        console.print(f"{label}: {stats['mean']:.4f} +- {stats['sem']:.4f} (n = {stats['n']})")
    console.print(f"wrote {path}")


def run_suite(name: str, source, set_, model, checkpoint, seed, steps, schedule, batch_size, device, result_name,
              output, save_images, repeats: int, conflicting: dict[str, bool], start_time: float,
              reward: list[str] | None = None, reward_set: list[str] | None = None,
              suite_prompts: Path | None = None, limit: int | None = None) -> None:
    """``flowrl eval --suite NAME``: a benchmark (:mod:`flowrl.suites`), sampled from fixed noise
    with deterministic ODE sampling, each image scored by the suite, its table (per category and
    overall, with standard errors) printed and written as JSON. The suite is the one the model
    carries by that name (:class:`flowrl.interfaces.BenchmarkSuite`), else flowrl's
    (:data:`flowrl.suites.SUITES`: a prompt set scored by a reward). ``repeats`` (``--seeds``)
    draws the suite's images that many times, each pass from new noise; the first pass is the
    suite's own images, so a table with more seeds extends one with fewer. ``limit``: the first
    N prompts only."""
    from .inference import resolve_sigmas

    reward, reward_set = list(reward or []), list(reward_set or [])
    check_suite_arguments(name, source, model, checkpoint, output, reward, conflicting)
    src, dev, ctx, policy, run, default_name = load_suite(name, source, set_, model, checkpoint, device, reward,
                                                          reward_set, suite_prompts)
    if limit is not None:
        run = run.first(limit)
        default_name += f"-first{limit}"
    sigmas = resolve_sigmas(schedule, steps or run.steps, src, policy).to(dev)
    base_seed = seed if seed is not None else src.recipe.run.seed
    path = Path(output) if output is not None else default_eval_path(src, result_name or default_name, [])
    check_outputs(path, output is not None, save_images)  # before the suite's images are drawn
    records, image_size = sample_suite(run, policy, sigmas, ctx, base_seed, repeats, batch_size, save_images)
    if not ctx.is_main:
        return
    from .. import suites
    from ..files import write_text_atomic
    from ..train.checkpoint import checkpoint_iteration

    table = run.tabulate(records)
    sampled = model_sampling(src, image_size)
    result = {
        "suite": name, "source": src.label, "checkpoint": str(src.checkpoint) if src.checkpoint else None,
        "iteration": checkpoint_iteration(src.checkpoint), **table,
        "settings": {"model": src.recipe.components["model"].use, "steps": len(sigmas) - 1,
                     "sigmas": sigmas.cpu().tolist(), "seed": base_seed, "images": len(records), "repeats": repeats,
                     "description": run.description, "world_size": ctx.world_size, "limit": limit,
                     "model_sampling": sampled, **run.settings},
        "per_image": records, "elapsed_s": time.perf_counter() - start_time,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(result, indent=1))
    console.print(suites.text_table(run, table), markup=False)
    differ = suites.setting_differences(run.settings.get("benchmark"), sampled)
    if differ:
        console.print(f"note: {differ} (settings.benchmark and settings.model_sampling record both); a model's "
                      "resolution and guidance are its parameters: --set model.KEY=VALUE where it has them "
                      "(e.g. height, width, cfg_scale)", markup=False)
    console.print(f"wrote {path}")


def check_suite_arguments(name: str, source, model, checkpoint, output, reward: list[str],
                          conflicting: dict[str, bool]) -> None:
    """What ``--suite NAME`` refuses before anything loads: options it replaces (a suite that lets
    the user choose its reward takes one ``--reward``), nothing to evaluate, nowhere to write."""
    from ..suites import SUITES

    spec = SUITES.get(name)
    brings = "prompts, images and scorer"
    if spec is not None and spec.choose_reward:
        conflicting = {flag: given for flag, given in conflicting.items() if flag != "--reward"}
        brings = "prompts and images"
        if len(reward) > 1:
            raise FlowrlError(f"--suite {name} is scored by one reward, got {len(reward)}: {', '.join(reward)}",
                              where="--reward", hint=f"run it once per reward: each writes its own result "
                                                     f"(<checkpoint>.{name}-<reward>.json)")
    given = [flag for flag, was_given in conflicting.items() if was_given]
    if given:
        raise FlowrlError(f"--suite {name} brings its own {brings}, so {', '.join(given)} "
                          f"cannot be combined with it", where="--suite", hint=f"drop {', '.join(given)}")
    if source is None and model is None:
        raise FlowrlError("--suite needs what to evaluate", where="flowrl eval",
                          hint=f"flowrl eval runs/my_run --suite {name}  or  "
                               f"flowrl eval --model embedded_compose --suite {name} -o {name}.json")
    if output is None and (source is None or Path(source).suffix == ".toml"):
        raise FlowrlError("without a checkpoint there is nowhere beside it to write", where="-o",
                          hint=f"pass -o {name}.json")
    from .inference import refuse_run_without_checkpoint  # a run before its first checkpoint

    refuse_run_without_checkpoint(source, checkpoint, "evaluate", "flowrl eval {recipe} -o base_eval.json")


def load_suite(name: str, source, set_, model, checkpoint, device, reward: list[str], reward_set: list[str],
               suite_prompts):
    """The model and the suite to run on it: ``(src, dev, ctx, policy, suite run, result name)``.
    A model that cannot carry suites is evaluated on flowrl's, and everything that can be refused
    (the suite's name, prompt file, reward and its settings, missing extras) is, before it loads;
    one that may carry suites is asked once it has loaded, and flowrl's suite is its fallback."""
    from .. import suites
    from ..interfaces import HasBenchmarkSuites
    from .inference import prepare

    planned: dict = {}

    def before_load(src) -> None:
        model_name = src.recipe.components["model"].use
        if not model_may_carry_suites(model_name):
            planned.update(plan_registered_suite(suites.get_suite(name), reward, reward_set, suite_prompts, model_name))

    src, dev, ctx, policy, _ = prepare(source, model, set_, checkpoint, device, 0, before_load=before_load)
    model_name = src.recipe.components["model"].use
    bench = policy.benchmark_suite(name) if not planned and isinstance(policy, HasBenchmarkSuites) else None
    if bench is not None:
        extra = [flag for flag, was_given in (("--reward", bool(reward)), ("--reward-set", bool(reward_set)),
                                              ("--suite-prompts", suite_prompts is not None)) if was_given]
        if extra:
            raise FlowrlError(f"model '{model_name}' carries its own '{name}' suite (its prompts and scorer), so "
                              f"{', '.join(extra)} do not apply", where="--suite", hint=f"drop {', '.join(extra)}")
        return src, dev, ctx, policy, suites.carried(bench), name
    if not planned:
        planned.update(plan_registered_suite(suites.get_suite(name, carried_by=model_name), reward, reward_set,
                                             suite_prompts, model_name))
    use = planned["choice"].use
    return src, dev, ctx, policy, build_registered_suite(name, planned), (
        name if use == planned["spec"].reward else f"{name}-{use}")


def sample_suite(run, policy, sigmas, ctx, seed: int, repeats: int, batch_size,
                 save_images) -> tuple[list[dict], list | None]:
    """Sample this process's share of the suite's images and score them: ``(records of every image on
    the main process, in item order; the images' [height, width])``."""
    from .inference import Item, generate, save_png, shard

    items = [Item(0, i, p, r * n + k) for r in range(repeats)
             for i, (p, n) in enumerate(zip(run.prompts, run.images_per_prompt)) for k in range(n)]
    items = [dataclasses.replace(it, index=j) for j, it in enumerate(items)]
    if save_images is not None:
        Path(save_images).mkdir(parents=True, exist_ok=True)
    records, image_size = [], None
    size = batch_size or run.batch_size
    for batch, images in generate(policy, shard(items, ctx.rank, ctx.world_size, size), sigmas, seed=seed,
                                  batch_size=size):
        image_size = list(images.shape[-2:])
        verdicts = run.score(images, [it.prompt for it in batch])
        for it, verdict, image in zip(batch, verdicts, images):
            records.append({"index": it.index, "prompt_index": it.prompt_index, "prompt": it.prompt,
                            "category": run.categories[it.prompt_index], "seed_index": it.seed_index, **verdict})
            if save_images is not None:
                save_png(image, Path(save_images) / f"{it.prompt_index:05d}_{it.seed_index:02d}.png")
    return gather_records(records, ctx), image_size


def model_may_carry_suites(model_name: str) -> bool:
    """Whether the registered model may carry benchmark suites (:class:`flowrl.interfaces.HasBenchmarkSuites`):
    its class defines ``benchmark_suite``, or its factory is not a class (then only the built model says)."""
    factory = registry().get("model", model_name).factory
    return not isinstance(factory, type) or callable(getattr(factory, "benchmark_suite", None))


def plan_registered_suite(spec, reward: list[str], reward_set: list[str], suite_prompts, model_name: str) -> dict:
    """Everything about a :data:`flowrl.suites.SUITES` suite that can be checked before a model
    loads: its prompts, its reward (``--reward`` where the suite lets the user choose, else its
    own) with its settings (the suite's defaults, then ``--reward-set``), checked as a recipe's
    ``[[rewards]]`` entry is; the settings and packages the reward needs."""
    from ..recipe import component_choice
    from .reward_common import parse_settings

    file, prompts, categories = spec.load(suite_prompts)
    use = reward[0] if reward else spec.reward
    registry().get("reward", use, where="--reward")
    user = parse_settings(reward_set)
    settings = {**(spec.reward_settings(file) if use == spec.reward else {}), **user}
    if use == spec.reward:
        spec.check_requirements(settings, model=model_name)
    choice = component_choice(registry(), "reward", {"use": use, **settings}, f"flowrl eval --suite {spec.name}")
    return {"spec": spec, "file": file, "prompts": prompts, "categories": categories, "choice": choice,
            "settings": settings}


def build_registered_suite(name: str, planned: dict):
    """The planned suite with its reward built (an image reward scores a video model's frames)."""
    from ..rewards import for_clips
    from .reward_common import build_chosen

    reward = build_chosen(planned["choice"], command=f"flowrl eval --suite {name}",
                          reads="a benchmark suite scores the decoded images")
    return planned["spec"].prepare(for_clips(reward), planned["choice"].use, planned["file"], planned["prompts"],
                                   planned["categories"], planned["settings"])


def model_sampling(src, image_size) -> dict:
    """The resolution the model sampled at (``height``, ``width`` of its images) and its guidance
    (``cfg_scale`` or ``guidance`` of its parameters; None when it has neither)."""
    params = src.recipe.components["model"].params
    guidance = next((getattr(params, key) for key in ("cfg_scale", "guidance") if hasattr(params, key)), None)
    height, width = image_size if image_size else (None, None)
    return {"height": height, "width": width, "guidance": guidance}
