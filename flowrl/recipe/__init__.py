"""TOML recipes: the schema, loading, ``--set`` overrides and validation.

A recipe is a TOML file. Plain tables (``[run]``, ``[train]``, ``[sampler]``, ``[prompts]``,
``[log]``, ``[checkpoint]``, ``[ema]``, ``[distributed]``, ``[replay]``, ``[data]``,
``[pipeline]``) configure the engine and are documented field by field in
:mod:`flowrl.recipe.schema`. Component tables name a registered component and give its parameters::

    [chunker]
    use = "explicit"
    sizes = [2, 3, 4, 7]

    [[rewards]]
    use = "verifier"
    weight = 1.0

:func:`load_recipe` validates everything (types, ranges, unknown tables and keys, component
names and their parameters, cross-field rules such as chunk sizes summing to the number of
trainable transitions) before any model is built. ``flowrl validate --explain`` prints every
key's documentation.

The package, one module per step (each imports only the ones above it in this list):

- :mod:`~flowrl.recipe.schema`: the tables' dataclasses and their fields, :class:`Recipe`;
- :mod:`~flowrl.recipe.writing`: :func:`dump_toml`, the resolved recipe as TOML;
- :mod:`~flowrl.recipe.validation`: the cross-checks between tables, :func:`build_component`;
- :mod:`~flowrl.recipe.startable`: what this machine and the recipe's files must hold for a run
  to start, :func:`check_startable` (and :func:`~flowrl.recipe.startable.cuda_device_count`,
  the one place validation asks PyTorch for GPUs: patch it there);
- :mod:`~flowrl.recipe.legacy`: keys of older recipes that moved (BranchGRPO's ``[sampler].branch_*``),
  read as their new keys with a notice, :func:`~flowrl.recipe.legacy.move_branch_keys`;
- :mod:`~flowrl.recipe.loading`: reading the file, ``--set`` overrides, unknown tables and keys,
  :func:`validate` and :func:`load_recipe`.

Every name below is importable from ``flowrl.recipe`` itself.
"""

from ..config import fields_of
from .loading import (
    apply_overrides,
    component_choice,
    load_recipe,
    parse_override,
    parse_toml,
    read_toml,
    resolve_path,
    resolve_paths,
    tomllib,
    validate,
)
from .schema import (
    COMPONENT_SECTIONS,
    LIST_SECTIONS,
    REWARD_ENTRY_KEYS,
    SECTIONS,
    CheckpointConfig,
    ComponentChoice,
    DataConfig,
    DistributedConfig,
    EmaConfig,
    LogConfig,
    PipelineConfig,
    PromptsConfig,
    Recipe,
    ReplayConfig,
    RewardEntryConfig,
    RunConfig,
    SamplerConfig,
    TrainConfig,
)
from .startable import (
    CUDA_DEVICE,
    check_devices,
    check_startable,
    component_tables,
    device_keys,
    has_columns,
    profile_keys,
)
from .validation import (
    DATA_HINT,
    build_component,
    build_loss,
    data_kind,
    keeps_reference_copy,
    located,
    no_reference_copy_because,
    plan_context,
    trainable_transitions,
    uses_units,
    window_plans,
)
from .writing import dump_toml

__all__ = [
    "COMPONENT_SECTIONS",
    "CUDA_DEVICE",
    "DATA_HINT",
    "LIST_SECTIONS",
    "REWARD_ENTRY_KEYS",
    "SECTIONS",
    "CheckpointConfig",
    "ComponentChoice",
    "DataConfig",
    "DistributedConfig",
    "EmaConfig",
    "LogConfig",
    "PipelineConfig",
    "PromptsConfig",
    "Recipe",
    "ReplayConfig",
    "RewardEntryConfig",
    "RunConfig",
    "SamplerConfig",
    "TrainConfig",
    "apply_overrides",
    "build_component",
    "check_devices",
    "check_startable",
    "component_choice",
    "component_tables",
    "data_kind",
    "device_keys",
    "dump_toml",
    "fields_of",
    "has_columns",
    "keeps_reference_copy",
    "build_loss",
    "uses_units",
    "load_recipe",
    "located",
    "no_reference_copy_because",
    "parse_override",
    "parse_toml",
    "plan_context",
    "profile_keys",
    "read_toml",
    "resolve_path",
    "resolve_paths",
    "tomllib",
    "trainable_transitions",
    "validate",
    "window_plans",
]
