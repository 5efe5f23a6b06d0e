"""``flowrl profile``: temporal dynamics of the training sampler, and chunk boundaries from them.

::

    flowrl profile recipes/quickstart_hacking.toml                      # the recipe's model and sampler
    flowrl profile --model embedded --model-param random_init=true --steps 17 --shift 3
    flowrl profile recipes/quickstart_hacking.toml --num-chunks 0 --max-size 6 -o recipes/profiles/embedded.json
    flowrl profile --compare runs/quickstart                    # base model vs the latest checkpoint

Sampling uses exactly what ``flowrl train`` builds from the recipe (a
:class:`flowrl.train.session.Session`: the same components, sigmas and kernels); the curves,
segmentation rules, report and file are in :mod:`flowrl.dynamics`. docs/profile.md explains
the output.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..errors import FlowrlError
from .base import DeviceOpt, SeedOpt, SetOpt, app, console, load, registry, table_console


@app.command()
def profile(
    recipe: Annotated[Optional[Path], typer.Argument(help="Recipe whose model and sampler are profiled (omit to use the options below).")] = None,
    set_: SetOpt = None,
    model: Annotated[Optional[str], typer.Option("--model", help="Model adapter to profile without a recipe (default: the default model).")] = None,
    model_param: Annotated[Optional[list[str]], typer.Option("--model-param", help="A model parameter key=value (TOML value), e.g. random_init=true. Repeatable.")] = None,
    prompts: Annotated[Optional[str], typer.Option("--prompts", help="'model' (the model's own prompts) or a text file, one prompt a line.")] = None,
    num_prompts: Annotated[int, typer.Option("--num-prompts", min=1, help="Prompts profiled (a fixed seeded subset of the source).")] = 32,
    steps: Annotated[Optional[int], typer.Option("--steps", min=2, help="Sampling steps N (default: the recipe's, else 17).")] = None,
    shift: Annotated[Optional[float], typer.Option("--shift", help="Time shift of the 'shift' schedule (default: the recipe's, else 3).")] = None,
    kernel: Annotated[Optional[str], typer.Option("--kernel", help="SDE kernel: flow, dance, cps, ode (default: the recipe's, else flow).")] = None,
    noise: Annotated[Optional[float], typer.Option("--noise", help="The kernel's noise level (flow/cps 'a', dance 'eta').")] = None,
    seeds: Annotated[int, typer.Option("--seeds", min=1, help="Noise seeds per prompt (spread across seeds needs >= 2).")] = 2,
    seed: SeedOpt = None,
    num_chunks: Annotated[Optional[int], typer.Option("--num-chunks", min=0, help="Chunks K for the proposals; 0 = choose (default: the recipe's dynamics chunker, else 4).")] = None,
    min_size: Annotated[Optional[int], typer.Option("--min-size", min=1, help="Smallest chunk size (default 1).")] = None,
    max_size: Annotated[Optional[int], typer.Option("--max-size", min=0, help="Largest chunk size, 0 = no limit (default 0).")] = None,
    curve: Annotated[Optional[str], typer.Option("--curve", help="Curve whose proposals are shown and drawn: l1rel, l1rel_norm, x0_change, v_change.")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Trajectories per batch (results do not depend on it).")] = 64,
    device: DeviceOpt = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output directory, or a .json path (the PNG goes beside it). Default profiles/<name>, or RUN_DIR/profile with --compare.")] = None,
    compare: Annotated[Optional[Path], typer.Option("--compare", help="A run directory: profile its base model and its latest checkpoint with the same noise.")] = None,
    plot: Annotated[bool, typer.Option("--plot/--no-plot", help="Write the PNG plot.")] = True,
) -> None:
    """Profile the sampler's temporal dynamics (L1rel, x0_hat and velocity change) and propose chunks."""
    import functools
    import time

    from ..dynamics.measure import CURVES, pick_prompts
    from ..prompts import read_prompts
    from ..train.session import Session

    t_start = time.perf_counter()
    if curve is not None and curve not in CURVES:
        raise FlowrlError(f"unknown curve '{curve}'", where="--curve", hint=f"valid: {', '.join(CURVES)}")
    resolved, overrides = _resolve_recipe(recipe, compare, model, set_, steps, shift, kernel, noise, model_param)
    seg = _segmentation_settings(resolved, num_chunks, min_size, max_size, curve)
    seed = resolved.run.seed if seed is None else seed
    name = resolved.run.name if recipe is not None else resolved.components["model"].use
    _check_output(output, compare, Path("profiles") / name)  # before the model loads and samples
    # Rewards and trackers play no part in sampling and can be heavy: leave them out.
    from ..distributed import resolve_device

    session = Session.open(resolved, registry(), device=resolve_device(device, where="--device") if device else None,
                           rewards=False, trackers=False)
    source = prompts or resolved.prompts.source
    chosen = pick_prompts(read_prompts(source, session.model, "--prompts"), num_prompts, seed)
    recipe_used = str(compare / "recipe.toml") if compare else (str(recipe) if recipe else None)
    settings = _profile_settings(resolved, session, recipe_used, overrides, source, chosen, batch_size)
    kwargs = dict(num_seeds=seeds, seed=seed, batch_size=batch_size, image_from=resolved.sampler.image_from,
                  reduction=resolved.sampler.logprob_reduction, num_chunks=seg["num_chunks"],
                  min_size=seg["min_size"], max_size=seg["max_size"] or None)
    measure = functools.partial(_measure_profile, session, chosen, kwargs, settings, t_start)
    if compare is None:
        _write_profile(measure("profiling"), output, Path("profiles") / name, seg["curve"], plot)
    else:
        _write_comparison(measure, session, compare, output, seg["curve"], plot)


