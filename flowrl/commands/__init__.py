"""CLI commands that live in their own modules.

Each module defines its command(s) on :data:`flowrl.cli.app` at import time and keeps heavy
imports inside the command function, so ``flowrl --help`` stays fast.
"""

#: Imported by flowrl.cli after the core commands are defined.
MODULES = ("profile", "sample", "evaluate", "export", "plan", "reward_server", "sweep", "compare")
