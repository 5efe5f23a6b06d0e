"""Z-Image's memory facts, for the ``zimage`` adapter (plugins/diffusers_models/zimage.py): the
published Z-Image-Turbo configs (the hub's transformer/, text_encoder/ and vae/config.json, copied
so that ``flowrl plan`` needs no download), the activation constants a one-block replica measures,
and the adapter's :class:`flowrl.memory_plan.ModelMemory`."""

from __future__ import annotations

import functools

import torch

from flowrl.memory_plan import ModelMemory

from .common import (
    QWEN3_4B,
    VAE16,
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

#: Tongyi-MAI/Z-Image-Turbo's transformer
ZIMAGE_TURBO = {
    "_class": "ZImageTransformer2DModel", "all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16,
    "dim": 3840, "n_layers": 30, "n_refiner_layers": 2, "n_heads": 30, "n_kv_heads": 30, "norm_eps": 1e-05,
    "qk_norm": True, "cap_feat_dim": 2560, "rope_theta": 256.0, "t_scale": 1000.0, "axes_dims": [32, 48, 48],
    "axes_lens": [1536, 512, 512],
}

#: Built-in copies of the public pipeline configs (component -> class and config).
PIPELINES = {
    "Tongyi-MAI/Z-Image-Turbo": {"transformer": ZIMAGE_TURBO, "text_encoder": dict(QWEN3_4B, _class="Qwen3Model"),
                                 "vae": dict(VAE16, scaling_factor=0.3611, shift_factor=0.1159)},
}


@functools.lru_cache(maxsize=8)
def _zimage_constants(head_axes: tuple[int, ...], in_channels: int) -> BlockConstants:
    from diffusers import ZImageTransformer2DModel

    side, txt, cap = 16, 64, 32
    dim = 2 * sum(head_axes)

    def run(counts):
        torch.manual_seed(0)
        m = ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=in_channels, dim=dim,
                                     n_layers=counts["main"], n_refiner_layers=counts["refiner"], n_heads=2,
                                     n_kv_heads=2, cap_feat_dim=cap, axes_dims=list(head_axes),
                                     axes_lens=[1024, 64, 64])
        x = [torch.randn(in_channels, 1, 2 * side, 2 * side)]
        return saved_elements(m, lambda: m(x, torch.tensor([0.5]), [torch.randn(txt, cap)], return_dict=False)[0][0])

    return replica_constants(run, ("main", "refiner"), side * side + txt, dim)


def zimage_memory_spec(config, lora_targets: list[str]):
    """:class:`flowrl.memory_plan.ModelMemory` of the ``zimage`` adapter, without weights."""
    cfgs, t, compute, storage, scale, decode, img = packed_facts(config)
    txt = config.max_sequence_length
    pad = lambda n: -(-n // 32) * 32  # noqa: E731  # the transformer pads both sequences to multiples of 32
    cfg = 2 if config.cfg_scale > 0 else 1
    axes = tuple(int(a) for a in t["axes_dims"])
    consts = _zimage_constants(axes, int(t["in_channels"]))
    return with_quantization(t, config, ModelMemory(
        **denoiser_counts(t), denoiser_bytes=storage, compute_bytes=compute, reference_bytes=compute,
        frozen=frozen_components(cfgs, ("text_encoder", "vae"), compute), offload_frozen=config.offload_encoders,
        lora_shapes=linear_shapes(t), default_lora_targets=list(lora_targets),
        tokens=pad(img) + pad(txt), width=int(t["dim"]),
        blocks={"main": int(t["n_layers"]), "refiner": int(t["n_refiner_layers"])},
        per_block=consts.per_block, outside=consts.outside, forwards_per_velocity=cfg,
        latent_elements=int(t["in_channels"]) * (config.height // scale) * (config.width // scale),
        text_bytes_per_prompt=cfg * (txt * int(t["cap_feat_dim"]) * compute + 8),
        decode_bytes_per_image=decode, vae_batch=config.vae_batch_size,
        gradient_checkpointing=config.gradient_checkpointing,
        notes=[measured_note(f"{img} image + up to {txt} text tokens, x{cfg} for CFG", consts)],
    ))
