"""FLUX.2 [klein] as a flowrl model adapter, on diffusers' Flux2KleinPipeline components.

- Latents: the VAE latent ``[C, H/8, W/8]`` (C = 32) is patchified 2x2 into ``[4C, H/16, W/16]``
  (channel order ``c, dy, dx``) and flattened row-major into tokens: ``latent_shape =
  ((H/16) * (W/16), 4 C)`` (128 channels per token). Image ids are ``(0, row, col, 0)``
  (time, height, width, layer), text ids ``(0, 0, 0, k)`` for text token ``k``.
- Timestep convention: the transformer takes ``timestep = sigma`` (it multiplies by 1000 inside;
  the pipeline passes ``t / 1000``).
- Guidance: the undistilled "base" checkpoints use true CFG against the empty prompt, ``v = v_u +
  w (v_c - v_u)`` with ``w = cfg_scale`` (the pipeline's ``guidance_scale``, 4.0); the combined
  velocity is the policy and both branches run as one batch of ``2B``. The step-distilled
  checkpoints (``is_distilled`` in the pipeline config; 4 steps) take no guidance: ``cfg_scale =
  1``. There is no guidance embedding.
- Text: Qwen3 (4B for klein-4B, 8B for klein-9B) over the prompt in its chat template (thinking
  disabled), padded to ``max_sequence_length`` tokens; the hidden states of layers 9, 18 and 27
  are concatenated per token (3 x 2560 = 7680 wide for klein-4B). Every prompt has the same
  length, and the transformer attends to the padding tokens too, as the pipeline does.
- Decode: tokens back to ``[4C, H/16, W/16]``, de-normalised with the VAE's batch-norm statistics
  (``z * sqrt(running_var + eps) + running_mean``), un-patchified to ``[C, H/8, W/8]``, VAE decode,
  ``x / 2 + 0.5`` clamped.
- Schedule: ``linspace(1, 1/N, N)`` through the pipeline's FlowMatchEuler scheduler with FLUX.2's
  empirical ``mu``, which depends on the token count AND the number of steps
  (:func:`flux2_empirical_mu`).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from flowrl.config import param
from flowrl.errors import FlowrlError

from .common import ATTENTION, DiffusersAdapter, grid_ids, preset_targets
from .memory.common import pipeline_configs
from .memory.flux2 import flux2_klein_memory_spec
from .quantize import QUANTIZE_HELP

FLUX2_FEED_FORWARD = ["ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out"]


def flux2_empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """FLUX.2's time-shift ``mu`` for ``image_seq_len`` tokens and ``num_steps`` steps.

    BFL fitted ``mu`` linearly in the token count for 10 and for 200 steps; between those it is
    linear in the step count (and extrapolated outside), and above 4300 tokens the 200-step fit
    is used for every step count.
    """
    fit_10 = 8.73809524e-05 * image_seq_len + 1.89833333
    fit_200 = 0.00016927 * image_seq_len + 0.45666666
    if image_seq_len > 4300:
        return float(fit_200)
    return float(fit_10 + (fit_200 - fit_10) * (num_steps - 10) / 190.0)


@dataclasses.dataclass(frozen=True)
class Flux2KleinConfig:
    path: str = param(
        "black-forest-labs/FLUX.2-klein-base-4B",
        "Hub id or local pipeline directory (model_index.json). klein-base-4B / klein-4B are Apache-2.0; the 9B "
        "checkpoints are gated (accept the licence on the model page and `huggingface-cli login`).", path="hub",
    )
    revision: str = param("", "Hub revision (branch, tag or commit); empty = default branch.")
    dtype: Literal["bf16", "fp16", "fp32"] = param("bf16", "Compute dtype, and storage of the text encoder and VAE.")
    denoiser_dtype: Literal["auto", "bf16", "fp16", "fp32"] = param(
        "auto", "Storage dtype of the transformer's weights; 'auto' = dtype ('fp32' for full fine-tuning)."
    )
    height: int = param(512, "Image height in pixels (a multiple of 16: VAE factor 8 x 2x2 patches).", min=16)
    width: int = param(512, "Image width in pixels (a multiple of 16).", min=16)
    cfg_scale: float = param(
        4.0,
        "True CFG weight w against the empty prompt: v = v_u + w (v_c - v_u) (the pipeline's guidance_scale; "
        "4.0 for the klein-base checkpoints). 1 = no CFG, one forward; the step-distilled klein checkpoints "
        "need 1.",
        min=1.0,
    )
    negative_prompt: str = param("", "Prompt of the unconditional branch (the pipeline always uses '').")
    max_sequence_length: int = param(512, "Qwen3 prompt tokens, padding included (the pipeline's 512).", min=1)
    gradient_checkpointing: bool = param(False, "Recompute transformer blocks in backward (saves activation memory).")
    offload_encoders: bool = param(
        True, "Keep the text encoder and VAE on the CPU; move them to the GPU only to encode / decode."
    )
    lora_preset: Literal["attention", "attention_ff"] = param(
        "attention_ff",
        "Default LoRA targets when train.lora_targets is empty: 'attention' = the double blocks' attention "
        "projections plus the single blocks' fused input (to_qkv_mlp_proj) and output (attn.to_out) "
        "projections; 'attention_ff' adds the double blocks' feed-forwards (Flow-Factory: r64/a128).",
    )
    vae_batch_size: int = param(4, "Images decoded per VAE call (bounds decode memory).", min=1)
    quantize: Literal["none", "nf4", "int8"] = param("none", QUANTIZE_HELP)

    def memory_spec(self):
        """What ``flowrl plan`` needs, from the published configuration (no weights)."""
        return flux2_klein_memory_spec(self, flux2_lora_targets(self.lora_preset, pipeline_single_blocks(self)))


def pipeline_single_blocks(config) -> int:
    """The transformer's number of single blocks, from its published or local config."""
    return int(pipeline_configs(config.path, config.revision)["transformer"]["num_single_layers"])


