"""Loading a recipe: reading the TOML file, ``--set`` overrides, relative paths made absolute,
and turning the parsed tables into a :class:`~flowrl.recipe.schema.Recipe` (:func:`validate`:
unknown tables and keys, component names and their parameters), then handing it to the
cross-checks (:mod:`flowrl.recipe.validation`). :func:`load_recipe` does all of it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from ..config import fields_of, from_dict
from ..errors import RecipeError, printable, suggest
from ..plugins import Registry, get_registry
from .schema import (
    COMPONENT_SECTIONS,
    LIST_SECTIONS,
    REWARD_ENTRY_KEYS,
    SECTIONS,
    ComponentChoice,
    Recipe,
    RewardEntryConfig,
)
from .legacy import move_branch_keys
from .validation import check_reward_weights, cross_check

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def read_toml(path: str | Path) -> dict[str, Any]:
    """A recipe file's tables; a file the TOML parser cannot read, for any reason, is one
    RecipeError naming the file."""
    path = Path(path)
    if path.is_dir():
        raise RecipeError(f"{path} is a directory, not a recipe file", hint="pass a .toml file (`ls recipes/`)")
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}", hint="check the path (`ls recipes/`)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(f"not a UTF-8 text file ({exc})", where=str(path)) from exc
    except OSError as exc:
        raise RecipeError(f"cannot read the recipe: {exc.strerror or exc}", where=str(path)) from exc
    return parse_toml(text, str(path))


def parse_toml(text: str, where: str) -> dict[str, Any]:
    """``tomllib.loads``, with every way it can fail as one RecipeError at ``where``: a syntax
    error, and nesting so deep that the parser (recursive) runs out of stack."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"TOML syntax error: {exc}", where=where) from exc
    except RecursionError as exc:
        raise RecipeError("arrays or tables nested too deeply for the TOML parser", where=where,
                          hint="a recipe nests a few levels at most: look for a run of '[' or '{'") from exc


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``section.key=value`` (value in TOML syntax, bare words taken as strings)."""
    if "=" not in text:
        raise RecipeError(f"override '{text}' must look like section.key=value", where="--set")
    dotted, raw = text.split("=", 1)
    keys = [k.strip() for k in dotted.strip().split(".")]
    if len(keys) < 2 or not all(keys):
        raise RecipeError(f"override '{text}' must name a section and a key, e.g. train.lr=1e-5", where="--set")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    except RecursionError as exc:
        raise RecipeError(f"the value of override '{dotted.strip()}' is nested too deeply for the TOML parser",
                          where="--set") from exc
    return keys, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``--set`` overrides. ``rewards.0.weight=2`` indexes arrays of tables."""
    for text in overrides:
        keys, value = parse_override(text)
        node: Any = data
        for depth, key in enumerate(keys[:-1]):
            if not isinstance(node, (dict, list)):
                parent = ".".join(keys[:depth])
                raise RecipeError(
                    f"override '{text}': '{parent}' is a value ({node!r}), not a table", where="--set"
                )
            if isinstance(node, list):
                if not key.isdigit() or int(key) >= len(node):
                    raise RecipeError(f"override '{text}': no entry {key} in that list", where="--set")
                node = node[int(key)]
            else:
                node = node.setdefault(key, {})  # unknown tables are reported by validation
        last = keys[-1]
        if not isinstance(node, (dict, list)):
            raise RecipeError(
                f"override '{text}': '{'.'.join(keys[:-1])}' is a value ({node!r}), not a table",
                where="--set",
            )
        if isinstance(node, list):
            raise RecipeError(f"override '{text}' must end with a key, not a list index", where="--set")
        if last == "use" and isinstance(node, dict) and node.get("use") != value:
            # switching component: the old component's parameters do not apply to the new one
            node.clear()
        node[last] = value
    return data