# ----------------------------------------------------------------------------- recipes


def _resolve_recipe(recipe, compare, model, set_, steps, shift, kernel, noise, model_param):
    """The recipe to profile and the overrides applied to it: the run's recipe (``--compare``), the
    given RECIPE, or one built from the options alone."""
    if compare is not None:
        if recipe is not None or model is not None:
            raise FlowrlError("--compare takes the recipe from the run directory", where="--compare",
                              hint="drop the RECIPE argument and --model")
        return _run_recipe(compare, set_, steps, shift, kernel, noise, model_param)
    if recipe is not None:
        if model is not None:
            raise FlowrlError("--model is for profiling without a recipe", where="--model",
                              hint="change the recipe's model with --set model.use=NAME")
        return _recipe_with_options(recipe, list(set_ or []), steps, shift, kernel, noise, model_param)
    if set_:
        raise FlowrlError("--set needs a RECIPE", where="--set", hint="use --model, --steps, --shift, --kernel, --noise")
    return _recipe_from_options(model, model_param, steps, shift, kernel, noise), []


def _noise_override(reg, kernel_name: str, noise: float) -> str:
    """``--noise`` names no key: it sets the kernel's one float parameter (flow/cps a, dance eta)."""
    import dataclasses

    comp = reg.get("kernel", kernel_name, where="--kernel")
    fields = [f.name for f in dataclasses.fields(comp.params) if f.type in ("float", float)] if comp.params else []
    if len(fields) != 1:
        raise FlowrlError(
            f"kernel '{kernel_name}' has no single noise parameter for --noise (parameters: {fields or 'none'})",
            where="--noise", hint="set the parameter with --set kernel.NAME=VALUE",
        )
    return f"kernel.{fields[0]}={noise!r}"


def _option_overrides(reg, kernel_name, steps, shift, kernel, noise, model_param) -> list[str]:
    out = []
    if steps is not None:
        out.append(f"sampler.steps={steps}")
    if shift is not None:
        out.append(f"schedule.shift={shift!r}")
    if kernel is not None:
        out.append(f"kernel.use={json.dumps(kernel)}")
    if noise is not None:
        out.append(_noise_override(reg, kernel or kernel_name, noise))
    for item in model_param or []:
        if "=" not in item:
            raise FlowrlError(f"--model-param '{item}' must look like key=value", where="--model-param")
        out.append(f"model.{item}")
    return out


