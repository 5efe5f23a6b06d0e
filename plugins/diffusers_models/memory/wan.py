"""Wan's memory facts, for the ``wan`` and ``wan22`` adapters (plugins/diffusers_models/wan.py) and
``wan22_a14b`` (plugins/diffusers_models/wan_a14b.py): the published configs of
Wan-AI/Wan2.1-T2V-{1.3B,14B}-Diffusers, Wan-AI/Wan2.2-TI2V-5B-Diffusers and
Wan-AI/Wan2.2-{T2V,I2V}-A14B-Diffusers
(transformer/, text_encoder/ and vae/config.json on the hub), the activation constants a 2- and
3-block replica measures, and the adapter's :class:`flowrl.memory_plan.ModelMemory`."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from flowrl.memory_plan import ModelMemory

from .common import (
    BYTES,
    BlockConstants,
    compute_and_storage_bytes,
    denoiser_counts,
    frozen_components,
    linear_shapes,
    peak_forward_bytes,
    pipeline_configs,
    replica_constants,
    with_quantization,
)

UMT5_XXL = {
    "_class": "UMT5EncoderModel", "vocab_size": 256384, "d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64,
    "num_layers": 24, "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32,
}
WAN_VAE = {
    "_class": "AutoencoderKLWan", "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
    "attn_scales": [], "temperal_downsample": [False, True, True],
}
#: Wan-AI/Wan2.1-T2V-1.3B-Diffusers's transformer (1.42e9 parameters)
WAN21_1P3B = {
    "_class": "WanTransformer3DModel", "patch_size": [1, 2, 2], "num_attention_heads": 12, "attention_head_dim": 128,
    "in_channels": 16, "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960, "num_layers": 30,
    "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-06, "rope_max_seq_len": 1024,
}
#: Wan-AI/Wan2.1-T2V-14B-Diffusers's transformer
WAN21_14B = dict(WAN21_1P3B, num_attention_heads=40, ffn_dim=13824, num_layers=40)
# Wan-AI/Wan2.2-TI2V-5B-Diffusers (transformer/ and vae/config.json, typed in: the hub is not
# reachable from where flowrl is tested). Instantiated on the meta device with the installed
# diffusers: transformer 4,999,787,712 parameters, VAE 704,688,668. The VAE's latents_mean /
# latents_std (48 values each) do not change any count and are left out.
WAN22_VAE = {
    "_class": "AutoencoderKLWan", "base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2, "attn_scales": [], "temperal_downsample": [False, True, True], "is_residual": True,
    "in_channels": 12, "out_channels": 12, "patch_size": 2, "scale_factor_spatial": 16, "scale_factor_temporal": 4,
}
#: Wan-AI/Wan2.2-TI2V-5B-Diffusers's transformer (5.00e9 parameters)
WAN22_5B = dict(WAN21_1P3B, num_attention_heads=24, in_channels=48, out_channels=48, ffn_dim=14336)

#: Wan-AI/Wan2.2-T2V-A14B-Diffusers: two experts, each Wan 2.1 14B's architecture (the Wan 2.2
#: repository's t2v_A14B config: dim 5120, ffn 13824, 40 heads, 40 layers), and Wan 2.1's VAE
WAN22_A14B_EXPERT = WAN21_14B
#: Wan-AI/Wan2.2-I2V-A14B-Diffusers's experts: the same, reading 16 latent + 4 mask + 16 image-latent
#: channels (the Wan 2.2 repository's i2v_A14B config; no CLIP image encoder, unlike Wan 2.1 I2V)
WAN22_A14B_I2V_EXPERT = dict(WAN21_14B, in_channels=36)

#: Built-in copies of the public pipeline configs (component -> class and config).
PIPELINES = {
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers": {"transformer": WAN22_A14B_EXPERT, "transformer_2": WAN22_A14B_EXPERT,
                                         "text_encoder": UMT5_XXL, "vae": WAN_VAE},
    "Wan-AI/Wan2.2-I2V-A14B-Diffusers": {"transformer": WAN22_A14B_I2V_EXPERT, "transformer_2": WAN22_A14B_I2V_EXPERT,
                                         "text_encoder": UMT5_XXL, "vae": WAN_VAE},
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": {"transformer": WAN21_1P3B, "text_encoder": UMT5_XXL, "vae": WAN_VAE},
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": {"transformer": WAN21_14B, "text_encoder": UMT5_XXL, "vae": WAN_VAE},
    "Wan-AI/Wan2.2-TI2V-5B-Diffusers": {"transformer": WAN22_5B, "text_encoder": UMT5_XXL, "vae": WAN22_VAE},
}

#: maps of the decoder's width per 4 decoded frames that the Wan VAE's decode holds (measured; see below)
DECODE_MAPS = 15


def _wan_spatial(vae: dict[str, Any]) -> int:
    """Pixels per latent of a Wan VAE: 2 per down-sampling stage, times Wan 2.2's pixel folding."""
    return 2 ** len(vae.get("temperal_downsample", [False, True, True])) * int(vae.get("patch_size") or 1)