def load_recipe(
    path: str | Path,
    overrides: list[str] | None = None,
    registry: Registry | None = None,
) -> Recipe:
    """Read, override and validate a recipe file. Raises RecipeError with file and key.

    Relative paths (keys declared with ``param(..., path=...)``) given in the file resolve
    against the file's directory; those given by ``--set`` overrides, against the current
    directory. The recipe then holds absolute paths (and so does the run's saved recipe)."""
    registry = registry or get_registry()
    data = read_toml(path)
    move_branch_keys(data, str(path))  # old keys first: a moved path resolves against the recipe's folder
    resolve_paths(data, Path(path).resolve().parent, registry, str(path), from_file=True)
    data = apply_overrides(data, overrides or [])
    touched = {tuple(parse_override(text)[0]) for text in overrides or []}
    if "branch_profile" in dict(move_branch_keys(data, str(path))):  # an old key given by --set: its path
        touched.add(("window", "profile"))  # resolves against the current directory, as the override's would
    resolve_paths(data, Path.cwd(), registry, "--set", only=touched)
    return validate(data, source=str(path), registry=registry)


def resolve_paths(data: dict[str, Any], base: Path, registry: Registry, where: str, *,
                  from_file: bool = False, only: set[tuple[str, ...]] | None = None) -> None:
    """Make the relative path values of a parsed recipe absolute against ``base``, in place.
    ``only``: just these key paths (``("prompts", "source")``, ``("rewards", "0", "model")``).
    Malformed tables are left for :func:`validate` to report."""
    tables: list[tuple[tuple[str, ...], Any, type | None]] = []
    for section, cls in SECTIONS.items():
        tables.append(((section,), data.get(section), cls))
    for section, kind in list(COMPONENT_SECTIONS.items()) + list(LIST_SECTIONS.items()):
        value = data.get(section)
        entries = [((section, str(i)), t) for i, t in enumerate(value)] if isinstance(value, list) else [((section,), value)]
        for key, table in entries:
            use = table.get("use") if isinstance(table, dict) else None
            comp = registry.components.get(kind, {}).get(use) if isinstance(use, str) else None
            tables.append((key, table, comp.params if comp is not None else None))
    for key, table, cls in tables:
        if not isinstance(table, dict) or cls is None:
            continue
        for f, _ in fields_of(cls):
            value = table.get(f.name)
            if f.metadata.get("path") and isinstance(value, str) and (only is None or (*key, f.name) in only):
                table[f.name] = resolve_path(value, base, f, f"{where}: {'.'.join((*key, f.name))}", from_file)


def resolve_path(value: str, base: Path, f: dataclasses.Field, where: str, from_file: bool) -> str:
    """One path value made absolute against ``base``; words, empty values, absolute paths and
    (for ``path="hub"`` keys) hub ids stay as they are. A path in a recipe file that exists only
    relative to the current directory is refused: the recipe would mean different files from
    different directories."""
    keep = f.metadata.get("keep", ())
    if not value or value in keep or any(k.endswith(":") and value.startswith(k) for k in keep):
        return value
    p = Path(value).expanduser()
    if p.is_absolute():
        return str(p)
    candidate = Path(os.path.normpath(base / p))
    explicit = value.startswith(("./", "../", ".\\", "..\\"))
    if f.metadata["path"] == "hub" and not (explicit or candidate.exists()) and not (from_file and p.exists()):
        return value  # a hub id
    if from_file and not candidate.exists() and p.exists() and candidate != Path.cwd() / p:
        raise RecipeError(
            f"'{value}' does not exist relative to the recipe's directory ({base}), only relative to the current "
            "directory; paths in a recipe are relative to the recipe file",
            where=where,
            hint=f"write it as {json.dumps(os.path.relpath(p.resolve(), base))} or as an absolute path",
        )
    return str(candidate)


