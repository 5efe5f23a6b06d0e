"""``flowrl profile``: temporal dynamics of the training sampler, and chunk boundaries from them.

::

    flowrl profile recipes/quickstart.toml                      # the recipe's model and sampler
    flowrl profile --model embedded --model-param random_init=true --steps 17 --shift 3
    flowrl profile recipes/quickstart.toml --num-chunks 0 --max-size 6 -o recipes/profiles/embedded.json
    flowrl profile --compare runs/quickstart                    # base model vs the latest checkpoint

Sampling uses exactly what ``flowrl train`` builds from the recipe (:func:`flowrl.engine.build_components`,
the schedule's sigmas, :func:`flowrl.sampling.make_kernels`, :func:`flowrl.sampling.rollout`);
the curves and segmentation rules are in :mod:`flowrl.profiling`, the file in
:mod:`flowrl.profile_io`. docs/profile.md explains the output.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..cli import SetOpt, _load, _registry, app, console
from ..errors import FlowrlError, RecipeError

_METHOD_STYLE = {"dp": ("tab:red", "-"), "curvature": ("tab:blue", "--"), "derivative": ("tab:green", ":")}


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
    seed: Annotated[Optional[int], typer.Option("--seed", help="Base seed (default: the recipe's run.seed, else 42).")] = None,
    num_chunks: Annotated[Optional[int], typer.Option("--num-chunks", min=0, help="Chunks K for the proposals; 0 = choose (default: the recipe's dynamics chunker, else 4).")] = None,
    min_size: Annotated[Optional[int], typer.Option("--min-size", min=1, help="Smallest chunk size (default 1).")] = None,
    max_size: Annotated[Optional[int], typer.Option("--max-size", min=0, help="Largest chunk size, 0 = no limit (default 0).")] = None,
    curve: Annotated[Optional[str], typer.Option("--curve", help="Curve whose proposals are shown and drawn: l1rel, l1rel_norm, x0_change, v_change.")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Trajectories per batch (results do not depend on it).")] = 64,
    device: Annotated[Optional[str], typer.Option("--device", help="'auto', 'cpu', 'cuda' (default: the recipe's run.device).")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output directory, or a .json path (the PNG goes beside it). Default profiles/<name>, or RUN_DIR/profile with --compare.")] = None,
    compare: Annotated[Optional[Path], typer.Option("--compare", help="A run directory: profile its base model and its latest checkpoint with the same noise.")] = None,
    plot: Annotated[bool, typer.Option("--plot/--no-plot", help="Write the PNG plot.")] = True,
) -> None:
    """Profile the sampler's temporal dynamics (L1rel, x0_hat and velocity change) and propose chunks."""
    import time

    from ..profiling import CURVES

    t_start = time.perf_counter()
    if curve is not None and curve not in CURVES:
        raise FlowrlError(f"unknown curve '{curve}'", where="--curve", hint=f"valid: {', '.join(CURVES)}")
    if compare is not None:
        if recipe is not None or model is not None:
            raise FlowrlError("--compare takes the recipe from the run directory", where="--compare",
                              hint="drop the RECIPE argument and --model")
        resolved, overrides = _run_recipe(compare, set_, steps, shift, kernel, noise, model_param)
    elif recipe is not None:
        if model is not None:
            raise FlowrlError("--model is for profiling without a recipe", where="--model",
                              hint="change the recipe's model with --set model.use=NAME")
        resolved, overrides = _recipe_with_options(recipe, list(set_ or []), steps, shift, kernel, noise, model_param)
    else:
        if set_:
            raise FlowrlError("--set needs a RECIPE", where="--set", hint="use --model, --steps, --shift, --kernel, --noise")
        resolved, overrides = _recipe_from_options(model, model_param, steps, shift, kernel, noise), []

    seg = _segmentation_settings(resolved, num_chunks, min_size, max_size, curve)
    seed = resolved.run.seed if seed is None else seed
    sampler = _build_sampler(resolved, device)
    from ..engine import read_prompts
    from ..profiling import pick_prompts

    source = prompts or resolved.prompts.source
    chosen = pick_prompts(read_prompts(source, sampler["model"], "--prompts"), num_prompts, seed)
    settings = {
        "recipe": str(compare / "recipe.toml") if compare else (str(recipe) if recipe else None),
        "overrides": overrides,
        "model": resolved.components["model"].as_table(),
        "schedule": resolved.components["schedule"].as_table(),
        "kernel": resolved.components["kernel"].as_table(),
        "steps": resolved.sampler.steps,
        "sde_window": list(resolved.sampler.sde_window),
        "logprob_reduction": resolved.sampler.logprob_reduction,
        "prompts_source": source,
        "prompts": chosen,
        "device": str(sampler["device"]),
        "batch_size": batch_size,
    }
    kwargs = dict(num_seeds=seeds, seed=seed, batch_size=batch_size, image_from=resolved.sampler.image_from,
                  reduction=resolved.sampler.logprob_reduction, num_chunks=seg["num_chunks"],
                  min_size=seg["min_size"], max_size=seg["max_size"] or None)

    if compare is None:
        result = _measure(sampler, chosen, kwargs, settings, "profiling")
        data = _finish(result, t_start)
        name = resolved.run.name if recipe is not None else resolved.components["model"].use
        json_path, png_path = _paths(output, Path("profiles") / name, "profile")
        from ..profile_io import write_profile

        write_profile(json_path, data)
        print_profile(data, seg["curve"])
        console.print(f"wrote {json_path}")
        if plot:
            plot_profile(data, png_path, curve=seg["curve"])
            console.print(f"wrote {png_path}")
        return

    base = _finish(_measure(sampler, chosen, kwargs, {**settings, "weights": "base"}, "base model"), t_start)
    ckpt = _load_trained(sampler["model"], resolved, compare)
    trained = _finish(
        _measure(sampler, chosen, kwargs, {**settings, "weights": str(ckpt)}, f"checkpoint {ckpt.name}"), t_start
    )
    out_dir = output if output is not None else compare / "profile"
    if out_dir.suffix == ".json":
        raise FlowrlError("--compare writes several files: give a directory", where="--output")
    from ..profile_io import write_json, write_profile

    write_profile(out_dir / "base.json", base)
    write_profile(out_dir / "trained.json", trained)
    summary = compare_profiles(base, trained)
    summary["checkpoint"] = str(ckpt)
    write_json(out_dir / "compare.json", summary)
    print_comparison(base, trained, summary, seg["curve"])
    console.print(f"wrote {out_dir / 'base.json'}, {out_dir / 'trained.json'}, {out_dir / 'compare.json'}")
    if plot:
        plot_profile(trained, out_dir / "compare.png", curve=seg["curve"], base=base)
        console.print(f"wrote {out_dir / 'compare.png'}")


