"""The import structure, read from the source: layers, plugins on the public API, no private names.

- The core (``flowrl``) never imports a built-in plugin (``flowrl_plugins``): built-ins are
  ordinary plugins, found through entry points like any third party's.
- A plugin imports flowrl's public modules, third-party packages and its own package only, never
  another plugin.
- Nothing imports a private name (``_x``) or a private module from another module.
- flowrl's modules form layers; a module imports only from its own layer or below, and no two
  modules import each other (directly or through a cycle).
- No command module (one that adds a command to the app) imports another: what commands share
  lives in helper modules (``flowrl/commands/base.py``, ``flowrl/commands/inference.py``).
- The objectives (``flowrl/objectives/``) never import the training loop (``flowrl/train/``): the
  loop calls an objective, never the other way round.
- A plugin imports flowrl's public modules only: not the training loop's internals
  (``flowrl.train``), the commands (``flowrl.commands``, ``flowrl.cli``) or the test support
  (``flowrl.testing``).
- Inside the library, flowrl modules are imported at the top of a file. Only the command-line
  modules (``flowrl/commands``, ``flowrl/cli.py``) import them inside functions, so that
  ``flowrl --help`` does not pay for torch; and a module that needs an optional extra may be
  imported where it is used, marked ``# optional extra: NAME`` (or inside ``try/except ImportError``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: Lower layers first. A module not listed is an error (new modules must be placed).
LAYERS: list[set[str]] = [
    {"flowrl", "flowrl.errors", "flowrl.files", "flowrl.hookspecs", "flowrl.config", "flowrl.seeding",
     "flowrl.compat", "flowrl.checks", "flowrl.checkpoint_dirs", "flowrl.processes", "flowrl.stop_points",
     "flowrl.geneval", "flowrl.check_result"},
    {"flowrl.plugins", "flowrl.interfaces", "flowrl.rewards", "flowrl.chunking", "flowrl.selection", "flowrl.prompts",
     "flowrl.offline", "flowrl.embeddings", "flowrl.batch",
     "flowrl.sampling", "flowrl.sampling.*", "flowrl.objectives", "flowrl.objectives.*",
     "flowrl.distributed", "flowrl.geometry", "flowrl.runlog", "flowrl.run_health", "flowrl.reference_curves", "flowrl.artefacts", "flowrl.plotting", "flowrl.stats",
     "flowrl.video", "flowrl.suites", "flowrl.comparison", "flowrl.sweeps",
     "flowrl.serving", "flowrl.serving.*"},
    {"flowrl.recipe", "flowrl.recipe.*", "flowrl.memory_plan", "flowrl.dynamics", "flowrl.dynamics.*", "flowrl.hub"},
    {"flowrl.train", "flowrl.train.*"},
    {"flowrl.testing", "flowrl.testing.*"},
    {"flowrl.diagnostics", "flowrl.diagnostics.*"},
    {"flowrl.commands", "flowrl.commands.*", "flowrl.cli", "flowrl.__main__",
     "flowrl.launch_agent", "flowrl.fork_server"},
]
CLI_MODULES = ("flowrl.commands", "flowrl.cli")


def _module_name(path: Path, root: Path = REPO) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "plugins":
        parts[0] = "flowrl_plugins"
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    files = [*sorted((REPO / "flowrl").rglob("*.py")), *sorted((REPO / "plugins").rglob("*.py"))]
    return {_module_name(p): p for p in files}


SOURCES = _sources()


def _imports(name: str, path: Path):
    """``(imported module, imported names, line, inside a function)`` for every import."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    nested = {id(n) for f in functions for n in ast.walk(f) if n is not f}
    # an optional import (`try: import x` / `except ImportError`) may sit where it is needed
    optional = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) and any(
        isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError") for h in t.handlers
    ) for stmt in t.body for n in ast.walk(stmt)}
    # so may an import of a module that needs an optional extra, marked on its line
    source = path.read_text(encoding="utf-8").splitlines()
    optional |= {id(n) for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                 and "# optional extra:" in source[n.lineno - 1]}
    nested -= optional
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno, id(node) in nested
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield module, [a.name for a in node.names], node.lineno, id(node) in nested


