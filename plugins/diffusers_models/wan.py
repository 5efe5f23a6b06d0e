"""Wan 2.1 text-to-video (1.3B and 14B, model ``wan``) and Wan 2.2 TI2V-5B (model ``wan22``) as
flowrl model adapters, on diffusers' WanPipeline components (WanTransformer3DModel,
AutoencoderKLWan, a UMT5-XXL text encoder). Both are one adapter: what differs is read off the
pipeline's own configuration (the VAE's factors, the pipeline's ``expand_timesteps``); ``wan22``
only changes the defaults (path, the 5B's 720p size 1280 x 704 and 121 frames, shift 5 for 720p).

- Latents are the Wan VAE's ``[C, F_lat, H/8, W/8]`` (C = 16) for ``num_frames = F`` frames,
  ``F_lat = (F - 1) / 4 + 1``: the VAE compresses time 4x causally (the first frame alone, then
  4 frames per latent frame), so ``F`` must be ``4k + 1``. The transformer cuts ``(1, 2, 2)``
  patches itself: ``F_lat * (H/16) * (W/16)`` video tokens (480p, 33 frames: 9 x 30 x 52 = 14040).
- Wan 2.2 TI2V-5B: a 48-channel VAE that first folds 2 x 2 pixels into channels (its
  ``patch_size = 2``) and then compresses 8x, so latents are ``[48, F_lat, H/16, W/16]`` and the
  transformer's ``(1, 2, 2)`` patches make ``F_lat * (H/32) * (W/32)`` tokens (704 x 1280, 121
  frames: 31 x 22 x 40 = 27280). The pipeline sets ``expand_timesteps``: the transformer gets one
  timestep per video token, ``[B, seq]`` (for text-to-video all equal to ``1000 sigma``; the
  image-to-video pipeline sets the first latent frame's to 0, clean, and overwrites that frame with
  the encoded image: ``wan22``'s ``image_to_video``, see Wan22Model).
- Timestep convention: the transformer takes ``timestep = 1000 * sigma`` (WanPipeline passes its
  scheduler's timesteps, which are ``1000 * sigma``). The published scheduler (UniPC) rounds them
  to integers; flowrl feeds the exact ``1000 * sigma``, as diffusers' FlowMatchEuler pipelines do.
- Schedule: ``sigma_i = s u / (1 + (s - 1) u)`` over ``u = linspace(1, 0, N + 1)`` with the flow
  shift ``s = flow_shift`` (Wan's recommendation: 3.0 at 480p, 5.0 at 720p); the same sigmas as
  diffusers' FlowMatchEulerDiscreteScheduler(shift=s). The published UniPC scheduler starts its
  grid at ``u = 0.999`` instead of 1 and solves the ODE with a multistep method, so a
  pipeline's video matches flowrl's only with an Euler scheduler swapped in.
- True classifier-free guidance: ``v = v_u + w (v_c - v_u)``, ``w = cfg_scale`` (Wan's 5.0), the
  unconditional branch on ``negative_prompt`` (the pipeline's default ''; Wan's own sampling
  scripts use a long list of unwanted qualities). The combined velocity is the policy; both
  branches run as one batch ``[uncond; cond]``. ``cfg_scale = 1`` runs the conditional branch alone.
- Text: UMT5's last hidden state over at most ``max_sequence_length`` tokens, each prompt's padding
  positions set to zero and kept (the transformer attends over all ``max_sequence_length`` rows),
  exactly as the pipeline does.
- Decode: ``z * latents_std + latents_mean`` per channel (the VAE config's statistics), the Wan
  VAE decodes ``[B, 3, F, H, W]`` in [-1, 1]; flowrl returns clips ``[B, F, 3, H, W]`` in [0, 1].
  The VAE is kept in float32 by default (``vae_dtype``), as Wan's diffusers examples load it.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import torch

from flowrl.config import param
from flowrl.errors import FlowrlError
from flowrl.sampling.schedules import shifted_sigmas

from .common import DiffusersAdapter, preset_targets
from .editing import encode_condition_frame
from .memory.wan import wan_memory_spec
from .quantize import QUANTIZE_HELP

#: every Wan block's self-attention (attn1) and cross-attention to the text (attn2)
WAN_ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]
WAN_FEED_FORWARD = ["ffn.net.0.proj", "ffn.net.2"]


def latent_statistics(vae, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Wan VAE config's per-channel ``(latents_mean, latents_std)``, float32, shaped
    ``[1, C, 1, 1, 1]`` to broadcast over video latents."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    return tuple(torch.tensor(values, dtype=torch.float32, device=device).view(shape)
                 for values in (vae.config.latents_mean, vae.config.latents_std))


def wan_lora_targets(preset: str) -> list[str]:
    """The LoRA targets of a preset: attention (self and cross), plus the feed-forwards."""
    return preset_targets(preset, WAN_ATTENTION, WAN_FEED_FORWARD)


@dataclasses.dataclass(frozen=True)
class WanConfig:
    path: str = param(
        "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
        "Hub id or local pipeline directory (model_index.json): Wan-AI/Wan2.1-T2V-1.3B-Diffusers or "
        "Wan-AI/Wan2.1-T2V-14B-Diffusers. Apache-2.0, not gated.", path="hub",
    )
    revision: str = param("", "Hub revision (branch, tag or commit); empty = default branch.")
    dtype: Literal["bf16", "fp16", "fp32"] = param("bf16", "Compute dtype, and storage of the text encoder and VAE.")
    denoiser_dtype: Literal["auto", "bf16", "fp16", "fp32"] = param(
        "auto", "Storage dtype of the transformer's weights; 'auto' = dtype ('fp32' for full fine-tuning)."
    )
    height: int = param(480, "Frame height in pixels (a multiple of 16: VAE factor 8 x patch 2). Wan 2.1: 480 or 720.",
                        min=16)
    width: int = param(832, "Frame width in pixels (a multiple of 16). Wan 2.1: 832 (480p) or 1280 (720p).", min=16)
    num_frames: int = param(
        33, "Frames per clip, 4k + 1 (the VAE compresses time 4x after the first frame; Wan 2.1 was trained at 81).",
        min=1,
    )
    cfg_scale: float = param(
        5.0, "True CFG weight w: v = v_u + w (v_c - v_u) (Wan 2.1: 5.0). 1 = no CFG, one forward per step.", min=0.0
    )
    negative_prompt: str = param("", "Prompt of the unconditional branch (the pipeline's default '').")
    flow_shift: float = param(
        3.0, "Time shift s of the sigma schedule, sigma = s u / (1 + (s - 1) u) (Wan: 3.0 at 480p, 5.0 at 720p).",
        min=0.01,
    )
    max_sequence_length: int = param(512, "UMT5 prompt tokens (the pipeline's 512), zero-padded.", min=1)
    gradient_checkpointing: bool = param(False, "Recompute transformer blocks in backward (saves activation memory).")
    offload_encoders: bool = param(
        True, "Keep the text encoder and VAE on the CPU; move them to the GPU only to encode / decode."
    )
    lora_preset: Literal["attention", "attention_ff"] = param(
        "attention",
        "Default LoRA targets when train.lora_targets is empty: 'attention' (to_q, to_k, to_v, to_out.0 of the "
        "self- and cross-attention of every block) or 'attention_ff' = attention + the feed-forward ffn.net.0.proj, "
        "ffn.net.2.",
    )
    vae_batch_size: int = param(1, "Clips decoded per VAE call (bounds decode memory; a 480p clip is large).", min=1)
    vae_dtype: Literal["auto", "fp32"] = param(
        "fp32", "Storage and compute dtype of the VAE: 'fp32' (as Wan's diffusers examples load it) or 'auto' = dtype."
    )
    quantize: Literal["none", "nf4", "int8"] = param("none", QUANTIZE_HELP)

    def __post_init__(self):
        if (self.num_frames - 1) % 4:
            k = (self.num_frames - 1) // 4 * 4 + 1
            raise ValueError(f"num_frames must be 4k + 1 (the Wan VAE's temporal factor is 4), got {self.num_frames}; "
                             f"use {k} or {k + 4}")

    def memory_spec(self):
        """What ``flowrl plan`` needs, from the published configuration (no weights)."""
        return wan_memory_spec(self, wan_lora_targets(self.lora_preset))


class WanModel(DiffusersAdapter):
    """Wan 2.1 T2V through diffusers: video latents [C, F_lat, H/8, W/8], timestep = 1000 sigma,
    true CFG as the policy, clips [B, F, 3, H, W] out of decode."""

    task = "text-to-video"  # the model card's pipeline tag (flowrl.hub)

    Config = WanConfig
    pipeline_class_name = "WanPipeline"

    def __init__(self, config: WanConfig, where: str = "[model] (model 'wan')"):
        super().__init__(config, where)
        if config.vae_dtype == "fp32":
            # frozen and small (2.1: 0.13e9 parameters, 2.2: 0.70e9): decode at full precision
            self.pipe.vae.to(torch.float32)
        vae = self.pipe.vae.config
        # the VAE's own factors: 2 per down-sampling stage in space (times the pixel folding of
        # Wan 2.2's VAE, patch_size 2), 2 per temporal stage in time
        self.vae_scale_temporal = 2 ** sum(vae.temperal_downsample)
        patch = tuple(self.denoiser.config.patch_size)
        self._check_image_size(patch[1], f"patch {patch[1]}",
                               vae_scale=2 ** len(vae.temperal_downsample) * (vae.get("patch_size") or 1))
        self._check_frame_count()
        channels, expected = vae.z_dim, self._transformer_in_channels(vae.z_dim)
        if self.denoiser.config.in_channels != expected:
            raise FlowrlError(
                f"transformer in_channels ({self.denoiser.config.in_channels}) != {expected} "
                f"({self._in_channels_rule})", where=f"{where}.path",
                hint="the pipeline's transformer and VAE do not belong together",
            )
        f_lat = (config.num_frames - 1) // self.vae_scale_temporal + 1
        h, w = config.height // self.vae_scale, config.width // self.vae_scale
        self.latent_shape = (channels, f_lat, h, w)
        self.image_seq_len = (f_lat // patch[0]) * (h // patch[1]) * (w // patch[2])
        self.uses_cfg = config.cfg_scale != 1.0
        # Wan 2.2 TI2V: one timestep per video token (the pipeline's config says so)
        self.expand_timesteps = bool(self.pipe.config.get("expand_timesteps", False))

    #: how the transformer's input channels follow from the VAE's, for the error above
    _in_channels_rule = "the VAE's z_dim"

    def _transformer_in_channels(self, z_dim: int) -> int:
        """The transformer's input channels for latents of ``z_dim`` channels: the latents alone."""
        return z_dim

    def _lora_preset(self, preset):
        return wan_lora_targets(preset)

    @torch.no_grad()
    def encode_prompts(self, prompts):
        prompts = list(prompts)
        with self._visiting(self.pipe.text_encoder):
            embeds, neg = self.pipe.encode_prompt(
                prompt=prompts, do_classifier_free_guidance=self.uses_cfg,
                negative_prompt=[self.config.negative_prompt] * len(prompts) if self.uses_cfg else None,
                max_sequence_length=self.config.max_sequence_length, device=self.device,
            )
        out = {"prompt_embeds": embeds}
        if self.uses_cfg:
            out["negative_prompt_embeds"] = neg
        return {k: v.to(self.device) for k, v in out.items()}

    def _inputs(self, latents, t, text):
        """The transformer's ``hidden_states`` and ``timestep`` for latents at ``t = 1000 sigma``."""
        if self.expand_timesteps:  # [B, seq], as WanPipeline passes it (all tokens at the same time)
            t = t[:, None].expand(-1, self.image_seq_len)
        return latents, t

    def _velocity(self, module, latents, sigma, text):
        compute = self.dtype
        t = sigma.to(self.device, torch.float32) * 1000.0  # Wan: timestep = 1000 sigma
        x, t = self._inputs(latents.to(self.device, torch.float32), t, text)
        x = x.to(compute)
        embeds = text["prompt_embeds"]
        if self.uses_cfg:
            # One batch [uncond; cond]; the CFG combination below is the policy's velocity.
            x, t = torch.cat([x, x]), torch.cat([t, t])
            embeds = torch.cat([text["negative_prompt_embeds"], embeds])
        with self._autocast():
            out = module(hidden_states=x, timestep=t, encoder_hidden_states=embeds.to(self.device, compute),
                         return_dict=False)[0]
        out = out.to(torch.float32)
        if self.uses_cfg:
            v_u, v_c = out.chunk(2)
            out = v_u + self._cfg_weight(sigma) * (v_c - v_u)  # WanPipeline's order of operations
        return self._conditioned(out, latents, sigma, text)

    def _cfg_weight(self, sigma: torch.Tensor):
        """The CFG weight at ``sigma`` (one for every step here; Wan 2.2 A14B's depends on the expert)."""
        return self.config.cfg_scale

    def _conditioned(self, velocity, latents, sigma, text):
        """The velocity with what conditioning fixes (nothing here: text-to-video)."""
        return velocity

    def _decoder(self, vae):
        """Wan latents -> clips ``[B, F, 3, H, W]`` in [-1, 1]: ``z * std + mean`` per channel (the VAE
        config's statistics, as WanPipeline applies them), then the VAE's ``[B, 3, F, H, W]``."""
        mean, std = latent_statistics(vae, self.device)

        def to_clips(z):
            video = vae.decode((z * std + mean).to(vae.dtype), return_dict=False)[0]
            return video.permute(0, 2, 1, 3, 4)

        return to_clips

    def sigmas(self, num_steps):
        return shifted_sigmas(num_steps, self.config.flow_shift)


