"""Qwen-Image's memory facts, for the ``qwen_image`` adapter (plugins/diffusers_models/qwen_image.py)
and the ``qwen_image_edit`` one built on it (:mod:`.editing`): the published configs (the hub's
transformer/, text_encoder/ and vae/config.json, copied so that ``flowrl plan`` needs no download),
the activation constants a one-block replica measures, and the adapter's
:class:`flowrl.memory_plan.ModelMemory`."""

from __future__ import annotations

import functools

import torch

from flowrl.memory_plan import ModelMemory

from .common import (
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

QWEN25_VL_7B = {
    "_class": "Qwen2_5_VLForConditionalGeneration", "vocab_size": 152064, "tie_word_embeddings": False,
    "text_config": {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                    "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 128000,
                    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "tie_word_embeddings": False},
    "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                      "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31]},
}
#: Qwen/Qwen-Image's transformer (20.4e9 parameters)
QWEN_IMAGE = {
    "_class": "QwenImageTransformer2DModel", "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60,
    "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": False,
    "axes_dims_rope": [16, 56, 56],
}
QWEN_VAE = {
    "_class": "AutoencoderKLQwenImage", "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
    "attn_scales": [], "temperal_downsample": [False, True, True],
}
_PARTS = {"transformer": QWEN_IMAGE, "text_encoder": QWEN25_VL_7B, "vae": QWEN_VAE}

#: Built-in copies of the public pipeline configs (component -> class and config).
PIPELINES = {
    "Qwen/Qwen-Image": _PARTS,
    "Qwen/Qwen-Image-2512": _PARTS,
    "Qwen/Qwen-Image-Edit": _PARTS,
}

#: measured: torch's MemTracker, full-size Qwen-Image, a group of 8 (docs/benchmarks.md): the
#: no-grad forward's live widths per token
INFERENCE_WIDTHS = 15.4
#: measured likewise, LoRA on the bf16 base: saved widths per token outside the blocks with
#: gradient checkpointing
CHECKPOINT_OUTSIDE = 37.3


@functools.lru_cache(maxsize=8)
def _qwen_image_constants(head: int, axes: tuple[int, ...], in_channels: int) -> BlockConstants:
    from diffusers import QwenImageTransformer2DModel

    side, txt, joint = 16, 64, 32

    def run(counts):
        torch.manual_seed(0)
        m = QwenImageTransformer2DModel(patch_size=2, in_channels=in_channels, out_channels=in_channels // 4,
                                        num_layers=counts["joint"], attention_head_dim=head, num_attention_heads=2,
                                        joint_attention_dim=joint, axes_dims_rope=axes)
        x = torch.randn(1, side * side, in_channels)
        return saved_elements(m, lambda: m(hidden_states=x, encoder_hidden_states=torch.randn(1, txt, joint),
                                           timestep=torch.tensor([0.5]), img_shapes=[[(1, side, side)]],
                                           return_dict=False)[0])

    return replica_constants(run, ("joint",), side * side + txt, 2 * head)


def qwen_image_memory_spec(config, lora_targets: list[str], *, condition_tokens: tuple[int, int] | None = None,
                           vision_tokens: int = 0):
    """:class:`flowrl.memory_plan.ModelMemory` of the ``qwen_image`` adapter; ``qwen_image_edit`` adds the
    condition's size in pixels (its latent tokens join every forward) and its vision tokens."""
    cfgs = pipeline_configs(config.path, config.revision)
    t = cfgs["transformer"]
    compute, storage = compute_and_storage_bytes(config)
    vae = cfgs.get("vae", {})
    step = 2 * 2 ** len(vae.get("temperal_downsample", [False, True, True]))  # VAE factor x 2x2 packing
    img = (config.height // step) * (config.width // step)
    txt = config.max_sequence_length + vision_tokens
    cfg = 2 if config.cfg_scale != 1.0 else 1
    consts = _qwen_image_constants(int(t["attention_head_dim"]), tuple(t["axes_dims_rope"]), int(t["in_channels"]))
    joint = int(t["joint_attention_dim"])
    condition_tokens = condition_tokens and (condition_tokens[0] // step) * (condition_tokens[1] // step)
    return with_quantization(t, config, ModelMemory(
        **denoiser_counts(t), denoiser_bytes=storage, compute_bytes=compute, reference_bytes=compute,
        frozen=frozen_components(cfgs, ("text_encoder", "vae"), compute), offload_frozen=config.offload_encoders,
        lora_shapes=linear_shapes(t), default_lora_targets=list(lora_targets),
        tokens=img + (condition_tokens or 0) + txt, width=int(t["num_attention_heads"]) * int(t["attention_head_dim"]),
        blocks={"joint": int(t["num_layers"])}, per_block=consts.per_block, outside=consts.outside,
        forwards_per_velocity=cfg, latent_elements=img * int(t["in_channels"]),
        inference_widths=INFERENCE_WIDTHS, checkpoint_outside=CHECKPOINT_OUTSIDE,
        text_bytes_per_prompt=cfg * txt * (joint * compute + 1) + (condition_tokens or 0) * int(t["in_channels"]) * compute,
        decode_bytes_per_image=6 * config.height * config.width * int(vae.get("base_dim", 96)) * compute,
        vae_batch=config.vae_batch_size, gradient_checkpointing=config.gradient_checkpointing,
        notes=[measured_note(f"{img} image + {condition_tokens or 0} condition + {txt} text tokens, x{cfg} for true CFG",
                             consts)],
    ))
