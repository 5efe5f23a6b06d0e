"""Z-Image (Turbo and base) as a flowrl model adapter, on diffusers' ZImagePipeline components.

- Latents are the VAE's ``[C, H/8, W/8]`` (C = 16, the FLUX.1 VAE); the transformer cuts 2x2
  patches itself. It takes Python lists (one latent ``[C, 1, H/8, W/8]`` and one caption of its
  own length per sample), pads each caption to a multiple of 32 with a learned pad token and
  places the image tokens after the caption's positions.
- Timestep convention: REVERSED. The transformer's time runs from 0 (noise) to 1 (data): it takes
  ``t = 1 - sigma`` (and multiplies by ``t_scale`` = 1000 inside), and it predicts ``x0 - eps``,
  the negative of flowrl's velocity ``v = eps - x0``. The adapter feeds ``1 - sigma`` and negates
  the output; it declares the map as :meth:`ZImageModel.timestep_from_sigma`, which the
  conformance suite checks against what the transformer receives.
- Guidance: Z-Image-Turbo is distilled and runs without guidance (``cfg_scale = 0``, one forward
  per step). The base model uses CFG in the pipeline's form ``v = v_c + w (v_c - v_u)`` with
  ``w = cfg_scale`` (the pipeline's ``guidance_scale``; ``w`` here is the usual CFG weight minus
  one), optionally with the output's norm capped at ``cfg_normalization`` x the conditional
  one's and CFG switched off where ``1 - sigma > cfg_truncation``. The combined velocity is the
  policy. Conditional and unconditional samples run in one transformer call.
- Text: Qwen3-4B's second-to-last hidden state (2560 wide) over the prompt in its chat template
  (thinking enabled, as the pipeline does), only the prompt's own tokens. The adapter stores them
  padded to ``max_sequence_length`` with each prompt's length (``prompt_lengths``) and hands the
  transformer each prompt's own tokens, exactly as the pipeline does.
- Decode: ``z / scaling_factor + shift_factor``, VAE decode, ``x / 2 + 0.5`` clamped.
- Schedule: the pipeline's FlowMatchEuler scheduler with ``linspace(1, 1/N, N)`` (its static
  shift, 3.0 for Z-Image-Turbo; FLUX's dynamic ``mu`` if the scheduler config asks for it).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from flowrl.config import param
from flowrl.errors import FlowrlError

from .common import DiffusersAdapter, preset_targets
from .memory.zimage import zimage_memory_spec
from .quantize import QUANTIZE_HELP

ZIMAGE_ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]
ZIMAGE_FEED_FORWARD = ["feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]


@dataclasses.dataclass(frozen=True)
class ZImageConfig:
    path: str = param(
        "Tongyi-MAI/Z-Image-Turbo",
        "Hub id or local pipeline directory (model_index.json): Tongyi-MAI/Z-Image-Turbo (distilled, no CFG) or "
        "Tongyi-MAI/Z-Image (base, with CFG). Apache-2.0, not gated.", path="hub",
    )
    revision: str = param("", "Hub revision (branch, tag or commit); empty = default branch.")
    dtype: Literal["bf16", "fp16", "fp32"] = param("bf16", "Compute dtype, and storage of the text encoder and VAE.")
    denoiser_dtype: Literal["auto", "bf16", "fp16", "fp32"] = param(
        "auto", "Storage dtype of the transformer's weights; 'auto' = dtype ('fp32' for full fine-tuning)."
    )
    height: int = param(
        512, "Image height in pixels (a multiple of 16: VAE factor 8 x 2x2 patches; the model card uses 1024).",
        min=16,
    )
    width: int = param(512, "Image width in pixels (a multiple of 16).", min=16)
    cfg_scale: float = param(
        0.0,
        "Z-Image's CFG weight w (the pipeline's guidance_scale): v = v_c + w (v_c - v_u), i.e. ordinary CFG with "
        "weight w + 1. 0 = no CFG, one forward per step (Z-Image-Turbo); the base model uses about 4.",
        min=0.0,
    )
    cfg_normalization: float = param(
        0.0,
        "With CFG, cap the guided output's norm at this multiple of the conditional output's norm (per sample, "
        "over the whole latent); 0 = off (the pipeline's cfg_normalization; True there is 1).",
        min=0.0,
    )
    cfg_truncation: float = param(
        1.0,
        "With CFG, switch CFG off for the steps where 1 - sigma > cfg_truncation (late, low-noise steps); "
        "1 = CFG at every step (the pipeline's default).",
        min=0.0,
    )
    negative_prompt: str = param("", "Prompt of the unconditional branch (the pipeline's default '').")
    max_sequence_length: int = param(512, "Qwen3 prompt tokens, chat template included (the pipeline's 512).", min=1)
    gradient_checkpointing: bool = param(False, "Recompute transformer blocks in backward (saves activation memory).")
    offload_encoders: bool = param(
        True, "Keep the text encoder and VAE on the CPU; move them to the GPU only to encode / decode."
    )
    lora_preset: Literal["attention", "attention_ff"] = param(
        "attention_ff",
        "Default LoRA targets when train.lora_targets is empty: 'attention' (to_q, to_k, to_v, to_out.0 of every "
        "block, refiners included) or 'attention_ff' = attention + the SwiGLU feed-forwards w1, w2, w3 "
        "(Flow-Factory Z-Image: r64/a128).",
    )
    vae_batch_size: int = param(4, "Images decoded per VAE call (bounds decode memory).", min=1)
    quantize: Literal["none", "nf4", "int8"] = param("none", QUANTIZE_HELP)

    def memory_spec(self):
        """What ``flowrl plan`` needs, from the published configuration (no weights)."""
        return zimage_memory_spec(self, zimage_lora_targets(self.lora_preset))


def zimage_lora_targets(preset: str) -> list[str]:
    """The LoRA targets of a preset: attention (refiners included), plus the feed-forwards."""
    return preset_targets(preset, ZIMAGE_ATTENTION, ZIMAGE_FEED_FORWARD)


class ZImageModel(DiffusersAdapter):
    """Z-Image through diffusers: reversed time (t = 1 - sigma), negated output, list inputs,
    CFG in the pipeline's v_c + w (v_c - v_u) form (off for Turbo)."""

    Config = ZImageConfig
    pipeline_class_name = "ZImagePipeline"
    patch_size = 2  # the pipeline calls the transformer with its default patch size

    def __init__(self, config: ZImageConfig, where: str = "[model] (model 'zimage')"):
        super().__init__(config, where)
        self._check_image_size(self.patch_size, f"patch {self.patch_size}")
        channels = self.denoiser.config.in_channels
        latent_channels = self.pipe.vae.config.latent_channels
        if channels != latent_channels:
            raise FlowrlError(
                f"transformer in_channels ({channels}) != VAE latent_channels ({latent_channels})",
                where=f"{where}.path", hint="the pipeline's transformer and VAE do not belong together",
            )
        h, w = config.height // self.vae_scale, config.width // self.vae_scale
        self.latent_shape = (channels, h, w)
        self.image_seq_len = (h // self.patch_size) * (w // self.patch_size)
        self.uses_cfg = config.cfg_scale > 0.0

    def encode_images(self, images):
        """Clean latents of images in ``[0, 1]`` (:class:`flowrl.interfaces.EncodesImages`: offline data)."""
        return self._encode_with_vae(images)

    def shardable_blocks(self):
        """Z-Image keeps its blocks in ``noise_refiner``, ``context_refiner``, ``siglip_refiner``
        (Omni only) and ``layers``: names flowrl's ``*blocks`` rule would not find."""
        lists = ("noise_refiner", "context_refiner", "siglip_refiner", "layers")
        return [block for name in lists for block in (getattr(self.denoiser, name, None) or [])]

    def _lora_preset(self, preset):
        return zimage_lora_targets(preset)

    @staticmethod
    def timestep_from_sigma(sigma: torch.Tensor) -> torch.Tensor:
        """The time the Z-Image transformer takes at noise level ``sigma``: ``1 - sigma``."""
        return 1.0 - sigma

    # ---- text -------------------------------------------------------------------------------

    def _encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, max_sequence_length, D]`` (each prompt's tokens, then zeros) and ``[B]`` lengths."""
        length = self.config.max_sequence_length
        # encode_prompt rewrites the list it is given in place: hand it a copy.
        rows, _ = self.pipe.encode_prompt(
            prompt=list(prompts), device=self.device, do_classifier_free_guidance=False, max_sequence_length=length,
        )
        d = rows[0].shape[-1]
        embeds = rows[0].new_zeros(len(rows), length, d)
        for i, r in enumerate(rows):
            embeds[i, : r.shape[0]] = r
        lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.long, device=embeds.device)
        return embeds, lengths

    @torch.no_grad()
    def encode_prompts(self, prompts):
        prompts = list(prompts)
        with self._visiting(self.pipe.text_encoder):
            embeds, lengths = self._encode(prompts)
            out = {"prompt_embeds": embeds, "prompt_lengths": lengths}
            if self.uses_cfg:
                neg, neg_len = self._encode([self.config.negative_prompt])  # the same for every row: once
                out.update(negative_prompt_embeds=neg.repeat(len(prompts), 1, 1),
                           negative_prompt_lengths=neg_len.repeat(len(prompts)))
        return {k: v.to(self.device) for k, v in out.items()}

    # ---- velocity ---------------------------------------------------------------------------

    @staticmethod
    def _captions(embeds: torch.Tensor, lengths: torch.Tensor, dtype) -> list[torch.Tensor]:
        return [e[:n].to(dtype) for e, n in zip(embeds, lengths.tolist())]

    def _velocity(self, module, latents, sigma, text):
        compute = self.dtype
        b = latents.shape[0]
        x = list(latents.to(self.device, compute).unsqueeze(2).unbind(0))  # B x [C, 1, h, w]
        sigma = sigma.to(self.device, torch.float32)
        t = self.timestep_from_sigma(sigma)
        caps = self._captions(text["prompt_embeds"].to(self.device), text["prompt_lengths"], compute)
        guided: list[int] = []
        if self.uses_cfg:
            # CFG where 1 - sigma <= cfg_truncation (everywhere at the default 1.0), per sample.
            guided = [i for i, s in enumerate(sigma.tolist()) if 1.0 - s <= self.config.cfg_truncation]
        if guided:
            idx = torch.tensor(guided, device=self.device)
            neg_lengths = text["negative_prompt_lengths"]
            neg = self._captions(text["negative_prompt_embeds"].to(self.device).index_select(0, idx),
                                 neg_lengths.index_select(0, idx.to(neg_lengths.device)), compute)
            x = x + [x[i] for i in guided]
            caps = caps + neg
            t = torch.cat([t, t.index_select(0, idx)])
        with self._autocast():
            # Positional (x, t, cap_feats), as the pipeline calls it.
            out = module(x, t, caps, return_dict=False)[0]
        rows = [o.float() for o in out[:b]]  # the model's x0 - eps, conditional
        w = self.config.cfg_scale
        for j, i in enumerate(guided):
            pos, neg_out = rows[i], out[b + j].float()
            row = pos + w * (pos - neg_out)
            if self.config.cfg_normalization > 0.0:
                limit = torch.linalg.vector_norm(pos) * self.config.cfg_normalization
                norm = torch.linalg.vector_norm(row)
                row = row * torch.where(norm > limit, limit / norm, torch.ones_like(norm))
            rows[i] = row
        pred = torch.stack(rows)
        return -pred.squeeze(2)  # flowrl's v = eps - x0

    # ---- images: the VAE's own latents, DiffusersAdapter.decode ------------------------------

    def sigmas(self, num_steps):
        return self._scheduler_sigmas(num_steps, self.image_seq_len, flux_style=True)
