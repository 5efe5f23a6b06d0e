"""Qwen-Image as a flowrl model adapter, on diffusers' QwenImagePipeline components.

- Latents are packed tokens like FLUX.1's: the VAE latent ``[C, H/8, W/8]`` cut into 2x2
  patches, ``latent_shape = ((H/16) * (W/16), 4 C)`` (C = 16: 64 channels per token). The
  transformer places the tokens with its own 3-axis RoPE from ``img_shapes = (1, H/16, W/16)``;
  text tokens continue the positions after the image grid.
- Timestep convention: the transformer takes ``timestep = sigma`` (it multiplies by 1000 inside;
  the pipeline passes ``t / 1000``).
- Guidance: true classifier-free guidance with a norm correction. With ``w = cfg_scale`` (the
  pipeline's ``true_cfg_scale``, 4.0 on the model card) and the negative prompt's velocity
  ``v_u``: ``c = v_u + w (v_c - v_u)``, then every token of ``c`` is rescaled to the norm of the
  same token of ``v_c`` (norm over the channel axis). That rescaled ``c`` is the policy. The two
  branches run as one batch of ``2B``. ``cfg_scale = 1`` runs the conditional branch alone.
- Text: Qwen2.5-VL-7B's last hidden state over the prompt wrapped in the pipeline's system
  template (the template's first 34 tokens are dropped), 3584 wide, one vector per prompt token.
  Prompts have different lengths, so the adapter pads every prompt to ``max_sequence_length``
  with zeros and a mask (``prompt_mask``): the engine caches and stacks embeddings per prompt. The
  mask goes to the transformer (masked keys get zero attention), so a padded prompt gives the
  same velocity as the pipeline's unpadded one, up to float rounding. ``trim_text_padding = true``
  makes each velocity call drop the columns that are padding in every row of its batch first
  (cheaper, but no longer independent of the batch at rounding level).
- Decode: unpack to ``[B, C, 1, H/8, W/8]`` (a one-frame video: the VAE is Wan-style 3-D),
  ``z * latents_std + latents_mean`` per channel, VAE decode, frame 0, ``x / 2 + 0.5`` clamped.
- Schedule: the pipeline's FlowMatchEuler scheduler with ``linspace(1, 1/N, N)`` and FLUX's
  resolution-dependent ``mu`` from the scheduler config (``base_shift``, ``max_shift``,
  ``base_image_seq_len``, ``max_image_seq_len``; the scheduler's own ``shift_terminal`` and time
  shift type apply).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from flowrl.config import param

from .common import ATTENTION, DiffusersAdapter, pack_2x2, preset_targets, unpack_2x2
from .memory.qwen_image import qwen_image_memory_spec
from .quantize import QUANTIZE_HELP

#: Qwen-Image's MLPs: one for the image stream, one for the text stream.
QWEN_FEED_FORWARD = ["img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"]


@dataclasses.dataclass(frozen=True)
class QwenImageConfig:
    path: str = param(
        "Qwen/Qwen-Image",
        "Hub id or local pipeline directory (model_index.json): Qwen/Qwen-Image or Qwen/Qwen-Image-2512 "
        "(Apache-2.0, not gated).", path="hub",
    )
    revision: str = param("", "Hub revision (branch, tag or commit); empty = default branch.")
    dtype: Literal["bf16", "fp16", "fp32"] = param("bf16", "Compute dtype, and storage of the text encoder and VAE.")
    denoiser_dtype: Literal["auto", "bf16", "fp16", "fp32"] = param(
        "auto", "Storage dtype of the transformer's weights; 'auto' = dtype ('fp32' for full fine-tuning)."
    )
    height: int = param(
        512, "Image height in pixels (a multiple of 16: VAE factor 8 x 2x2 packing; the model card's 1:1 size is "
        "1328).", min=16,
    )
    width: int = param(512, "Image width in pixels (a multiple of 16).", min=16)
    cfg_scale: float = param(
        4.0,
        "True CFG weight w (the pipeline's true_cfg_scale; model card 4.0): c = v_u + w (v_c - v_u), then each "
        "token rescaled to the norm of v_c's. 1 = no CFG, one forward per step.",
        min=0.0,
    )
    negative_prompt: str = param(
        " ", "Prompt of the unconditional branch (the model card uses a single space).",
    )
    max_sequence_length: int = param(
        512, "Prompt tokens kept after the template (the pipeline's default 512; at most 1024).", min=1, max=1024,
    )
    trim_text_padding: bool = param(
        False,
        "Drop the text columns that are padding in every row of a velocity call's batch (they are masked anyway: "
        "less compute with short prompts). A sample's velocity then depends on the longest prompt in its batch at "
        "rounding level, which in bf16 shows in the on-policy check (2.2e-5 on a tiny model on the CPU); false "
        "keeps all max_sequence_length columns and is batch-independent.",
    )
    gradient_checkpointing: bool = param(False, "Recompute transformer blocks in backward (saves activation memory).")
    offload_encoders: bool = param(
        True, "Keep the text encoder and VAE on the CPU; move them to the GPU only to encode / decode."
    )
    lora_preset: Literal["attention", "attention_ff"] = param(
        "attention_ff",
        "Default LoRA targets when train.lora_targets is empty: 'attention' (image and text attention "
        "projections) or 'attention_ff' = attention + both MLPs (Flow-Factory / verl-omni Qwen-Image: r64/a128).",
    )
    vae_batch_size: int = param(4, "Images decoded per VAE call (bounds decode memory).", min=1)
    quantize: Literal["none", "nf4", "int8"] = param("none", QUANTIZE_HELP)

    def memory_spec(self):
        """What ``flowrl plan`` needs, from the published configuration (no weights)."""
        return qwen_image_memory_spec(self, qwen_lora_targets(self.lora_preset))


def qwen_lora_targets(preset: str) -> list[str]:
    """The LoRA targets of a preset: attention (image and text streams), plus both MLPs."""
    return preset_targets(preset, ATTENTION, QWEN_FEED_FORWARD)


class QwenImageModel(DiffusersAdapter):
    """Qwen-Image through diffusers: packed latents, true CFG with per-token norm correction,
    timestep = sigma, padded text with a mask."""

    Config = QwenImageConfig
    pipeline_class_name = "QwenImagePipeline"

    def __init__(self, config: QwenImageConfig, where: str = "[model] (model 'qwen_image')"):
        super().__init__(config, where)
        vae_cfg = self.pipe.vae.config
        # The pipeline's own rule: the Wan-style VAE halves H and W once per temporal stage entry.
        self._packed_grid("2x2 packing", vae_cfg.z_dim, "z_dim", vae_scale=2 ** len(vae_cfg.temperal_downsample))
        self.uses_cfg = config.cfg_scale != 1.0

    def _lora_preset(self, preset):
        return qwen_lora_targets(preset)

    # ---- text -------------------------------------------------------------------------------

    def _encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, max_sequence_length, D]`` embeddings (zeros after each prompt) and a bool mask."""
        length = self.config.max_sequence_length
        embeds, mask = self.pipe.encode_prompt(prompt=prompts, device=self.device, max_sequence_length=length)
        b, n, d = embeds.shape
        if mask is None:  # the pipeline drops an all-true mask
            mask = torch.ones(b, n, dtype=torch.bool, device=embeds.device)
        out = embeds.new_zeros(b, length, d)
        out[:, :n] = embeds
        full = torch.zeros(b, length, dtype=torch.bool, device=embeds.device)
        full[:, :n] = mask.bool()
        return out * full[..., None], full

    @torch.no_grad()
    def encode_prompts(self, prompts):
        prompts = list(prompts)
        with self._visiting(self.pipe.text_encoder):
            embeds, mask = self._encode(prompts)
            out = {"prompt_embeds": embeds, "prompt_mask": mask}
            if self.uses_cfg:
                # One negative prompt for every row: encode it once.
                neg, neg_mask = (v.repeat(len(prompts), *[1] * (v.ndim - 1))
                                 for v in self._encode([self.config.negative_prompt]))
                out.update(negative_prompt_embeds=neg, negative_prompt_mask=neg_mask)
        return {k: v.to(self.device) for k, v in out.items()}

    # ---- velocity ---------------------------------------------------------------------------

    def _velocity(self, module, latents, sigma, text):
        compute = self.dtype
        x = latents.to(self.device, compute)
        t = sigma.to(self.device, torch.float32)  # Qwen-Image: timestep = sigma
        embeds, mask = text["prompt_embeds"].to(self.device), text["prompt_mask"].to(self.device)
        if self.uses_cfg:
            # One batch [uncond; cond]; the corrected combination below is the policy's velocity.
            x, t = torch.cat([x, x]), torch.cat([t, t])
            embeds = torch.cat([text["negative_prompt_embeds"].to(self.device), embeds])
            mask = torch.cat([text["negative_prompt_mask"].to(self.device), mask])
        if self.config.trim_text_padding:
            # Valid tokens come first; drop the columns that are padding in every row of this batch.
            keep = max(int(mask.sum(dim=1).max()), 1)
            embeds, mask = embeds[:, :keep], mask[:, :keep]
        x, shapes = self._image_inputs(x, text)
        with self._autocast():
            out = module(
                hidden_states=x, timestep=t,
                encoder_hidden_states=embeds.to(compute),
                encoder_hidden_states_mask=None if bool(mask.all()) else mask,
                img_shapes=[shapes] * x.shape[0], return_dict=False,
            )[0]
        out = out[:, : latents.shape[1]].to(torch.float32)  # the generated image's tokens
        if self.uses_cfg:
            combined, v_c = self._cfg_combined(out)
            out = combined * (v_c.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))
        return out

    def _image_inputs(self, x, text) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """The image tokens the transformer reads (``[B or 2B, seq, C]``) and their grids
        (Qwen-Image-Edit appends the condition's)."""
        return x, [(1, *self.grid)]

    # ---- latents and images -----------------------------------------------------------------

    def unpack(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed tokens ``[B, seq, 4C]`` -> VAE latents ``[B, C, 1, H/8, W/8]`` (one frame)."""
        return unpack_2x2(latents, self.grid).unsqueeze(2)

    def pack(self, vae_latents: torch.Tensor) -> torch.Tensor:
        """VAE latents ``[B, C, 1, H/8, W/8]`` (or ``[B, C, H/8, W/8]``) -> packed tokens ``[B, seq, 4C]``."""
        if vae_latents.ndim == 5:
            vae_latents = vae_latents[:, :, 0]
        return pack_2x2(vae_latents)

    def _decoder(self, vae):
        cfg = vae.config
        mean = torch.tensor(cfg.latents_mean, dtype=torch.float32, device=self.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(cfg.latents_std, dtype=torch.float32, device=self.device).view(1, -1, 1, 1, 1)
        # per channel de-normalised, one frame of the Wan-style 3-D VAE
        return lambda z: vae.decode((self.unpack(z) * std + mean).to(vae.dtype), return_dict=False)[0][:, :, 0]

    def encode_images(self, images):
        """Clean latents of images in ``[0, 1]`` (:class:`flowrl.interfaces.EncodesImages`: offline data)."""
        return self._encode_with_vae(images)

    def _vae_mode(self, vae, pixels):
        return super()._vae_mode(vae, pixels.unsqueeze(2))  # one frame of the 3-D VAE

    def _from_vae(self, vae, z):
        """``(z - latents_mean) / latents_std`` per channel, packed: the inverse of :meth:`_decoder`."""
        mean = torch.tensor(vae.config.latents_mean, dtype=z.dtype, device=z.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std, dtype=z.dtype, device=z.device).view(1, -1, 1, 1, 1)
        return self.pack((z - mean) / std)

    def sigmas(self, num_steps):
        return self._scheduler_sigmas(num_steps, self.image_seq_len, flux_style=True)