def flux2_lora_targets(preset: str, single_blocks: int) -> list[str]:
    """The LoRA targets of a preset: the double blocks' attention, the single blocks' fused input
    and output projections, plus the double blocks' feed-forwards for ``attention_ff``."""
    singles = [f"single_transformer_blocks.{i}.attn.to_out" for i in range(single_blocks)]
    targets = list(ATTENTION) + ["to_qkv_mlp_proj"] + singles
    return preset_targets(preset, targets, FLUX2_FEED_FORWARD)


class Flux2KleinModel(DiffusersAdapter):
    """FLUX.2 [klein] through diffusers: patchified tokens with 4-axis ids, timestep = sigma,
    true CFG (base checkpoints) or none (distilled)."""

    Config = Flux2KleinConfig
    pipeline_class_name = "Flux2KleinPipeline"

    def __init__(self, config: Flux2KleinConfig, where: str = "[model] (model 'flux2_klein')"):
        super().__init__(config, where)
        self._packed_grid("2x2 patches", self.pipe.vae.config.latent_channels, "latent_channels")
        if self.denoiser.config.guidance_embeds:
            raise FlowrlError(
                "this FLUX.2 transformer has a guidance embedding (FLUX.2 [dev]); this adapter runs FLUX.2 [klein]",
                where=f"{where}.path", hint="point model.path at a FLUX.2 [klein] pipeline (Flux2KleinPipeline)",
            )
        self.is_distilled = bool(self.pipe.config.get("is_distilled", False))
        if self.is_distilled and config.cfg_scale != 1.0:
            raise FlowrlError(
                f"this FLUX.2 [klein] checkpoint is step-distilled (is_distilled) and takes no CFG, but cfg_scale = "
                f"{config.cfg_scale}",
                where=f"{where}.cfg_scale", hint="set model.cfg_scale = 1 (or use a klein-base checkpoint for CFG)",
            )
        self.uses_cfg = config.cfg_scale > 1.0

    def _lora_preset(self, preset):
        return flux2_lora_targets(preset, len(self.denoiser.single_transformer_blocks))

    def image_ids(self) -> torch.Tensor:
        """``[seq, 4]`` ids ``(0, row, col, 0)`` of the token grid, row-major like the packing."""
        return self._device_constant("img_ids", lambda: grid_ids(self.grid, 4, dtype=torch.long).to(self.device))

    @staticmethod
    def text_ids(length: int, device) -> torch.Tensor:
        """``[L, 4]`` ids ``(0, 0, 0, k)`` of the text tokens."""
        ids = torch.zeros(length, 4, dtype=torch.long, device=device)
        ids[:, 3] = torch.arange(length, device=device)
        return ids

    # ---- text -------------------------------------------------------------------------------

    def _encode(self, prompts: list[str]) -> torch.Tensor:
        embeds, _ = self.pipe.encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=self.config.max_sequence_length,
        )
        return embeds

    @torch.no_grad()
    def encode_prompts(self, prompts):
        prompts = list(prompts)
        with self._visiting(self.pipe.text_encoder):
            out = {"prompt_embeds": self._encode(prompts)}
            if self.uses_cfg:
                neg = self._encode([self.config.negative_prompt])  # the same for every row: once
                out["negative_prompt_embeds"] = neg.repeat(len(prompts), 1, 1)
        return {k: v.to(self.device) for k, v in out.items()}

    # ---- velocity ---------------------------------------------------------------------------

    def _velocity(self, module, latents, sigma, text):
        compute = self.dtype
        x = latents.to(self.device, compute)
        t = sigma.to(self.device, torch.float32)  # FLUX.2: timestep = sigma
        embeds = text["prompt_embeds"].to(self.device)
        if self.uses_cfg:
            x, t = torch.cat([x, x]), torch.cat([t, t])
            embeds = torch.cat([text["negative_prompt_embeds"].to(self.device), embeds])
        with self._autocast():
            out = module(
                hidden_states=x, encoder_hidden_states=embeds.to(compute), timestep=t,
                img_ids=self.image_ids(), txt_ids=self.text_ids(embeds.shape[1], self.device),
                guidance=None, return_dict=False,
            )[0]
        out = out.to(torch.float32)
        return self._cfg_combined(out)[0] if self.uses_cfg else out

    # ---- latents and images -----------------------------------------------------------------

    def pack(self, vae_latents: torch.Tensor) -> torch.Tensor:
        """VAE latents ``[B, C, H/8, W/8]`` -> tokens ``[B, seq, 4C]`` (patchify 2x2, then flatten)."""
        b, c, hh, ww = vae_latents.shape
        x = vae_latents.reshape(b, c, hh // 2, 2, ww // 2, 2).permute(0, 1, 3, 5, 2, 4)
        return x.reshape(b, 4 * c, (hh // 2) * (ww // 2)).transpose(1, 2)

    def tokens_to_grid(self, latents: torch.Tensor) -> torch.Tensor:
        """Tokens ``[B, seq, 4C]`` -> patchified grid ``[B, 4C, H/16, W/16]`` (the pipeline's latents layout)."""
        b, _, c4 = latents.shape
        h, w = self.grid
        return latents.transpose(1, 2).reshape(b, c4, h, w)

    @staticmethod
    def unpatchify(grid: torch.Tensor) -> torch.Tensor:
        """Patchified grid ``[B, 4C, h, w]`` -> VAE latents ``[B, C, 2h, 2w]``."""
        b, c4, h, w = grid.shape
        x = grid.reshape(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
        return x.reshape(b, c4 // 4, 2 * h, 2 * w)

    def unpack(self, latents: torch.Tensor) -> torch.Tensor:
        """Tokens ``[B, seq, 4C]`` -> VAE latents ``[B, C, H/8, W/8]`` (inverse of :meth:`pack`)."""
        return self.unpatchify(self.tokens_to_grid(latents))

    def _decoder(self, vae):
        bn = vae.bn  # the latents are normalised per patchified channel by the VAE's batch norm
        mean = bn.running_mean.to(self.device, torch.float32).view(1, -1, 1, 1)
        var = bn.running_var.to(self.device, torch.float32).view(1, -1, 1, 1)
        std = torch.sqrt(var + vae.config.batch_norm_eps)
        return lambda z: vae.decode(self.unpatchify(self.tokens_to_grid(z) * std + mean).to(vae.dtype),
                                    return_dict=False)[0]

    def encode_images(self, images):
        """Clean latents of images in ``[0, 1]`` (:class:`flowrl.interfaces.EncodesImages`: offline data)."""
        return self._encode_with_vae(images)

    def _from_vae(self, vae, z):
        """Patchified tokens normalised by the VAE's batch-norm statistics: the inverse of :meth:`_decoder`."""
        bn = vae.bn
        mean = bn.running_mean.to(z.device, torch.float32).view(1, 1, -1)
        std = torch.sqrt(bn.running_var.to(z.device, torch.float32) + vae.config.batch_norm_eps).view(1, 1, -1)
        return (self.pack(z) - mean) / std

    def sigmas(self, num_steps):
        mu = flux2_empirical_mu(self.image_seq_len, num_steps)
        return self._scheduler_sigmas(num_steps, self.image_seq_len, flux_style=True, mu=mu)
