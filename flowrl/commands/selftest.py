"""``flowrl selftest``: train a tiny FLUX on this machine's GPU (or CPU) and check what a long run relies on.

::

    flowrl selftest                    # the GPU if there is one (bf16 where it computes it), else the CPU
    flowrl selftest --device cpu       # what CI runs (14 s on a 2-core CPU)
    flowrl selftest --json

Builds a tiny FLUX-architecture pipeline offline (no download) and checks: a 2-iteration
training run through the fast path and the chunk-graph update, the on-policy check, kill and
resume against the uninterrupted run, every attention backend, ``torch.compile`` (GPU) and a
2-process FSDP2 run (2+ GPUs). Each check is ``pass``, ``skip`` (with the reason) or ``fail``,
with seconds, images per second and peak memory against the plan; exit status 1 on any fail.
What each check proves: :mod:`flowrl.testing.selftest`.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from .base import app, console, err_console
from .checkup import failed, print_report, report_json


@app.command()
def selftest(
    device: Annotated[str, typer.Option(
        "--device", help="'auto' (the GPU if any), 'cpu', 'cuda' or 'cuda:N'.")] = "auto",
    dtype: Annotated[str, typer.Option(
        "--dtype", help="Compute dtype; 'auto': bf16 on a GPU that has it natively, else fp32.")] = "auto",
    compile_mode: Annotated[str, typer.Option(
        "--compile",
        help="torch.compile check; 'auto': on a GPU, skipped on a CPU (minutes of C++ compilation).")] = "auto",
    workdir: Annotated[Optional[Path], typer.Option(
        "--workdir", help="Keep the pipeline and runs here (default: a temporary directory, removed).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Train a tiny FLUX offline on this machine and check training, resume, kernels and sharding (CPU: ~15 s)."""
    # the tiny pipeline is built here: nothing may reach for the hub, and no download bar is due
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import torch

    from ..distributed import resolve_device
    from ..errors import FlowrlError
    from ..testing.selftest import choose_dtype, remove, run_selftest

    choices = (("--dtype", dtype, ("auto", "bf16", "fp32")), ("--compile", compile_mode, ("auto", "on", "off")))
    for option, value, allowed in choices:
        if value not in allowed:
            raise FlowrlError(f"{option} {value!r} is not one of {', '.join(allowed)}", where=option)
    where = resolve_device(device)
    if where.type == "cuda" and not torch.cuda.is_available():
        raise FlowrlError(f"--device {device}: no GPU is visible to torch {torch.__version__}",
                          where="--device", hint="run `flowrl doctor` to see why, or use --device cpu")
    _quiet_libraries()
    chosen = choose_dtype(where, dtype)
    name = torch.cuda.get_device_name(where) if where.type == "cuda" else "CPU"
    title = f"flowrl selftest on {where} ({name}), {chosen}, torch {torch.__version__}"
    directory = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="flowrl-selftest-"))
    directory.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        checks = run_selftest(directory, where, dtype=chosen, compile_mode=compile_mode,
                              say=lambda text: err_console.print(f"[dim]running {text}[/dim]", highlight=False))
    finally:
        if workdir is None:
            remove(directory)
    seconds = time.perf_counter() - started
    if as_json:
        print(report_json("selftest", checks, device=str(where), device_name=name, dtype=chosen,
                          torch=torch.__version__, seconds=round(seconds, 2)))
    else:
        print_report(console, title, checks)
        console.print(f"{seconds:.1f} s for the checks" + (f"; files kept in {directory}" if workdir is not None else ""))
    if failed(checks):
        raise typer.Exit(1)


def _quiet_libraries() -> None:
    """diffusers' and transformers' loading messages (the tiny tokenizers truncate, by design) say
    nothing about this machine: errors only, no progress bars."""
    from ..compat import ensure_torchvision_importable

    ensure_torchvision_importable()
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    for library in (diffusers_logging, transformers_logging):
        library.set_verbosity_error()
        library.disable_progress_bar()
