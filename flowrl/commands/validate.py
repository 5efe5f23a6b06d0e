"""``flowrl validate``: check a recipe without loading a model; ``--explain`` documents every key."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from ..errors import DISTRIBUTION, FlowrlError
from .base import TEXT_WIDTH_WITHOUT_TERMINAL, SetOpt, app, console, load, registry, table_console


@app.command()
def validate(
    recipe: Annotated[Optional[Path], typer.Argument(help="Recipe to check (omit with --explain to document every key).")] = None,
    set_: SetOpt = None,
    explain: Annotated[bool, typer.Option("--explain", help="Print the documentation of every key the recipe can use.")] = False,
    markdown: Annotated[bool, typer.Option("--markdown", help="With --explain and no RECIPE: print docs/reference.md (Markdown).")] = False,
    gpu_memory: Annotated[Optional[float], typer.Option(
        "--gpu-memory", min=1.0, help="Memory of one GPU in GB, for the memory plan's verdict [default: this "
        "machine's GPU, else 80].")] = None,
) -> None:
    """Check a recipe without building anything heavy: tables, keys, types, ranges, components,
    prompt files, trackers' extras."""
    if markdown:
        if recipe is not None or not explain:
            raise FlowrlError("--markdown documents every key of every component: use `flowrl validate --explain --markdown`",
                              where="--markdown", hint="flowrl validate --explain --markdown > docs/reference.md")
        print(reference_markdown(registry()), end="")
        return
    if recipe is None:
        if not explain:
            raise FlowrlError("validate needs a RECIPE path", hint="flowrl validate recipes/quickstart.toml")
        explain_recipe(None)
        return
    resolved = load(recipe, set_)
    from ..recipe import check_startable

    check_startable(resolved, registry())  # what train would reject before building the model
    check_memory(recipe, list(set_ or []), resolved, gpu_memory)
    if explain:
        explain_recipe(resolved)
    c = resolved.components
    console.print(
        f"[green]ok[/green] {escape(str(recipe))}: model={c['model'].use}, kernel={c['kernel'].use}, "
        f"chunker={c['chunker'].use}, selector={c['selector'].use}, loss={c['loss'].use}, "
        f"rewards={[r.label for r in resolved.rewards]}, T={resolved.num_trainable} trainable transitions"
    )


def host_memory_bytes() -> int | None:
    """This machine's RAM in bytes (None where the OS does not say)."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def visible_gpu_memory_gb() -> float | None:
    """The memory of this machine's first CUDA device in GB, when torch sees one."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / 2**30


