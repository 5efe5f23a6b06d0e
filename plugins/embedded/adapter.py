"""What the embedded image and video models share as flowrl model adapters: a tiny diffusers
FLUX transformer with its own text encoder, loaded from weights shipped in the package or built
at random, frozen until flowrl makes parts of it trainable."""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from flowrl.config import param
from flowrl.sampling.schedules import conditioning_timestep

from .network import decode, encode_images, pack, unpack


@dataclasses.dataclass(frozen=True)
class EmbeddedConfig:
    weights: str = param("", "Path to embedded.safetensors (and its .json); empty = the weights shipped in the package.", path=True)
    random_init: bool = param(False, "Start from random weights instead (for tests of the machinery).")
    seed: int = param(0, "Seed of the random init (random_init = true).", min=0, max=2**63 - 1)
    timestep_conditioning: Literal["exact", "truncated_1000"] = param(
        "exact", "Sigma fed to the transformer: 'exact', or 'truncated_1000' = int(sigma * 1000) / 1000 as GCPO, "
        "DanceGRPO and MixGRPO feed FLUX (for reproducing their numbers; the kernel keeps the exact sigma).")


class EmbeddedAdapter:
    """Base of ``embedded`` and ``embedded_video``: a subclass names its network class
    (``network_class``) and loader (``load``), and says how its latents become the transformer's
    token sequence (``velocity``), how they decode and which prompts it ships."""

    ships_prompts = True  # prompt_source(): every prompt of its grammar
    lora_targets = ["to_q", "to_k", "to_v", "to_out.0"]

    #: the network (``torch.nn.Module``) built for ``random_init``
    network_class: type
    #: ``load(path or None)``: the pretrained network (None: the weights shipped in the package)
    load = None

    def __init__(self, config):
        self.timestep_conditioning = config.timestep_conditioning
        if config.random_init:
            torch.manual_seed(config.seed)
            self.network = self.network_class().eval()
        else:
            self.network = self.load(config.weights or None)
        self.network.requires_grad_(False)
        self.denoiser = self.network.transformer

    def to(self, device):
        self.network.to(device)
        return self

    def encode_prompts(self, prompts):
        with torch.no_grad():
            embeds, pooled = self.network.encode_prompts(list(prompts))
        return {"prompt_embeds": embeds, "pooled": pooled}

    def _transformer(self, tokens, sigma, text):
        """The transformer's velocity of a token sequence ``[B, T, C]`` at ``sigma``."""
        net = self.network
        return self.denoiser(
            hidden_states=tokens,
            encoder_hidden_states=text["prompt_embeds"],
            pooled_projections=text["pooled"],
            timestep=conditioning_timestep(sigma, self.timestep_conditioning).to(tokens.dtype),
            img_ids=net.img_ids,
            txt_ids=net.txt_ids[: text["prompt_embeds"].shape[1]],
            return_dict=False,
        )[0]

    def trainable_parameters(self):
        return [p for p in self.denoiser.parameters() if p.requires_grad]

    def sigmas(self, num_steps):
        return None


class PixelImageAdapter(EmbeddedAdapter):
    """An embedded image model on the 32x32 canvas (``embedded``, ``embedded_compose``): latents are
    the 64 packed tokens of 48 channels of the lossless pixel "VAE"."""

    latent_shape = (64, 48)
    image_seq_len = 64
    image_size = (32, 32)

    def velocity(self, latents, sigma, text):
        return self._transformer(latents, sigma, text)

    def decode(self, latents):
        return decode(unpack(latents.float())).clamp(0, 1)

    def encode_images(self, images):
        # EncodesImages: the pixel "VAE" is exact, the inverse of decode on [0, 1] images
        return pack(encode_images(images.float()))
