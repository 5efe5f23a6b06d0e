"""FLUX.1's memory facts, for the ``flux`` adapter (plugins/diffusers_models/flux.py): the
published FLUX.1-dev and -schnell configs, the activation constants a one-block replica
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
    denoiser_counts,
    frozen_components,
    linear_shapes,
    packed_facts,
    saved_elements,
    with_quantization,
)

#: black-forest-labs/FLUX.1-dev's transformer/config.json (11.9e9 parameters)
FLUX1_DEV = {
    "_class": "FluxTransformer2DModel", "patch_size": 1, "in_channels": 64, "num_layers": 19,
    "num_single_layers": 38, "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
    "pooled_projection_dim": 768, "guidance_embeds": True, "axes_dims_rope": [16, 56, 56],
}

#: Built-in copies of the public pipeline configs (component -> class and config).
PIPELINES = {
    "black-forest-labs/FLUX.1-dev": {"transformer": FLUX1_DEV, "text_encoder": CLIP_L, "text_encoder_2": T5_XXL,
                                     "vae": VAE16},
    "black-forest-labs/FLUX.1-schnell": {
        "transformer": dict(FLUX1_DEV, guidance_embeds=False), "text_encoder": CLIP_L, "text_encoder_2": T5_XXL,
        "vae": VAE16,
    },
}

#: saved widths per token outside the blocks with gradient checkpointing, measured: torch's
#: MemTracker, full-size FLUX.1-dev (benchmarks/memory_plan.py)
CHECKPOINT_OUTSIDE = 29.7


def measure_flux_constants(cfg: dict[str, Any]) -> BlockConstants:
    from diffusers import FluxTransformer2DModel

    head = int(cfg.get("attention_head_dim", 128))
    axes = list(cfg.get("axes_dims_rope", [16, 56, 56]))
    img, txt, width = 256, 64, 2 * head
    joint = 32

    def run(double: int, single: int) -> float:
        torch.manual_seed(0)
        m = FluxTransformer2DModel(
            patch_size=1, in_channels=int(cfg.get("in_channels", 64)), num_layers=double, num_single_layers=single,
            attention_head_dim=head, num_attention_heads=2, joint_attention_dim=joint, pooled_projection_dim=32,
            guidance_embeds=bool(cfg.get("guidance_embeds", True)), axes_dims_rope=axes,
        )
        x = torch.randn(1, img, int(cfg.get("in_channels", 64)))
        side = int(img ** 0.5)
        ids = torch.zeros(side, side, 3)
        ids[..., 1] = torch.arange(side)[:, None]
        ids[..., 2] = torch.arange(side)[None, :]
        kw = {"guidance": torch.tensor([3.5])} if cfg.get("guidance_embeds", True) else {}
        n = saved_elements(m, lambda: m(
            hidden_states=x, encoder_hidden_states=torch.randn(1, txt, joint), pooled_projections=torch.randn(1, 32),
            timestep=torch.tensor([0.5]), img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(txt, 3), return_dict=False, **kw,
        )[0])
        return n / ((img + txt) * width)

    base = run(0, 0)
    return BlockConstants({"double": run(1, 0) - base, "single": run(0, 1) - base}, max(base, 0.0))


@functools.lru_cache(maxsize=8)
def _flux_constants(key: str) -> BlockConstants:
    return measure_flux_constants(json.loads(key))


def flux_memory_spec(config):
    """:class:`flowrl.memory_plan.ModelMemory` of the ``flux`` adapter, without weights."""
    cfgs, t, compute, storage, scale, decode, img_tokens = packed_facts(config)
    key = json.dumps({k: t.get(k) for k in ("attention_head_dim", "axes_dims_rope", "in_channels", "guidance_embeds")})
    consts = _flux_constants(key)
    width = int(t["num_attention_heads"]) * int(t["attention_head_dim"])
    return with_quantization(t, config, ModelMemory(
        **denoiser_counts(t), denoiser_bytes=storage, compute_bytes=compute, reference_bytes=compute,
        frozen=frozen_components(cfgs, ("text_encoder", "text_encoder_2", "vae"), compute),
        offload_frozen=config.offload_encoders, lora_shapes=linear_shapes(t),
        default_lora_targets=preset_targets(config.lora_preset, ATTENTION, FEED_FORWARD),
        tokens=img_tokens + config.max_sequence_length, width=width,
        blocks={"double": int(t["num_layers"]), "single": int(t["num_single_layers"])},
        per_block=consts.per_block, outside=consts.outside, forwards_per_velocity=1,
        checkpoint_outside=CHECKPOINT_OUTSIDE,
        latent_elements=img_tokens * int(t["in_channels"]),
        text_bytes_per_prompt=(config.max_sequence_length * int(t["joint_attention_dim"]) + int(t["pooled_projection_dim"])) * compute,
        decode_bytes_per_image=decode, vae_batch=config.vae_batch_size,
        gradient_checkpointing=config.gradient_checkpointing,
        notes=[f"{img_tokens} image + {config.max_sequence_length} text tokens per sample; activation constants "
               f"measured on a one-block replica: {', '.join(f'{k} {v:.1f}' for k, v in consts.per_block.items())} "
               "widths per token"],
    ))
