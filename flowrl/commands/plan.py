"""``flowrl plan``: the resolved batch geometry and an estimate of peak GPU memory per process.

::

    flowrl plan recipes/chunk_grpo_flux.toml                   # at its [distributed].num_processes (8)
    flowrl plan recipes/chunk_grpo_flux.toml --num-processes 16
    flowrl plan recipes/lora_single_gpu_sd3.toml --gpu-memory 80 --set train.micro_batch_size=2
    flowrl plan recipes/chunk_grpo_flux.toml --num-processes 16 --num-nodes 2 --set distributed.shard=hybrid

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
    gpu_memory: Annotated[float, typer.Option("--gpu-memory", min=1.0, help="Memory of one GPU in GB, for the verdict.")] = DEFAULT_GPU_MEMORY_GB,
    num_nodes: Annotated[int, typer.Option("--num-nodes", min=1, help="Machines the processes are spread over "
                                           "(hybrid sharding shards within a machine).")] = 1,
) -> None:
    """Print the resolved geometry and an estimate of peak GPU memory per process (no GPU needed)."""
    from rich.markup import escape
    from rich.table import Table

    from ..memory_plan import GB, cpu_bytes, estimate, peak

    resolved = load(recipe, set_)
    # A recipe written for 8 GPUs planned at one process would say "does not fit" about a run
    # nobody starts that way: plan at the count the recipe states, and say where it came from.
    if num_processes is None:
        num_processes, origin = resolved.distributed.num_processes, "from [distributed].num_processes in the recipe"
    else:
        origin = "from --num-processes"
    geometry, mm, lines = estimate(resolved, registry(), num_processes, num_nodes)
    console.print(f"[bold]{escape(str(recipe))}[/bold]: model {resolved.components['model'].use}, "
                  f"finetune {resolved.train.finetune}")
    console.print(f"geometry: {geometry.describe()}")
    processes = f"{num_processes} process{'es' if num_processes > 1 else ''}"
    table = Table(title=f"estimated GPU memory per process ({processes}, {escape(origin)})", title_justify="left")
    for col in ("phase", "item", "GB", "how"):
        table.add_column(col, overflow="fold")
    for l in lines:
        table.add_row(l.phase, l.item, f"{l.bytes / GB:.2f}", escape(l.note))
    table_console().print(table)  # piped (a log, Slurm): wide enough not to fold a note mid-word
    total, worst = peak(lines)
    verdict = "[green]fits[/green]" if total <= gpu_memory * GB else "[red]does not fit[/red]"
    console.print(f"peak ~ {total / GB:.1f} GB (persistent + the {worst} phase): {verdict} in {gpu_memory:g} GB")
    host = cpu_bytes(lines)
    if host:
        console.print(f"CPU memory per process for the offloaded state: ~ {host / GB:.1f} GB")
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
