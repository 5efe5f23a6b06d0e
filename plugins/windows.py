"""Built-in SDE window planners (``[window]``): where each rollout's stochastic steps sit.

- ``fixed`` (default): one kernel per step for the whole run, ``[sampler].sde_window``; today's
  sampler, nothing moves.
- ``sliding``: MixGRPO. A window of ``size`` steps, the same for every sample of an iteration,
  starts at 0 and moves by ``stride`` steps every ``every`` iterations (rolling back to 0 past
  the last trainable step); Euler before it, ``outside`` (``euler`` or ``dpm2m``,
  DPM-Solver++(2M): MixGRPO-Flash) after it; ``compress`` < 1 replaces the schedule after the
  window by ``int((N - last) * compress)`` points (MixGRPO-Flash's compression); the window then
  rolls back before compression would leave fewer than 2 points.
- ``random``: Flow-GRPO-Fast. A window of ``size`` steps placed uniformly in ``[lo, hi)`` per
  sample (``scope = "sample"``), per prompt group or per iteration, ODE elsewhere.
- ``ode``: no stochastic step at all, the whole trajectory with ``solver`` (for objectives that
  need no trajectory log-probs, DiffusionNFT).
- ``branch``: BranchGRPO's tree rollouts, with the sampler's kernels (``[sampler].sde_window``): each
  prompt group split at ``steps`` into ``factors`` copies, shared prefixes computed once
  (:class:`flowrl.sampling.branching.BranchWindow`; its tree advantage is ``[advantage] use = "tree"``).

Every plan depends only on (seed, iteration, global sample index), never on the process layout
(docs/objectives.md).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from flowrl import hookimpl
from flowrl.config import param
from flowrl.sampling.branching import BranchWindow
from flowrl.sampling.plans import RolloutPlan
from flowrl.seeding import generator
from flowrl.sampling.solvers import flash_schedule
from flowrl.sampling.windows import random_sde_window_start, sliding_sde_window_start


class FixedWindow:
    """The run's static sampler: one kernel per step, ``[sampler].sde_window`` (no plan)."""

    def num_trainable(self, context) -> int:
        return int(context.trainable.sum())

    def plan(self, iteration, keys, context):
        return None


def _check_fits(size: int, room: int, what: str) -> None:
    if size > room:
        raise ValueError(f"a window of {size} steps does not fit in {what}, which holds {room}; lower size or use "
                         "more sampling steps")


@dataclasses.dataclass(frozen=True)
class SlidingConfig:
    size: int = param(4, "Steps in the SDE window (trained; MixGRPO: 4).", min=1)
    every: int = param(25, "Iterations before the window moves (MixGRPO: 25, Flash: 20).", min=1)
    stride: int = param(1, "Steps the window moves by (MixGRPO: 1; 0 = frozen at the start, Flash*).", min=0)
    outside: Literal["euler", "dpm2m"] = param(
        "euler", "Solver after the window: 'euler' (MixGRPO) or 'dpm2m', DPM-Solver++(2M) (MixGRPO-Flash).")
    compress: float = param(
        1.0, "MixGRPO-Flash: keep int((N - last) * compress) schedule points after the window (1 = the run's "
        "own schedule; Flash 0.4, Flash* 0.2). Needs a schedule with a time warp (shift).", min=0.0, max=1.0,
        exclusive_min=True)


class SlidingWindow:
    """MixGRPO's progressive window (roll back past the last trainable step)."""

    Config = SlidingConfig

    @staticmethod
    def variant(config: SlidingConfig) -> tuple[str, str]:
        """The model card's words for this window (flowrl.hub): MixGRPO, or MixGRPO-Flash when a
        higher-order solver or a compressed schedule follows the window."""
        flash = config.outside == "dpm2m" or config.compress < 1
        return ((", with MixGRPO-Flash's sliding SDE window and DPM-Solver++(2M) after it" if flash
                 else ", with MixGRPO's sliding SDE window"), "MixGRPO, arXiv:2507.21802")

    def __init__(self, config: SlidingConfig):
        self.config = config

    def max_start(self, context) -> int:
        """The last start before rolling back: the last whole window on trainable steps and, with
        ``compress < 1``, the last whose compressed schedule keeps >= 2 points after it."""
        c = self.config
        start = context.trainable_prefix - c.size
        if c.compress < 1.0:
            while start >= 0 and int((context.num_steps - (start + c.size - 1)) * c.compress) < 2:
                start -= 1
            if start < 0:
                raise ValueError(f"compress = {c.compress} leaves fewer than 2 schedule points after every window "
                                 f"(N = {context.num_steps}, size = {c.size}); raise compress")
        return start

    def num_trainable(self, context) -> int:
        c = self.config
        _check_fits(c.size, context.trainable_prefix, "the trainable steps (sliding window)")
        self.max_start(context)
        return c.size

    def plan(self, iteration, keys, context):
        c = self.config
        start = sliding_sde_window_start(iteration, every=c.every, stride=c.stride, max_start=self.max_start(context))
        sigmas = context.sigmas
        if c.compress < 1.0:
            if context.warp is None:
                raise ValueError("window compress < 1 needs a schedule with a time warp (schedule 'shift')")
            sigmas = flash_schedule(sigmas, start + c.size - 1, c.compress, context.warp).to(sigmas.device)
        sde_windows = torch.tensor([[start, start + c.size]] * len(keys), dtype=torch.long)
        return RolloutPlan(sigmas, sde_windows, c.outside)