def check_memory(path: Path, overrides: list[str], resolved, gpu_memory: float | None) -> None:
    """What `flowrl plan` knows before any model loads, said by validate too: a recipe for the
    CPU whose weights and optimizer state alone (exact parameter counts) exceed this machine's
    RAM is an error; a peak beyond it, or beyond a GPU's memory (which validate may not see:
    --gpu-memory, else this machine's GPU, else the plan's 80 GB), is a warning naming the keys
    that would make it fit. The plan works from configs (no weights), at the recipe's
    [distributed].num_processes."""
    from ..memory_plan import CUDA_OVERHEAD, GB, cpu_bytes, estimate, peak
    from .base import DEFAULT_GPU_MEMORY_GB

    inexact = ("CUDA context + allocator slack", "trajectories", "prompt-embedding cache")

    processes = resolved.distributed.num_processes
    on_cpu = resolved.run.device == "cpu"
    memory = None if on_cpu else gpu_memory or visible_gpu_memory_gb() or DEFAULT_GPU_MEMORY_GB

    def plan(recipe) -> tuple[float, str, float, float]:
        """(GPU peak, its phase, the bytes known exactly, the bytes kept in CPU memory)."""
        # fsdp2's gradient_sync "auto" decides against the same GPU memory, as at start-up
        _, _, lines = estimate(recipe, registry(), processes, gpu_memory=None if memory is None else memory * GB)
        total, phase = peak(lines)
        # From exact parameter counts: weights, LoRA, gradients, AdamW state, a reference copy,
        # encoders and VAE (not the activations, trajectories, caches, reward sizes or slack).
        exact = sum(l.bytes for l in lines if l.phase in ("persistent", "cpu") and l.item not in inexact
                    and not l.item.startswith("reward "))
        return total, phase, exact, cpu_bytes(lines)

    try:
        total, phase, exact, host = plan(resolved)
    except FlowrlError:
        return  # `flowrl plan` reports what keeps it from planning; validation stays as it was
    if on_cpu:
        ram = host_memory_bytes()
        if ram is None:
            return
        # On the CPU everything is in RAM (no CUDA context), and every process of the run shares it.
        total, exact = (total - CUDA_OVERHEAD + host) * processes, exact * processes
        limit, what = ram, f"this machine's {ram / GB:.1f} GB of RAM ([run].device = 'cpu')"
        if exact > limit:
            raise FlowrlError(
                f"the model's weights, gradients and optimizer state alone need {exact / GB:.1f} GB "
                f"({processes} process{'es' if processes > 1 else ''}; from exact parameter counts, as `flowrl plan` "
                f"adds them), more than {what}",
                where=f"{resolved.source}: [run].device",
                hint=f"train on a GPU (device = 'auto' or 'cuda'), or a smaller model; `flowrl plan {path}` "
                     "prints every line")
    else:
        limit, what = memory * GB, f"the {memory:g} GB of one GPU"
    if total <= limit:
        return
    said = "see `flowrl plan`'s suggestions"
    if not on_cpu:  # the keys that make it fit, each alone, else all of them together
        def fits(fixes: list[str]) -> bool:
            try:
                return plan(load(path, overrides + fixes))[0] <= limit
            except FlowrlError:
                return False

        candidates = _memory_fixes(resolved)
        alone = [fix for fix in candidates if fits([fix])]
        if alone:
            said = f"each of these makes it fit: {', '.join(_set_flag(f) for f in alone)}"
        elif len(candidates) > 1 and fits(candidates):
            said = f"these together make it fit: {' '.join(_set_flag(f) for f in candidates)}"
        else:
            said = f"no change of these keys makes it fit at {processes} process{'es' if processes > 1 else ''}: " + said
    gpu = "" if on_cpu else f" --gpu-memory {limit / GB:g}"
    from .base import err_console

    err_console.print(
        "[yellow]warning:[/yellow] " + escape(
            f"{resolved.source}: `flowrl plan` estimates a peak of {total / GB:.1f} GB {'in all' if on_cpu else 'per process'} "
            f"(persistent + the {phase} phase, at {processes} process{'es' if processes > 1 else ''}), more than {what}; "
            f"{said} "
            f"(`flowrl plan {path}{gpu}` prints every line)"),
        highlight=False, soft_wrap=True)


def _set_flag(override: str) -> str:
    return f"--set '{override}'" if '"' in override else f"--set {override}"


def _memory_fixes(resolved) -> list[str]:
    """``--set`` overrides that lower the planned peak, each one the recipe does not use yet."""
    t, d, model = resolved.train, resolved.distributed, resolved.components["model"].params
    fixes = []
    if t.micro_batch_size > 1:
        fixes.append("train.micro_batch_size=1")
    if getattr(model, "gradient_checkpointing", True) is False:
        fixes.append("model.gradient_checkpointing=true")
    elif not d.activation_checkpointing and not hasattr(model, "gradient_checkpointing"):
        fixes.append("distributed.activation_checkpointing=true")
    if getattr(model, "offload_encoders", True) is False:
        fixes.append("model.offload_encoders=true")
    if t.finetune == "full":
        fixes.append('train.finetune="lora"')
    if d.num_processes > 1 and d.strategy != "fsdp2":
        fixes.append('distributed.strategy="fsdp2"')
    for i, reward in enumerate(resolved.rewards):
        if getattr(reward.params, "offload", True) is False:
            fixes.append(f"rewards.{i}.offload=true")
    return fixes