#: LoRA rank of the Wan replica: its rank-r float32 intermediates cost 2 r / width bf16 widths per
#: adapted layer, which a small rank keeps near the real model's (r 64 on width 1536: 0.08)
_WAN_REPLICA_RANK = 4


@functools.lru_cache(maxsize=8)
def _wan_constants(head: int, ffn_ratio: float, in_channels: int, per_token_timesteps: bool = False,
                   dtype: str = "bf16", lora_targets: tuple[str, ...] = ()) -> BlockConstants:
    """Per video token: the text enters each block only as cross-attention keys and values (64
    rows here, ``max_sequence_length`` in the real model, small beside the video tokens). With
    ``per_token_timesteps`` (Wan 2.2 TI2V) the replica gets a timestep per token, as the adapter
    passes them: every block's modulation is then per token too, not one row per sample.

    The replica (2 and 3 blocks of width 256) is run as the model is trained, since what a forward
    holds depends on it, and its bytes are measured (:func:`.common.peak_forward_bytes`) and counted in
    elements of the compute dtype:

    - in the compute dtype: Wan keeps its norms' inputs and its modulations (shift, scale, gate:
      six rows of the width, per token with per-token timesteps) in float32 inside a bf16 model,
      twice a bf16 element each, which an element count of a float32 replica cannot see;
    - with ``lora_targets``: a frozen base with a float32 LoRA on them, as
      ``flowrl.train.finetune.prepare_trainable`` makes it (a frozen Linear does not save its
      input, each float32 LoRA saves a float32 copy of its own); without, every weight trainable;
    - the peak of live bytes, not only what autograd saves: the top-level forward keeps its
      timestep projection (six rows of the width, per token with per-token timesteps) and the
      rotary tables alive until it returns."""
    from diffusers import WanTransformer3DModel

    frames, side, txt, text_dim = 2, 16, 64, 32
    width = 2 * head
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]

    def run(counts):
        from diffusers.utils import logging as diffusers_logging

        torch.manual_seed(0)
        m = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=head,
                                  in_channels=in_channels, out_channels=in_channels, text_dim=text_dim, freq_dim=32,
                                  ffn_dim=int(round(ffn_ratio * width)), num_layers=counts["block"], rope_max_seq_len=64)
        # Cast whole, as the benchmark's tracker casts the full-size model. diffusers warns that its
        # float32 modules (norms, time embedder, modulation tables) become bf16; the blocks upcast
        # their norms and modulations to float32 either way, and the time embedder's own float32
        # intermediates, which from_pretrained would keep, are small and transient.
        verbosity = diffusers_logging.get_verbosity()
        diffusers_logging.set_verbosity_error()
        try:
            m.to(torch_dtype)
        finally:
            diffusers_logging.set_verbosity(verbosity)
        m.requires_grad_(not lora_targets)
        if lora_targets:
            from peft import LoraConfig

            m.add_adapter(LoraConfig(r=_WAN_REPLICA_RANK, lora_alpha=_WAN_REPLICA_RANK,
                                     target_modules=list(lora_targets)))
            for p in m.parameters():
                if p.requires_grad:
                    p.data = p.data.float()
        x = torch.randn(1, in_channels, frames, 2 * side, 2 * side, dtype=torch_dtype)
        t = torch.full((1, frames * side * side) if per_token_timesteps else (1,), 500.0)
        text = torch.randn(1, txt, text_dim, dtype=torch_dtype)
        peak = peak_forward_bytes(m, lambda: m(hidden_states=x, timestep=t, encoder_hidden_states=text,
                                               return_dict=False)[0])
        return peak / BYTES[dtype]

    return replica_constants(run, ("block",), frames * side * side, width, base_depth=2)


