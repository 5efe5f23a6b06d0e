"""SD3's memory facts, for the ``sd3`` adapter (plugins/diffusers_models/sd3.py): the published
SD3 Medium, SD3.5 Medium and SD3.5 Large configs, the activation constants a one-block replica
measures, and the adapter's :class:`flowrl.memory_plan.ModelMemory`."""

from __future__ import annotations

import functools
import json
from typing import Any

import torch

from flowrl.memory_plan import ModelMemory

from ..common import ATTENTION, FEED_FORWARD, preset_targets
from .common import (
    CLIP_L,
    T5_XXL,
    VAE16,
    BlockConstants,
    compute_and_storage_bytes,
    denoiser_counts,
    frozen_components,
    linear_shapes,
    pipeline_configs,
    saved_elements,
    vae_facts,
    with_quantization,
)

CLIP_G = {
    "_class": "CLIPTextModelWithProjection", "vocab_size": 49408, "hidden_size": 1280, "intermediate_size": 5120,
    "num_hidden_layers": 32, "num_attention_heads": 20, "max_position_embeddings": 77, "projection_dim": 1280,
}
#: stabilityai/stable-diffusion-3.5-medium's transformer
SD35M = {
    "_class": "SD3Transformer2DModel", "sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 24,
    "attention_head_dim": 64, "num_attention_heads": 24, "joint_attention_dim": 4096, "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048, "out_channels": 16, "pos_embed_max_size": 384,
    "dual_attention_layers": list(range(13)), "qk_norm": "rms_norm",
}
#: stabilityai/stable-diffusion-3.5-large's transformer
SD35L = dict(SD35M, num_layers=38, num_attention_heads=38, caption_projection_dim=2432, pos_embed_max_size=192,
             dual_attention_layers=[])
#: stabilityai/stable-diffusion-3-medium-diffusers's transformer
SD3M = dict(SD35M, pos_embed_max_size=192, dual_attention_layers=[], qk_norm=None)

#: Built-in copies of the public pipeline configs (component -> class and config).
PIPELINES = {
    "stabilityai/stable-diffusion-3.5-medium": {
        "transformer": SD35M, "text_encoder": dict(CLIP_L, _class="CLIPTextModelWithProjection"),
        "text_encoder_2": CLIP_G, "text_encoder_3": T5_XXL, "vae": VAE16,
    },
    "stabilityai/stable-diffusion-3.5-large": {
        "transformer": SD35L, "text_encoder": dict(CLIP_L, _class="CLIPTextModelWithProjection"),
        "text_encoder_2": CLIP_G, "text_encoder_3": T5_XXL, "vae": VAE16,
    },
    "stabilityai/stable-diffusion-3-medium-diffusers": {
        "transformer": SD3M, "text_encoder": dict(CLIP_L, _class="CLIPTextModelWithProjection"),
        "text_encoder_2": CLIP_G, "text_encoder_3": T5_XXL, "vae": VAE16,
    },
}


def measure_sd3_constants(cfg: dict[str, Any]) -> BlockConstants:
    from diffusers import SD3Transformer2DModel

    head = int(cfg.get("attention_head_dim", 64))
    patch = int(cfg.get("patch_size", 2))
    side, txt, width, joint = 16 * patch, 64, 2 * head, 32

    def run(layers: int, dual: bool) -> float:
        torch.manual_seed(0)
        m = SD3Transformer2DModel(
            sample_size=side, patch_size=patch, in_channels=int(cfg.get("in_channels", 16)), num_layers=layers,
            attention_head_dim=head, num_attention_heads=2, joint_attention_dim=joint, caption_projection_dim=width,
            pooled_projection_dim=32, out_channels=int(cfg.get("in_channels", 16)), pos_embed_max_size=side,
            dual_attention_layers=tuple(range(layers)) if dual else (), qk_norm=cfg.get("qk_norm"),
        )
        x = torch.randn(1, int(cfg.get("in_channels", 16)), side, side)
        n = saved_elements(m, lambda: m(
            hidden_states=x, encoder_hidden_states=torch.randn(1, txt, joint), pooled_projections=torch.randn(1, 32),
            timestep=torch.tensor([500.0]), return_dict=False,
        )[0])
        return n / (((side // patch) ** 2 + txt) * width)

    # A one-layer SD3 is all "last layer" (context_pre_only); two layers give one ordinary block.
    one = run(1, False)
    joint_block = run(2, False) - one
    dual_block = run(2, True) - run(1, True) if cfg.get("dual_attention_layers") else joint_block
    return BlockConstants({"joint": joint_block, "dual": dual_block}, max(one - joint_block, 0.0))


@functools.lru_cache(maxsize=8)
def _sd3_constants(key: str) -> BlockConstants:
    return measure_sd3_constants(json.loads(key))


def sd3_memory_spec(config):
    """:class:`flowrl.memory_plan.ModelMemory` of the ``sd3`` adapter, without weights."""
    cfgs = dict(pipeline_configs(config.path, config.revision))
    if not config.use_t5:
        cfgs.pop("text_encoder_3", None)
    t = cfgs["transformer"]
    compute, storage = compute_and_storage_bytes(config)
    scale, decode = vae_facts(cfgs.get("vae", {}), config.height, config.width, compute)
    patch = int(t.get("patch_size", 2))
    img_tokens = (config.height // scale // patch) * (config.width // scale // patch)
    txt_tokens = 77 + config.max_sequence_length
    key = json.dumps({k: t.get(k) for k in ("attention_head_dim", "patch_size", "in_channels", "qk_norm", "dual_attention_layers")})
    consts = _sd3_constants(key)
    dual = len(t.get("dual_attention_layers") or [])
    cfg_factor = 2 if config.cfg_scale != 1.0 else 1
    return with_quantization(t, config, ModelMemory(
        **denoiser_counts(t), denoiser_bytes=storage, compute_bytes=compute, reference_bytes=compute,
        frozen=frozen_components(cfgs, ("text_encoder", "text_encoder_2", "text_encoder_3", "vae"), compute),
        offload_frozen=config.offload_encoders, lora_shapes=linear_shapes(t),
        default_lora_targets=preset_targets(config.lora_preset, ATTENTION, FEED_FORWARD),
        tokens=img_tokens + txt_tokens, width=int(t["num_attention_heads"]) * int(t["attention_head_dim"]),
        blocks={"dual": dual, "joint": int(t["num_layers"]) - dual},
        per_block=consts.per_block, outside=consts.outside, forwards_per_velocity=cfg_factor,
        latent_elements=int(t["in_channels"]) * (config.height // scale) * (config.width // scale),
        text_bytes_per_prompt=cfg_factor * (txt_tokens * int(t["joint_attention_dim"]) + int(t["pooled_projection_dim"])) * compute,
        decode_bytes_per_image=decode, vae_batch=config.vae_batch_size,
        gradient_checkpointing=config.gradient_checkpointing,
        notes=[f"{img_tokens} image + {txt_tokens} text tokens per sample, x{cfg_factor} for true CFG; activation "
               f"constants measured on a one-block replica: {', '.join(f'{k} {v:.1f}' for k, v in consts.per_block.items())} "
               "widths per token"],
    ))
