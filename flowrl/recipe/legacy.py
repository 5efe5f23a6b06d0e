"""Keys of older recipes that moved, read as their new keys.

BranchGRPO was nine ``[sampler].branch_*`` keys; it is two components now (docs/objectives.md,
"Branch rollouts"):

- the tree's shape, ``[window] use = "branch"``: ``branch_steps``, ``branch_factors``,
  ``branch_profile`` and ``branch_count`` are its ``steps``, ``factors``, ``profile`` and ``count``;
- the tree advantage, ``[advantage] use = "tree"`` (``branch_advantage = "tree"``): the group
  z-score's keys of the recipe's ``group_zscore`` table (for the leaves) and ``branch_fusion``,
  ``branch_keep``, ``branch_prune_steps`` and ``branch_prune_slide`` as its ``fusion``, ``keep``,
  ``prune_steps`` and ``prune_slide``.

:func:`move_branch_keys` moves them in a parsed recipe, so that a recipe file, ``--set`` overrides
and a run directory's ``recipe.toml`` (the resolved recipe, which holds every key: a run written
before the move holds all nine, at their defaults unless it branched) keep loading, and a resumed
run compares equal to the recipe that started it. Keys at their defaults are dropped silently;
any other move prints one notice naming the new keys. What has no new home is refused with a
message naming the new keys: branch keys beside a ``[window]`` that plans its own windows (a tree
samples with the sampler's kernels), a tree advantage on another estimator than ``group_zscore``,
and width or depth pruning without the tree advantage (refused before the move too).
"""

from __future__ import annotations

import sys
from typing import Any

from ..errors import RecipeError

#: Every old ``[sampler]`` key and its default.
DEFAULTS: dict[str, Any] = {
    "branch_steps": [], "branch_factors": [], "branch_profile": "", "branch_count": 0, "branch_advantage": "leaf",
    "branch_keep": 0, "branch_prune_steps": [], "branch_prune_slide": 0, "branch_fusion": "mean",
}
#: The tree's shape: old key -> ``[window] use = "branch"`` key.
WINDOW_KEYS = {"branch_steps": "steps", "branch_factors": "factors", "branch_profile": "profile",
               "branch_count": "count"}
#: The tree advantage: old key -> ``[advantage] use = "tree"`` key.
ADVANTAGE_KEYS = {"branch_fusion": "fusion", "branch_keep": "keep", "branch_prune_steps": "prune_steps",
                  "branch_prune_slide": "prune_slide"}
#: Windows that take no parameters and plan nothing: a tree replaces them.
PLAIN_WINDOWS = ("fixed",)
DOCS = 'docs/objectives.md, "Branch rollouts"'

_noticed: set[str] = set()


def move_branch_keys(data: dict[str, Any], where: str) -> list[tuple[str, str]]:
    """Move the old ``[sampler].branch_*`` keys of the parsed recipe ``data`` to their new tables,
    in place (module docstring); returns ``(old key, new key)`` of each key moved, as
    ``("branch_profile", "[window].profile")``. ``where`` names the recipe in the notice and in a
    refusal (the file's keys and its ``--set`` overrides alike, as every recipe message does).
    Tables that are not tables are left for validation to report."""
    sampler = data.get("sampler")
    if not isinstance(sampler, dict) or not any(key in sampler for key in DEFAULTS):
        return []
    old = {key: sampler.pop(key) for key in list(sampler) if key in DEFAULTS}
    given = {key: value for key, value in old.items() if value != DEFAULTS[key]}
    moved: list[tuple[str, str]] = []
    shape = {key: value for key, value in given.items() if key in WINDOW_KEYS}
    window = data.get("window")
    if shape and (window is None or isinstance(window, dict)):
        use = (window or {}).get("use", "fixed")
        if use not in (*PLAIN_WINDOWS, "branch"):
            first = next(iter(shape))
            raise RecipeError(
                f"[sampler].{first} is now [window] use = 'branch' ({WINDOW_KEYS[first]}), and this recipe's [window] is "
                f"'{use}', which plans its own windows; a tree samples with the sampler's kernels and sde_window",
                where=f"{where}: [sampler].{first}",
                hint=f"sample trees with [window] use = 'branch' (steps, factors) in place of [window] '{use}', or "
                     f"drop the branch keys ({DOCS})")
        window = data["window"] = window if use == "branch" else {"use": "branch"}
        for key, value in shape.items():
            window[WINDOW_KEYS[key]] = value
            moved.append((key, f"[window].{WINDOW_KEYS[key]}"))
    advantage = data.get("advantage")
    if advantage is not None and not isinstance(advantage, dict):
        return _notice(moved, where)
    use = (advantage or {}).get("use", "group_zscore")
    tree = {key: value for key, value in given.items() if key in ADVANTAGE_KEYS}
    if old.get("branch_advantage") == "tree" or (use == "tree" and tree):
        if use not in ("group_zscore", "tree"):
            raise RecipeError(
                f"[sampler].branch_advantage = 'tree' is now [advantage] use = 'tree', which computes its leaves' "
                f"advantages as group_zscore does (std, eps, global_std, clip, multi_reward); this recipe's "
                f"[advantage] is '{use}'", where=f"{where}: [sampler].branch_advantage",
                hint=f"write [advantage] use = 'tree' with its keys in place of [advantage] '{use}' ({DOCS})")
        advantage = data["advantage"] = {**(advantage or {}), "use": "tree"}
        if "branch_advantage" in given:
            moved.append(("branch_advantage", "[advantage] use = 'tree'"))
        for key, value in tree.items():
            advantage[ADVANTAGE_KEYS[key]] = value
            moved.append((key, f"[advantage].{ADVANTAGE_KEYS[key]}"))
    elif tree:
        pruning = [key for key in tree if key != "branch_fusion"]
        if pruning:  # refused before the move too: pruning without the tree advantage
            key = pruning[0]
            raise RecipeError(
                f"[sampler].{key} prunes a tree advantage; it is now [advantage].{ADVANTAGE_KEYS[key]} of [advantage] "
                f"use = 'tree', and this recipe's advantage is '{use}'", where=f"{where}: [sampler].{key}",
                hint=f"write [advantage] use = 'tree' with {ADVANTAGE_KEYS[key]} = ..., or drop {key} ({DOCS})")
        moved.append(("branch_fusion", "nothing ([advantage] use = 'tree' only; ignored before too)"))
    return _notice(moved, where)


def _notice(moved: list[tuple[str, str]], where: str) -> list[tuple[str, str]]:
    """Print one line (once per text in this process) naming the new keys of what moved."""
    if moved:
        text = (f"warning: {where}: old [sampler] keys read as their new ones: "
                + ", ".join(f"{key} -> {new}" for key, new in moved)
                + f" (write them so; {DOCS})")
        if text not in _noticed:
            _noticed.add(text)
            print(text, file=sys.stderr)
    return moved
