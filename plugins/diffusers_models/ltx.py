"""LTX-Video text-to-video (model ``ltx``) as a flowrl model adapter, on diffusers' LTXPipeline
components (LTXVideoTransformer3DModel, AutoencoderKLLTXVideo, a T5-XXL text encoder).

- Latents are the policy's tokens ``[F_lat * (H/32) * (W/32), 128]``, packed as LTXPipeline packs
  them (``_pack_latents`` with the transformer's patch sizes, 1 and 1 for the published model:
  one token per latent voxel, frame-major, then rows, then columns). The VAE compresses space 32x
  (4 x 4 pixels folded into channels, then 3 down-sampling stages) and time 8x causally, so
  ``num_frames`` is ``8k + 1`` and ``F_lat = (F - 1) / 8 + 1`` (704 x 480, 121 frames: 16 x 15 x 22
  = 5280 tokens). The transformer is told the latent grid (``num_frames``, ``height``, ``width``)
  and RoPE's ``rope_interpolation_scale = (8 / frame_rate, 32, 32)``, as the pipeline passes them.
- Timestep convention: ``timestep = 1000 sigma`` (the pipeline passes its FlowMatchEuler
  scheduler's timesteps, ``1000 sigma``).
- Schedule: the pipeline's own (``[schedule] use = "model"``): FlowMatchEuler on
  ``linspace(1, 1/N, N)`` with the resolution-dependent dynamic shift
  ``mu = calculate_shift(video tokens, ...)`` from the scheduler's config, and the scheduler's
  ``shift_terminal`` (the published scheduler stretches the grid so its last non-zero sigma is
  0.1), then 0. flowrl's Euler ODE on these sigmas is the pipeline's sampler.
- True classifier-free guidance: ``v = v_u + w (v_c - v_u)``, ``w = cfg_scale`` (the pipeline's
  default 3.0), the unconditional branch on ``negative_prompt``; one batch ``[uncond; cond]``. The
  pipeline's optional ``guidance_rescale`` is not offered (its default is 0).
- Text: T5's last hidden state over ``max_sequence_length`` tokens (the pipeline's 128), padded,
  with its attention mask, which the transformer turns into an attention bias over the text keys.
- Decode: unpack to ``[B, 128, F_lat, H/32, W/32]``, ``z * latents_std / scaling_factor +
  latents_mean`` per channel (the VAE's stored statistics), the VAE decodes ``[B, 3, F, H, W]``
  in [-1, 1]; clips ``[B, F, 3, H, W]`` in [0, 1]. A VAE with ``timestep_conditioning`` (LTX-Video
  0.9.1 and later) decodes at ``decode_timestep``; the pipeline's ``decode_noise_scale`` (noise
  mixed into the latents before decoding) is not applied: flowrl's decode is deterministic, which
  is what the pipeline does with ``decode_noise_scale = 0``.
- Image-to-video (``image_to_video``, as LTXImageToVideoPipeline does): each prompt's condition
  image, resized to the clip's size, is encoded by the VAE as one latent frame, normalised
  ``(z - mean) / std`` (the pipeline leaves the VAE's ``scaling_factor``, 1.0 in the published VAE,
  out of this one normalisation) and packed into that frame's tokens; every transformer call
  sees them in place of the first latent frame's tokens, which get timestep 0 (clean), and the
  pipeline's scheduler step leaves that frame unchanged. flowrl's velocity on those tokens is the
  exact flow velocity towards the image, ``(x - c) / sigma``, as ``wan22``'s image-to-video, so the
  ODE lands on the image; see LTXModel. The pipeline samples the image's latent from the VAE's
  posterior (with its generator); flowrl takes its mode, so a prompt's condition is one tensor.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from flowrl.config import param
from flowrl.errors import FlowrlError

from .common import DiffusersAdapter, preset_targets
from .editing import encode_condition_frame
from .memory.ltx import ltx_memory_spec
from .quantize import QUANTIZE_HELP

LTX_ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]
LTX_FEED_FORWARD = ["ff.net.0.proj", "ff.net.2"]


def ltx_lora_targets(preset: str) -> list[str]:
    """The LoRA targets of a preset: attention (self and cross), plus the feed-forwards."""
    return preset_targets(preset, LTX_ATTENTION, LTX_FEED_FORWARD)


@dataclasses.dataclass(frozen=True)
class LTXConfig:
    path: str = param(
        "Lightricks/LTX-Video",
        "Hub id or local pipeline directory (model_index.json) of an LTX-Video (0.9.x, 2B) diffusers pipeline. "
        "LTX-Video open-weights licence; not gated.", path="hub",
    )
    revision: str = param("", "Hub revision (branch, tag or commit); empty = default branch.")
    dtype: Literal["bf16", "fp16", "fp32"] = param("bf16", "Compute dtype, and storage of the text encoder and VAE.")
    denoiser_dtype: Literal["auto", "bf16", "fp16", "fp32"] = param(
        "auto", "Storage dtype of the transformer's weights; 'auto' = dtype ('fp32' for full fine-tuning)."
    )
    height: int = param(480, "Frame height in pixels (a multiple of 32, the VAE's factor). LTX-Video: 480.", min=32)
    width: int = param(704, "Frame width in pixels (a multiple of 32). LTX-Video: 704.", min=32)
    num_frames: int = param(
        121, "Frames per clip, 8k + 1 (the VAE compresses time 8x after the first frame; the pipeline's default 161).",
        min=1,
    )
    frame_rate: float = param(25.0, "Frames per second the transformer's RoPE is scaled for (the pipeline's 25).",
                              min=1.0)
    cfg_scale: float = param(
        3.0, "True CFG weight w: v = v_u + w (v_c - v_u) (the pipeline's 3.0). 1 = no CFG, one forward per step.",
        min=0.0,
    )
    negative_prompt: str = param("", "Prompt of the unconditional branch (the pipeline's default '').")
    max_sequence_length: int = param(128, "T5 prompt tokens (the pipeline's 128), padded and masked.", min=1)
    decode_timestep: float = param(
        0.0, "Timestep the VAE decodes at when it is timestep-conditioned (0.9.1+; the pipeline's default 0.0).",
        min=0.0,
    )
    gradient_checkpointing: bool = param(False, "Recompute transformer blocks in backward (saves activation memory).")
    offload_encoders: bool = param(
        True, "Keep the text encoder and VAE on the CPU; move them to the GPU only to encode / decode."
    )
    lora_preset: Literal["attention", "attention_ff"] = param(
        "attention",
        "Default LoRA targets when train.lora_targets is empty: 'attention' (to_q, to_k, to_v, to_out.0 of the "
        "self- and cross-attention of every block) or 'attention_ff' = attention + ff.net.0.proj, ff.net.2.",
    )
    vae_batch_size: int = param(1, "Clips decoded per VAE call (bounds decode memory).", min=1)
    quantize: Literal["none", "nf4", "int8"] = param("none", QUANTIZE_HELP)
    image_to_video: bool = param(
        False, "Image-to-video: the first frame is each prompt's condition image ([prompts].condition_column), "
        "as LTXImageToVideoPipeline does (the image's latent frame kept clean, at timestep 0).",
    )

    def __post_init__(self):
        if (self.num_frames - 1) % 8:
            k = (self.num_frames - 1) // 8 * 8 + 1
            raise ValueError(f"num_frames must be 8k + 1 (the LTX VAE's temporal factor is 8), got {self.num_frames}; "
                             f"use {k} or {k + 8}")
        if self.image_to_video and self.num_frames == 1:
            raise FlowrlError(
                "image_to_video = true with num_frames = 1: the clip's one latent frame would be the condition "
                "image itself, with nothing left to generate", where="[model] (model 'ltx').image_to_video",
                hint="set model.num_frames = 9 or more (8k + 1), or model.image_to_video = false",
            )

    def memory_spec(self):
        """What ``flowrl plan`` needs, from the published configuration (no weights)."""
        return ltx_memory_spec(self, ltx_lora_targets(self.lora_preset))


class LTXModel(DiffusersAdapter):
    """LTX-Video through diffusers: packed video tokens [F_lat * h * w, C], timestep = 1000 sigma,
    true CFG as the policy, the pipeline's dynamic-shift schedule, clips [B, F, 3, H, W] out of decode;
    with ``image_to_video``, the first frame is each prompt's condition image.

    Image-to-video follows LTXImageToVideoPipeline: the image, resized to the clip's size by the
    pipeline's video processor, is encoded by the VAE (its mode) as one latent frame, normalised
    ``(z - mean) / std`` as the pipeline does it and packed like the video, ``h * w`` tokens; every
    transformer call sees them in place of the first latent frame's tokens, and those tokens get
    timestep 0 (clean), the others ``1000 sigma``: one timestep per token, ``[B, seq]``, as the
    pipeline's conditioning mask makes it. The pipeline starts that frame on the image and its
    scheduler step leaves it there; flowrl's rollout starts from noise everywhere, so its velocity
    on that frame is instead the exact flow velocity towards the image, ``(x - c) / sigma`` (as
    ``wan22``'s image-to-video), and the ODE lands on ``c`` at sigma = 0: decode needs nothing
    else. That frame's velocity has no parameters in it: it adds nothing to a policy ratio or a
    gradient."""

    task = "text-to-video"  # the model card's pipeline tag (flowrl.hub)

    Config = LTXConfig
    pipeline_class_name = "LTXPipeline"

    def __init__(self, config: LTXConfig, where: str = "[model] (model 'ltx')"):
        super().__init__(config, where)
        vae = self.pipe.vae
        self.vae_scale_temporal = int(vae.temporal_compression_ratio)
        self.patch = int(self.denoiser.config.patch_size)
        self.patch_t = int(self.denoiser.config.patch_size_t)
        self._check_image_size(self.patch, f"patch {self.patch}", vae_scale=int(vae.spatial_compression_ratio))
        self._check_frame_count()
        channels = self.denoiser.config.in_channels
        if channels != vae.config.latent_channels * self.patch * self.patch * self.patch_t:
            raise FlowrlError(
                f"transformer in_channels ({channels}) != VAE latent_channels ({vae.config.latent_channels}) x patches",
                where=f"{where}.path", hint="the pipeline's transformer and VAE do not belong together",
            )
        f_lat = (config.num_frames - 1) // self.vae_scale_temporal + 1
        h, w = config.height // self.vae_scale, config.width // self.vae_scale
        self.latent_grid = (f_lat, h, w)  # of the VAE's latents, before the transformer's patches
        self.grid = (f_lat // self.patch_t, h // self.patch, w // self.patch)
        self.image_seq_len = self.grid[0] * self.grid[1] * self.grid[2]
        self.latent_shape = (self.image_seq_len, channels)
        self.uses_cfg = config.cfg_scale != 1.0
        self.rope_scale = (self.vae_scale_temporal / config.frame_rate, self.vae_scale, self.vae_scale)
        if config.image_to_video:
            if self.patch_t != 1:
                raise FlowrlError(
                    f"image_to_video needs a transformer with patch_size_t = 1 (this one's is {self.patch_t}): the "
                    "condition image is one latent frame", where=f"{where}.image_to_video",
                    hint="set model.image_to_video = false",
                )
            self.condition_size = (config.height, config.width)  # flowrl.interfaces.TakesConditionImage
            self.condition_tokens = self.grid[1] * self.grid[2]  # the first latent frame's, first in the packing
            mask = torch.ones(self.image_seq_len)
            mask[: self.condition_tokens] = 0.0  # the first latent frame's tokens are clean
            self._token_mask = mask

    def _lora_preset(self, preset):
        return ltx_lora_targets(preset)

    @torch.no_grad()
    def encode_prompts(self, prompts):
        prompts = list(prompts)
        with self._visiting(self.pipe.text_encoder):
            embeds, mask, neg, neg_mask = self.pipe.encode_prompt(
                prompt=prompts, do_classifier_free_guidance=self.uses_cfg,
                negative_prompt=[self.config.negative_prompt] * len(prompts) if self.uses_cfg else None,
                max_sequence_length=self.config.max_sequence_length, device=self.device,
            )
        out = {"prompt_embeds": embeds, "prompt_mask": mask.bool()}
        if self.uses_cfg:
            out.update(negative_prompt_embeds=neg, negative_prompt_mask=neg_mask.bool())
        if self.config.image_to_video:
            out["condition_latents"] = self.encode_conditions(prompts)
        return {k: v.to(self.device) for k, v in out.items()}

    @torch.no_grad()
    def encode_conditions(self, prompts) -> torch.Tensor:
        """``[B, h * w, C]`` float32: each prompt's image as LTXImageToVideoPipeline encodes it (the
        VAE's mode where the pipeline samples), normalised and packed as the first latent frame."""
        vae = self.pipe.vae
        mean = vae.latents_mean.to(torch.float32).cpu().view(1, -1, 1, 1, 1)
        std = vae.latents_std.to(torch.float32).cpu().view(1, -1, 1, 1, 1)
        # [B, C, 1, h, w]; the pipeline's _normalize_latents here, without the VAE's scaling_factor
        z = (encode_condition_frame(self, prompts) - mean) / std
        b, c, _, hh, ww = z.shape
        p = self.patch
        tokens = z.reshape(b, c, 1, hh // p, p, ww // p, p).permute(0, 2, 3, 5, 1, 4, 6).reshape(b, -1, c * p * p)
        return tokens.to(self.device)

    def _inputs(self, latents, t, text):
        """The transformer's ``hidden_states`` and ``timestep`` for latents at ``t = 1000 sigma``:
        with ``image_to_video`` the condition's tokens first, at timestep 0 (one timestep per token)."""
        if not self.config.image_to_video:
            return latents, t
        cond = text["condition_latents"].to(self.device, torch.float32)
        x = torch.cat([cond, latents[:, self.condition_tokens:]], dim=1)
        return x, self._token_timesteps(t)

    def _velocity(self, module, latents, sigma, text):
        compute = self.dtype
        t = sigma.to(self.device, torch.float32) * 1000.0  # LTX: timestep = 1000 sigma
        x, t = self._inputs(latents.to(self.device, torch.float32), t, text)
        x = x.to(compute)
        embeds, mask = text["prompt_embeds"], text["prompt_mask"]
        if self.uses_cfg:
            # One batch [uncond; cond]; the CFG combination below is the policy's velocity.
            x, t = torch.cat([x, x]), torch.cat([t, t])
            embeds = torch.cat([text["negative_prompt_embeds"], embeds])
            mask = torch.cat([text["negative_prompt_mask"], mask])
        f, h, w = self.grid
        with self._autocast():
            out = module(hidden_states=x, timestep=t, encoder_hidden_states=embeds.to(self.device, compute),
                         encoder_attention_mask=mask.to(self.device), num_frames=f, height=h, width=w,
                         rope_interpolation_scale=self.rope_scale, return_dict=False)[0]
        out = out.to(torch.float32)
        return self._conditioned(self._cfg_combined(out)[0] if self.uses_cfg else out, latents, sigma, text)

    def _conditioned(self, velocity, latents, sigma, text):
        """The velocity with what conditioning fixes: with ``image_to_video``, the first latent
        frame's tokens flow to the condition image, ``(x - c) / sigma``."""
        if not self.config.image_to_video:
            return velocity
        n = self.condition_tokens
        x0 = latents[:, :n].to(self.device, torch.float32)
        cond = text["condition_latents"].to(self.device, torch.float32)
        s = sigma.to(self.device, torch.float32).view(-1, 1, 1)
        return torch.cat([(x0 - cond) / s, velocity[:, n:]], dim=1)

    def _decoder(self, vae):
        """Tokens -> clips ``[B, F, 3, H, W]`` in [-1, 1]: unpacked as LTXPipeline unpacks them, then
        ``z * std / scaling_factor + mean`` per channel, then the VAE's ``[B, 3, F, H, W]``."""
        mean = vae.latents_mean.to(self.device, torch.float32).view(1, -1, 1, 1, 1)
        std = vae.latents_std.to(self.device, torch.float32).view(1, -1, 1, 1, 1)
        scale = vae.config.scaling_factor
        f, h, w = self.grid
        p, pt = self.patch, self.patch_t

        def to_clips(tokens):
            b = tokens.shape[0]
            z = tokens.reshape(b, f, h, w, -1, pt, p, p).permute(0, 4, 1, 5, 2, 6, 3, 7)
            z = z.flatten(6, 7).flatten(4, 5).flatten(2, 3)
            z = z * std / scale + mean
            timestep = None
            if vae.config.timestep_conditioning:
                timestep = torch.full((b,), self.config.decode_timestep, device=self.device, dtype=vae.dtype)
            video = vae.decode(z.to(vae.dtype), timestep, return_dict=False)[0]
            return video.permute(0, 2, 1, 3, 4)

        return to_clips

    def sigmas(self, num_steps):
        return self._scheduler_sigmas(num_steps, self.image_seq_len, flux_style=True)
