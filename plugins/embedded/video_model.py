"""The embedded text-to-video model as a flowrl model: ``embedded_video``.

Latent ``[F, 16, 48]`` = 4 frames of 16 packed tokens: the frames axis is an axis of the latent,
which the engine never looks inside (flowrl.interfaces: ``*L``); ``decode`` returns clips
``[B, 4, 3, 16, 16]``. Weights ship in ``weights/embedded_video.safetensors`` (MODEL_CARD.md,
"The video model").
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from flowrl.config import param
from flowrl.sampling.schedules import conditioning_timestep

from .video_dataset import all_prompts
from .video_network import EmbeddedT2V, decode_clips, load_video_pretrained


@dataclasses.dataclass(frozen=True)
class EmbeddedVideoConfig:
    weights: str = param("", "Path to embedded_video.safetensors (and its .json); empty = the weights shipped in the package.", path=True)
    random_init: bool = param(False, "Start from random weights instead (for tests of the machinery).")
    seed: int = param(0, "Seed of the random init (random_init = true).", min=0, max=2**63 - 1)
    timestep_conditioning: Literal["exact", "truncated_1000"] = param(
        "exact", "Sigma fed to the transformer: 'exact', or 'truncated_1000' = int(sigma * 1000) / 1000 (as the image model).")


class EmbeddedVideoModel:
    """The embedded tiny text-to-video model: 4 frames of 16x16 RGB, latent [4, 16, 48]."""

    Config = EmbeddedVideoConfig
    ships_prompts = True  # prompt_source(): every prompt of its grammar
    latent_shape = EmbeddedT2V.latent_shape
    image_seq_len = 64  # tokens the transformer sees per clip (FLUX's dynamic shift reads it)
    lora_targets = ["to_q", "to_k", "to_v", "to_out.0"]

    def __init__(self, config: EmbeddedVideoConfig):
        self.timestep_conditioning = config.timestep_conditioning
        if config.random_init:
            torch.manual_seed(config.seed)
            self.network = EmbeddedT2V().eval()
        else:
            self.network = load_video_pretrained(config.weights or None)
        self.network.requires_grad_(False)
        self.denoiser = self.network.transformer

    def to(self, device):
        self.network.to(device)
        return self

    def encode_prompts(self, prompts):
        with torch.no_grad():
            embeds, pooled = self.network.encode_prompts(list(prompts))
        return {"prompt_embeds": embeds, "pooled": pooled}

    def velocity(self, latents, sigma, text):
        net = self.network
        out = self.denoiser(  # the clip's frames as one token sequence, told apart by the (frame, row, col) RoPE ids
            hidden_states=latents.flatten(1, 2),
            encoder_hidden_states=text["prompt_embeds"],
            pooled_projections=text["pooled"],
            timestep=conditioning_timestep(sigma, self.timestep_conditioning).to(latents.dtype),
            img_ids=net.img_ids,
            txt_ids=net.txt_ids[: text["prompt_embeds"].shape[1]],
            return_dict=False,
        )[0]
        return out.view(latents.shape)

    def decode(self, latents):
        return decode_clips(latents.float()).clamp(0, 1)

    def trainable_parameters(self):
        return [p for p in self.denoiser.parameters() if p.requires_grad]

    def sigmas(self, num_steps):
        return None

    def prompt_source(self):
        return all_prompts()
