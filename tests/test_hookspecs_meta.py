"""Meta-tests that keep the plugin contract honest as it grows.

- every hook in flowrl/hookspecs.py has a docstring (it is the plugin author's documentation);
- every hook is implemented by at least one test (a hookimpl named after it in tests/, outside
  this file), so a new hook cannot land untested;
- every built-in hookimpl in plugins/ is ``trylast``, so third-party plugins run first and can
  override the built-in defaults.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from flowrl import hookspecs
from flowrl.plugins import ENTRY_POINT_GROUP, get_registry

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
HOOKS = sorted(n for n, obj in vars(hookspecs).items() if hasattr(obj, "flowrl_spec"))


def test_hooks_are_found():
    assert "register_rewards" in HOOKS and "default_component" in HOOKS and len(HOOKS) >= 10


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_has_a_docstring(hook):
    doc = inspect.getdoc(getattr(hookspecs, hook)) or ""
    assert len(doc.split()) >= 5, f"hookspec {hook} needs a docstring saying what it registers or returns"


def _test_sources() -> dict[Path, str]:
    this = Path(__file__).resolve()
    return {p: p.read_text(encoding="utf-8") for p in TESTS.rglob("*.py") if p.resolve() != this}


def test_every_hook_is_implemented_by_a_test():
    sources = _test_sources()
    untested = [
        hook for hook in HOOKS
        if not any(re.search(rf"\bdef {hook}\(", text) for text in sources.values())
    ]
    assert not untested, (
        f"no test implements these hooks (write a test plugin with `@hookimpl def <hook>(...)`): {untested}"
    )


# ----------------------------------------------------------------------------- built-ins are trylast


def _is_hookimpl(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (isinstance(target, ast.Name) and target.id == "hookimpl") or (
        isinstance(target, ast.Attribute) and target.attr == "hookimpl"
    )


def _is_trylast(decorator: ast.expr) -> bool:
    return isinstance(decorator, ast.Call) and any(
        kw.arg == "trylast" and isinstance(kw.value, ast.Constant) and kw.value.value is True
        for kw in decorator.keywords
    )


def non_trylast_hookimpls(source: str, filename: str = "<source>") -> list[str]:
    """``file:line name`` of every function decorated with hookimpl but not ``trylast=True``."""
    bad = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for dec in node.decorator_list:
                if _is_hookimpl(dec) and not _is_trylast(dec):
                    bad.append(f"{filename}:{node.lineno} {node.name}")
    return bad


def test_the_trylast_checker_catches_violations():
    source = (
        "from flowrl import hookimpl\nimport flowrl\n"
        "@hookimpl\ndef register_rewards(register): pass\n"
        "@hookimpl(tryfirst=True)\ndef register_losses(register): pass\n"
        "@flowrl.hookimpl(trylast=False)\ndef register_models(register): pass\n"
        "@hookimpl(trylast=True)\ndef default_component(kind): pass\n"
        "class P:\n    @hookimpl\n    def register_kernels(self, register): pass\n"
    )
    names = [b.split()[-1] for b in non_trylast_hookimpls(source)]
    assert names == ["register_rewards", "register_losses", "register_models", "register_kernels"]


def test_builtin_hookimpls_in_plugins_are_trylast_in_source():
    files = sorted((REPO / "plugins").rglob("*.py"))
    assert files
    bad = []
    for path in files:
        bad += non_trylast_hookimpls(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))
    assert not bad, f"built-in hookimpls must be @hookimpl(trylast=True): {bad}"


def test_builtin_hookimpls_are_trylast_once_loaded():
    """The same rule on what pluggy actually registered from the flowrl distribution."""
    registry = get_registry()
    builtin = {name for name, info in registry.plugins.items() if info.distribution == "flowrl-diffusion"}
    assert builtin, f"no built-in plugin found in the '{ENTRY_POINT_GROUP}' entry-point group"
    bad = []
    for hook in HOOKS:
        for impl in getattr(registry.pm.hook, hook).get_hookimpls():
            if impl.plugin_name in builtin and not impl.trylast:
                bad.append(f"{impl.plugin_name}.{hook}")
    assert not bad, f"built-in hookimpls must be @hookimpl(trylast=True): {bad}"
