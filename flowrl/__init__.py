"""flowrl: plugin-based reinforcement learning for flow-matching text-to-image models.

The core is small: interfaces (:mod:`flowrl.interfaces`), pure maths (:mod:`flowrl.sampling.kernels`,
:mod:`flowrl.sampling.schedules`, :mod:`flowrl.chunking`, :mod:`flowrl.selection`,
:mod:`flowrl.objectives.advantages`, :mod:`flowrl.objectives.losses`), plugins (:mod:`flowrl.hookspecs`,
:mod:`flowrl.plugins`), recipes (:mod:`flowrl.recipe`) and the engine (:mod:`flowrl.engine`).
Components live in plugins, the built-ins included.
"""

from .errors import FlowrlError
from .hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = ["FlowrlError", "hookimpl", "__version__"]
