"""The training engine: one loop for the whole GRPO family.

Read :mod:`flowrl.train.loop` top to bottom; each phase lives in the module named after it:
``session`` (loading a policy), ``collect`` (rollout, rewards, advantages), ``update`` (the
policy update), ``evaluate`` (the one ODE sampler), ``state`` and ``checkpoint`` (what a
checkpoint holds, written atomically). docs/architecture.md draws the map.
"""

from .loop import train

__all__ = ["train"]