# ----------------------------------------------------------------------------- recipes


def _noise_override(registry, kernel_name: str, noise: float) -> str:
    """``--noise`` names no key: it sets the kernel's one float parameter (flow/cps a, dance eta)."""
    import dataclasses

    comp = registry.get("kernel", kernel_name, where="--kernel")
    fields = [f.name for f in dataclasses.fields(comp.params)] if comp.params else []
    if len(fields) != 1:
        raise FlowrlError(
            f"kernel '{kernel_name}' has no single noise parameter for --noise (parameters: {fields or 'none'})",
            where="--noise", hint="set the parameter with --set kernel.NAME=VALUE",
        )
    return f"kernel.{fields[0]}={noise!r}"


def _option_overrides(registry, kernel_name, steps, shift, kernel, noise, model_param) -> list[str]:
    out = []
    if steps is not None:
        out.append(f"sampler.steps={steps}")
    if shift is not None:
        out.append(f"schedule.shift={shift!r}")
    if kernel is not None:
        out.append(f"kernel.use={json.dumps(kernel)}")
    if noise is not None:
        out.append(_noise_override(registry, kernel or kernel_name, noise))
    for item in model_param or []:
        if "=" not in item:
            raise FlowrlError(f"--model-param '{item}' must look like key=value", where="--model-param")
        out.append(f"model.{item}")
    return out


def _recipe_with_options(path: Path, overrides, steps, shift, kernel, noise, model_param):
    from ..recipe import read_toml

    kernel_name = (read_toml(path).get("kernel") or {}).get("use") or _registry().default("kernel")
    overrides = overrides + _option_overrides(_registry(), kernel_name, steps, shift, kernel, noise, model_param)
    return _load(path, overrides), overrides


def _run_recipe(run_dir: Path, set_, steps, shift, kernel, noise, model_param):
    if not (run_dir / "recipe.toml").is_file():
        raise FlowrlError(f"no recipe.toml in {run_dir}", where="--compare", hint="pass the directory of a `flowrl train` run")
    return _recipe_with_options(run_dir / "recipe.toml", list(set_ or []), steps, shift, kernel, noise, model_param)


