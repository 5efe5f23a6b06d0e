"""The optimizer a recipe names (``[train].optimizer``): torch's AdamW, or bitsandbytes' 8-bit
AdamW, whose two moments take 1 byte each per trainable parameter instead of 4 (fp32)."""

from __future__ import annotations

import torch

from ..errors import FlowrlError, require
from .accel import make_adamw


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
