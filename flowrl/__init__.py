"""flowrl: plugin-based reinforcement learning for flow-matching text-to-image models.

The core is small: interfaces (:mod:`flowrl.interfaces`), the sampler (:mod:`flowrl.sampling`),
the objectives (:mod:`flowrl.objectives`), plugins (:mod:`flowrl.hookspecs`, :mod:`flowrl.plugins`),
recipes (:mod:`flowrl.recipe`) and the training loop (:mod:`flowrl.train`). Components live in
plugins, the built-ins included (docs/architecture.md draws the layout).
"""

from .errors import DISTRIBUTION, FlowrlError
from .hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = ["DISTRIBUTION", "FlowrlError", "hookimpl", "__version__"]
