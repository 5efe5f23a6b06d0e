"""The optimizer a recipe names (``[train].optimizer``): torch's AdamW, or bitsandbytes' 8-bit
AdamW, whose two moments take 1 byte each per trainable parameter instead of 4 (fp32)."""

from __future__ import annotations

import torch

from ..errors import FlowrlError, require


def make_optimizer(params, train, strategy_kind: str) -> torch.optim.Optimizer:
    """AdamW over ``params`` with the recipe's learning rate, betas, epsilon and weight decay."""
    kw = dict(lr=train.lr, betas=tuple(train.adam_betas), eps=train.adam_eps, weight_decay=train.weight_decay)
    if train.optimizer == "adamw":
        return torch.optim.AdamW(params, **kw)
    if strategy_kind == "fsdp2":  # also reached when the launcher picked fsdp2 for strategy = "auto"
        raise FlowrlError("optimizer = 'adamw_8bit' cannot hold FSDP2's sharded (DTensor) parameters",
                          where="[train].optimizer", hint="use 'adamw' with fsdp2 (its state is sharded already)")
    bnb = require("bitsandbytes", extra="quant", purpose="[train].optimizer = 'adamw_8bit'")
    return bnb.optim.AdamW8bit(params, **kw)
