"""Stable Diffusion 3 / 3.5 as a flowrl model adapter, on diffusers' StableDiffusion3Pipeline.

- Latents are the VAE's ``[C, H/8, W/8]`` (no packing; the transformer patchifies inside).
- Timestep convention: the transformer takes ``timestep = 1000 * sigma``.
- True classifier-free guidance: ``v = v_u + w (v_c - v_u)`` with ``w = cfg_scale`` (4.5 in
  Flow-GRPO). The combined velocity IS the policy: rollouts and training log-probs both use it.
  The unconditional and conditional halves run as one batch of ``2B``. ``cfg_scale = 1`` runs
  the conditional branch alone (no negative embeddings are computed).
- Decode: ``z / scaling_factor + shift_factor``, VAE decode, ``x / 2 + 0.5`` clamped.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from flowrl.config import param

from .common import DiffusersAdapter
from .memory.sd3 import sd3_memory_spec
from .quantize import QUANTIZE_HELP


@dataclasses.dataclass(frozen=True)
class SD3Config:
    path: str = param(
        "stabilityai/stable-diffusion-3.5-medium",
        "Hub id or local pipeline directory (model_index.json). SD3.x repositories are gated: accept the "
        "licence on the model page and `huggingface-cli login`.", path="hub",
    )
    revision: str = param("", "Hub revision (branch, tag or commit); empty = default branch.")
    dtype: Literal["bf16", "fp16", "fp32"] = param("bf16", "Compute dtype, and storage of text encoders and VAE.")
    denoiser_dtype: Literal["auto", "bf16", "fp16", "fp32"] = param(
        "auto", "Storage dtype of the transformer's weights; 'auto' = dtype ('fp32' for full fine-tuning)."
    )
    height: int = param(512, "Image height in pixels (a multiple of VAE factor x patch size, 16).", min=16)
    width: int = param(512, "Image width in pixels.", min=16)
    cfg_scale: float = param(
        4.5, "True CFG weight w: v = v_u + w (v_c - v_u) (Flow-GRPO SD3.5: 4.5). 1 = no CFG, one forward.", min=0.0
    )
    negative_prompt: str = param("", "Prompt of the unconditional branch.")
    max_sequence_length: int = param(256, "T5 prompt tokens.", min=1)
    use_t5: bool = param(True, "Load the T5 encoder (false: zeros in its place, as SD3 allows; saves ~9.5 GB).")
    gradient_checkpointing: bool = param(False, "Recompute transformer blocks in backward (saves activation memory).")
    offload_encoders: bool = param(
        True, "Keep the text encoders and VAE on the CPU; move them to the GPU only to encode / decode."
    )
    lora_preset: Literal["attention", "attention_ff"] = param(
        "attention", "Default LoRA targets when train.lora_targets is empty (Flow-GRPO SD3: attention)."
    )
    vae_batch_size: int = param(4, "Images decoded per VAE call (bounds decode memory).", min=1)
    quantize: Literal["none", "nf4", "int8"] = param("none", QUANTIZE_HELP)

    def memory_spec(self):
        """What ``flowrl plan`` needs, from the published configuration (no weights)."""
        return sd3_memory_spec(self)


class SD3Model(DiffusersAdapter):
    """Stable Diffusion 3 / 3.5 through diffusers: true CFG is the policy, timestep = 1000 sigma."""

    Config = SD3Config
    pipeline_class_name = "StableDiffusion3Pipeline"
    frozen_names = ("text_encoder", "text_encoder_2", "text_encoder_3", "vae")

    def __init__(self, config: SD3Config, where: str = "[model] (model 'sd3')"):
        super().__init__(config, where)
        patch = self.denoiser.config.patch_size
        self._check_image_size(patch, f"patch {patch}")
        h, w = config.height // self.vae_scale, config.width // self.vae_scale
        self.latent_shape = (self.denoiser.config.in_channels, h, w)
        self.image_seq_len = (h // patch) * (w // patch)
        self.uses_cfg = config.cfg_scale != 1.0

    def encode_images(self, images):
        """Clean latents of images in ``[0, 1]`` (:class:`flowrl.interfaces.EncodesImages`: offline data)."""
        return self._encode_with_vae(images)

    def _load_kwargs(self):
        if self.config.use_t5:
            return {}
        return {"text_encoder_3": None, "tokenizer_3": None}

    @torch.no_grad()
    def encode_prompts(self, prompts):
        p = self.pipe
        prompts = list(prompts)
        encoders = [m for m in (p.text_encoder, p.text_encoder_2, p.text_encoder_3) if m is not None]
        with self._visiting(*encoders):
            embeds, neg, pooled, neg_pooled = p.encode_prompt(
                prompt=prompts, prompt_2=None, prompt_3=None, device=self.device,
                do_classifier_free_guidance=self.uses_cfg,
                negative_prompt=[self.config.negative_prompt] * len(prompts) if self.uses_cfg else None,
                max_sequence_length=self.config.max_sequence_length,
            )
        out = {"prompt_embeds": embeds, "pooled": pooled}
        if self.uses_cfg:
            out.update(negative_prompt_embeds=neg, negative_pooled=neg_pooled)
        return {k: v.to(self.device) for k, v in out.items()}

    def _velocity(self, module, latents, sigma, text):
        compute = self.dtype
        x = latents.to(self.device, compute)
        t = sigma.to(self.device, torch.float32) * 1000.0  # SD3: timestep = 1000 sigma
        embeds, pooled = text["prompt_embeds"], text["pooled"]
        if self.uses_cfg:
            # One batch [uncond; cond]; the CFG combination below is the policy's velocity.
            x = torch.cat([x, x])
            t = torch.cat([t, t])
            embeds = torch.cat([text["negative_prompt_embeds"], embeds])
            pooled = torch.cat([text["negative_pooled"], pooled])
        with self._autocast():
            out = module(
                hidden_states=x, timestep=t,
                encoder_hidden_states=embeds.to(self.device, compute),
                pooled_projections=pooled.to(self.device, compute), return_dict=False,
            )[0]
        out = out.to(torch.float32)
        return self._cfg_combined(out)[0] if self.uses_cfg else out

    def sigmas(self, num_steps):
        return self._scheduler_sigmas(num_steps, self.image_seq_len, flux_style=False)
