"""The optimizer a recipe names, its options and its learning-rate schedule (``[train]``).

- :func:`make_optimizer`: torch's AdamW (``adamw_impl``: its ``fused`` / ``foreach`` kernels,
  :func:`adamw_options`), or bitsandbytes' 8-bit AdamW, whose two moments take 1 byte each per
  trainable parameter instead of 4 (fp32);
- :func:`make_scheduler`: the LR schedule over the run's optimizer steps (:func:`lr_lambda`:
  linear warm-up, then constant, cosine or linear decay).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from ..errors import FlowrlError, require


def make_optimizer(params, train, strategy_kind: str, device: torch.device | str = "cpu",
                   source: str = "<recipe>") -> torch.optim.Optimizer:
    """AdamW over ``params`` with the recipe's learning rate, betas, epsilon and weight decay
    (torch's, with ``[train].adamw_impl``: :func:`flowrl.train.accel.make_adamw`; or 8-bit)."""
    if train.optimizer == "adamw":
        return make_adamw(params, train, torch.device(device), source)
    if train.adamw_impl != "auto":
        raise FlowrlError(f"adamw_impl = {train.adamw_impl!r} chooses torch's AdamW kernels, but optimizer = 'adamw_8bit'",
                          where=f"{source}: [train].adamw_impl", hint="leave adamw_impl = 'auto' with 8-bit AdamW")
    kw = dict(lr=train.lr, betas=tuple(train.adam_betas), eps=train.adam_eps, weight_decay=train.weight_decay)
    if strategy_kind == "fsdp2":  # also reached when the launcher picked fsdp2 for strategy = "auto"
        raise FlowrlError("optimizer = 'adamw_8bit' cannot hold FSDP2's sharded (DTensor) parameters",
                          where="[train].optimizer", hint="use 'adamw' with fsdp2 (its state is sharded already)")
    bnb = require("bitsandbytes", extra="quant", purpose="[train].optimizer = 'adamw_8bit'")
    return bnb.optim.AdamW8bit(params, **kw)


def adamw_options(impl: str, device: torch.device, source: str = "<recipe>") -> dict:
    """The ``fused`` / ``foreach`` keyword arguments of ``torch.optim.AdamW`` for ``impl``."""
    if impl == "auto":
        return {}
    if impl == "for-loop":
        return {"foreach": False, "fused": False}
    if impl == "foreach":
        return {"foreach": True}
    if impl == "fused":
        try:  # a private helper of torch.optim (torch >= 2.4); without it, let AdamW itself decide
            from torch.optim.optimizer import _get_fused_kernels_supported_devices

            supported = _get_fused_kernels_supported_devices()
        except ImportError:
            return {"fused": True}
        if device.type not in supported:
            raise FlowrlError(
                f"adamw_impl = 'fused' is not available on device {device.type!r} (torch {torch.__version__} "
                f"has fused AdamW on: {', '.join(supported)})",
                where=f"{source}: [train].adamw_impl", hint="use adamw_impl = 'foreach' or 'auto' on this device",
            )
        return {"fused": True}
    raise FlowrlError(f"unknown adamw_impl {impl!r}", where=f"{source}: [train].adamw_impl",
                      hint="one of 'auto', 'for-loop', 'foreach', 'fused'")


def make_adamw(params: Iterable[torch.nn.Parameter], train, device: torch.device, source: str = "<recipe>"):
    """AdamW over ``params`` with ``[train]``'s lr, betas, eps, weight decay and ``adamw_impl``."""
    return torch.optim.AdamW(params, lr=train.lr, betas=tuple(train.adam_betas), eps=train.adam_eps,
                             weight_decay=train.weight_decay, **adamw_options(train.adamw_impl, device, source))


def lr_lambda(train, total_steps: int) -> Callable[[int], float]:
    """The LR multiplier of optimizer step ``step``: linear warm-up, then constant, cosine or
    linear decay over ``total_steps``."""

    def f(step: int) -> float:
        if train.warmup_steps and step < train.warmup_steps:
            return (step + 1) / train.warmup_steps
        progress = min(1.0, (step - train.warmup_steps) / max(1, total_steps - train.warmup_steps))
        if train.lr_schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * progress))
        if train.lr_schedule == "linear":
            return 1.0 - progress
        return 1.0

    return f


def make_scheduler(optimizer: torch.optim.Optimizer, train, geometry, extra_steps: int = 0
                   ) -> torch.optim.lr_scheduler.LambdaLR:
    """The LR schedule over every optimizer step of the run: ``iterations x updates_per_rollout x
    optimizer_steps_per_update``, plus ``extra_steps`` (the steps on replayed rollouts,
    :func:`flowrl.train.replay.replay_optimizer_steps`) (:func:`lr_lambda`)."""
    total = train.iterations * geometry.updates_per_rollout * geometry.optimizer_steps_per_update + extra_steps
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(train, total))