def reference_sections(reg, resolved=None, *, distribution: str | None = None) -> list[tuple[str, str, list[tuple[str, str, str, str]]]]:
    """``(title, description, rows)`` for every table a recipe can hold, rows being ``(key,
    type with bounds, default, description)`` from the schema validation uses: the plain
    tables, then every registered component of every component table (only the recipe's own
    components when ``resolved`` is given; only those of one ``distribution``, when given), the
    keys of every ``[[rewards]]`` entry included."""
    from ..config import explain as explain_rows
    from ..recipe import COMPONENT_SECTIONS, LIST_SECTIONS, SECTIONS, RewardEntryConfig

    out = [(f"[{name}]", "", explain_rows(cls)) for name, cls in SECTIONS.items()]
    for section, kind in list(COMPONENT_SECTIONS.items()) + list(LIST_SECTIONS.items()):
        listed = section in LIST_SECTIONS
        brackets = f"[[{section}]]" if listed else f"[{section}]"
        if section == "rewards":
            out.append((f"{brackets} (every entry)", "Keys of every entry, besides `use` and the reward's own.",
                        explain_rows(RewardEntryConfig)))
        if resolved is not None:
            names = sorted({c.use for c in getattr(resolved, section)}) if listed else [resolved.components[section].use]
        else:
            names = [n for n in reg.names(kind)
                     if distribution is None or reg.plugins[reg.get(kind, n).plugin].distribution == distribution]
        default = None if listed else reg.default(kind)
        for name in names:
            comp = reg.get(kind, name)
            note = f" (the default when the recipe has no {brackets} table)" if name == default else ""
            out.append((f'{brackets} use = "{name}"', comp.help + note, explain_rows(comp.params)))
    return out


def explain_recipe(resolved) -> None:
    """One table per recipe table: every key with its type, default and meaning. Piped output
    is not cut to 80 columns (key names never wrap), nor wider than a reader takes in."""
    out = table_console(TEXT_WIDTH_WITHOUT_TERMINAL)
    for title, description, rows in reference_sections(registry(), resolved):
        t = Table(title=escape(f"{title} - {description}" if description else title), title_justify="left")
        t.add_column("key", no_wrap=True)
        t.add_column("type", overflow="fold")
        t.add_column("default", overflow="fold")
        t.add_column("meaning", overflow="fold")
        for row in rows:
            t.add_row(*(escape(str(c)) for c in row))
        if not rows:
            t.add_row("(no parameters)", "", "", "")
        out.print(t)


def reference_markdown(reg) -> str:
    """docs/reference.md: every key of every table and of every component flowrl ships (the
    built-in plugins: other installed plugins are left out)."""
    def cell(text: str) -> str:
        return str(text).replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")

    lines = [
        "# Recipe reference",
        "",
        "Every key of every recipe table and of every registered component: its type (with the bounds",
        "validation enforces), its default and what it does. Generated from the schema the recipe",
        "validator uses by `flowrl validate --explain --markdown > docs/reference.md`;",
        "`tests/test_reference_doc.py` fails when this file is stale. `docs/recipes.md` explains the",
        "format; `flowrl validate --explain RECIPE` prints the keys of one recipe's components.",
        "",
    ]
    for title, description, rows in reference_sections(reg, distribution=DISTRIBUTION):
        lines += [f"## `{title}`", ""]
        if description:
            lines += [cell(description), ""]
        if not rows:
            lines += ["No parameters: `use` only.", ""]
            continue
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        lines += [f"| `{k}` | {cell(t)} | `{cell(d)}` | {cell(h)} |" for k, t, d, h in rows]
        lines.append("")
    return "\n".join(lines)
