"""What the ``flowrl reward`` commands share: their command group, and building a reward from
``--set key=value`` settings the way a recipe's ``[[rewards]]`` entry is built.

The group is added to the app by :mod:`flowrl.commands.reward_server`; ``flowrl reward score``
(:mod:`flowrl.commands.reward_score`) adds its command to the same group.
"""

from __future__ import annotations

from .base import FlowrlTyper, registry

reward_app = FlowrlTyper(name="reward", help="Reward utilities: score images with a reward, or serve one over HTTP.",
                         no_args_is_help=True)


def parse_settings(settings: list[str]) -> dict:
    """``key=value`` settings as a table: each value read as TOML, a bare word as a string (as
    ``flowrl train --set`` reads them)."""
    from ..errors import RecipeError
    from ..recipe import tomllib

    table: dict = {}
    for text in settings:
        if "=" not in text:
            raise RecipeError(f"setting '{text}' must look like key=value", where="--set",
                              hint="e.g. --set device=cuda:1 --set scale=cosine")
        key, raw = (part.strip() for part in text.split("=", 1))
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except RecursionError as exc:
            raise RecipeError(f"the value of setting '{key}' is nested too deeply for the TOML parser",
                              where="--set") from exc
        except tomllib.TOMLDecodeError:
            value = raw  # bare words are strings, as in `flowrl train --set`
        table[key] = value
    return table


def reward_choice(name: str, settings: list[str], command: str = "flowrl reward serve"):
    """Reward ``name`` and its ``key=value`` settings (TOML values), validated as a recipe's
    ``[[rewards]]`` entry is (:func:`flowrl.recipe.component_choice`), nothing built yet.
    ``command`` names the command in messages."""
    from ..recipe import component_choice

    registry().get("reward", name, where=f"{command} NAME")  # an unknown name, said plainly
    return component_choice(registry(), "reward", {"use": name, **parse_settings(settings)}, command)


def build_chosen(choice, *, command: str = "flowrl reward serve", reads: str = "a reward server receives images"):
    """Build a :func:`reward_choice` as training builds a reward (:func:`flowrl.recipe.build_component`):
    a factory's own ``ValueError`` or ``TypeError`` becomes one message. A reward that scores
    latents is refused (``reads`` says why)."""
    from ..errors import FlowrlError, RecipeError
    from ..interfaces import scores_latents

    where = f"{command} ({choice.use})"
    try:
        reward = registry().get("reward", choice.use).build(choice.params)
    except FlowrlError as exc:
        raise type(exc)(exc.message, where=exc.where or where, hint=exc.hint) from exc
    except (ValueError, TypeError) as exc:
        raise RecipeError(str(exc), where=where) from exc
    if scores_latents(reward):
        raise FlowrlError(f"reward '{choice.use}' scores a model's latents, and {reads}", where=f"{command} NAME",
                          hint="name it in the recipe's [[rewards]] instead: it runs beside the model it reads")
    return reward


def build_reward(name: str, settings: list[str], *, command: str = "flowrl reward serve",
                 reads: str = "a reward server receives images"):
    """Reward ``name`` built from ``key=value`` settings: :func:`reward_choice`, then :func:`build_chosen`."""
    return build_chosen(reward_choice(name, settings, command), command=command, reads=reads)
