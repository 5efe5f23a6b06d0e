"""FLUX.2 [klein]'s memory facts, for the ``flux2_klein`` adapter (plugins/diffusers_models/flux2.py):
the published configs of the 4B models (the hub's transformer/, text_encoder/ and vae/config.json,
copied so that ``flowrl plan`` needs no download), the activation constants a one-block replica
measures, and the adapter's :class:`flowrl.memory_plan.ModelMemory`."""

from __future__ import annotations

import functools

import torch

from flowrl.memory_plan import ModelMemory

from .common import (
    QWEN3_4B,
    BlockConstants,
    denoiser_counts,
    frozen_components,
    linear_shapes,
    measured_note,
    packed_facts,
    replica_constants,
    saved_elements,
    with_quantization,
)

#: black-forest-labs/FLUX.2-klein-4B's transformer (text encoder Qwen3-4B: joint_attention_dim =
#: 3 layers x 2560)
FLUX2_KLEIN_4B = {
    "_class": "Flux2Transformer2DModel", "patch_size": 1, "in_channels": 128, "num_layers": 5, "num_single_layers": 20,
    "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 7680,
    "timestep_guidance_channels": 256, "mlp_ratio": 3.0, "axes_dims_rope": [32, 32, 32, 32], "rope_theta": 2000,
    "eps": 1e-6, "guidance_embeds": False,
}
FLUX2_VAE = {
    "_class": "AutoencoderKLFlux2", "latent_channels": 32, "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2, "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
}
_PARTS = {"transformer": FLUX2_KLEIN_4B, "text_encoder": QWEN3_4B, "vae": FLUX2_VAE}

#: Built-in copies of the public pipeline configs (component -> class and config).
PIPELINES = {
    "black-forest-labs/FLUX.2-klein-base-4B": _PARTS,
    "black-forest-labs/FLUX.2-klein-4B": _PARTS,
}

#: measured: torch's MemTracker, full-size FLUX.2 [klein] (its 27648-wide fused projection): the
#: no-grad forward's live widths per token
INFERENCE_WIDTHS = 49.7
#: measured likewise, LoRA on an NF4 base: saved widths per token outside the blocks with
#: gradient checkpointing
CHECKPOINT_OUTSIDE = 48.7


@functools.lru_cache(maxsize=8)
def _flux2_constants(head: int, axes: tuple[int, ...], in_channels: int, mlp_ratio: float) -> BlockConstants:
    from diffusers import Flux2Transformer2DModel

    side, txt, joint = 16, 64, 48

    def run(counts):
        torch.manual_seed(0)
        m = Flux2Transformer2DModel(patch_size=1, in_channels=in_channels, num_layers=counts["double"],
                                    num_single_layers=counts["single"], attention_head_dim=head, num_attention_heads=2,
                                    joint_attention_dim=joint, timestep_guidance_channels=32, mlp_ratio=mlp_ratio,
                                    axes_dims_rope=axes, guidance_embeds=False)
        ids = torch.zeros(side, side, len(axes), dtype=torch.long)
        ids[..., 1] = torch.arange(side)[:, None]
        ids[..., 2] = torch.arange(side)[None, :]
        txt_ids = torch.zeros(txt, len(axes), dtype=torch.long)
        txt_ids[:, -1] = torch.arange(txt)
        x = torch.randn(1, side * side, in_channels)
        return saved_elements(m, lambda: m(hidden_states=x, encoder_hidden_states=torch.randn(1, txt, joint),
                                           timestep=torch.tensor([0.5]), img_ids=ids.reshape(-1, len(axes)),
                                           txt_ids=txt_ids, guidance=None, return_dict=False)[0])

    return replica_constants(run, ("double", "single"), side * side + txt, 2 * head)


def flux2_klein_memory_spec(config, lora_targets: list[str]):
    """:class:`flowrl.memory_plan.ModelMemory` of the ``flux2_klein`` adapter, without weights."""
    cfgs, t, compute, storage, scale, decode, img = packed_facts(config)
    txt = config.max_sequence_length
    cfg = 2 if config.cfg_scale != 1.0 else 1
    consts = _flux2_constants(int(t["attention_head_dim"]), tuple(t["axes_dims_rope"]), int(t["in_channels"]),
                              float(t.get("mlp_ratio", 3.0)))
    return with_quantization(t, config, ModelMemory(
        **denoiser_counts(t), denoiser_bytes=storage, compute_bytes=compute, reference_bytes=compute,
        frozen=frozen_components(cfgs, ("text_encoder", "vae"), compute), offload_frozen=config.offload_encoders,
        lora_shapes=linear_shapes(t), default_lora_targets=list(lora_targets),
        tokens=img + txt, width=int(t["num_attention_heads"]) * int(t["attention_head_dim"]),
        blocks={"double": int(t["num_layers"]), "single": int(t["num_single_layers"])},
        per_block=consts.per_block, outside=consts.outside, forwards_per_velocity=cfg,
        latent_elements=img * int(t["in_channels"]),
        inference_widths=INFERENCE_WIDTHS, checkpoint_outside=CHECKPOINT_OUTSIDE,
        text_bytes_per_prompt=cfg * txt * int(t["joint_attention_dim"]) * compute,
        decode_bytes_per_image=decode, vae_batch=config.vae_batch_size,
        gradient_checkpointing=config.gradient_checkpointing,
        notes=[measured_note(f"{img} image + {txt} text tokens, x{cfg} for true CFG", consts)],
    ))
