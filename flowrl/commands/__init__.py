"""The ``flowrl`` commands, one module each (``flowrl train`` is in ``train.py``, and so on).

Each module adds its command(s) to :data:`flowrl.commands.base.app` when imported;
:mod:`flowrl.cli` imports them all. Heavy imports (torch, diffusers, matplotlib) stay inside the
command functions, so ``flowrl --help`` stays fast.
"""
