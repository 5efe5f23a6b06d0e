"""Batch geometry: the global quantities a recipe states, turned into per-process sizes.

A recipe states global quantities (prompts per iteration, group size); the world size is only
known at launch. :func:`resolve_geometry` derives what each process does, checks that it
divides, and explains the fix when it does not.
"""

from __future__ import annotations

import dataclasses

from .errors import RecipeError


@dataclasses.dataclass(frozen=True)
class Geometry:
    world_size: int
    prompts_per_iteration: int
    group_size: int
    samples_per_iteration: int  # global: prompts x group size
    samples_per_process: int
    groups_split_across_processes: bool
    micro_batch_size: int
    optimizer_steps_per_update: int
    grad_accumulation: int  # micro-batches per optimizer step, per process
    updates_per_rollout: int

    def local_sample_range(self, rank: int) -> range:
        """Global indices of the samples this rank generates and trains."""
        start = rank * self.samples_per_process
        return range(start, start + self.samples_per_process)

    def describe(self) -> str:
        split = "split across processes (advantages use gathered rewards)" if self.groups_split_across_processes else "whole on one process"
        return (
            f"world size {self.world_size}; per iteration {self.prompts_per_iteration} prompts x "
            f"{self.group_size} samples = {self.samples_per_iteration} samples, "
            f"{self.samples_per_process} per process; groups {split}; update: micro-batch "
            f"{self.micro_batch_size} x {self.grad_accumulation} accumulation x "
            f"{self.optimizer_steps_per_update} optimizer steps per pass x {self.updates_per_rollout} passes"
        )


def resolve_geometry(train, world_size: int, source: str = "<recipe>", group_size: int | None = None) -> Geometry:
    """``group_size``: the recipe's samples per prompt when not ``train.group_size``
    (:attr:`flowrl.recipe.Recipe.group_size`: 1 for an offline run)."""
    P, G, W = train.prompts_per_iteration, group_size or train.group_size, world_size
    S = P * G
    where = f"{source}: [train]"
    if S % W:
        raise RecipeError(
            f"{S} samples per iteration ({P} prompts x {G}) cannot be shared by {W} processes",
            where=where,
            hint=f"make prompts_per_iteration x group_size a multiple of {W}",
        )
    s = S // W
    m, o = train.micro_batch_size, train.optimizer_steps_per_update
    if s % (m * o):
        raise RecipeError(
            f"{s} samples per process do not divide into {o} optimizer step(s) of micro-batches of {m}",
            where=f"{where}.micro_batch_size",
            hint=f"choose micro_batch_size x optimizer_steps_per_update dividing {s}",
        )
    return Geometry(
        world_size=W,
        prompts_per_iteration=P,
        group_size=G,
        samples_per_iteration=S,
        samples_per_process=s,
        groups_split_across_processes=(P % W != 0),
        micro_batch_size=m,
        optimizer_steps_per_update=o,
        grad_accumulation=s // (m * o),
        updates_per_rollout=train.updates_per_rollout,
    )