def _resolve(module: str, names: list[str], sources: dict[str, Path] | None = None) -> list[str]:
    """The project modules an import refers to (``from pkg import mod`` names a module)."""
    sources = SOURCES if sources is None else sources
    out = [module] if module in sources else []
    out += [f"{module}.{n}" for n in names if f"{module}.{n}" in sources]
    return out


def _layer(module: str) -> int:
    for i, layer in enumerate(LAYERS):
        if module in layer or any(p.endswith(".*") and module.startswith(p[:-1]) for p in layer):
            return i
    raise AssertionError(f"{module} is in no layer of tests/test_layering.py: place it")


def _plugin_root(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])  # flowrl_plugins.<plugin>


def _all_imports():
    for name, path in SOURCES.items():
        for module, names, line, nested in _imports(name, path):
            yield name, path, module, names, line, nested


def test_a_package_sits_in_one_layer_whole():
    """The table places packages, not their modules one by one: each package of flowrl is one
    ``flowrl.X`` and ``flowrl.X.*`` pair in one layer, so a module added to a package is placed
    with it, and no package is split across layers."""
    packages = sorted({name for name, path in SOURCES.items() if name.startswith("flowrl.") and path.name == "__init__.py"})
    for package in packages:
        rows = [i for i, layer in enumerate(LAYERS) if package in layer or f"{package}.*" in layer]
        assert len(rows) == 1 and {package, f"{package}.*"} <= LAYERS[rows[0]], (package, rows)
        named = [m for layer in LAYERS for m in layer if m.startswith(f"{package}.") and m != f"{package}.*"]
        assert not named, f"{package}'s modules are placed one by one: {named}"


def test_every_module_has_a_layer():
    for name in SOURCES:
        if name.startswith("flowrl."):
            _layer(name)


def test_core_never_imports_a_builtin_plugin():
    bad = [f"{p.relative_to(REPO)}:{line} imports {m}" for n, p, m, _, line, _ in _all_imports()
           if n.split(".")[0] == "flowrl" and m.split(".")[0] == "flowrl_plugins"]
    assert not bad, bad


def test_plugins_use_only_the_public_api_and_their_own_package():
    bad = []
    for name, path, module, names, line, _ in _all_imports():
        if not name.startswith("flowrl_plugins"):
            continue
        if module.split(".")[0] == "flowrl_plugins" and _plugin_root(module) != _plugin_root(name):
            if module != "flowrl_plugins" or any(_plugin_root(f"flowrl_plugins.{n}") != _plugin_root(name) for n in names):
                bad.append(f"{path.relative_to(REPO)}:{line} imports another plugin: {module} {names}")
    assert not bad, bad


def test_no_private_name_or_module_is_imported_across_modules():
    bad = []
    for name, path, module, names, line, _ in _all_imports():
        if module.split(".")[0] not in ("flowrl", "flowrl_plugins") or module == name:
            continue
        # a private module may be imported by its own package's modules only
        same_package = module.rpartition(".")[0] == name.rpartition(".")[0]
        private_module = [p for p in module.split(".")[1:] if p.startswith("_") and not p.startswith("__")]
        if same_package and private_module == [module.rpartition(".")[2]]:
            private_module = []
        private_names = [n for n in names if n.startswith("_") and not n.startswith("__")]
        if private_module or private_names:
            bad.append(f"{path.relative_to(REPO)}:{line}: from {module} import {names}")
    assert not bad, bad


