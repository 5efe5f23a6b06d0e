"""LTX-Video's memory facts, for the ``ltx`` adapter (plugins/diffusers_models/ltx.py): the
configs of Lightricks/LTX-Video (0.9.x, 2B), the activation constants a one-block replica
measures, and the adapter's :class:`flowrl.memory_plan.ModelMemory`.

The transformer's published config is diffusers' ``LTXVideoTransformer3DModel`` defaults (128
latent channels, 28 blocks of 32 x 64, T5-XXL captions); the VAE here is
``AutoencoderKLLTXVideo``'s defaults, the 0.9.0 VAE (later 0.9.x VAEs differ in their decoder,
which only changes the frozen VAE's bytes). Typed in: no hub access offline."""

from __future__ import annotations

import functools

import torch

from flowrl.memory_plan import ModelMemory

from .common import (
    T5_XXL,
    BlockConstants,
    compute_and_storage_bytes,
    denoiser_counts,
    frozen_components,
    linear_shapes,
    measured_note,
    pipeline_configs,
    replica_constants,
    saved_elements,
    with_quantization,
)

#: Lightricks/LTX-Video's transformer (1.923e9 parameters)
LTX_2B = {
    "_class": "LTXVideoTransformer3DModel", "in_channels": 128, "out_channels": 128, "patch_size": 1,
    "patch_size_t": 1, "num_attention_heads": 32, "attention_head_dim": 64, "cross_attention_dim": 2048,
    "num_layers": 28, "activation_fn": "gelu-approximate", "qk_norm": "rms_norm_across_heads",
    "norm_elementwise_affine": False, "norm_eps": 1e-6, "caption_channels": 4096, "attention_bias": True,
    "attention_out_bias": True,
}
LTX_VAE = {"_class": "AutoencoderKLLTXVideo", "latent_channels": 128, "patch_size": 4, "patch_size_t": 1}

#: Built-in copies of the public pipeline configs (component -> class and config).
PIPELINES = {
    "Lightricks/LTX-Video": {"transformer": LTX_2B, "text_encoder": T5_XXL, "vae": LTX_VAE},
}


@functools.lru_cache(maxsize=8)
def _ltx_constants(head: int, in_channels: int, per_token_timesteps: bool = False) -> BlockConstants:
    """Per video token, as for Wan: the text enters each block only as cross-attention keys. With
    ``per_token_timesteps`` (image-to-video: the condition's tokens at timestep 0) the replica gets
    a timestep per token, as the adapter passes them: every block's modulation is then per token."""
    from diffusers import LTXVideoTransformer3DModel

    frames, side, txt, caption = 2, 16, 64, 32
    width = 2 * head

    def run(counts):
        torch.manual_seed(0)
        m = LTXVideoTransformer3DModel(in_channels=in_channels, out_channels=in_channels, num_attention_heads=2,
                                       attention_head_dim=head, cross_attention_dim=width, num_layers=counts["block"],
                                       caption_channels=caption)
        x = torch.randn(1, frames * side * side, in_channels)
        t = torch.full((1, frames * side * side) if per_token_timesteps else (1,), 500.0)
        return saved_elements(m, lambda: m(hidden_states=x, timestep=t,
                                           encoder_hidden_states=torch.randn(1, txt, caption),
                                           encoder_attention_mask=torch.ones(1, txt), num_frames=frames,
                                           height=side, width=side, rope_interpolation_scale=(0.32, 32, 32),
                                           return_dict=False)[0])

    return replica_constants(run, ("block",), frames * side * side, width)


def ltx_memory_spec(config, lora_targets: list[str]):
    """:class:`flowrl.memory_plan.ModelMemory` of the ``ltx`` adapter, without weights: a "sample" is a
    clip of ``F_lat * (H/32) * (W/32)`` tokens."""
    cfgs = pipeline_configs(config.path, config.revision)
    t, vae = cfgs["transformer"], cfgs.get("vae", LTX_VAE)
    compute, storage = compute_and_storage_bytes(config)
    blocks = vae.get("spatio_temporal_scaling", [True, True, True, False])
    spatial = int(vae.get("patch_size", 4)) * 2 ** sum(blocks)
    temporal = int(vae.get("patch_size_t", 1)) * 2 ** sum(blocks)
    f_lat = (config.num_frames - 1) // temporal + 1
    p, pt = int(t.get("patch_size", 1)), int(t.get("patch_size_t", 1))
    video = (f_lat // pt) * (config.height // spatial // p) * (config.width // spatial // p)
    txt = config.max_sequence_length
    cfg = 2 if config.cfg_scale != 1.0 else 1
    width = int(t["num_attention_heads"]) * int(t["attention_head_dim"])
    per_token = bool(getattr(config, "image_to_video", False))  # the adapter's one timestep per token
    consts = _ltx_constants(int(t["attention_head_dim"]), int(t["in_channels"]), per_token)
    # The LTX VAE decodes the whole clip at once: about six maps of its first decoder width at a
    # quarter of the pixels (4 x 4 folding) for every frame, plus the clip.
    hw = config.height * config.width
    dec = list(vae.get("decoder_block_out_channels", vae.get("block_out_channels", [128, 256, 512, 512])))
    decode = 6 * config.num_frames * hw // 16 * int(dec[0]) * compute + config.num_frames * 3 * hw * 4
    return with_quantization(t, config, ModelMemory(
        **denoiser_counts(t), denoiser_bytes=storage, compute_bytes=compute, reference_bytes=compute,
        frozen=frozen_components(cfgs, ("text_encoder", "vae"), compute), offload_frozen=config.offload_encoders,
        lora_shapes=linear_shapes(t), default_lora_targets=list(lora_targets),
        tokens=video, width=width, blocks={"block": int(t["num_layers"])},
        per_block=consts.per_block, outside=consts.outside, forwards_per_velocity=cfg,
        latent_elements=video * int(t["in_channels"]),
        text_bytes_per_prompt=cfg * txt * (int(t["caption_channels"]) * compute + 1),
        decode_bytes_per_image=decode, vae_batch=config.vae_batch_size,
        gradient_checkpointing=config.gradient_checkpointing,
        notes=[measured_note(f"{video} video tokens ({f_lat} latent frames{', a timestep per token' if per_token else ''})"
                             f" with {txt} text tokens as cross-attention keys, x{cfg} for true CFG", consts)],
    ))
