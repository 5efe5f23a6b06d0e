"""FLUX.1 (dev, schnell) as a flowrl model adapter, on diffusers' FluxPipeline components.

- Latents are FLUX's packed tokens: the VAE latent ``[C, H/8, W/8]`` cut into 2x2 patches,
  ``latent_shape = ((H/16) * (W/16), 4 C)``; ``image_seq_len`` is the token count (it sets FLUX's
  dynamic shift). Image ids are ``(0, row, col)`` of the token grid, text ids are zeros.
- Timestep convention: the transformer takes ``timestep = sigma`` (it multiplies by 1000 inside;
  the pipeline passes ``t / 1000``).
- Guidance: FLUX.1-dev is guidance-distilled: ``guidance`` (3.5) enters through the guidance
  embedding, one forward per step, no CFG. FLUX.1-schnell has no guidance embedding: set
  ``guidance = 0``.
- Decode: unpack, ``z / scaling_factor + shift_factor``, VAE decode, ``x / 2 + 0.5`` clamped.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from flowrl.config import param
from flowrl.errors import FlowrlError
from flowrl.sampling.schedules import conditioning_timestep

from .common import DiffusersAdapter, grid_ids, pack_2x2, unpack_2x2
from .memory.flux import flux_memory_spec
from .quantize import QUANTIZE_HELP


@dataclasses.dataclass(frozen=True)
class FluxConfig:
    path: str = param(
        "black-forest-labs/FLUX.1-dev",
        "Hub id or local pipeline directory (model_index.json). FLUX.1-dev is gated: accept its licence "
        "on the model page and `huggingface-cli login`.", path="hub",
    )
    revision: str = param("", "Hub revision (branch, tag or commit); empty = default branch.")
    dtype: Literal["bf16", "fp16", "fp32"] = param("bf16", "Compute dtype, and storage of text encoders and VAE.")
    denoiser_dtype: Literal["auto", "bf16", "fp16", "fp32"] = param(
        "auto",
        "Storage dtype of the transformer's weights; 'auto' = dtype. Use 'fp32' for full fine-tuning "
        "(fp32 master weights, bf16 compute under autocast).",
    )
    height: int = param(512, "Image height in pixels (a multiple of 16; the GCPO paper trains at 720).", min=16)
    width: int = param(512, "Image width in pixels (a multiple of 16).", min=16)
    guidance: float = param(
        3.5, "Embedded guidance scale (FLUX.1-dev: 3.5). 0 for models without a guidance embedding (schnell).",
        min=0.0,
    )
    max_sequence_length: int = param(512, "T5 prompt tokens (FLUX.1-dev 512, schnell 256).", min=1)
    gradient_checkpointing: bool = param(False, "Recompute transformer blocks in backward (saves activation memory).")
    offload_encoders: bool = param(
        True, "Keep the text encoders and VAE on the CPU; move them to the GPU only to encode / decode."
    )
    lora_preset: Literal["attention", "attention_ff"] = param(
        "attention_ff",
        "Default LoRA targets when train.lora_targets is empty: 'attention' (DanceGRPO: r128/a256) "
        "or 'attention_ff' = attention + feed-forward (Flow-GRPO FLUX: r64/a128).",
    )
    vae_batch_size: int = param(4, "Images decoded per VAE call (bounds decode memory).", min=1)
    quantize: Literal["none", "nf4", "int8"] = param("none", QUANTIZE_HELP)
    timestep_conditioning: Literal["exact", "truncated_1000"] = param(
        "exact", "Sigma fed to the transformer: 'exact' (diffusers' pipeline), or 'truncated_1000' = "
        "int(sigma * 1000) / 1000 as GCPO, DanceGRPO and MixGRPO feed it (to reproduce their numbers: step "
        "log-probs then differ from 'exact' by up to ~1e-4). The kernel keeps the exact sigma.")

    def memory_spec(self):
        """What ``flowrl plan`` needs, from the published configuration (no weights)."""
        return flux_memory_spec(self)


class FluxModel(DiffusersAdapter):
    """FLUX.1 (dev / schnell) through diffusers: packed latents, embedded guidance, timestep = sigma."""

    Config = FluxConfig
    pipeline_class_name = "FluxPipeline"
    frozen_names = ("text_encoder", "text_encoder_2", "vae")

    def __init__(self, config: FluxConfig, where: str = "[model] (model 'flux')"):
        super().__init__(config, where)
        self._packed_grid("2x2 packing", self.pipe.vae.config.latent_channels, "latent_channels")
        self.uses_guidance = bool(self.denoiser.config.guidance_embeds)
        if not self.uses_guidance and config.guidance:
            raise FlowrlError(
                f"this FLUX transformer has no guidance embedding (schnell-like), but guidance = {config.guidance}",
                where=f"{where}.guidance", hint="set model.guidance = 0 for FLUX.1-schnell",
            )

    def image_ids(self) -> torch.Tensor:
        """``[seq, 3]`` ids ``(0, row, col)`` of the packed token grid, as FLUX's pipeline makes them."""
        return self._device_constant("img_ids", lambda: grid_ids(self.grid, 3).to(self.device))

    @torch.no_grad()
    def encode_prompts(self, prompts):
        p = self.pipe
        with self._visiting(*[m for m in (p.text_encoder, p.text_encoder_2) if m is not None]):
            embeds, pooled, _ = p.encode_prompt(
                prompt=list(prompts), prompt_2=None, device=self.device,
                max_sequence_length=self.config.max_sequence_length,
            )
        return {"prompt_embeds": embeds.to(self.device), "pooled": pooled.to(self.device)}

    def _velocity(self, module, latents, sigma, text):
        embeds = text["prompt_embeds"].to(self.device)
        kwargs = {}
        if self.uses_guidance:
            # one value for the whole batch: the transformer broadcasts its guidance embedding over
            # the rows, so a [1] tensor embeds once instead of b identical rows kept for backward;
            # built once per device, not on every forward
            guidance = float(self.config.guidance)
            kwargs["guidance"] = self._device_constant(
                "guidance", lambda: torch.full((1,), guidance, device=self.device, dtype=torch.float32))
        compute = self.dtype
        hidden, img_ids = self._image_inputs(latents.to(self.device, compute), text)
        with self._autocast():
            out = module(
                hidden_states=hidden,
                encoder_hidden_states=embeds.to(compute),
                pooled_projections=text["pooled"].to(self.device, compute),
                timestep=conditioning_timestep(sigma, self.config.timestep_conditioning).to(self.device, torch.float32),
                img_ids=img_ids.to(compute),
                txt_ids=torch.zeros(embeds.shape[1], 3, device=self.device, dtype=compute),
                return_dict=False,
                **kwargs,
            )[0]
        return out[:, : latents.shape[1]].to(torch.float32)  # the generated image's tokens

    def _image_inputs(self, latents, text) -> tuple[torch.Tensor, torch.Tensor]:
        """The image tokens the transformer reads and their ids (FLUX.1 Kontext appends the condition's)."""
        return latents, self.image_ids()

    def unpack(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed tokens ``[B, seq, 4C]`` -> VAE latents ``[B, C, H/8, W/8]``."""
        return unpack_2x2(latents, self.grid)

    def pack(self, vae_latents: torch.Tensor) -> torch.Tensor:
        """VAE latents ``[B, C, H/8, W/8]`` -> packed tokens ``[B, seq, 4C]`` (inverse of unpack)."""
        return pack_2x2(vae_latents)

    def _decoder(self, vae):
        scaled = super()._decoder(vae)  # the VAE's own latents once unpacked
        return lambda z: scaled(self.unpack(z))

    def encode_images(self, images):
        """Clean latents of images in ``[0, 1]`` (:class:`flowrl.interfaces.EncodesImages`: offline data)."""
        return self._encode_with_vae(images)

    def _from_vae(self, vae, z):
        return self.pack(super()._from_vae(vae, z))

    def sigmas(self, num_steps):
        return self._scheduler_sigmas(num_steps, self.image_seq_len, flux_style=True)