def _recipe_from_options(model, model_param, steps, shift, kernel, noise):
    """A recipe holding only what sampling needs, validated like any recipe table."""
    from ..config import from_dict
    from ..recipe import COMPONENT_SECTIONS, SECTIONS, Recipe, RunConfig, SamplerConfig, _component, apply_overrides

    registry = _registry()
    model = model or registry.default("model")
    if model is None:
        raise FlowrlError("no model to profile", where="--model", hint=f"valid: {', '.join(registry.names('model'))}")
    kernel_name = kernel or "flow"
    data: dict[str, Any] = {
        "model": {"use": model},
        "sampler": {"steps": 17},
        "schedule": {"use": "shift", "shift": 3.0},
        "kernel": {"use": kernel_name},
    }
    if kernel_name == "flow":
        data["kernel"]["a"] = 0.7  # the paper's setting (GCPO, MixGRPO)
    apply_overrides(data, _option_overrides(registry, kernel_name, steps, shift, kernel, noise, model_param))
    components = {}
    for section, kind in COMPONENT_SECTIONS.items():
        table = data.get(section) or {"use": registry.default(kind)}
        if table.get("use") is None:
            raise RecipeError(f"no default {kind} is registered", where=f"[{section}]")
        components[section] = _component(registry, kind, table, f"options: [{section}]")
    plain = {name: cls() for name, cls in SECTIONS.items()}
    plain["sampler"] = from_dict(SamplerConfig, data["sampler"], where="options: [sampler]")
    plain["run"] = RunConfig(name="profile")
    return Recipe(**plain, components=components, rewards=[], trackers=[], source="options")


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


def _build_sampler(resolved, device_name: Optional[str]) -> dict[str, Any]:
    """Model, sigmas and kernels exactly as :func:`flowrl.engine.train` builds them."""
    import dataclasses

    from ..engine import build_components, build_sampler, resolve_device

    # Rewards and trackers play no part in sampling and can be heavy: leave them out.
    comps = build_components(dataclasses.replace(resolved, rewards=[], trackers=[]), _registry())
    device = resolve_device(device_name or resolved.run.device)
    model = comps.model
    model.to(device)
    sigmas, kernels, _ = build_sampler(resolved, comps, device)
    return {"components": comps, "model": model, "sigmas": sigmas, "kernels": kernels, "device": device}


def _load_trained(model, resolved, run_dir: Path) -> Path:
    """Load the run's latest trainable weights into ``model`` (LoRA attached first if the run used it)."""
    from ..checkpoint import latest_checkpoint, load_checkpoint
    from ..finetune import load_trainable_state_dict, prepare_trainable

    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise FlowrlError(f"{run_dir} has no checkpoint", where="--compare", hint="train first, or wait for the first checkpoint")
    prepare_trainable(model, resolved.train)
    load_trainable_state_dict(model.denoiser, load_checkpoint(ckpt)["model"])
    model.denoiser.requires_grad_(False)
    return ckpt


# ----------------------------------------------------------------------------- measuring


def _measure(sampler, prompts, kwargs, settings, label):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..profiling import profile_model

    total = kwargs["num_seeds"] * len(prompts)
    with Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task(label, total=total)
        try:
            return profile_model(
                sampler["model"], sampler["sigmas"], sampler["kernels"], prompts, settings=settings,
                progress=lambda done, _: progress.update(task, completed=done), **kwargs,
            )
        except ValueError as exc:
            raise FlowrlError(str(exc), where="flowrl profile",
                              hint="check --num-chunks, --min-size and --max-size against T") from exc


def _finish(result, t_start: float) -> dict[str, Any]:
    import time

    import torch

    from .. import __version__
    from ..profile_io import profile_to_dict

    data = profile_to_dict(result)
    data["settings"].update({
        "flowrl_version": __version__,
        "torch_version": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_s_since_command_start": round(time.perf_counter() - t_start, 2),
    })
    return data


def _paths(output: Optional[Path], default_dir: Path, stem: str) -> tuple[Path, Path]:
    if output is not None and output.suffix == ".json":
        return output, output.with_suffix(".png")
    out_dir = output if output is not None else default_dir
    return out_dir / f"{stem}.json", out_dir / f"{stem}.png"


