"""The tiny recipe: the one builder of the small recipes the tests train, validate or sweep.

Every such recipe runs the embedded model on the CPU in seconds. :data:`BASE` holds what they
share; a test states only how its recipe differs::

    tiny_recipe()                                    # BASE as TOML text
    tiny_recipe(ENGINE, log={"image_every": 1})      # the training tests' recipe, images every iteration
    tiny_recipe(CLI, run={"name": "x", "seed": 3})   # the CLI tests' one-iteration run
    tiny_recipe(model={"random_init": None}, rewards=[{"use": "verifier"}])

The positional layers (:data:`ENGINE`, :data:`CLI`) apply first, in order, then the keyword
tables. A table given as a dict is merged key by key into the table of that name (created where
absent); a key set to ``None`` is removed (its default applies), a table set to ``None`` is removed
whole. A list of tables (``rewards``, ``trackers``) replaces the list; ``None`` or ``[]`` removes it.
:func:`tiny_recipe_data` gives the same recipe as a dict (for ``flowrl.recipe.validate``),
:func:`write_recipe` writes a recipe text to ``DIRECTORY/tiny.toml``.

Imported by name (``tests/`` is on the path of every test, beside ``tests/conftest.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flowrl.recipe import dump_toml

#: What every tiny recipe shares: the randomly initialised embedded model on the CPU, 5 sampling
#: steps (T = 4 trainable transitions) in chunks of 2, 2 prompts x 4 samples in micro-batches of 2
#: for 2 iterations, no progress bar and no images, the area reward.
BASE: dict[str, Any] = {
    "run": {"name": "tiny", "seed": 7, "device": "cpu"},
    "model": {"use": "embedded", "random_init": True},
    "sampler": {"steps": 5},
    "chunker": {"use": "fixed", "size": 2},
    "train": {"iterations": 2, "prompts_per_iteration": 2, "group_size": 4, "micro_batch_size": 2},
    "log": {"progress": False, "image_every": 0},
    "rewards": [{"use": "area"}],
}

#: The training tests' recipe (tests/train, tests/gpu): 4 iterations, each rollout used for two
#: passes of two optimizer steps, a warm-up + cosine LR schedule, a clipped loss on half the chunks,
#: checkpoints every 2 iterations, so that resume has optimizer moments, a moving LR and
#: off-policy ratios to get right.
#:
#: AdamW's eps is 1e-6, not torch's 1e-8, so that comparing two runs is well conditioned. AdamW
#: moves a weight by about lr * g / (|g| + eps): where a gradient is near zero (a group's
#: advantages sum to zero, so some gradients cancel to rounding level), a rounding difference dg in
#: g moves the weight by up to lr / eps * dg. With eps = 1e-8 and lr = 3e-3 that is 3e5 * dg, so
#: two processes that sum the same gradient in a different order (dg ~ 1e-11) can disagree by 3e-6
#: in a weight; with eps = 1e-6 by 3e-8, well under the 1e-6 the comparisons allow.
ENGINE: dict[str, Any] = {
    "schedule": {"use": "shift", "shift": 3.0},
    "kernel": {"use": "flow", "a": 0.7},
    "selector": {"use": "uniform", "fraction": 0.5},
    "advantage": {"use": "group_zscore"},
    "loss": {"use": "clipped", "eps_low": 0.2, "eps_high": 0.2},
    "train": {"iterations": 4, "updates_per_rollout": 2, "optimizer_steps_per_update": 2, "lr": 3e-3,
              "adam_eps": 1e-6, "lr_schedule": "cosine", "warmup_steps": 2},
    "checkpoint": {"every": 2, "keep_last": 3},
}

#: The CLI tests' run (tests/cli), trained before a command reads its run directory: one
#: iteration of 4 sampling steps in single-step chunks, 2 prompts x 2 samples, 2 evaluation prompts
#: of one seed, a checkpoint at the end. Each test names its run and seed.
CLI: dict[str, Any] = {
    "sampler": {"steps": 4},
    "chunker": {"size": 1},
    "train": {"iterations": 1, "group_size": 2},
    "prompts": {"num_eval": 2, "eval_seeds": 1},
    "checkpoint": {"every": 1},
}


def _merge(data: dict[str, Any], tables: Mapping[str, Any]) -> None:
    for name, value in tables.items():
        if value is None or (isinstance(value, list) and not value):
            data.pop(name, None)
        elif isinstance(value, Mapping):
            table = data.setdefault(name, {})
            for key, item in value.items():
                if item is None:
                    table.pop(key, None)
                else:
                    table[key] = copy.deepcopy(item)
        elif isinstance(value, list):
            data[name] = copy.deepcopy(value)
        else:
            raise TypeError(f"tiny_recipe: table {name!r} must be a dict, a list of dicts or None, not {value!r}")


def tiny_recipe_data(*layers: Mapping[str, Any], **tables: Any) -> dict[str, Any]:
    """:data:`BASE` with ``layers`` and then ``tables`` applied (see the module's docstring)."""
    data = copy.deepcopy(BASE)
    for layer in (*layers, tables):
        _merge(data, layer)
    return data


def tiny_recipe(*layers: Mapping[str, Any], **tables: Any) -> str:
    """The recipe of :func:`tiny_recipe_data` as TOML text."""
    return dump_toml(tiny_recipe_data(*layers, **tables))


def write_recipe(directory: Path, text: str | None = None) -> Path:
    """``text`` (the training tests' recipe, ``tiny_recipe(ENGINE)``, by default) written to
    ``directory/tiny.toml``; returns the path."""
    path = Path(directory) / "tiny.toml"
    path.write_text(tiny_recipe(ENGINE) if text is None else text)
    return path
