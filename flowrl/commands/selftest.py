"""``flowrl selftest``: train a tiny FLUX on this machine's GPU (or CPU) and check what a long run relies on.

::

    flowrl selftest                    # the GPU if there is one (bf16 where it computes it), else the CPU
    flowrl selftest --device cpu       # what CI runs (14 s on a 2-core CPU)
    flowrl selftest --json
    flowrl selftest --gpu              # the whole GPU check, at most 8 minutes: JSON + table in benchmarks/results/
    flowrl selftest --gpu --dry-run    # its steps, budgets and commands; runs nothing
    flowrl selftest --gpu --only suite # the whole test suite with CUDA visible, failures with tracebacks

Builds a tiny FLUX-architecture pipeline offline (no download) and checks: a 2-iteration
training run through the fast path and the chunk-graph update, the on-policy check, kill and
resume against the uninterrupted run, every attention backend, ``torch.compile`` (GPU) and a
2-process FSDP2 run (2+ GPUs). Each check is ``pass``, ``skip`` (with the reason) or ``fail``,
with seconds, images per second and peak memory against the plan; exit status 1 on any fail.
What each check proves: :mod:`flowrl.diagnostics.selftest`. ``--gpu`` runs the GPU check
(:mod:`flowrl.diagnostics.gpu_check`): doctor, this self-test on CUDA, the GPU test lane, the
quickstart, a full-size FLUX.1-dev iteration, planned against measured memory and every attention
backend, each step in its own time budget.
"""

from __future__ import annotations

import os
import shlex
import tempfile
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from .base import app, console, err_console


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
    gpu: Annotated[bool, typer.Option(
        "--gpu", help="The whole GPU check (at most 8 minutes): doctor, this self-test, the GPU test lane, the "
                      "quickstart, a full-size FLUX.1-dev iteration, planned vs measured memory, attention "
                      "backends; one JSON and one Markdown table.")] = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="With --gpu: list the steps, their budgets and commands; run nothing.")] = False,
    output: Annotated[Optional[Path], typer.Option(
        "--output", help="With --gpu: where the JSON and table go (default: the checkout's benchmarks/results/).")] = None,
    only: Annotated[Optional[str], typer.Option("--only", help="With --gpu: run only these steps (comma-separated).")] = None,
    skip: Annotated[Optional[str], typer.Option("--skip", help="With --gpu: leave out these steps (comma-separated).")] = None,
    budget: Annotated[Optional[float], typer.Option(
        "--budget", min=1, help="With --gpu: the whole check's wall-clock seconds (default 480).")] = None,
) -> None:
    """Train a tiny FLUX offline on this machine and check training, resume, kernels and sharding (CPU: ~15 s)."""
    if gpu or dry_run or output is not None or only is not None or skip is not None or budget is not None:
        return _gpu_check(gpu, dry_run, device, output, only, skip, budget)
    # the tiny pipeline is built here: nothing may reach for the hub, and no download bar is due
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import torch

    from ..diagnostics.report import failed, print_report, report_json
    from ..diagnostics.selftest import choose_dtype, remove, run_selftest
    from ..distributed import resolve_device
    from ..errors import FlowrlError

    choices = (("--dtype", dtype, ("auto", "bf16", "fp32")), ("--compile", compile_mode, ("auto", "on", "off")))
    for option, value, allowed in choices:
        if value not in allowed:
            raise FlowrlError(f"{option} {value!r} is not one of {', '.join(allowed)}", where=option)
    where = resolve_device(device, where="--device")  # a GPU this machine lacks: one message there
    _quiet_libraries()
    chosen = choose_dtype(where, dtype)
    name = torch.cuda.get_device_name(where) if where.type == "cuda" else "CPU"
    title = f"flowrl selftest on {where} ({name}), {chosen}, torch {torch.__version__}"
    if workdir is not None:
        from ..files import ensure_writable

        ensure_writable(Path(workdir), where="--workdir", directory=True)
    # absolute: the self-test writes recipes that name files in it, and a recipe reads paths from its own folder
    directory = Path(workdir).resolve() if workdir is not None else Path(tempfile.mkdtemp(prefix="flowrl-selftest-"))
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


def _gpu_check(gpu: bool, dry_run: bool, device: str, output: Optional[Path], only: Optional[str],
               skip: Optional[str], budget: Optional[float]) -> None:
    """``flowrl selftest --gpu``: :mod:`flowrl.diagnostics.gpu_check`."""
    from ..errors import FlowrlError

    if not gpu:
        raise FlowrlError("--dry-run, --output, --only, --skip and --budget belong to the GPU check", where="flowrl selftest",
                          hint="flowrl selftest --gpu --dry-run")
    from ..diagnostics import gpu_check

    chosen = gpu_check.choose(only, skip)
    total = budget if budget is not None else gpu_check.TOTAL_BUDGET_S
    device = "cuda" if device == "auto" else device
    repo = gpu_check.find_repo()
    directory = Path(output) if output is not None else (repo / "benchmarks" / "results" if repo else Path("gpu_check"))
    if dry_run:
        setting = gpu_check.Setting(repo=repo, workdir=Path("<scratch>"), python="python", device=device)
        console.print(f"flowrl selftest --gpu: {len(chosen)} step(s), {sum(s.budget_s for s in chosen)} s of budgets, "
                      f"at most {total:.0f} s in all; results to {directory}/gpu_check_<device>_<date>.json and .md",
                      highlight=False, soft_wrap=True)
        for step in chosen:
            command = step.command(setting)
            shown = f"skipped here: {command}" if isinstance(command, str) else shlex.join(command)
            console.print(f"  {step.name:<15} {step.budget_s:>4} s  {step.title}\n{'':>24}{shown}",
                          highlight=False, soft_wrap=True, markup=False)
        for step in gpu_check.steps():
            if step.on_request and step.name not in {c.name for c in chosen}:
                console.print(f"  on request (--only {step.name}): {step.name}, {step.budget_s} s: {step.title}",
                              highlight=False, soft_wrap=True, markup=False)
        return
    import torch

    if not device.startswith("cuda"):
        raise FlowrlError(f"--device {device}: the GPU check runs on CUDA", where="--device", hint="--device cuda:N, or drop --device")
    if not torch.cuda.is_available():
        raise FlowrlError(f"the GPU check needs a CUDA GPU and torch {torch.__version__} sees none",
                          where="flowrl selftest --gpu",
                          hint="`flowrl doctor` says why; `flowrl selftest --gpu --dry-run` lists the steps")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".flowrl-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise FlowrlError(f"cannot write the results to {directory}: {exc.strerror or exc}", where="--output",
                          hint="choose a writable directory with --output DIR") from None
    workdir = Path(tempfile.mkdtemp(prefix="flowrl-gpu-check-"))
    setting = gpu_check.Setting(repo=repo, workdir=workdir, device=device)
    date = gpu_check.today()
    started = time.perf_counter()
    results = gpu_check.run_check(setting, chosen, total,
                                  say=lambda text: err_console.print(f"[dim]{text}[/dim]", highlight=False))
    result = gpu_check.report(results, gpu_check.device_facts(device), gpu_check.versions(), total,
                              time.perf_counter() - started, date)
    names = [s.name for s in chosen]
    part = names if names != [s.name for s in gpu_check.default_steps()] else None  # --only / --skip
    json_path, md_path = gpu_check.write_report(result, directory, part)
    console.print(gpu_check.markdown(result), markup=False, highlight=False, soft_wrap=True)
    console.print(f"written: {json_path} and {md_path}; each step's output in {workdir}", highlight=False)
    if any(r.status in ("fail", "timeout") for r in results):
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