def validate(
    data: dict[str, Any], *, source: str = "<recipe>", registry: Registry | None = None, require_rewards: bool = True
) -> Recipe:
    """Validate a parsed recipe dict and return a :class:`Recipe`.

    ``require_rewards=False`` accepts a recipe without ``[[rewards]]`` (for sampling and
    profiling a model, which score nothing)."""
    registry = registry or get_registry()
    move_branch_keys(data, source)  # [sampler].branch_* of older recipes and run directories (flowrl.recipe.legacy)
    valid_tables = list(SECTIONS) + list(COMPONENT_SECTIONS) + list(LIST_SECTIONS)
    for key, value in data.items():
        if key not in valid_tables:
            raise RecipeError(f"unknown table [{printable(key)}]", where=source, hint=suggest(key, valid_tables))
        is_list = key in LIST_SECTIONS
        if is_list and not (isinstance(value, list) and all(isinstance(v, dict) for v in value)):
            raise RecipeError(f"[[{key}]] must be an array of tables ([[{key}]] entries)", where=source)
        if not is_list and not isinstance(value, dict):
            raise RecipeError(f"'{key}' must be a table ([{key}]), got {type(value).__name__}", where=source)

    plain = {
        name: from_dict(cls, data.get(name, {}), where=f"{source}: [{name}]") for name, cls in SECTIONS.items()
    }
    components = {}
    for section, kind in COMPONENT_SECTIONS.items():
        table = data.get(section)
        if table is None:
            default = registry.default(kind)
            if default is None:
                raise RecipeError(
                    f"table [{section}] is missing and no plugin provides a default {kind}",
                    where=source,
                    hint=f'add [{section}] with use = "<name>"; valid: {", ".join(registry.names(kind))}',
                )
            table = {"use": default}
        components[section] = component_choice(registry, kind, table, f"{source}: [{section}]")

    rewards = [
        component_choice(registry, "reward", t, f"{source}: [[rewards]] #{i + 1}", extra=REWARD_ENTRY_KEYS)
        for i, t in enumerate(data.get("rewards", []))
    ]
    if not rewards and require_rewards:
        raise RecipeError(
            "no reward: add at least one [[rewards]] entry",
            where=source,
            hint=f'valid rewards: {", ".join(registry.names("reward"))}',
        )
    labels = [r.label for r in rewards]
    dupes = sorted({n for n in labels if labels.count(n) > 1})
    if dupes:
        raise RecipeError(
            f"reward '{dupes[0]}' is listed twice",
            where=f"{source}: [[rewards]]",
            hint="give each entry a distinct `name = \"...\"`",
        )
    trackers = [
        component_choice(registry, "tracker", t, f"{source}: [[trackers]] #{i + 1}")
        for i, t in enumerate(data.get("trackers", []))
    ]
    recipe = Recipe(
        **plain, components=components, rewards=rewards, trackers=trackers, source=source
    )
    if require_rewards:
        check_reward_weights(recipe)
    cross_check(recipe, registry)
    if recipe.data.enabled and "group_size" in data.get("train", {}):  # after the [loss] agreed with [data]
        raise RecipeError("group_size does not apply to an offline run: a row of the [data] table is one sample",
                          where=f"{source}: [train].group_size",
                          hint="remove it; prompts_per_iteration is the number of rows each iteration trains")
    return recipe


def component_choice(
    registry: Registry, kind: str, table: dict[str, Any], where: str, extra: tuple[str, ...] = ()
) -> ComponentChoice:
    if "use" not in table:
        raise RecipeError(
            "required key 'use' is missing",
            where=where,
            hint=f'name a registered {kind}: {", ".join(registry.names(kind))}',
        )
    name = table["use"]
    if not isinstance(name, str):
        raise RecipeError(f"key 'use' must be a string, got {name!r}", where=where)
    comp = registry.get(kind, name, where=f"{where}.use")
    where = f"{where} ({kind} '{name}')"
    body = {k: v for k, v in table.items() if k != "use" and k not in extra}
    if comp.params is None:
        if body:
            key = next(iter(body))
            raise RecipeError(
                f"unknown key '{key}': {kind} '{name}' takes no parameters", where=where,
                hint=f"valid: use{', ' + ', '.join(extra) if extra else ''}",
            )
        params = None
    else:
        params = from_dict(comp.params, body, where=where, ignore=("use",) + extra)
    choice = ComponentChoice(use=name, params=params)
    if "weight" in extra:
        entry = from_dict(RewardEntryConfig, {k: table[k] for k in extra if k in table}, where=where)
        if "name" in table and not entry.name:
            raise RecipeError("key 'name' must be a non-empty string, got ''", where=where,
                              hint=RewardEntryConfig.__dataclass_fields__["name"].metadata["help"])
        choice.weight, choice.label, choice.chunk_weights = entry.weight, entry.name or name, list(entry.chunk_weights)
        choice.frames = entry.frames
    return choice
