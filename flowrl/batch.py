"""The :class:`Batch`: one iteration's samples on this process, from the rollout to the update.

The training loop builds it (:func:`flowrl.train.collect.collect`, or
:func:`~flowrl.train.collect.collect_rows` for an offline run) and the objectives
(:mod:`flowrl.objectives`) read it; it lives here, below both, so that an objective can name
its type without importing the training loop.
"""

from __future__ import annotations

import dataclasses

import torch

from .interfaces import TextEmbeddings
from .offline import OfflineBatch
from .sampling.trajectory import Trajectory

__all__ = ["Batch"]


@dataclasses.dataclass
class Batch:
    """This process's samples of one iteration, from rollout to update.

    ``indices`` are the samples' global indices; ``group_ids [B]`` their prompt groups;
    ``rewards`` and ``reward_extras`` the local scores (``[B]`` each); ``advantages`` ``[B]`` or
    ``[B, K]``, or None when a reward was not finite (the update is then skipped). An offline
    run's batch holds the table's rows (``data``: their encoded images) and no trajectory,
    rewards or advantages: the table is the training signal.
    """

    iteration: int
    indices: range
    prompts: list[str]
    group_ids: torch.Tensor
    text: TextEmbeddings
    trajectory: Trajectory | None = None
    images: torch.Tensor | None = None
    rewards: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    reward_extras: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    advantages: torch.Tensor | None = None
    data: OfflineBatch | None = None

    @property
    def trainable(self) -> bool:
        """Whether the update trains on it: a rollout with finite rewards, or offline rows."""
        return self.advantages is not None or self.data is not None