def _with_kernel(validated, overrides: list[str]):
    """``validated(overrides)``, the recipe. A deterministic kernel (``--kernel ode``) leaves no
    trainable transition, which validation refuses for a training recipe; a profile never trains,
    so the recipe is validated with its own kernel and the ODE kernel put in its place after."""
    if 'kernel.use="ode"' not in overrides:
        return validated(overrides)
    from ..recipe.loading import component_choice
    from ..recipe.validation import trainable_transitions

    recipe = validated([o for o in overrides if not o.startswith("kernel.")])
    recipe.components["kernel"] = component_choice(registry(), "kernel", {"use": "ode"}, "--kernel")
    recipe.num_trainable = trainable_transitions(recipe, registry())  # 0: no proposals, the curves only
    return recipe


def _recipe_with_options(path: Path, overrides, steps, shift, kernel, noise, model_param):
    from ..recipe import read_toml

    kernel_name = (read_toml(path).get("kernel") or {}).get("use") or registry().default("kernel")
    overrides = overrides + _option_overrides(registry(), kernel_name, steps, shift, kernel, noise, model_param)
    return _with_kernel(lambda chosen: load(path, chosen), overrides), overrides


def _run_recipe(run_dir: Path, set_, steps, shift, kernel, noise, model_param):
    from ..train.checkpoint import latest_checkpoint

    if not (run_dir / "recipe.toml").is_file():
        raise FlowrlError(f"no recipe.toml in {run_dir}", where="--compare", hint="pass the directory of a `flowrl train` run")
    if latest_checkpoint(run_dir) is None:  # before the base model is profiled, not after
        raise FlowrlError(f"{run_dir} has no checkpoint", where="--compare",
                          hint="train first, or wait for the first checkpoint")
    return _recipe_with_options(run_dir / "recipe.toml", list(set_ or []), steps, shift, kernel, noise, model_param)


def _recipe_from_options(model, model_param, steps, shift, kernel, noise):
    """A recipe holding only what sampling needs, validated like any recipe (no rewards)."""
    from ..recipe import apply_overrides, validate

    reg = registry()
    model = model or reg.default("model")
    if model is None:
        raise FlowrlError("no model to profile", where="--model", hint=f"valid: {', '.join(reg.names('model'))}")
    kernel_name = kernel or "flow"
    data: dict[str, Any] = {
        "run": {"name": "profile"},
        "model": {"use": model},
        "sampler": {"steps": 17},
        "schedule": {"use": "shift", "shift": 3.0},
        "kernel": {"use": "flow"},  # the kernel's own defaults (flow: a = 0.7, the paper's setting)
    }

    def validated(overrides: list[str]):
        return validate(apply_overrides(copy.deepcopy(data), overrides), source="options", registry=reg,
                        require_rewards=False)

    return _with_kernel(validated, _option_overrides(reg, kernel_name, steps, shift, kernel, noise, model_param))


def _segmentation_settings(resolved, num_chunks, min_size, max_size, curve) -> dict[str, Any]:
    """Command-line values, else the recipe's dynamics chunker, else K = 4 and no size limits."""
    base: dict[str, Any] = {"num_chunks": 4, "min_size": 1, "max_size": 0, "curve": "l1rel"}
    chunker = resolved.components["chunker"]
    if chunker.use == "dynamics" and chunker.params is not None:
        base.update({k: getattr(chunker.params, k) for k in base})
    for key, value in (("num_chunks", num_chunks), ("min_size", min_size), ("max_size", max_size), ("curve", curve)):
        if value is not None:
            base[key] = value
    return base


def _load_trained(session, run_dir: Path) -> Path:
    """Load the run's latest trained weights into the session's model."""
    from ..train.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise FlowrlError(f"{run_dir} has no checkpoint", where="--compare", hint="train first, or wait for the first checkpoint")
    session.load_policy(ckpt)
    return ckpt


# ----------------------------------------------------------------------------- measuring


def _profile_settings(resolved, session, recipe_used, overrides, source, prompts, batch_size) -> dict[str, Any]:
    """What the profile file records about how it was made."""
    return {
        "recipe": recipe_used,
        "overrides": overrides,
        "model": resolved.components["model"].as_table(),
        "schedule": resolved.components["schedule"].as_table(),
        "kernel": resolved.components["kernel"].as_table(),
        "steps": resolved.sampler.steps,
        "sde_window": list(resolved.sampler.sde_window),
        "logprob_reduction": resolved.sampler.logprob_reduction,
        "prompts_source": source,
        "prompts": prompts,
        "device": str(session.device),
        "batch_size": batch_size,
    }