@dataclasses.dataclass(frozen=True)
class RandomConfig:
    size: int = param(2, "Steps in each sample's SDE window (trained; Flow-GRPO-Fast: 1 to 3).", min=1)
    lo: int = param(0, "First step a window may start at.", min=0)
    hi: int = param(0, "Windows end at or before this step (0 = the last trainable step + 1).", min=0)
    scope: Literal["sample", "group", "iteration"] = param(
        "sample", "Draw the window per sample (flowrl's default), per prompt group (Flow-GRPO-Fast v1's shared "
        "branch) or once per iteration (MixGRPO's 'random' strategy).")
    outside: Literal["euler", "dpm2m"] = param("euler", "Solver after the window.")


class RandomWindow:
    """Flow-GRPO-Fast: the window's start is uniform on ``{lo, ..., hi - size}``."""

    Config = RandomConfig
    #: the model card's words for this window (flowrl.hub)
    variant = (", with Flow-GRPO-Fast's SDE window placed at random", "Flow-GRPO-Fast, yifan123/flow_grpo")

    def __init__(self, config: RandomConfig):
        self.config = config

    def _hi(self, context) -> int:
        return self.config.hi or context.trainable_prefix

    def num_trainable(self, context) -> int:
        c, room = self.config, context.trainable_prefix
        if c.hi > room:  # silently clipped to the trainable steps, the windows would not be where asked
            raise ValueError(f"hi = {c.hi} is beyond the trainable steps: windows can end at step {room} at the "
                             f"latest (the first {room} steps are trainable); set hi <= {room}, or 0 for the last")
        hi = self._hi(context)
        if c.lo >= hi:
            raise ValueError(f"lo = {c.lo} must be below hi = {hi} (windows start at lo and end at or before hi"
                             f"{'; hi = 0 is the last trainable step + 1' if not c.hi else ''})")
        _check_fits(c.size, hi - c.lo, f"[lo, hi) = [{c.lo}, {hi})")
        return c.size

    def plan(self, iteration, keys, context):
        c = self.config
        hi = min(self._hi(context), context.trainable_prefix)
        starts = []
        for k in keys:
            key = {"sample": int(k), "group": int(k) // context.group_size, "iteration": 0}[c.scope]
            starts.append(random_sde_window_start(generator(context.seed, "window", iteration, key), c.lo, hi, c.size))
        sde_windows = torch.tensor([[s, s + c.size] for s in starts], dtype=torch.long).reshape(-1, 2)
        return RolloutPlan(context.sigmas, sde_windows, c.outside)


@dataclasses.dataclass(frozen=True)
class OdeConfig:
    solver: Literal["euler", "dpm2m"] = param("dpm2m", "Deterministic solver for every step (DiffusionNFT: dpm2m).")


class OdeSampler:
    """No stochastic step: the whole trajectory with a deterministic solver."""

    Config = OdeConfig

    def __init__(self, config: OdeConfig):
        self.config = config

    def num_trainable(self, context) -> int:
        return 0

    def plan(self, iteration, keys, context):
        return RolloutPlan(context.sigmas, torch.zeros(len(keys), 2, dtype=torch.long), self.config.solver)


@hookimpl(trylast=True)
def register_windows(register):
    register("fixed", FixedWindow)
    register("sliding", SlidingWindow)
    register("random", RandomWindow)
    register("ode", OdeSampler)
    register("branch", BranchWindow)


@hookimpl(trylast=True)
def default_component(kind):
    return "fixed" if kind == "window" else None