@dataclasses.dataclass(frozen=True)
class Wan22Config(WanConfig):
    """Wan 2.2 TI2V-5B: the ``wan`` adapter's keys, with that model's defaults."""

    #: the published pipeline's expand_timesteps, for the memory plan (the adapter reads the pipeline's own)
    per_token_timesteps: ClassVar[bool] = True

    path: str = param(
        "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
        "Hub id or local pipeline directory (model_index.json) of Wan 2.2 TI2V-5B. Apache-2.0, not gated.", path="hub",
    )
    height: int = param(
        704, "Frame height in pixels (a multiple of 32: VAE factor 16 x patch 2). Wan 2.2 5B's 720p: 704.", min=32
    )
    width: int = param(1280, "Frame width in pixels (a multiple of 32). Wan 2.2 5B: 1280.", min=32)
    num_frames: int = param(
        121, "Frames per clip, 4k + 1 (the VAE compresses time 4x after the first frame; Wan 2.2 5B: 121 at 24 fps).",
        min=1,
    )
    cfg_scale: float = param(
        5.0, "True CFG weight w: v = v_u + w (v_c - v_u) (Wan 2.2 5B: 5.0). 1 = no CFG, one forward per step.", min=0.0
    )
    flow_shift: float = param(
        5.0, "Time shift s of the sigma schedule, sigma = s u / (1 + (s - 1) u) (5.0 at 720p, as diffusers' Wan "
        "example sets it).", min=0.01,
    )
    image_to_video: bool = param(
        False, "Image-to-video: the first frame is each prompt's condition image ([prompts].condition_column), "
        "as WanImageToVideoPipeline does for this model (the image's latent frame kept clean, at timestep 0).",
    )


