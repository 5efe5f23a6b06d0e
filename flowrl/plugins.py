"""Plugin discovery and the component registry, on pluggy.

Plugins come from the ``flowrl`` entry-point group only, built-ins included: the core keeps no
list of them. :func:`get_registry` loads every plugin once, validates its hook implementations
against :mod:`flowrl.hookspecs`, calls the registration hooks and returns a :class:`Registry`
of components by kind and name.

- A plugin that fails to import is a :class:`~flowrl.errors.PluginError` naming it and saying
  how to disable it.
- A hook implementation with a misspelt name is rejected, with the closest hook suggested.
- Two plugins registering the same name is an error naming both (see ``replace`` in
  :mod:`flowrl.hookspecs`).
- ``FLOWRL_DISABLE_PLUGINS=a,b`` (or ``flowrl --disable-plugin a``) skips plugins by name.
- Tests add a plugin for one test with :func:`temporary_plugin`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import threading
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Any

import pluggy

from . import hookspecs
from .config import params_from_signature
from .errors import PluginError, RecipeError, suggest
from .rewards import FunctionReward

ENTRY_POINT_GROUP = "flowrl"
DISABLE_ENV = "FLOWRL_DISABLE_PLUGINS"

#: Component kinds and the hook that registers each.
KINDS: dict[str, str] = {
    "model": "register_models",
    "schedule": "register_schedules",
    "kernel": "register_kernels",
    "chunker": "register_chunkers",
    "selector": "register_selectors",
    "advantage": "register_advantages",
    "loss": "register_losses",
    "likelihood": "register_likelihoods",
    "window": "register_windows",
    "reward": "register_rewards",
    "tracker": "register_trackers",
}


@dataclasses.dataclass(frozen=True)
class Component:
    """One registered component: what a recipe's ``use = "name"`` resolves to."""

    kind: str
    name: str
    factory: Callable[..., Any]
    params: type | None
    plugin: str
    help: str
    replace: bool = False

    def build(self, params: Any = None) -> Any:
        """Instantiate the component: ``factory(params)`` when it has a params dataclass (its
        defaults when ``params`` is None), ``factory()`` when it has none (flowrl.hookspecs)."""
        if self.params is None:
            return self.factory()
        return self.factory(params if params is not None else self.params())


@dataclasses.dataclass(frozen=True)
class PluginInfo:
    name: str
    distribution: str
    version: str
    module: str


class Registry:
    """Components by kind and name, plus which plugin provided what."""

    def __init__(self, pm: pluggy.PluginManager, plugins: dict[str, PluginInfo]):
        self.pm = pm
        self.plugins = plugins
        self.components: dict[str, dict[str, Component]] = {kind: {} for kind in KINDS}
        self._seen: dict[tuple[str, str, bool], Component] = {}

    def add(self, component: Component) -> None:
        # Two registrations of one name clash unless exactly one of them says replace=True.
        # Registrations are remembered per (kind, name, replace) so that order never matters.
        key = (component.kind, component.name, component.replace)
        other = self._seen.get(key)
        if other is not None:
            raise PluginError(
                f"{component.kind} '{component.name}' is registered twice: by plugin "
                f"'{other.plugin}' and by plugin '{component.plugin}'",
                hint=f"rename one, disable one with {DISABLE_ENV}=<plugin>, or pass replace=True "
                "in the plugin that should win",
            )
        self._seen[key] = component
        table = self.components[component.kind]
        old = table.get(component.name)
        if old is None or (component.replace and not old.replace):
            table[component.name] = component

    def names(self, kind: str) -> list[str]:
        return sorted(self.components[kind])

    def get(self, kind: str, name: str, *, where: str | None = None) -> Component:
        table = self.components[kind]
        if name not in table:
            raise RecipeError(
                f"unknown {kind} '{name}'",
                where=where,
                hint=suggest(name, table) + " (see `flowrl plugins`)",
            )
        return table[name]

    def default(self, kind: str) -> str | None:
        return self.pm.hook.default_component(kind=kind)

    def by_plugin(self) -> dict[str, list[Component]]:
        out: dict[str, list[Component]] = {name: [] for name in self.plugins}
        for table in self.components.values():
            for comp in table.values():
                out.setdefault(comp.plugin, []).append(comp)
        return out


_extra_plugins: list[tuple[str, object]] = []
_cache: dict[frozenset[str], Registry] = {}
_lock = threading.Lock()


def disabled_plugins(extra: tuple[str, ...] | list[str] = ()) -> frozenset[str]:
    names = {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}
    return frozenset(names | set(extra))


def get_registry(disable: tuple[str, ...] | list[str] = ()) -> Registry:
    """Load all plugins (once per set of disabled names) and return the registry."""
    key = disabled_plugins(disable)
    with _lock:
        if key not in _cache:
            _cache[key] = _load(key)
        return _cache[key]


def reset() -> None:
    """Forget loaded plugins; the next :func:`get_registry` rediscovers them."""
    with _lock:
        _cache.clear()


@contextlib.contextmanager
def temporary_plugin(plugin: object, name: str | None = None) -> Iterator[Registry]:
    """Register ``plugin`` (a module, class or object with hook implementations) for a block.

    Yields the registry that includes it. Intended for tests::

        class Plugin:
            @hookimpl
            def register_rewards(self, register):
                register("const", lambda images, prompts: torch.ones(len(prompts)))

        with temporary_plugin(Plugin()) as registry:
            ...
    """
    entry = (name or getattr(plugin, "__name__", type(plugin).__name__), plugin)
    _extra_plugins.append(entry)
    reset()
    try:
        yield get_registry()
    finally:
        _extra_plugins.remove(entry)
        reset()


