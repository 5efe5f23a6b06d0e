"""Branch (tree) rollouts in the manner of BranchGRPO: the samples of a prompt group share a
prefix and split at chosen steps.

A group of ``G`` samples starts from ``G / prod(factors)`` roots; at branch step ``s_k`` every
live trajectory is copied ``factors[k]`` times and each copy draws its own SDE noise from then
on. The velocity of a step is computed once per LIVE row (the distinct states), then expanded, so
a shared prefix costs one forward per step instead of one per sample: the splits are the branch
factors of the per-step plan of the one rollout loop (:func:`~flowrl.sampling.rollout.rollout_steps`).
The returned :class:`~flowrl.sampling.trajectory.Trajectory` holds ``G`` full trajectories per group (the
shared prefixes duplicated in storage): every objective reads it unchanged.

Randomness: a live row stands for a contiguous block of the group's final samples and draws
from the generator of the block's FIRST sample (a global sample index, :mod:`flowrl.seeding`),
so the tree is the same on any process layout. With every factor 1 each live row is one sample
and the rollout is exactly :func:`~flowrl.sampling.rollout.rollout`.

As components (BranchGRPO is no flag of the engine): the tree's shape is the ``[window] use =
"branch"`` planner's (:class:`BranchWindow`, a :class:`flowrl.interfaces.SamplesTrees`: its :class:`Tree` gives the
per-step plan and the forwards the rollout runs), and the tree advantage with its depth and
width pruning is the ``[advantage] use = "tree"`` estimator's (an :class:`flowrl.interfaces.AdvantagesOnTrees`).
The training loop asks the two through these protocols and reads none of their keys.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from flowrl.config import param
from flowrl.interfaces import Kernel
from flowrl.sampling.rollout import PlannedStep, VelocityFn, rollout_steps
from flowrl.sampling.schedules import validate_sigmas
from flowrl.sampling.trajectory import Trajectory

__all__ = ["check_branches", "live_rows_per_step", "branch_forward_rows", "branch_rollout", "node_blocks",
           "first_of_block", "tree_advantages", "prune_leaves", "pruned_steps", "steps_of_highest_dynamics", "FUSIONS",
           "Tree", "TreeAdvantages", "BranchConfig", "BranchWindow",
           "tree_unit_advantages"]

#: How the rewards of a node's leaves fuse into the node's value (:func:`tree_advantages`).
FUSIONS = ("mean", "probability")


def check_branches(steps: Sequence[int], factors: Sequence[int], num_steps: int, group_size: int) -> None:
    """Raise ``ValueError`` (one message) unless ``steps`` are strictly increasing step indices
    in ``[0, num_steps)``, one factor >= 1 per step, and ``prod(factors)`` divides ``group_size``."""
    steps, factors = list(steps), list(factors)
    if len(steps) != len(factors):
        raise ValueError(f"steps and factors need one entry each per split, got "
                         f"{len(steps)} steps and {len(factors)} factors")
    if any(f < 1 for f in factors):
        raise ValueError(f"factors must be >= 1, got {factors}")
    if any(not 0 <= s < num_steps for s in steps) or any(a >= b for a, b in zip(steps, steps[1:])):
        raise ValueError(f"steps must be strictly increasing step indices in [0, {num_steps}), got {steps}")
    if group_size % math.prod(factors):
        raise ValueError(f"the product of factors ({math.prod(factors)}) must divide the group size "
                         f"({group_size}): a group starts from group_size / product roots")


def live_rows_per_step(num_steps: int, group_size: int, steps: Sequence[int], factors: Sequence[int]) -> list[int]:
    """Distinct rows of one group whose velocity step ``i`` computes (before that step's split)."""
    live, out, split = group_size // math.prod(factors), [], dict(zip(steps, factors))
    for i in range(num_steps):
        out.append(live)
        live *= split.get(i, 1)
    return out


def branch_forward_rows(num_steps: int, group_size: int, steps: Sequence[int], factors: Sequence[int]) -> int:
    """Velocity rows one group's branch rollout runs (``num_steps * group_size`` without branches)."""
    return sum(live_rows_per_step(num_steps, group_size, steps, factors))


def branch_rollout(
    velocity_for: Callable[[torch.Tensor], VelocityFn],
    initial_noise: torch.Tensor,
    sigmas,
    kernels: Sequence[Kernel],
    *,
    group_size: int,
    branch_steps: Sequence[int],
    branch_factors: Sequence[int],
    generators: Sequence[torch.Generator],
    **options,
) -> Trajectory:
    """Sample ``B`` trajectories (``B`` a multiple of ``group_size``, whole groups in order) as
    trees: :func:`~flowrl.sampling.rollout.rollout_steps` with ``kernels[i]`` at step ``i`` and the
    split ``branch_factors[k]`` at step ``branch_steps[k]``. ``initial_noise [B, ...]`` and
    ``generators`` (one per sample) are the plain rollout's; a root takes the noise and generator
    of its block's first sample. ``velocity_for(rows)`` builds the velocity closure for the live
    rows ``rows`` (indices into the batch, ascending; the text embeddings of those samples), called
    once per distinct set of live rows. ``options`` are :func:`~flowrl.sampling.rollout.rollout_steps`'
    other keywords (``image_from``, ``reduction``, ``prompts``, ``group_ids``, ``keep_means``)."""
    b, n = initial_noise.shape[0], validate_sigmas(sigmas).numel() - 1
    if b % group_size:
        raise ValueError(f"a branch rollout needs whole groups: {b} samples, group size {group_size}")
    check_branches(branch_steps, branch_factors, n, group_size)
    if len(generators) != b:
        raise ValueError(f"need one generator per sample: {len(generators)} for {b}")
    split = dict(zip(branch_steps, branch_factors))
    steps = [PlannedStep(kernel, branch_factor=split.get(i, 1)) for i, kernel in enumerate(kernels)]
    return rollout_steps(velocity_for, initial_noise, sigmas, steps, generators=generators, **options)


def steps_of_highest_dynamics(curve: Sequence[float], positions: Sequence[int], count: int) -> list[int]:
    """Branch where the temporal dynamics are highest: the sampler steps (``positions[t]``, the
    step of trainable transition ``t``) of the ``count`` largest values of ``curve`` (one per
    trainable transition, e.g. a profile's mean l1rel), in step order; ties go to the earlier."""
    if len(curve) != len(positions) or not 0 <= count <= len(curve):
        raise ValueError(f"need one curve value per position and 0 <= count <= {len(curve)}, got {len(curve)} values, "
                         f"{len(positions)} positions, count {count}")
    order = sorted(range(len(curve)), key=lambda t: (-float(curve[t]), t))
    return sorted(int(positions[t]) for t in order[:count])


# ----------------------------------------------------------------------------- tree advantages


def node_blocks(num_steps: int, steps: Sequence[int], factors: Sequence[int]) -> list[int]:
    """For each state ``x_0 .. x_N`` of a tree (``N + 1`` entries), how many consecutive samples
    of a group share it: ``prod(factors)`` for a root, 1 for a leaf. A split at step ``i`` happens
    before that step's noise, so the state after transition ``i`` (``x_{i+1}``) is already split."""
    block, out, split = math.prod(factors), [], dict(zip(steps, factors))
    out.append(block)
    for i in range(num_steps):
        block //= split.get(i, 1)
        out.append(block)
    return out


def first_of_block(group_size: int, blocks: Sequence[int], device=None) -> torch.Tensor:
    """``[group_size, N]`` bool: True where sample ``j`` is the first of the block that owns
    transition ``i`` (the block of the state it leads into, ``blocks[i + 1]``): each distinct
    transition of a tree is marked once."""
    j = torch.arange(group_size, device=device)[:, None]
    return (j % torch.tensor(list(blocks[1:]), device=device)[None, :]) == 0


def tree_advantages(leaf: torch.Tensor, blocks: Sequence[int], *, fusion: str = "mean",
                    log_probs: torch.Tensor | None = None, min_std: float = 1e-6) -> torch.Tensor:
    """BranchGRPO's tree advantage for one group: ``[G, N]`` float32, for each sample and
    transition ``i``, the advantage of the node (the state ``x_{i+1}``) the transition leads into.

    ``leaf [G]`` are the leaves' values (rewards, or their group advantages: the result is the
    same, since every step below is invariant to an affine map of them with a positive scale);
    ``blocks`` (``N + 1`` entries) come from :func:`node_blocks`. A node's value fuses the
    leaves below it:

    - ``"mean"``: the mean of its leaves (its block of samples);
    - ``"probability"``: bottom up, at each split the children weighted by the softmax of the
      log-probs of the transitions into them (``log_probs [G, N]``, the rollout's); a node with
      one child takes the child's value.

    At each depth the group's nodes (``G / blocks[i + 1]`` of them) are standardised, ``(v -
    mean) / std`` with the unbiased std; a depth with one node, or whose nodes' std is at most
    ``min_std``, gets 0 (a transition every sample shares teaches nothing). Computed in float64."""
    g, n = leaf.shape[0], len(blocks) - 1
    if fusion not in FUSIONS:
        raise ValueError(f"fusion must be one of {FUSIONS}, got {fusion!r}")
    if n < 1 or any(g % b for b in blocks) or list(blocks) != sorted(blocks, reverse=True) or blocks[-1] != 1:
        raise ValueError(f"blocks must be non-increasing divisors of the group size {g} ending in 1, got {list(blocks)}")
    values = torch.empty(g, n, dtype=torch.float64)  # values[:, i]: the node after transition i
    v = leaf.detach().to(torch.float64).cpu()
    if fusion == "probability":
        if log_probs is None or tuple(log_probs.shape) != (g, n):
            raise ValueError(f"probability fusion needs the rollout's log-probs [{g}, {n}]")
        lp = log_probs.detach().to(torch.float64).cpu()
        node = v.clone()  # each sample's node value at the current depth, from the leaves up
        for i in reversed(range(n)):
            values[:, i] = node
            parent, child = blocks[i], blocks[i + 1]
            if parent != child:  # transition i splits: each parent fuses its parent // child children
                k = parent // child
                child_v = node.reshape(g // parent, k, child)[:, :, 0]
                child_lp = lp[:, i].reshape(g // parent, k, child)[:, :, 0]
                node = (torch.softmax(child_lp, dim=1) * child_v).sum(dim=1).repeat_interleave(parent)
    else:
        for i in range(n):
            b = blocks[i + 1]
            values[:, i] = v.reshape(g // b, b).mean(dim=1).repeat_interleave(b)
    out = torch.zeros(g, n, dtype=torch.float64)
    for i in range(n):
        b = blocks[i + 1]
        nodes = values[::b, i]
        if nodes.numel() < 2:
            continue
        std = nodes.std(unbiased=True)
        if std > min_std:
            out[:, i] = ((nodes - nodes.mean()) / std).repeat_interleave(b)
    return out.to(torch.float32)


def pruned_steps(steps: Sequence[int], slide: int, iteration: int, stop: int) -> list[int]:
    """Depth pruning: the sampling steps whose transitions go untrained at ``iteration``. The window
    ``steps`` moves one step earlier every ``slide`` iterations (0: never) until its earliest step is
    ``stop`` (the last branch step, so that it slides over the leaf segment only, where every sample
    has transitions of its own); a window that starts above ``stop`` does not move."""
    if not steps:
        return []
    shift = min(iteration // slide if slide else 0, max(0, steps[0] - stop))
    return [s - shift for s in steps]


def prune_leaves(tree: torch.Tensor, blocks: Sequence[int], keep: int) -> torch.Tensor:
    """Width pruning of one group's tree advantages ``[G, N]``: below the last split (the
    transitions whose node is a leaf, ``blocks[i + 1] == 1``) only the ``keep`` leaves with the
    largest ``|advantage|`` there keep theirs; the others' become 0 (not trained). Ties go to the
    earlier sample. ``keep = 0`` or ``keep >= G`` prunes nothing."""
    g = tree.shape[0]
    if keep <= 0 or keep >= g:
        return tree
    tails = [i for i in range(len(blocks) - 1) if blocks[i + 1] == 1]
    if not tails:
        return tree
    strength = tree[:, tails[-1]].abs()
    order = torch.sort(-strength, stable=True).indices
    pruned = torch.ones(g, dtype=torch.bool)
    pruned[order[:keep]] = False
    out = tree.clone()
    out[pruned.nonzero().flatten()[:, None], torch.tensor(tails)[None, :]] = 0.0
    return out


# ----------------------------------------------------------------------------- as components


@dataclasses.dataclass(frozen=True)
class Tree:
    """The shape of every prompt group's tree: before step ``steps[k]`` draws its noise, each live
    row is copied ``factors[k]`` times (a group of ``G`` starts from ``G / prod(factors)`` roots).
    What the rollout, the compute accounting and a tree advantage need of it."""

    steps: tuple[int, ...] = ()
    factors: tuple[int, ...] = ()

    def check(self, num_steps: int, group_size: int) -> None:
        """:func:`check_branches` for a sampler of ``num_steps`` steps and groups of ``group_size``."""
        check_branches(self.steps, self.factors, num_steps, group_size)

    @property
    def last_step(self) -> int:
        """The tree's last step: where depth pruning stops sliding (:func:`pruned_steps`)."""
        return max(self.steps)

    def forward_rows(self, num_steps: int, group_size: int) -> int:
        """Velocity rows one group's rollout runs (:func:`branch_forward_rows`)."""
        return branch_forward_rows(num_steps, group_size, self.steps, self.factors)

    def blocks(self, num_steps: int) -> list[int]:
        """How many consecutive samples of a group share each state (:func:`node_blocks`)."""
        return node_blocks(num_steps, self.steps, self.factors)


class TreeAdvantages(NamedTuple):
    """What a tree advantage gives an iteration: ``advantages [B, T]`` for every trainable
    transition of this process's samples, ``trained [B, T]`` (bool: the distinct transitions it
    trains; the others have advantage 0) and ``metrics`` for the iteration's row."""

    advantages: torch.Tensor
    trained: torch.Tensor
    metrics: dict[str, float]


def tree_unit_advantages(advantages: torch.Tensor, trajectory: Trajectory, tree: Tree, group_size: int, *,
                         fusion: str = "mean", keep: int = 0,
                         pruned: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """BranchGRPO's tree advantage of every trainable transition of a batch of whole groups (as
    branch rollouts sample them), from the samples' own group advantages ``advantages [B]``:
    ``[B, T]`` advantages, and the ``[B, T]`` mask of the distinct transitions outside the
    depth-pruned steps ``pruned`` (:func:`pruned_steps`). A transition several samples share is
    trained once, by the first sample of its block: its copies in the other samples get advantage
    0, which the update skips (no forward on-policy) and which keeps every sample's mean over its
    units, so each distinct transition weighs the same. Depth-pruned transitions get 0 too, and
    width pruning (``keep``, :func:`prune_leaves`) zeroes the weaker leaves' inside the mask.
    ``fusion``: :func:`tree_advantages`' (the probability fusion reads the trajectory's log-probs)."""
    traj = trajectory
    blocks = tree.blocks(traj.num_steps)
    positions = torch.nonzero(traj.trainable.cpu(), as_tuple=False).flatten()
    first = first_of_block(group_size, blocks)[:, positions]  # the same tree shape in every group
    first &= ~torch.isin(positions, torch.tensor(list(pruned), dtype=positions.dtype))[None, :]
    out = []
    for start in range(0, len(advantages), group_size):
        rows = slice(start, start + group_size)
        values = tree_advantages(advantages[rows], blocks, fusion=fusion, log_probs=traj.log_probs[rows])
        values = prune_leaves(values, blocks, keep)
        out.append(torch.where(first, values[:, positions], torch.zeros(())))
    device, groups = advantages.device, len(out)
    return torch.cat(out).to(device), first.repeat(groups, 1).to(device)


@dataclasses.dataclass(frozen=True)
class BranchConfig:
    steps: list[int] = param(
        [], "The steps at which every live trajectory of a group splits into `factors` copies, each drawing its own "
        "SDE noise from there on (BranchGRPO; docs/objectives.md, \"Branch rollouts\"). A group starts from "
        "group_size / prod(factors) roots and the shared prefixes are computed once. Strictly increasing, in "
        "[0, [sampler].steps), at stochastic steps ([sampler].sde_window).", min=0, max=10_000)
    factors: list[int] = param(
        [], "Copies made at each of `steps` (one factor each, >= 1); their product must divide group_size.",
        min=1, max=10_000)
    profile: str = param(
        "", "Choose the steps from the temporal dynamics instead: a profile.json written by `flowrl profile` for "
        "this sampler; the trajectories split in 2 at the `count` trainable transitions where its l1rel curve is "
        "highest (`steps` and `factors` are then filled in, and kept in the run's recipe).", path=True)
    count: int = param(0, "With `profile`: how many splits, each in 2 (2 ** count must divide group_size).",
                       min=0, max=30)

    def __post_init__(self):
        if bool(self.profile) != bool(self.count):
            raise ValueError("profile and count go together: the profile to read and how many splits to take from it")
        if len(self.steps) != len(self.factors):
            raise ValueError(f"steps and factors need one entry each per split, got {len(self.steps)} steps and "
                             f"{len(self.factors)} factors")
        if any(b <= a for a, b in zip(self.steps, self.steps[1:])):
            raise ValueError(f"steps must be strictly increasing step indices, got {list(self.steps)}")


class BranchWindow:
    """BranchGRPO's tree rollouts: each prompt group a tree, shared prefixes computed once.

    The tree splits at ``steps`` (or where a profile's dynamics are highest) and samples with the
    sampler's own kernels (``[sampler].sde_window``): T is the sampler's, as with ``fixed``."""

    Config = BranchConfig
    #: the model card's words for this window (flowrl.hub)
    variant = (", with BranchGRPO's tree rollouts", "BranchGRPO, arXiv:2509.06040")

    def __init__(self, config: BranchConfig):
        self.config = config

    def num_trainable(self, context) -> int:
        return int(context.trainable.sum())

    def plan(self, iteration, keys, context):
        return None

    def tree(self) -> Tree:
        return Tree(tuple(self.config.steps), tuple(self.config.factors))
