"""The embedded text-to-video model as a flowrl model: ``embedded_video``.

Latent ``[F, 16, 48]`` = 4 frames of 16 packed tokens: the frames axis is an axis of the latent,
which the engine never looks inside (flowrl.interfaces: ``*L``); ``decode`` returns clips
``[B, 4, 3, 16, 16]``. Weights ship in ``weights/embedded_video.safetensors`` (MODEL_CARD.md,
"The video model").
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from flowrl.config import param

from .adapter import EmbeddedAdapter, EmbeddedConfig
from .video_dataset import all_prompts
from .video_network import EmbeddedT2V, decode_clips, load_video_pretrained


@dataclasses.dataclass(frozen=True)
class EmbeddedVideoConfig(EmbeddedConfig):
    """The image model's settings, with the video model's weights file."""

    weights: str = param("", "Path to embedded_video.safetensors (and its .json); empty = the weights shipped in the package.", path=True)
    timestep_conditioning: Literal["exact", "truncated_1000"] = param(
        "exact", "Sigma fed to the transformer: 'exact', or 'truncated_1000' = int(sigma * 1000) / 1000 (as the image model).")


class EmbeddedVideoModel(EmbeddedAdapter):
    """The embedded tiny text-to-video model: 4 frames of 16x16 RGB, latent [4, 16, 48]."""

    task = "text-to-video"  # the model card's pipeline tag (flowrl.hub)

    Config = EmbeddedVideoConfig
    latent_shape = EmbeddedT2V.latent_shape
    image_seq_len = 64  # tokens the transformer sees per clip (FLUX's dynamic shift reads it)
    network_class = EmbeddedT2V
    load = staticmethod(load_video_pretrained)

    def velocity(self, latents, sigma, text):
        # the clip's frames as one token sequence, told apart by the (frame, row, col) RoPE ids
        return self._transformer(latents.flatten(1, 2), sigma, text).view(latents.shape)

    def decode(self, latents):
        return decode_clips(latents.float()).clamp(0, 1)

    def prompt_source(self):
        return all_prompts()
