"""Typed, documented configuration dataclasses and their validation.

Every recipe key is a dataclass field declared with :func:`param`, which holds its default, its
one documentation string and its limits. :func:`from_dict` builds a dataclass from a TOML table
and raises :class:`~flowrl.errors.RecipeError` naming the file and the key for an unknown key,
a wrong type or an out-of-range value. :func:`explain` renders the documentation.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, Union

from .errors import RecipeError, printable, suggest

_MISSING = dataclasses.MISSING


#: The largest value an integer key takes when its field names no ``max`` of its own: every
#: count has a bound, checked before anything is allocated.
MAX_COUNT = 10**9


def param(
    default: Any = _MISSING,
    help: str = "",
    *,
    min: float | None = None,
    max: float | None = None,
    exclusive_min: bool = False,
    path: bool | Literal["hub"] = False,
    keep: tuple[str, ...] = (),
    required: bool = False,
) -> Any:
    """Declare one documented recipe field.

    Args:
        default: the default; omit it to make the key required. Lists are copied per instance.
        help: the field's documentation, written once, here.
        min, max: inclusive bounds for numbers (``exclusive_min`` makes ``min`` strict). An
            integer field without ``max`` is bounded by :data:`MAX_COUNT`. Floats must be finite.
        path: the value is a file or directory path: a relative one is resolved against the
            directory of the recipe file that gives it (:func:`flowrl.recipe.load_recipe`), and the
            run records the absolute path. ``"hub"``: a Hugging Face hub id or a path; a relative
            value is a path only when it starts with ``./`` or ``../`` or exists there.
        keep: values of a path field that are words, not paths (the empty string always is); an
            entry ending in ``:`` keeps every value with that prefix (``"hf:"``: a dataset name).
        required: the key must hold a value to train: an empty string or list is refused
            by ``flowrl validate`` and ``flowrl train`` before any model loads
            (:func:`flowrl.recipe.check_startable`). The default may still be empty, so that a
            shipped recipe can leave the key for its user to fill in (and ``flowrl plan`` reads it).
    """
    metadata = {"help": help, "min": min, "max": max, "exclusive_min": exclusive_min, "path": path, "keep": keep,
                "required": required}
    if isinstance(default, (list, dict)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return "table"
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


def _check_type(value: Any, tp: Any) -> tuple[bool, Any]:
    """Return (ok, converted value) for a TOML value against a type annotation."""
    if tp is Any:
        return True, value
    origin = typing.get_origin(tp)
    if origin is Literal:
        return value in typing.get_args(tp), value
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            ok, converted = _check_type(value, arg)
            if ok:
                return True, converted
        return False, value
    if tp is type(None):
        return value is None, value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False, value
        args = typing.get_args(tp)
        item_type = args[0] if args else Any
        out = []
        for item in value:
            ok, converted = _check_type(item, item_type)
            if not ok:
                return False, value
            out.append(converted)
        return True, out
    if origin is dict or tp is dict:
        return isinstance(value, dict), value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, bool):
            return False, value
        if isinstance(value, (int, float)):
            return True, float(value)
        return False, value
    if tp is str:
        return isinstance(value, str), value
    return isinstance(value, tp), value


def fields_of(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    """The dataclass fields of ``cls`` with their resolved type annotations."""
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls) if f.init]


def from_dict(cls: type, data: Mapping[str, Any], *, where: str, ignore: tuple[str, ...] = ()):
    """Build the dataclass ``cls`` from a TOML table, validating every key.

    Args:
        where: the location prefix used in errors, e.g. ``"recipe.toml: [train]"``.
        ignore: keys handled by the caller (such as ``use``), skipped here.
    """
    known = {f.name: (f, tp) for f, tp in fields_of(cls)}
    kwargs = {}
    for key, value in data.items():
        if key in ignore:
            continue
        if key not in known:
            valid = [k for k in known] + list(ignore)
            raise RecipeError(f"unknown key '{printable(key)}'", where=where, hint=suggest(key, valid))
        f, tp = known[key]
        ok, converted = _check_type(value, tp)
        if not ok:
            raise RecipeError(
                f"key '{key}' must be {_type_name(tp)}, got {value!r} ({type(value).__name__})",
                where=where,
                hint=_field_help(f) or None,
            )
        _check_range(key, converted, f, where)
        kwargs[key] = converted
    missing = [
        name
        for name, (f, _) in known.items()
        if name not in kwargs and f.default is _MISSING and f.default_factory is _MISSING
    ]
    if missing:
        f = known[missing[0]][0]
        raise RecipeError(
            f"required key '{missing[0]}' is missing",
            where=where,
            hint=_field_help(f) or None,
        )
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:  # __post_init__ cross-field checks
        raise RecipeError(str(exc), where=where) from exc


def _check_range(key: str, value: Any, f: dataclasses.Field, where: str) -> None:
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, str) and "\x00" in v:
            raise RecipeError(f"key '{key}' contains a NUL character", where=where, hint="remove it from the value")
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        lo, hi = bounds(f, v)
        if isinstance(v, float) and not math.isfinite(v):
            raise RecipeError(f"key '{key}' must be a finite number, got {v}", where=where, hint=_field_help(f) or None)
        if lo is not None:
            too_low = v <= lo if f.metadata.get("exclusive_min") else v < lo
            if too_low:
                op = ">" if f.metadata.get("exclusive_min") else ">="
                raise RecipeError(f"key '{key}' must be {op} {lo}, got {v}", where=where)
        if hi is not None and v > hi:
            raise RecipeError(f"key '{key}' must be <= {hi}, got {v}", where=where)


def bounds(f: dataclasses.Field, value: Any = 0) -> tuple[float | None, float | None]:
    """The field's (min, max); an integer field without its own max is bounded by MAX_COUNT."""
    lo, hi = f.metadata.get("min"), f.metadata.get("max")
    if hi is None and isinstance(value, int) and not isinstance(value, bool):
        hi = MAX_COUNT
    return lo, hi


