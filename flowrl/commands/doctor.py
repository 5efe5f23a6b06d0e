"""``flowrl doctor [RECIPE]``: is this machine ready for a long run? An environment report.

::

    flowrl doctor                                   # python, torch build, packages, devices, kernels, launcher
    flowrl doctor recipes/chunk_grpo_flux.toml      # and the recipe's planned memory against this machine's
    flowrl doctor --json                            # the same for machines
    flowrl doctor recipes/chunk_grpo_flux.toml --num-nodes 2   # and what a run over two nodes needs of this one

Each line is ``ok``, ``warn`` or ``fail``; the command exits 1 only on a ``fail`` (a package that
does not import, a recipe that does not fit, a launcher setting the recipe refuses).
It runs no model: the GPU self-test that trains one is ``flowrl selftest``. The checks
themselves: :mod:`flowrl.diagnostics.doctor`. docs/install.md shows
the report of a CPU machine and what a GPU machine should say.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .base import SetOpt, app, console, load, registry


@app.command()
def doctor(
    recipe: Annotated[Optional[Path], typer.Argument(
        help="A recipe: check its planned GPU memory per process (at its [distributed].num_processes) "
             "and its [distributed] table against this machine and launcher.")] = None,
    set_: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    num_nodes: Annotated[Optional[int], typer.Option(
        "--num-nodes", min=1, help="Machines the run will span (default: WORLD_SIZE / LOCAL_WORLD_SIZE of a launched "
        "process, else 1): with more than one, the recipe's run directory must be on a shared file system.")] = None,
) -> None:
    """Check this machine before a long run: torch build, versions, GPUs, bf16, attention kernels, launcher, memory."""
    from ..diagnostics.doctor import (
        attention_checks,
        launcher_checks,
        package_checks,
        plan_checks,
        probe_devices,
        python_checks,
        recipe_device_checks,
        torch_checks,
        weights_checks,
    )
    from ..diagnostics.nodes import launched_nodes, launched_processes, node_checks
    from ..diagnostics.report import failed, print_report, report_json

    resolved = load(recipe, set_) if recipe is not None else None  # a bad recipe: one message, nothing else
    checks = [*python_checks(), *torch_checks(), *package_checks()]
    devices, device_checks = probe_devices()
    checks += device_checks
    checks += attention_checks()
    checks += launcher_checks(resolved, devices)
    nodes = num_nodes or launched_nodes()
    gpus = sum(1 for d in devices if d["device"].startswith("cuda"))  # a later launch's processes, at least
    processes = max(resolved.distributed.num_processes if resolved is not None else 1, nodes, launched_processes(), gpus)
    checks += node_checks(processes, nodes, resolved.output_dir if resolved is not None else None)
    if resolved is not None:
        checks += recipe_device_checks(resolved)
        checks += plan_checks(resolved, devices, registry())
        checks += weights_checks(resolved)
    if as_json:
        print(report_json("doctor", checks, recipe=str(recipe) if recipe else None))
    else:
        print_report(console, "flowrl doctor", checks)
    if failed(checks):
        raise typer.Exit(1)

