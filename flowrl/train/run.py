"""What every phase of a training run reads and none changes, passed as one value."""

from __future__ import annotations

import dataclasses
import functools

from ..distributed import DistContext
from ..geometry import Geometry
from ..offline import LatentCache, OfflineRows, read_offline_rows
from .session import Session


@dataclasses.dataclass(frozen=True)
class Run:
    """The built session (components, device, sampler), the batch geometry (global sizes turned
    into this process's) and this process's place among the processes: the three things the
    loop's phases were each handed separately."""

    session: Session
    geometry: Geometry
    ctx: DistContext

    @functools.cached_property
    def data(self) -> OfflineRows | None:
        """The ``[data]`` table an offline run trains on (read once; validation checked it), or
        None for an online run."""
        recipe = self.session.recipe
        return read_offline_rows(recipe.data.path, f"{recipe.source}: [data].path") if recipe.data.enabled else None

    @functools.cached_property
    def table_latents(self) -> LatentCache:
        """An offline run's table images as clean latents, each encoded once (:class:`LatentCache`)."""
        return LatentCache()
