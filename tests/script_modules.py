"""Import a script of ``scripts/`` or ``benchmarks/`` (not packages) as a module, for the tests
that check it."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def script_module(name: str) -> Iterator[ModuleType]:
    """``scripts/<name>.py`` imported as module ``name`` (registered in ``sys.modules`` so its
    dataclasses resolve, removed afterwards): a generator for a ``yield from`` fixture."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)


def benchmark_module(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` imported as module ``flowrl_bench_<name>``, registered in
    ``sys.modules`` (its dataclasses resolve their annotations through it)."""
    spec = importlib.util.spec_from_file_location(f"flowrl_bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