class Wan22Model(WanModel):
    """Wan 2.2 TI2V-5B: the Wan adapter on a 48-channel, 16x VAE with per-token timesteps (both read
    off the pipeline); with ``image_to_video``, the first frame is each prompt's condition image.

    Image-to-video follows WanImageToVideoPipeline with ``expand_timesteps``: the image, resized to
    the clip's size, is encoded by the VAE (its mode) as one latent frame and normalised
    ``(z - mean) / std``; every transformer call sees it in place of the first latent frame, whose
    tokens get timestep 0 (clean). The pipeline lets its solver move the first frame anyway and
    overwrites it before decoding; flowrl's velocity on that frame is instead the exact flow
    velocity towards the image, ``(x - c) / sigma``, so the frame ends at the image itself (the ODE
    lands on ``c`` at sigma = 0) and decode needs nothing else. That frame's velocity has no
    parameters in it: it adds nothing to a policy ratio."""

    Config = Wan22Config

    def __init__(self, config: Wan22Config, where: str = "[model] (model 'wan22')"):
        super().__init__(config, where)
        if config.image_to_video:
            if not self.expand_timesteps:
                raise FlowrlError("image_to_video needs a pipeline with expand_timesteps (Wan 2.2 TI2V-5B)",
                                  where=f"{where}.image_to_video", hint="set model.image_to_video = false")
            self.condition_size = (config.height, config.width)  # flowrl.interfaces.TakesConditionImage
            patch = tuple(self.denoiser.config.patch_size)
            f, h, w = self.latent_shape[1:]
            mask = torch.ones(f // patch[0], h // patch[1], w // patch[2])
            mask[0] = 0.0  # the first latent frame's tokens are clean
            self._token_mask = mask.flatten()

    @torch.no_grad()
    def encode_prompts(self, prompts):
        prompts = list(prompts)
        out = super().encode_prompts(prompts)
        if self.config.image_to_video:
            out["condition_latents"] = self.encode_conditions(prompts)
        return out

    @torch.no_grad()
    def encode_conditions(self, prompts) -> torch.Tensor:
        """``[B, C, 1, H/16, W/16]`` float32: each prompt's image as WanImageToVideoPipeline encodes it."""
        mean, std = latent_statistics(self.pipe.vae)
        return ((encode_condition_frame(self, prompts) - mean) / std).to(self.device)

    def _inputs(self, latents, t, text):
        if not self.config.image_to_video:
            return super()._inputs(latents, t, text)
        cond = text["condition_latents"].to(self.device, torch.float32)
        x = torch.cat([cond, latents[:, :, 1:]], dim=2)
        return x, self._token_timesteps(t)

    def _conditioned(self, velocity, latents, sigma, text):
        if not self.config.image_to_video:
            return velocity
        x0 = latents[:, :, :1].to(self.device, torch.float32)
        cond = text["condition_latents"].to(self.device, torch.float32)
        s = sigma.to(self.device, torch.float32).view(-1, 1, 1, 1, 1)
        return torch.cat([(x0 - cond) / s, velocity[:, :, 1:]], dim=2)
