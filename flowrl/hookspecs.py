"""Every hook a flowrl plugin can implement, in one place.

A plugin is a module (or object) exposed through the ``flowrl`` entry-point group::

    # pyproject.toml of a third-party package
    [project.entry-points.flowrl]
    my_rewards = "my_package.flowrl_plugin"

    # my_package/flowrl_plugin.py
    from flowrl import hookimpl

    @hookimpl
    def register_rewards(register):
        register("redness", lambda images, prompts: images[:, 0].mean(dim=(1, 2)))

The registration hooks all receive one argument, ``register``, a callback bound to one kind of
component::

    register(name, factory, *, params=None, help=None, replace=False)

- ``name``: the name recipes use (``use = "name"``). A name registered twice is an error that
  names both plugins, unless exactly one of the two passes ``replace=True`` (an explicit
  override; the built-ins never do).
- ``factory``: builds the component. One rule: a component WITH parameters (``params=``, or a
  class with a nested dataclass ``Config``) is built as ``factory(params)``, ``params`` being the
  validated instance of that dataclass; a component WITHOUT parameters is built as
  ``factory()``. For rewards, a plain function ``fn(images, prompts) -> Tensor[B]`` is a complete
  reward; its keyword-only arguments with defaults become its recipe parameters.
- ``params``: a dataclass whose fields are the recipe keys, each documented with
  :func:`flowrl.config.param` (shown by ``flowrl validate --explain``).
- ``help``: one line for ``flowrl plugins``; defaults to the factory's docstring.
- A reward that can score only some prompts (the embedded model's ``area`` and ``verifier`` read
  its prompt grammar) may carry an attribute ``accepts_prompt(prompt)`` (on the function or the
  class) that raises ``ValueError`` for a prompt it cannot score: ``flowrl validate`` (and
  ``flowrl train``, before the model loads) runs it over the recipe's prompt files.

The built-in plugins (``plugins/`` in the repository, ``flowrl_plugins`` once installed) are
registered through this same entry-point group, so they are ordinary plugins. Their hook
implementations are ``trylast`` so that a third party's run first and can override defaults.
A hook implementation whose name matches no spec below is rejected when the plugin loads.
"""

from __future__ import annotations

import pluggy

PROJECT = "flowrl"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_models(register):
    """Register model adapters (see :class:`flowrl.interfaces.ModelAdapter`).

    A model adapter wraps a flow-matching text-to-image network: it encodes prompts, predicts
    the velocity at ``(x, sigma)``, decodes latents to images in [0, 1], and names its trainable
    module. Recipes pick one with ``[model] use = "name"``.
    """


@hookspec
def register_schedules(register):
    """Register sigma schedules (see :class:`flowrl.interfaces.Schedule`).

    A schedule maps a number of sampling steps N to ``N + 1`` decreasing sigmas from 1 to 0.
    Recipes pick one with ``[schedule] use = "name"``.
    """


@hookspec
def register_kernels(register):
    """Register SDE step kernels (see :class:`flowrl.interfaces.Kernel`).

    A kernel is one stochastic (or deterministic) sampling step with a Gaussian transition whose
    log-probability the policy gradient uses. Recipes pick one with ``[kernel] use = "name"``.
    """


@hookspec
def register_chunkers(register):
    """Register chunkers (see :class:`flowrl.interfaces.Chunker`).

    A chunker splits the T trainable transitions of a trajectory into consecutive chunks, the
    units that the loss computes one ratio for. Recipes pick one with ``[chunker] use = "name"``.
    """


@hookspec
def register_selectors(register):
    """Register chunk selectors (see :class:`flowrl.interfaces.ChunkSelector`).

    A selector chooses, per sample, which chunks are trained in an update, and reports them.
    Recipes pick one with ``[selector] use = "name"``.
    """


@hookspec
def register_advantages(register):
    """Register advantage estimators (see :class:`flowrl.interfaces.AdvantageEstimator`).

    An estimator turns the rewards of a batch of groups into one advantage per sample.
    Recipes pick one with ``[advantage] use = "name"``.
    """


@hookspec
def register_losses(register):
    """Register policy losses (see :class:`flowrl.interfaces.PolicyLoss`).

    A loss maps each trained unit's log-ratio and advantage to a scalar objective.
    Recipes pick one with ``[loss] use = "name"``.
    """


@hookspec
def register_likelihoods(register):
    """Register likelihood estimators (see :class:`flowrl.interfaces.LikelihoodEstimator`).

    An estimator says where a ratio-based loss reads a sample's log-likelihood: the SDE
    trajectory's transitions (``trajectory``, the default) or the final image's flow-matching ELBO
    (``elbo``). It turns the ``[loss]`` into the objective the update runs, and refuses a loss it
    cannot serve. Recipes pick one with ``[likelihood] use = "name"``.
    """


@hookspec
def register_windows(register):
    """Register SDE window planners (see :class:`flowrl.interfaces.WindowPlanner`).

    A planner says, per iteration and per sample, which steps of the rollout use the SDE kernel
    (and are trained) and which solver runs elsewhere: MixGRPO's sliding window, Flow-GRPO-Fast's
    random window. Recipes pick one with ``[window] use = "name"`` (default ``fixed``).
    """


@hookspec
def register_rewards(register):
    """Register rewards (see :class:`flowrl.interfaces.Reward`).

    A reward scores a batch of images ``[B, 3, H, W]`` in [0, 1] against their prompts and
    returns ``[B]`` scores. A plain function is enough. Recipes list rewards as
    ``[[rewards]] use = "name"`` entries with weights.
    """


@hookspec
def register_trackers(register):
    """Register experiment trackers (see :class:`flowrl.interfaces.Tracker`).

    A tracker receives every step's metrics and image grids (TensorBoard, for example).
    ``metrics.jsonl`` is always written by the engine itself. Recipes add trackers as
    ``[[trackers]] use = "name"`` entries.
    """


@hookspec(firstresult=True)
def default_component(kind: str):
    """Name the component a recipe gets when it omits the table for ``kind``.

    ``kind`` is one of ``model``, ``schedule``, ``kernel``, ``chunker``, ``selector``,
    ``advantage``, ``loss``, ``likelihood``, ``window``. Return a registered name, or ``None`` to defer to other plugins.
    The first non-None answer wins; the built-in answer is ``trylast``, so any plugin can
    change a default. flowrl's core itself holds no default names.
    """