def _hook_names() -> set[str]:
    return {n for n, obj in vars(hookspecs).items() if hasattr(obj, "flowrl_spec")}


def _check_hook_names(name: str, plugin: object) -> None:
    valid = _hook_names()
    for attr in dir(plugin):
        obj = getattr(plugin, attr, None)
        if obj is None or not hasattr(obj, "flowrl_impl"):
            continue
        if attr not in valid:
            raise PluginError(
                f"plugin '{name}' implements unknown hook '{attr}'",
                hint=suggest(attr, valid) + f"; or disable it with {DISABLE_ENV}={name}",
            )


def _load(disabled: frozenset[str]) -> Registry:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    infos: dict[str, PluginInfo] = {}

    candidates: list[tuple[str, Callable[[], object], PluginInfo]] = []
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist = getattr(ep, "dist", None)
        info = PluginInfo(
            name=ep.name,
            distribution=dist.metadata["Name"] if dist is not None else "?",
            version=dist.version if dist is not None else "?",
            module=ep.value,
        )
        candidates.append((ep.name, ep.load, info))
    for name, obj in _extra_plugins:
        module = getattr(obj, "__module__", None) or getattr(obj, "__name__", "?")
        info = PluginInfo(name=name, distribution="(registered in-process)", version="-", module=module)
        candidates.append((name, lambda obj=obj: obj, info))

    known = {name for name, _, _ in candidates}
    for name in sorted(disabled - known):
        raise PluginError(
            f"cannot disable plugin '{name}': no plugin has that name",
            where=f"{DISABLE_ENV} / --disable-plugin",
            hint=suggest(name, known) + " (see `flowrl plugins`)",
        )
    for name, load, info in candidates:
        if name in disabled:
            continue
        if name in infos:
            raise PluginError(
                f"two plugins are both named '{name}' ({infos[name].module} and {info.module})",
                hint=f"uninstall one, or disable the name with {DISABLE_ENV}={name}",
            )
        try:
            plugin = load()
        except Exception as exc:  # any import-time failure of third-party code
            raise PluginError(
                f"plugin '{name}' from {info.distribution} failed to load: "
                f"{type(exc).__name__}: {exc}",
                hint=f"fix or uninstall {info.distribution}, or disable the plugin with "
                f"{DISABLE_ENV}={name} (or `flowrl --disable-plugin {name}`)",
            ) from exc
        _check_hook_names(name, plugin)
        try:
            pm.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(
                f"plugin '{name}' has an invalid hook implementation: {exc}",
                hint=f"check its signature against flowrl.hookspecs, or disable it with "
                f"{DISABLE_ENV}={name}",
            ) from exc
        infos[name] = info

    registry = Registry(pm, infos)
    for kind, hook_name in KINDS.items():
        hook = getattr(pm.hook, hook_name)
        # get_hookimpls() lists implementations in reverse call order (trylast first).
        for impl in reversed(hook.get_hookimpls()):
            try:
                impl.function(register=_make_register(registry, kind, impl.plugin_name))
            except PluginError:
                raise
            except Exception as exc:  # a bug inside a third party's registration hook
                raise PluginError(
                    f"plugin '{impl.plugin_name}' failed in {hook_name}: {type(exc).__name__}: {exc}",
                    hint=f"fix or uninstall it, or disable it with {DISABLE_ENV}={impl.plugin_name}",
                ) from exc
    return registry


def _make_register(registry: Registry, kind: str, plugin_name: str) -> Callable[..., None]:
    def register(
        name: str,
        factory: Callable[..., Any],
        *,
        params: type | None = None,
        help: str | None = None,
        replace: bool = False,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin '{plugin_name}' registered a {kind} with an invalid name {name!r}")
        if params is None:
            params = getattr(factory, "Config", None)
        if kind == "reward" and params is None and not inspect.isclass(factory):
            factory, params = _plain_reward(name, factory)
        if params is not None and not dataclasses.is_dataclass(params):
            raise PluginError(
                f"plugin '{plugin_name}': params of {kind} '{name}' must be a dataclass, "
                f"got {params!r}"
            )
        doc = help or inspect.getdoc(factory) or ""
        registry.add(
            Component(
                kind=kind,
                name=name,
                factory=factory,
                params=params,
                plugin=plugin_name,
                help=doc.strip().splitlines()[0] if doc.strip() else "",
                replace=replace,
            )
        )

    return register


def _plain_reward(name: str, fn: Callable[..., Any]) -> tuple[Callable[..., Any], type | None]:
    """Wrap a plain function ``fn(images, prompts, *, kw=default) -> Tensor[B]`` as a reward."""
    params = params_from_signature(fn)

    def factory(p: Any = None) -> FunctionReward:
        kwargs = dataclasses.asdict(p) if p is not None else {}
        return FunctionReward(fn, name=name, kwargs=kwargs)

    factory.__doc__ = inspect.getdoc(fn)
    if hasattr(fn, "accepts_prompt"):  # the prompts it can score (flowrl.hookspecs), checked by validation
        factory.accepts_prompt = fn.accepts_prompt
    return factory, params
