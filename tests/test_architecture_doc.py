"""docs/architecture.md matches the code.

tests/test_docs_references.py already checks that every path the page cites exists. This test
checks the other direction and the names:

- every module of the training, sampling and objectives packages (``flowrl/train/*.py``,
  ``flowrl/sampling/*.py``, ``flowrl/objectives/*.py``) is on the page, so a new one (as
  ``parallel.py`` once was) cannot be added without saying what it owns;
- every protocol of :mod:`flowrl.interfaces` is named on the page (a capability a component
  author cannot find does not exist for them);
- a name given beside a module, ``flowrl/x.py`` (``A``, ``B``), is defined in that module;
- the page says where a new chunker, loss, reward, model and tracker goes.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

from flowrl import interfaces

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "architecture.md"
#: ``flowrl/train/state.py`` (``Checkpointer``) or ``flowrl/recipe.py`` (``check_startable``; ...)
MODULE_WITH_NAMES = re.compile(r"`(flowrl/[\w/]+)\.py` \(([^)]*(?:\([^)]*\))?[^)]*)\)")
NAME = re.compile(r"`([A-Za-z_]\w*)(?:\(\))?`")


def _text() -> str:
    return PAGE.read_text(encoding="utf-8")


def names_beside_modules(text: str) -> list[tuple[str, str]]:
    """``(module, name)`` for every ``flowrl/x.py`` (``name``, ...) on the page."""
    out = []
    for module, inside in MODULE_WITH_NAMES.findall(text):
        dotted = module.replace("/", ".")
        out += [(dotted, name) for name in NAME.findall(inside)]
    return out


def test_the_scanner_reads_names_beside_modules():
    text = "| x | `flowrl/train/state.py` (`Checkpointer`), `flowrl/recipe.py` (`check_startable`; the rest) |"
    assert names_beside_modules(text) == [("flowrl.train.state", "Checkpointer"), ("flowrl.recipe", "check_startable")]


def test_every_training_sampling_and_objective_module_is_on_the_page():
    """A newcomer finds each module of the loop, the sampler and the objectives from this page."""
    text = _text()
    modules = sorted(p.relative_to(REPO).as_posix() for package in ("train", "sampling", "objectives")
                     for p in (REPO / "flowrl" / package).glob("*.py") if p.name != "__init__.py")
    missing = [m for m in modules if not re.search(rf"`{re.escape(m)}[`:]", text)]
    assert not missing, f"docs/architecture.md does not say which phase these modules own: {missing}"


def test_every_protocol_is_named():
    text = _text()
    protocols = [name for name, obj in vars(interfaces).items()
                 if inspect.isclass(obj) and getattr(obj, "_is_protocol", False) and obj.__module__ == interfaces.__name__]
    assert protocols
    missing = [p for p in protocols if not re.search(rf"`{p}[`.(]", text)]
    assert not missing, f"docs/architecture.md does not name these protocols of flowrl/interfaces.py: {missing}"


def test_names_beside_modules_are_defined_there():
    pairs = names_beside_modules(_text())
    assert len(pairs) >= 10, pairs
    wrong = [f"{m}.{n}" for m, n in pairs if not hasattr(importlib.import_module(m), n)]
    assert not wrong, f"docs/architecture.md names what its module does not define: {wrong}"


def test_the_page_says_where_each_new_component_goes():
    rows = {line.split("|")[1].strip() for line in _text().splitlines() if line.startswith("| ")}
    for kind in ("chunker", "loss", "reward", "model", "tracker"):
        assert kind in rows, f"docs/architecture.md: no row for a new {kind} in 'Where a new component goes'"
