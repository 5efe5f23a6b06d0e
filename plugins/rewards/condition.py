"""``condition_fidelity``: how close an edited image stays to its condition image.

For image editing (FLUX.1 Kontext, Qwen-Image-Edit) the prompt rows carry the image to edit, and
rewards receive it in ``metadata["condition_images"]`` (float32 ``[B, 3, H, W]`` in [0, 1], at the
generated images' size; :func:`flowrl.prompts.reward_metadata`). This reward compares the two at
low resolution (both average-pooled to ``size`` x ``size``): ``1 - mean |image - condition|``, in
[0, 1], 1 when the layout and colours are unchanged. It is a preservation term to weigh against a
preference or instruction-following reward (an edit must change something), not a quality score
on its own.
"""

from __future__ import annotations

import dataclasses

import torch

from flowrl.config import param
from flowrl.errors import FlowrlError
from flowrl.interfaces import RewardOutput


@dataclasses.dataclass(frozen=True)
class ConditionFidelityConfig:
    size: int = param(32, "Both images are average-pooled to size x size before the comparison.", min=1, max=4096)


class ConditionFidelity:
    """``1 - mean |pool(image) - pool(condition)|`` over the prompt rows' condition images."""

    Config = ConditionFidelityConfig
    name = "condition_fidelity"

    def __init__(self, config: ConditionFidelityConfig | None = None):
        self.size = (config or ConditionFidelityConfig()).size

    @torch.no_grad()
    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        cond = (metadata or {}).get("condition_images")
        if cond is None:
            raise FlowrlError(
                "the condition_fidelity reward needs every prompt to carry a condition image",
                where="[[rewards]] condition_fidelity",
                hint="read prompts from a table with [prompts].condition_column set",
            )
        pool = torch.nn.AdaptiveAvgPool2d(self.size)
        a = pool(images.detach().float().cpu().clamp(0, 1))
        b = pool(cond.detach().float().cpu().clamp(0, 1))
        return RewardOutput(scores=1.0 - (a - b).abs().mean(dim=(1, 2, 3)))
