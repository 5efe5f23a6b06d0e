"""The fork server of ``flowrl train --num-processes``: imported by it (and by nothing else) before it
forks any worker (flowrl.launch_agent.run_launch_agent lists it in ``WORKER_PRELOAD``).

Two effects, both wanted only there:

- the server dies with the torchrun agent that started it (Linux's parent-death signal, as every
  other link of launcher -> agent -> fork server -> worker). Python's fork server would otherwise
  live as long as any worker: each holds the pipe whose end-of-file tells the server to exit;
- the heavy libraries are imported once, here, and every worker forked from the server shares
  them instead of importing them again (measured on a 2-core CPU: about 6 CPU-seconds a process
  for diffusers' model code, which brings in torch's compiler stack, peft and transformers). A
  library that is missing or fails to import is skipped: the worker imports what it needs itself
  and reports a failure with flowrl's own messages.
"""

from __future__ import annotations

import contextlib
import os

from .compat import ensure_torchvision_importable
from .processes import die_with_parent

if "FLOWRL_AGENT_PID" in os.environ:
    die_with_parent(int(os.environ["FLOWRL_AGENT_PID"]))

ensure_torchvision_importable()  # before diffusers, as every model adapter does
with contextlib.suppress(Exception):
    import diffusers.models.transformers  # noqa: F401  (every transformer class: the models' adapters use them)