def compare_profiles(base: dict[str, Any], trained: dict[str, Any]) -> dict[str, Any]:
    """Per curve and trainable transition: base mean, trained mean and relative change."""
    positions = base["positions"] or list(range(len(base["trainable"])))
    out: dict[str, Any] = {"format": "flowrl-profile-compare", "positions": positions, "curves": {}, "proposals": {}}
    for name, entry in base["curves"].items():
        b = [entry["mean"][i] for i in positions]
        t = [trained["curves"][name]["mean"][i] for i in positions]
        out["curves"][name] = {
            "base": b, "trained": t,
            "relative_change": [(tv - bv) / bv if bv else None for bv, tv in zip(b, t)],
        }
    for name, by in base["proposals"].items():
        out["proposals"][name] = {
            m: {"base": by[m]["sizes"], "trained": trained["proposals"][name][m]["sizes"]} for m in by
        }
    return out


# ----------------------------------------------------------------------------- reporting


def _fmt(v: Optional[float], spec: str = ".4f") -> str:
    return "-" if v is None else format(v, spec)


def print_profile(data: dict[str, Any], curve: str = "l1rel") -> None:
    """The per-transition table, a sparkline per curve and the boundary proposals (fits 80 columns)."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    from ..profiling import CURVE_HELP, CURVES, sparkline

    s = data["settings"]
    sig = data["sigmas"]
    curves = data["curves"]
    proposals = data["proposals"]
    # an all-ODE sampler trains nothing: show its curves over every transition, without cuts
    positions = data["positions"] or list(range(len(data["trainable"])))

    def table(t):
        return f"{t.get('use')}(" + ", ".join(f"{k}={v}" for k, v in t.items() if k != "use" and v != "") + ")"

    console.print(escape(
        f"flowrl profile: {table(s['model'])}, {s['steps']} steps, {table(s['schedule'])}, kernel {table(s['kernel'])}; "
        f"{s['num_prompts']} prompts x {s['num_seeds']} seeds (seed {s['seed']}); sampled and segmented in "
        f"{data['elapsed_s']:.1f} s"
    ), highlight=False)

    def pct(vals, i):
        return "-" if vals is None or vals[i] is None or vals[i] != vals[i] else f"{100 * vals[i]:.1f}"

    t = Table(title="Per transition: mean over prompts and seeds; cv% = spread / mean across prompts (p) or seeds (s)",
              title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("i", "sigma", "dsigma", "T", "l1rel", "cv%p", "cv%s", "l1r/ds", "x0chg", "cv%p", "vchg"):
        t.add_column(col, justify="right")
    for i in range(len(data["trainable"])):
        t.add_row(
            str(i), f"{sig[i]:.3f}", f"{sig[i] - sig[i + 1]:.3f}", "y" if data["trainable"][i] else "-",
            f"{curves['l1rel']['mean'][i]:.3f}", pct(curves["l1rel"]["prompt_cv"], i), pct(curves["l1rel"]["seed_cv"], i),
            f"{curves['l1rel_norm']['mean'][i]:.3g}", f"{curves['x0_change']['mean'][i]:.3f}",
            pct(curves["x0_change"]["prompt_cv"], i), f"{curves['v_change']['mean'][i]:.3f}",
        )
    console.print(t)

    what = f"the T = {len(positions)} trainable transitions ('|' = dp boundaries)" if proposals else "all transitions"
    t = Table(title=f"Curves over {what}",
              title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("curve", "shape", "min", "max", "cv%p", "cv%s"):
        t.add_column(col, justify="left" if col in ("curve", "shape") else "right")
    for name in CURVES:
        entry = curves[name]
        y = [entry["mean"][i] for i in positions]
        summ = entry.get("summary", {})
        t.add_row(
            name, sparkline(y, proposals[name]["dp"]["boundaries"] if proposals else ()), f"{min(y):.4g}", f"{max(y):.4g}",
            "-" if summ.get("prompt_cv") is None else f"{100 * summ['prompt_cv']:.1f}",
            "-" if summ.get("seed_cv") is None else f"{100 * summ['seed_cv']:.1f}",
        )
        if name == curve:
            # first and second differences of the mean, between consecutive trainable steps
            for label, key, width in (("  d1", "d1", 1), ("  d2", "d2", 2)):
                d = [entry[key][i] for i in positions if i + width < len(entry["mean"]) and i + width in positions]
                if d:
                    t.add_row(label, sparkline(d), f"{min(d):.3g}", f"{max(d):.3g}", "", "", style="dim")
    console.print(t)
    for name in CURVES:
        console.print(escape(f"  {name}: {CURVE_HELP[name]}"), highlight=False)

    if not proposals:
        console.print("no trainable transition (the kernel injects no noise): no chunk proposals")
        return
    limits = s["segmentation"]
    t = Table(
        title=f"Chunk proposals: K = {limits['num_chunks'] or 'chosen'}, sizes in "
        f"[{limits['min_size']}, {limits['max_size'] or 'T'}] (bold: --curve {curve})",
        title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
    )
    for col in ("curve", "method", "sizes", "var.expl.", "layout"):
        t.add_column(col)
    for name in [curve] + [c for c in CURVES if c != curve]:
        y = [curves[name]["mean"][i] for i in positions]
        for method, p in data["proposals"][name].items():
            t.add_row(name, method, str(p["sizes"]), f"{100 * p['explained']:.1f}%", sparkline(y, p["boundaries"]),
                      style="bold" if name == curve else "dim")
    console.print(t)
    for method in data["proposals"][curve]:
        p = data["proposals"][curve][method]
        console.print(escape(f"# {curve}, {method}:\n{p['snippet']}"), highlight=False)


def print_comparison(base, trained, summary, curve: str = "l1rel") -> None:
    from rich.table import Table

    from ..profiling import CURVES, sparkline

    t = Table(title=f"base vs {Path(summary.get('checkpoint', 'trained')).name}: mean over trainable transitions", title_justify="left")
    for col in ("curve", "base", "trained", "largest change", "at position"):
        t.add_column(col)
    for name in CURVES:
        c = summary["curves"][name]
        changes = [abs(v) if v is not None else 0.0 for v in c["relative_change"]]
        j = max(range(len(changes)), key=changes.__getitem__)
        t.add_row(
            name, sparkline(c["base"], lo=min(c["base"] + c["trained"]), hi=max(c["base"] + c["trained"])),
            sparkline(c["trained"], lo=min(c["base"] + c["trained"]), hi=max(c["base"] + c["trained"])),
            f"{100 * c['relative_change'][j]:+.1f}%" if c["relative_change"][j] is not None else "-", str(j),
        )
    console.print(t)
    t = Table(title=f"proposals on {curve}", title_justify="left")
    for col in ("method", "base", "trained"):
        t.add_column(col)
    for method, p in summary["proposals"][curve].items():
        t.add_row(method, str(p["base"]), str(p["trained"]))
    console.print(t)


def plot_profile(data: dict[str, Any], path: Path, *, curve: str = "l1rel", base: dict[str, Any] | None = None) -> Path:
    """Draw every curve (mean with its spread across prompts) and the chunk proposals for ``curve``.

    Top: one panel per curve, red lines at the ``dp`` boundaries. Bottom: the layouts of every
    method as rows of boxes labelled with their sizes. With ``base``, both profiles are drawn
    (``data`` is the trained one) and the layouts of both are listed.
    """
    from ..errors import require

    require("matplotlib", extra="plot", purpose="the flowrl profile plot")
    import matplotlib
    import matplotlib.patches

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..profiling import CURVE_HELP, CURVES

    sig = data["sigmas"]
    n = len(data["trainable"])
    positions = data["positions"]
    xs = list(range(n))
    if not data["proposals"] or (base is not None and not base["proposals"]):
        curve = ""
    ticks = [f"{i}\n{sig[i]:.2f}" for i in xs]
    profiles = [("trained", data)] if base is None else [("base", base), ("trained", data)]
    rows = [(label, method, d["proposals"][curve][method]) for label, d in profiles for method in d["proposals"].get(curve, {})]

    fig = plt.figure(figsize=(12, 7.5 + (0.7 + 0.25 * len(rows) if rows else 0)))
    grid = fig.add_gridspec(3 if rows else 2, 2, height_ratios=[1, 1, 0.16 * len(rows) + 0.2] if rows else [1, 1])
    axes = [fig.add_subplot(grid[r, c]) for r in range(2) for c in range(2)]

    def boundary_x(b: int) -> float:
        return (positions[b - 1] + positions[b]) / 2  # between the two trainable steps it separates

    colours = {"base": "tab:orange", "trained": "black"}
    for ax, name in zip(axes, CURVES):
        for label, d in profiles:
            entry = d["curves"][name]
            mean = entry["mean"]
            colour = colours[label]
            shown = "mean" if base is None else label
            ax.plot(xs, mean, marker="o", ms=3.5, color=colour, label=shown, zorder=4 if label == "base" else 3,
                    ls="--" if label == "base" else "-")
            if entry.get("prompt_std"):
                lo = [m - s for m, s in zip(mean, entry["prompt_std"])]
                hi = [m + s for m, s in zip(mean, entry["prompt_std"])]
                ax.fill_between(xs, lo, hi, color=colour, alpha=0.2, lw=0, label=f"{shown} ± std across prompts")
        for label, d in profiles if rows else ():
            p = d["proposals"][curve]["dp"]
            for k, b in enumerate(p["boundaries"]):
                ax.axvline(boundary_x(b), color="tab:red", ls="--" if label == "base" else "-", lw=1.3, alpha=0.8,
                           label=(f"dp boundaries ({curve})" + ("" if base is None else f", {label}")) if k == 0 else None)
        for i, tr in enumerate(data["trainable"]):
            if not tr and positions:  # all-ODE: nothing is trainable, hatching everything says nothing
                ax.axvspan(i - 0.5, i + 0.5, facecolor="none", hatch="///", edgecolor="0.75", lw=0, zorder=0,
                           label="not trainable")
        cv = data["curves"][name].get("summary", {}).get("prompt_cv")
        ax.set_title(f"{name}" + (f" (mean CV across prompts {100 * cv:.1f}%)" if cv is not None else "")
                     + f"\n{CURVE_HELP[name]}", fontsize=9.5)
        ax.grid(alpha=0.3)
        ax.set_xlim(-0.5, n - 0.5)
        ax.set_xticks(xs)
        ax.set_xticklabels(ticks if name in CURVES[2:] else [], fontsize=7)
    handles, labels = axes[0].get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    axes[0].legend(unique.values(), unique.keys(), fontsize=8, loc="upper right")

    if rows:
        _draw_layouts(fig.add_subplot(grid[2, :]), rows, data, positions, ticks, curve, base is not None)
    else:
        for ax in axes[2:]:
            ax.set_xlabel("transition i (below: sigma_i); nothing trainable, no chunk proposals")

    s = data["settings"]

    def table(t):
        return f"{t.get('use')}(" + ", ".join(f"{k}={v}" for k, v in t.items() if k != "use" and v != "") + ")"

    title = (f"{table(s['model'])}: {s['steps']} steps, schedule {table(s['schedule'])}, "
             f"kernel {table(s['kernel'])}; {s['num_prompts']} prompts x {s['num_seeds']} seeds")
    if base is not None:
        title += f"\nbase model vs {s.get('weights', 'trained')}"
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _draw_layouts(strip, rows, data, positions, ticks, curve, compare):
    """One row of boxes per (profile, method): each box a chunk, labelled with its size."""
    import matplotlib.patches

    n = len(data["trainable"])
    for r, (label, method, p) in enumerate(rows):
        y = len(rows) - 1 - r
        colour = _METHOD_STYLE.get(method, ("k", "-"))[0]
        start = 0
        for k, size in enumerate(p["sizes"]):
            a, b = positions[start] - 0.5, positions[start + size - 1] + 0.5
            strip.add_patch(matplotlib.patches.Rectangle((a, y - 0.4), b - a, 0.8, facecolor=colour,
                                                         alpha=0.55 if k % 2 == 0 else 0.3, edgecolor="white", lw=1.5))
            strip.text((a + b) / 2, y, str(size), ha="center", va="center", fontsize=9)
            start += size
        for i, tr in enumerate(data["trainable"]):
            if not tr:
                strip.add_patch(matplotlib.patches.Rectangle((i - 0.5, y - 0.4), 1, 0.8, facecolor="none",
                                                             hatch="///", edgecolor="0.75", lw=0))
    strip.set_yticks(range(len(rows)))
    strip.set_yticklabels(
        [f"{label + ' ' if compare else ''}{method} {p['sizes']} ({100 * p['explained']:.0f}% var.)"
         for label, method, p in reversed(rows)], fontsize=8,
    )
    strip.set_ylim(-0.6, len(rows) - 0.4)
    strip.set_xlim(-0.5, n - 0.5)
    strip.set_xticks(range(n))
    strip.set_xticklabels(ticks, fontsize=7)
    strip.set_xlabel("transition i (below: sigma_i); hatched = not trainable")
    lim = data["settings"].get("segmentation", {})
    strip.set_title(
        f"chunk proposals from {curve}: K = {lim.get('num_chunks') or 'chosen'}, sizes in "
        f"[{lim.get('min_size', 1)}, {lim.get('max_size') or 'T'}] (boxes = chunks, numbers = sizes)", fontsize=9.5,
    )