def wan_video_tokens(config, t: dict[str, Any], vae: dict[str, Any]) -> tuple[int, int]:
    """``(latent frames, video tokens)`` of a Wan clip: ``F_lat = (F - 1) / 4 + 1`` and
    ``F_lat * (H / 16) * (W / 16)`` for patch (1, 2, 2) and the VAE's factor 8 (Wan 2.2 5B: 32)."""
    down = list(vae.get("temperal_downsample", [False, True, True]))
    temporal, spatial = 2 ** sum(down), _wan_spatial(vae)
    pt, ph, pw = (int(p) for p in t.get("patch_size", (1, 2, 2)))
    f_lat = (config.num_frames - 1) // temporal + 1
    return f_lat, (f_lat // pt) * (config.height // spatial // ph) * (config.width // spatial // pw)


def wan_memory_spec(config, lora_targets: list[str]):
    """:class:`flowrl.memory_plan.ModelMemory` of the ``wan`` adapter, without weights. A "sample" is
    a clip: its latents, its decode and its tokens cover all its frames."""
    t = pipeline_configs(config.path, config.revision)["transformer"]
    return with_quantization(t, config, _wan_memory_spec(config, lora_targets))


def _wan_memory_spec(config, lora_targets: list[str]):
    """:func:`wan_memory_spec` with the transformer's weights in ``dtype`` (``model.quantize`` not applied)."""
    cfgs = pipeline_configs(config.path, config.revision)
    t, vae = cfgs["transformer"], cfgs.get("vae", WAN_VAE)
    compute, storage = compute_and_storage_bytes(config)
    f_lat, video = wan_video_tokens(config, t, vae)
    spatial = _wan_spatial(vae)
    txt = config.max_sequence_length
    cfg = 2 if config.cfg_scale != 1.0 else 1
    width = int(t["num_attention_heads"]) * int(t["attention_head_dim"])
    per_token = bool(getattr(config, "per_token_timesteps", False))
    args = (int(t["attention_head_dim"]), int(t["ffn_dim"]) / width, int(t["in_channels"]), per_token, config.dtype)
    consts = _wan_constants(*args)  # full fine-tuning: every weight trainable
    lora = _wan_constants(*args, tuple(lora_targets))  # LoRA, as every shipped Wan recipe trains
    # The Wan VAE decodes one latent frame (4 frames) at a time with a cache of the causal
    # convolutions: about fifteen maps of the decoder's width for 4 frames at its last stage's
    # resolution (full; Wan 2.2's folds 2 x 2 pixels, so a quarter), plus the clip. Measured on an
    # H200 with Wan 2.1's VAE at 832 x 480 x 33 in fp32 (benchmarks/results/gpu_memory_check_h200.json:
    # the decode phase peaked 9.02 GiB above the step before it, where six maps planned 4.05 GiB with
    # the visiting VAE and the clip): cuDNN's convolution workspaces count there too. Wan 2.2's VAE
    # takes the same factor, unmeasured.
    tokens_note = (f"{video} video tokens ({f_lat} latent frames) with {txt} text tokens as cross-attention keys, "
                   f"x{cfg} for true CFG")
    vae_bytes = 4 if config.vae_dtype == "fp32" else compute
    hw = config.height * config.width
    fold = int(vae.get("patch_size") or 1) ** 2
    dec_dim = int(vae.get("decoder_base_dim") or vae.get("base_dim", 96))
    decode = DECODE_MAPS * 4 * hw // fold * dec_dim * vae_bytes + config.num_frames * 3 * hw * 4
    return ModelMemory(
        **denoiser_counts(t), denoiser_bytes=storage, compute_bytes=compute, reference_bytes=compute,
        frozen={**frozen_components(cfgs, ("text_encoder",), compute), **frozen_components(cfgs, ("vae",), vae_bytes)},
        offload_frozen=config.offload_encoders,
        lora_shapes=linear_shapes(t), default_lora_targets=list(lora_targets),
        tokens=video, width=width, blocks={"block": int(t["num_layers"])},
        # With checkpointing the plan's default applies: one block's recompute plus the outside,
        # both from the replica. The full-size tracker's figures are what benchmarks/memory_plan.py
        # checks this plan against, so none of them is used here.
        per_block=consts.per_block, outside=consts.outside, forwards_per_velocity=cfg,
        lora_per_block=lora.per_block, lora_outside=lora.outside,
        latent_elements=int(t.get("out_channels") or t["in_channels"]) * f_lat * (config.height // spatial) * (config.width // spatial),
        text_bytes_per_prompt=cfg * txt * int(t["text_dim"]) * compute,
        decode_bytes_per_image=decode, vae_batch=config.vae_batch_size,
        gradient_checkpointing=config.gradient_checkpointing,
        notes=[f"{tokens_note} per sample{'; a timestep per token' if per_token else ''}; activation constants "
               f"measured on a 2- and 3-block replica in {config.dtype} (bytes, in {config.dtype} elements): LoRA "
               f"block {lora.per_block['block']:.1f}, outside {lora.outside:.1f}; full fine-tuning block "
               f"{consts.per_block['block']:.1f}, outside {consts.outside:.1f} widths per token"],
    )


def wan_a14b_memory_spec(config, lora_targets: list[str], trained: tuple[str, ...]):
    """The ``wan`` plan with both experts held (Wan 2.2 A14B): twice the weights and the root's
    parameters; one expert runs per forward, so the activations are one expert's. ``trained``
    names the experts that train: LoRA is counted on their layers only, and full fine-tuning
    counts their parameters as trainable."""
    one = _wan_memory_spec(config, lora_targets)
    cfgs = pipeline_configs(config.path, config.revision)
    experts = [name for name in ("transformer", "transformer_2") if name in cfgs]
    shapes = {f"{name}.{layer}": shape for name in trained if name in cfgs
              for layer, shape in linear_shapes(cfgs[name]).items()}
    held = {f"{name}.{layer}": shape for name in experts for layer, shape in linear_shapes(cfgs[name]).items()}
    counts = {name: denoiser_counts(cfgs[name]) for name in experts}
    # model.quantize quantises both experts' blocks, the frozen one's too
    return with_quantization(None, config, dataclasses.replace(
        one,
        denoiser_params=sum(c["denoiser_params"] for c in counts.values()),
        outside_block_params=sum(c["outside_block_params"] for c in counts.values()),
        trainable_params=sum(counts[name]["denoiser_params"] for name in trained if name in counts),
        lora_shapes=shapes,
        notes=[*one.notes, f"two experts held ({', '.join(experts)}), one runs per step; trained: {', '.join(trained)}"],
    ), shapes=held)