def _measure_profile(session, prompts, kwargs, settings, t_start: float, label: str, **more_settings) -> dict[str, Any]:
    """Profile the session's model as it is now: the ``profile.json`` dict."""
    return _finish(_measure(session, prompts, kwargs, {**settings, **more_settings}, label), t_start)


def _write_profile(data, output: Optional[Path], default_dir: Path, curve: str, plot: bool) -> None:
    """Write the profile (and its plot) and print its report."""
    from ..dynamics.profile_file import write_profile
    from ..dynamics.report import plot_profile, print_profile

    json_path, png_path = _paths(output, default_dir, "profile")
    write_profile(json_path, data)
    print_profile(table_console(), data, curve)
    console.print(f"wrote {json_path}")
    if plot:
        plot_profile(data, png_path, curve=curve)
        console.print(f"wrote {png_path}")


def _write_comparison(measure, session, run_dir: Path, output: Optional[Path], curve: str, plot: bool) -> None:
    """Profile the run's base model, then its latest checkpoint with the same noise; write both
    profiles, their comparison (and its plot), and print the comparison."""
    from ..dynamics.profile_file import write_json, write_profile
    from ..dynamics.report import compare_profiles, plot_profile, print_comparison

    base = measure("base model", weights="base")
    ckpt = _load_trained(session, run_dir)
    trained = measure(f"checkpoint {ckpt.name}", weights=str(ckpt))
    out_dir = output if output is not None else run_dir / "profile"
    write_profile(out_dir / "base.json", base)
    write_profile(out_dir / "trained.json", trained)
    summary = compare_profiles(base, trained)
    summary["checkpoint"] = str(ckpt)
    write_json(out_dir / "compare.json", summary)
    print_comparison(table_console(), base, trained, summary, curve)
    console.print(f"wrote {out_dir / 'base.json'}, {out_dir / 'trained.json'}, {out_dir / 'compare.json'}")
    if plot:
        plot_profile(trained, out_dir / "compare.png", curve=curve, base=base)
        console.print(f"wrote {out_dir / 'compare.png'}")


def _measure(session, prompts, kwargs, settings, label):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..dynamics.measure import profile_model

    total = kwargs["num_seeds"] * len(prompts)
    with Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task(label, total=total)
        try:
            return profile_model(
                session.encoding_model, session.sampler.sigmas, session.sampler.kernels, prompts, settings=settings,
                progress=lambda done, _: progress.update(task, completed=done), **kwargs,
            )
        except ValueError as exc:
            raise FlowrlError(str(exc), where="flowrl profile",
                              hint="check --num-chunks, --min-size and --max-size against T") from exc


def _finish(result, t_start: float) -> dict[str, Any]:
    import time

    import torch

    from .. import __version__
    from ..dynamics.profile_file import profile_to_dict

    data = profile_to_dict(result)
    data["settings"].update({
        "flowrl_version": __version__,
        "torch_version": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_s_since_command_start": round(time.perf_counter() - t_start, 2),
    })
    return data


def _check_output(output: Optional[Path], compare: Optional[Path], default_dir: Path) -> None:
    """Where the profile goes can be written (and --compare's several files go to a folder)."""
    from ..files import ensure_writable

    where = "--output" if output is not None else "the default output"
    if compare is None:
        ensure_writable(_paths(output, default_dir, "profile")[0], where=where, directory=False)
        return
    if output is not None and output.suffix == ".json":
        raise FlowrlError("--compare writes several files: give a directory", where="--output")
    ensure_writable(output if output is not None else compare / "profile", where=where, directory=True)


def _paths(output: Optional[Path], default_dir: Path, stem: str) -> tuple[Path, Path]:
    if output is not None and output.suffix == ".json":
        return output, output.with_suffix(".png")
    out_dir = output if output is not None else default_dir
    return out_dir / f"{stem}.json", out_dir / f"{stem}.png"


