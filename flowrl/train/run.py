"""What every phase of a training run reads and none changes, passed as one value."""

from __future__ import annotations

import dataclasses

from ..distributed import DistContext
from ..geometry import Geometry
from .session import Session


@dataclasses.dataclass(frozen=True)
class Run:
    """The built session (components, device, sampler), the batch geometry (global sizes turned
    into this process's) and this process's place among the processes: the three things the
    loop's phases were each handed separately."""

    session: Session
    geometry: Geometry
    ctx: DistContext
