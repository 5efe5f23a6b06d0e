"""``flowrl plan``: the resolved batch geometry and an estimate of peak GPU memory per process.

::

    flowrl plan recipes/chunk_grpo_flux.toml                   # at its [distributed].num_processes (8)
    flowrl plan recipes/chunk_grpo_flux.toml --num-processes 16
    flowrl plan recipes/lora_single_gpu_sd3.toml --gpu-memory 80 --set train.micro_batch_size=2
    flowrl plan recipes/chunk_grpo_flux.toml --num-processes 16 --num-nodes 2 --set distributed.shard=hybrid
    flowrl plan recipes/chunk_grpo_flux.toml --gpu-memory 40     # fsdp2 'auto' gradient sync picks for 40 GB

Needs no GPU and no weights; how the estimate is made: :mod:`flowrl.memory_plan`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .base import DEFAULT_GPU_MEMORY_GB, SetOpt, app, console, load, registry, table_console


@app.command()
def plan(
    recipe: Annotated[Path, typer.Argument(help="Path to a TOML recipe.")],
    set_: SetOpt = None,
    num_processes: Annotated[Optional[int], typer.Option(
        "--num-processes", min=1,
        help="Data-parallel processes (GPUs) to plan for [default: the recipe's [distributed].num_processes].")] = None,
    gpu_memory: Annotated[float, typer.Option("--gpu-memory", min=1.0, max=100_000.0, help="Memory of one GPU in GB, for the verdict.")] = DEFAULT_GPU_MEMORY_GB,
    num_nodes: Annotated[int, typer.Option("--num-nodes", min=1, help="Machines the processes are spread over "
                                           "(hybrid sharding shards within a machine).")] = 1,
) -> None:
    """Print the resolved geometry and an estimate of peak GPU memory per process (no GPU needed)."""
    from rich.markup import escape
    from rich.table import Table

    from ..memory_plan import GB, estimate, host_lines, largest_update_group, peak, startup_peak

    resolved = load(recipe, set_)
    # A recipe written for 8 GPUs planned at one process would say "does not fit" about a run
    # nobody starts that way: plan at the count the recipe states, and say where it came from.
    if num_processes is None:
        num_processes, origin = resolved.distributed.num_processes, "from [distributed].num_processes in the recipe"
    else:
        origin = "from --num-processes"
    geometry, mm, lines = estimate(resolved, registry(), num_processes, num_nodes, gpu_memory=gpu_memory * GB)
    console.print(f"[bold]{escape(str(recipe))}[/bold]: model {resolved.components['model'].use}, "
                  f"finetune {resolved.train.finetune}")
    console.print(f"geometry: {geometry.describe()}")
    processes = f"{num_processes} process{'es' if num_processes > 1 else ''}"
    table = Table(title=f"estimated GPU memory per process ({processes}, {escape(origin)})", title_justify="left")
    for col in ("phase", "item", "GB", "how"):
        table.add_column(col, overflow="fold")
    host = host_lines(resolved, mm, lines, num_processes, num_nodes)
    for l in lines:
        table.add_row(l.phase, l.item, f"{l.bytes / GB:.2f}", escape(l.note))
    per_node = num_processes // num_nodes
    for l in host:  # host memory, summed over one node's processes
        table.add_row(f"host {l.phase}", l.item + (f" (node of {per_node})" if per_node > 1 else ""),
                      f"{l.bytes / GB:.2f}", escape(l.note))
    table_console().print(table)  # piped (a log, Slurm): wide enough not to fold a note mid-word
    total, worst = peak(lines)
    verdict = "[green]fits[/green]" if total <= gpu_memory * GB else "[red]does not fit[/red]"
    console.print(f"peak ~ {total / GB:.1f} GB (persistent + the {worst} phase): {verdict} in {gpu_memory:g} GB")
    console.print(f"start-up ~ {startup_peak(lines, mm) / GB:.1f} GB per GPU while the model is placed "
                  "(before gradients, AdamW state and trajectories exist)")
    held = sum(l.bytes for l in host if l.phase == "held")
    loading = sum(l.bytes for l in host if l.phase == "loading")
    console.print(f"host memory per node ({per_node} process{'es' if per_node > 1 else ''}): ~ {held / GB:.1f} GB held, "
                  f"~ {(held + loading) / GB:.1f} GB at start-up")
    other = _other_gradient_sync(resolved, num_processes, num_nodes, lines)
    if other:
        console.print(other)
    group = largest_update_group(resolved, lines, gpu_memory * GB, registry())
    if group is not None and group != resolved.train.update_group:
        console.print(f"update_group: up to {group} steps of a chunk per forward fit in {gpu_memory:g} GB (this recipe: "
                      f"{resolved.train.update_group}); more steps per forward, fewer weight gathers under fsdp2; "
                      f"set it with --set train.update_group={group}")

    for note in mm.notes:
        console.print(f"note: {escape(note)}")
    intended = resolved.distributed.num_processes
    if num_processes != intended:
        console.print(f"note: the recipe is written for {intended} process{'es' if intended > 1 else ''} "
                      f"({escape('[distributed].num_processes')}); this plan is for {num_processes}")
    if total > gpu_memory * GB:
        console.print("to reduce it: [distributed] strategy = 'fsdp2' on several GPUs (cpu_offload = true); "
                      "finetune = 'lora'; model.gradient_checkpointing = true; "
                      "model.offload_encoders = true; offload = true on rewards; a smaller micro_batch_size; "
                      "more processes (fewer samples each); fewer steps or a lower resolution")


def _other_gradient_sync(recipe, num_processes: int, num_nodes: int, lines) -> str:
    """Under fsdp2, the peak with the other ``[distributed].gradient_sync`` choice, so that a
    user sees both sides of the trade (memory against one reduce-scatter per backward)."""
    import dataclasses

    from ..memory_plan import GB, estimate, peak

    if not any(l.item.startswith("gradients (") and "accumulating" in l.item for l in lines):
        return ""  # not fsdp2
    mine = "step" if any(l.item == "gradients (unsharded, accumulating)" for l in lines) else "micro_batch"
    other = "micro_batch" if mine == "step" else "step"
    changed = dataclasses.replace(recipe, distributed=dataclasses.replace(recipe.distributed, gradient_sync=other))
    total, worst = peak(estimate(changed, registry(), num_processes, num_nodes)[2])
    what = ("reduce-scattered after every backward: gradients stay sharded, one reduce-scatter per backward"
            if other == "micro_batch" else "reduce-scattered once per optimizer step: a full-size float32 gradient "
            "on every process during the update, the fewest collectives")
    return (f"with gradient_sync = '{other}' ({what}): peak ~ {total / GB:.1f} GB ({worst} phase); "
            f"set it with --set distributed.gradient_sync={other}")