def _field_help(f: dataclasses.Field) -> str:
    return f.metadata.get("help", "")


def to_dict(obj: Any) -> dict[str, Any]:
    """A dataclass as a plain TOML-serialisable dict (None values dropped)."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            value = to_dict(value)
        if value is not None:
            out[f.name] = value
    return out


def explain(cls: type | None) -> list[tuple[str, str, str, str]]:
    """Rows (key, type, default, help) documenting a params dataclass."""
    if cls is None:
        return []
    rows = []
    for f, tp in fields_of(cls):
        if f.default is not _MISSING:
            default = repr(f.default)
        elif f.default_factory is not _MISSING:
            default = repr(f.default_factory())
        else:
            default = "(required)"
        rows.append((f.name, _type_name(tp) + _bounds_text(f, tp) + _path_text(f) + _required_text(f), default,
                     _field_help(f)))
    return rows


def _required_text(f: dataclasses.Field) -> str:
    return " (required: not empty)" if f.metadata.get("required") else ""


def _path_text(f: dataclasses.Field) -> str:
    kind = f.metadata.get("path")
    if not kind:
        return ""
    return " (hub id or path, relative to the recipe)" if kind == "hub" else " (path, relative to the recipe)"


def _bounds_text(f: dataclasses.Field, tp: Any) -> str:
    """`` in [lo, hi]`` (or ``>= lo`` ...) for numeric fields, as validation enforces them."""
    numeric = tp in (int, float) or typing.get_args(tp) in ((int,), (float,))
    if not numeric:
        return ""
    lo, hi = bounds(f, 0 if int in (tp, *typing.get_args(tp)) else 0.0)
    lo, hi = (None if v is None else (v if isinstance(v, int) else f"{v:g}") for v in (lo, hi))
    left = "(" if f.metadata.get("exclusive_min") else "["
    if lo is not None and hi is not None:
        return f" in {left}{lo}, {hi}]"
    if lo is not None:
        return f" {'>' if left == '(' else '>='} {lo}"
    return f" <= {hi}" if hi is not None else ""


def params_from_signature(fn: Callable) -> type | None:
    """A params dataclass from a function's keyword-only arguments that have defaults.

    Used for rewards registered as plain functions: ``def fn(images, prompts, *, scale=1.0)``
    gets a recipe key ``scale`` of type float.
    """
    fields = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind is not inspect.Parameter.KEYWORD_ONLY or p.default is inspect.Parameter.empty:
            continue
        tp = p.annotation if p.annotation is not inspect.Parameter.empty else type(p.default)
        if isinstance(tp, str):  # postponed annotations: fall back to the default's type
            tp = type(p.default)
        fields.append((p.name, tp, param(p.default, f"keyword argument of {fn.__name__}")))
    if not fields:
        return None
    return dataclasses.make_dataclass(f"{fn.__name__}_params", fields, frozen=True)