def test_core_modules_import_only_their_layer_or_below():
    bad = []
    for name, path, module, names, line, _ in _all_imports():
        if not name.startswith("flowrl.") and name != "flowrl":
            continue
        for target in _resolve(module, names):
            if target.startswith("flowrl") and not target.startswith("flowrl_plugins") and _layer(target) > _layer(name):
                bad.append(f"{path.relative_to(REPO)}:{line}: {name} (layer {_layer(name)}) imports {target} "
                           f"(layer {_layer(target)})")
    assert not bad, bad


def test_no_import_cycles_in_the_core():
    graph: dict[str, set[str]] = {n: set() for n in SOURCES if n.split(".")[0] == "flowrl"}
    for name, path, module, names, line, _ in _all_imports():
        if name in graph:
            graph[name] |= {t for t in _resolve(module, names) if t in graph and t != name}
    # a package's __init__ importing its own submodules is the package, not a cycle
    for name in graph:
        graph[name] = {t for t in graph[name] if not t.startswith(name + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_library_modules_import_flowrl_at_the_top():
    bad = [f"{p.relative_to(REPO)}:{line}: {m}" for n, p, m, _, line, nested in _all_imports()
           if nested and m.split(".")[0] in ("flowrl", "flowrl_plugins") and not n.startswith(CLI_MODULES)]
    assert not bad, bad


def _registers_a_command(path: Path) -> bool:
    """True for a module that adds a command to a typer app (``@app.command()``, ``add_typer``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                f = d.func if isinstance(d, ast.Call) else d
                if isinstance(f, ast.Attribute) and f.attr == "command":
                    return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_typer":
            return True
    return False


def commands_importing_commands(sources: dict[str, Path]) -> list[str]:
    """Every import of a command module by another module under ``flowrl/commands/``."""
    commands = {n for n, p in sources.items() if n.startswith("flowrl.commands.") and _registers_a_command(p)}
    bad = []
    for name, path in sources.items():
        if not name.startswith("flowrl.commands"):
            continue
        for module, names, line, _ in _imports(name, path):
            for target in _resolve(module, names, sources):
                if target in commands and target != name:
                    bad.append(f"{path}:{line}: {name} imports the command module {target}")
    return bad


def objectives_importing_train(sources: dict[str, Path]) -> list[str]:
    """Every import of ``flowrl.train`` (or below) by a module of ``flowrl.objectives``."""
    bad = []
    for name, path in sources.items():
        if name != "flowrl.objectives" and not name.startswith("flowrl.objectives."):
            continue
        for module, names, line, _ in _imports(name, path):
            targets = [module, *(f"{module}.{n}" for n in names)]
            if any(t == "flowrl.train" or t.startswith("flowrl.train.") for t in targets):
                bad.append(f"{path}:{line}: {name} imports {module} {names}")
    return bad


#: flowrl modules a plugin may not import: the loop's internals, the commands, the test support.
NOT_PUBLIC = ("flowrl.train", "flowrl.commands", "flowrl.cli", "flowrl.testing", "flowrl.__main__")


def plugins_importing_non_public(sources: dict[str, Path]) -> list[str]:
    bad = []
    for name, path in sources.items():
        if not name.startswith("flowrl_plugins"):
            continue
        for module, names, line, _ in _imports(name, path):
            targets = [module, *(f"{module}.{n}" for n in names)]
            if any(t == p or t.startswith(p + ".") for t in targets for p in NOT_PUBLIC):
                bad.append(f"{path}:{line}: {name} imports {module} {names}")
    return bad


def test_no_command_module_imports_another():
    bad = commands_importing_commands(SOURCES)
    assert not bad, bad


def commands_and_test_kit_importing_each_other(sources: dict[str, Path]) -> list[str]:
    """Every import between the commands (``flowrl/commands/``, ``flowrl/cli.py``) and the test kit
    for plugin authors (``flowrl/testing/``), either way: the commands reach the kit's tiny models
    only through the diagnostics (``flowrl/diagnostics/``)."""
    sides = {"flowrl.commands": "flowrl.testing", "flowrl.cli": "flowrl.testing", "flowrl.testing": "flowrl.commands"}
    bad = []
    for name, path in sources.items():
        side = next((s for s in sides if name == s or name.startswith(s + ".")), None)
        if side is None:
            continue
        other = sides[side]
        for module, names, line, _ in _imports(name, path):
            for target in _resolve(module, names, sources):
                if target == other or target.startswith(other + "."):
                    bad.append(f"{path}:{line}: {name} imports {target}")
    return bad


def test_commands_and_the_test_kit_never_import_each_other():
    bad = commands_and_test_kit_importing_each_other(SOURCES)
    assert not bad, bad


def relative_imports_above_the_package(sources: dict[str, Path]) -> list[str]:
    """Every relative import that climbs above its top-level package (``from ..x`` in
    ``flowrl/y.py``): Python refuses it only when it runs, so a function-level one fails late."""
    bad = []
    for name, path in sources.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        depth = len(package.split(".")) if package else 0
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level and node.level > depth:
                bad.append(f"{path}:{node.lineno}: {name} imports {'.' * node.level}{node.module or ''}, above its package")
    return bad


def test_no_relative_import_climbs_above_its_package():
    bad = relative_imports_above_the_package(SOURCES)
    assert not bad, bad


def test_objectives_never_import_the_training_loop():
    assert any(n.startswith("flowrl.objectives.") for n in SOURCES), "flowrl/objectives/ is gone: update this rule"
    bad = objectives_importing_train(SOURCES)
    assert not bad, bad


def test_plugins_import_only_public_flowrl_modules():
    bad = plugins_importing_non_public(SOURCES)
    assert not bad, bad


@pytest.mark.parametrize("rule, planted, source, expected", [
    (commands_importing_commands, "flowrl/commands/bad.py",
     "from .sample import shard\nfrom .base import app\n", "imports the command module flowrl.commands.sample"),
    (objectives_importing_train, "flowrl/objectives/bad.py",
     "from ..train.update import PolicyUpdate\n", "flowrl.objectives.bad imports flowrl.train.update"),
    (commands_and_test_kit_importing_each_other, "flowrl/commands/bad.py",
     "from ..testing.tiny_pipelines import build_tiny_flux\nfrom ..diagnostics.report import Check\n",
     "flowrl.commands.bad imports flowrl.testing.tiny_pipelines"),
    (relative_imports_above_the_package, "flowrl/bad.py",
     "from .errors import FlowrlError\n\ndef f():\n    from ..errors import FlowrlError\n", "imports ..errors, above its package"),
    (plugins_importing_non_public, "plugins/bad/plugin.py",
     "from flowrl.train.evaluate import evaluate\nfrom flowrl.errors import FlowrlError\n",
     "flowrl_plugins.bad.plugin imports flowrl.train.evaluate"),
])
def test_each_new_rule_reports_a_planted_violation(tmp_path, rule, planted, source, expected):
    """Each rule above, run on the real tree plus one planted module, reports the planted import
    (one line of it: the planted module's other import is allowed)."""
    path = tmp_path / planted
    path.parent.mkdir(parents=True)
    path.write_text(source)
    name = _module_name(path, root=tmp_path)
    bad = [b for b in rule({**SOURCES, name: path}) if b.startswith(str(path))]
    assert len(bad) == 1 and expected in bad[0], bad


def test_the_layering_test_sees_violations(tmp_path, monkeypatch):
    """The checks above can fail: a planted private import and a plugin import are caught."""
    fake = tmp_path / "flowrl" / "bad.py"
    fake.parent.mkdir()
    fake.write_text("from flowrl.sampling.kernels import _reduce\nimport flowrl_plugins.embedded\n")
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
    found = list(_imports("flowrl.bad", fake))
    assert [m for m, *_ in found] == ["flowrl.sampling.kernels", "flowrl_plugins.embedded"]
    assert found[0][1] == ["_reduce"]
