"""Memory facts about a FLUX / SD3 pipeline for ``flowrl plan``, without loading any weights.

- Parameter counts are exact: each component is instantiated from its config on the ``meta``
  device (no memory, no weights). Configs come from a local pipeline directory, from the
  built-in copies below of the public FLUX.1 and SD3.x configs (so ``flowrl plan`` works offline
  and without access to the gated repositories), or, for another hub id, from the hub
  (config files only).
- Activation constants are measured, not assumed: a one-block replica of the transformer (same
  classes, same head dimension and MLP ratio, 2 heads) runs one forward pass with autograd on the
  CPU, and the tensors autograd saves for backward (parameters and shared storage excluded) are
  counted per block, per token and per unit of width.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import weakref
from pathlib import Path
from typing import Any

import torch

from flowrl.compat import ensure_torchvision_importable
from flowrl.errors import FlowrlError
from flowrl.memory_plan import ModelMemory

from .common import ATTENTION, FEED_FORWARD, preset_targets
from .loading import check_local_pipeline, looks_like_local_path
from .quantize import quantized_weight_bytes

ensure_torchvision_importable()  # before diffusers imports transformers (flowrl.compat)

_CLIP_L = {
    "_class": "CLIPTextModel", "vocab_size": 49408, "hidden_size": 768, "intermediate_size": 3072,
    "num_hidden_layers": 12, "num_attention_heads": 12, "max_position_embeddings": 77, "projection_dim": 768,
}
_CLIP_G = {
    "_class": "CLIPTextModelWithProjection", "vocab_size": 49408, "hidden_size": 1280, "intermediate_size": 5120,
    "num_hidden_layers": 32, "num_attention_heads": 20, "max_position_embeddings": 77, "projection_dim": 1280,
}
_T5_XXL = {
    "_class": "T5EncoderModel", "vocab_size": 32128, "d_model": 4096, "d_ff": 10240, "d_kv": 64,
    "num_heads": 64, "num_layers": 24, "feed_forward_proj": "gated-gelu",
}
_VAE16 = {
    "_class": "AutoencoderKL", "in_channels": 3, "out_channels": 3, "latent_channels": 16,
    "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2,
    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
}
_FLUX = {
    "_class": "FluxTransformer2DModel", "patch_size": 1, "in_channels": 64, "num_layers": 19,
    "num_single_layers": 38, "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
    "pooled_projection_dim": 768, "guidance_embeds": True, "axes_dims_rope": [16, 56, 56],
}
_SD35M = {
    "_class": "SD3Transformer2DModel", "sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 24,
    "attention_head_dim": 64, "num_attention_heads": 24, "joint_attention_dim": 4096, "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048, "out_channels": 16, "pos_embed_max_size": 384,
    "dual_attention_layers": list(range(13)), "qk_norm": "rms_norm",
}
_SD35L = dict(_SD35M, num_layers=38, num_attention_heads=38, caption_projection_dim=2432, pos_embed_max_size=192,
              dual_attention_layers=[])
_SD3M = dict(_SD35M, pos_embed_max_size=192, dual_attention_layers=[], qk_norm=None)

#: Built-in copies of public pipeline configs (component -> class and config).
KNOWN: dict[str, dict[str, dict[str, Any]]] = {
    "black-forest-labs/FLUX.1-dev": {"transformer": _FLUX, "text_encoder": _CLIP_L, "text_encoder_2": _T5_XXL, "vae": _VAE16},
    "black-forest-labs/FLUX.1-schnell": {
        "transformer": dict(_FLUX, guidance_embeds=False), "text_encoder": _CLIP_L, "text_encoder_2": _T5_XXL, "vae": _VAE16,
    },
    "stabilityai/stable-diffusion-3.5-medium": {
        "transformer": _SD35M, "text_encoder": dict(_CLIP_L, _class="CLIPTextModelWithProjection"),
        "text_encoder_2": _CLIP_G, "text_encoder_3": _T5_XXL, "vae": _VAE16,
    },
    "stabilityai/stable-diffusion-3.5-large": {
        "transformer": _SD35L, "text_encoder": dict(_CLIP_L, _class="CLIPTextModelWithProjection"),
        "text_encoder_2": _CLIP_G, "text_encoder_3": _T5_XXL, "vae": _VAE16,
    },
    "stabilityai/stable-diffusion-3-medium-diffusers": {
        "transformer": _SD3M, "text_encoder": dict(_CLIP_L, _class="CLIPTextModelWithProjection"),
        "text_encoder_2": _CLIP_G, "text_encoder_3": _T5_XXL, "vae": _VAE16,
    },
}
_COMPONENTS = ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3", "vae")


def pipeline_configs(path: str, revision: str = "", where: str = "[model].path") -> dict[str, dict[str, Any]]:
    """Component configs (``_class`` + config keys) of a pipeline: local dir, built-in, or hub."""
    if looks_like_local_path(path):
        root = check_local_pipeline(path, where)
        index = json.loads((root / "model_index.json").read_text())
        out = {}
        for name in _COMPONENTS:
            entry = index.get(name)
            if not entry or entry[1] is None or not (root / name / "config.json").is_file():
                continue
            cfg = json.loads((root / name / "config.json").read_text())
            out[name] = dict(cfg, _class=entry[1])
        return out
    if path in KNOWN and not revision:
        return KNOWN[path]
    try:
        from huggingface_hub import hf_hub_download

        index = json.loads(Path(hf_hub_download(path, "model_index.json", revision=revision or None)).read_text())
        out = {}
        for name in _COMPONENTS:
            entry = index.get(name)
            if not entry or entry[1] is None:
                continue
            cfg = json.loads(Path(hf_hub_download(path, f"{name}/config.json", revision=revision or None)).read_text())
            out[name] = dict(cfg, _class=entry[1])
        return out
    except Exception as exc:  # no network, gated, unknown repo: all say the same to the user
        raise FlowrlError(
            f"cannot read the configs of '{path}' to plan its memory ({type(exc).__name__})",
            where=where,
            hint=f"built-in configs exist for: {', '.join(KNOWN)}; or point [model].path at a local pipeline "
            "directory (`huggingface-cli download ID --include '*.json'` fetches only the configs)",
        ) from exc


def _instantiate_meta(cfg: dict[str, Any]) -> torch.nn.Module:
    cls_name = cfg["_class"]
    kwargs = {k: v for k, v in cfg.items() if not k.startswith("_")}
    with torch.device("meta"):
        import diffusers
        import transformers

        if hasattr(diffusers, cls_name) and not hasattr(transformers, cls_name):
            cls = getattr(diffusers, cls_name)
            return cls.from_config(cls.extract_init_dict(kwargs)[0])
        cls = getattr(transformers, cls_name)
        config_cls = cls.config_class
        known = {k: v for k, v in kwargs.items() if k not in ("architectures", "transformers_version", "dtype", "torch_dtype")}
        return cls(config_cls(**known))


def _elements(model: torch.nn.Module) -> int:
    """Parameters plus buffers (SD3's positional-embedding table is a buffer, yet takes memory)."""
    return sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())


@dataclasses.dataclass(frozen=True)
class _MetaFacts:
    elements: int
    block_sizes: tuple[int, ...]
    linears: tuple[tuple[str, tuple[int, int]], ...]


@functools.lru_cache(maxsize=64)
def _meta_facts(key: str) -> _MetaFacts:
    """Everything the plan reads off one component's architecture, from one instantiation on the
    meta device: building a FLUX.1-dev there still runs every layer's initialiser (about 0.1 s), and
    a plan of several recipes reads the same few configs hundreds of times."""
    model = _instantiate_meta(json.loads(key))
    blocks = [m for child in model.children() if isinstance(child, torch.nn.ModuleList) and len(child) > 1 for m in child]
    return _MetaFacts(
        elements=_elements(model),
        block_sizes=tuple(sum(p.numel() for p in b.parameters()) for b in blocks),
        linears=tuple((n, (m.in_features, m.out_features)) for n, m in model.named_modules()
                      if isinstance(m, torch.nn.Linear)),
    )


def _facts(cfg: dict[str, Any]) -> _MetaFacts:
    return _meta_facts(json.dumps(cfg, sort_keys=True))


def count_parameters(cfg: dict[str, Any]) -> int:
    """The component's parameters plus buffers."""
    return _facts(cfg).elements


def denoiser_counts(cfg: dict[str, Any]) -> dict[str, int]:
    """``denoiser_params`` (parameters plus buffers), ``largest_block_params`` (the largest
    element of the transformer's block lists, the unit FSDP2 gathers) and
    ``outside_block_params`` (everything outside the blocks: the root FSDP2 keeps gathered)."""
    facts = _facts(cfg)
    return {"denoiser_params": facts.elements, "largest_block_params": max(facts.block_sizes, default=0),
            "outside_block_params": facts.elements - sum(facts.block_sizes)}


def linear_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """``{module name: (in_features, out_features)}`` of every Linear in the component."""
    return dict(_facts(cfg).linears)


# ---------------------------------------------------------------------------- activations


def _saved_elements(module: torch.nn.Module, fn) -> int:
    """Elements autograd saves for backward during ``fn()``: each storage once, parameters
    (and views of them) excluded, since they are weights, not activations."""
    for p in module.parameters():
        p.requires_grad_(True)
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: set[int] = set()
    total = [0]

    def pack(t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            total[0] += storage.nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total[0]


def _peak_forward_bytes(module: torch.nn.Module, fn) -> int:
    """The most bytes that tensors created during ``fn()`` hold at once (each storage once; the
    module's weights and buffers excluded): what torch's MemTracker files as activations in a
    forward. Besides what autograd saves, that counts what the forward keeps alive for its whole
    length without saving it (Wan 2.2's timestep projection: six rows of the width per token),
    and the dtype each tensor really has."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    own = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}
    live: dict[int, int] = {}
    now, peak = [0], [0]

    def freed(ptr: int) -> None:
        now[0] -= live.pop(ptr, 0)

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    ptr, n = storage.data_ptr(), storage.nbytes()
                    if n and ptr not in own and ptr not in live:
                        live[ptr] = n
                        now[0] += n
                        weakref.finalize(storage, freed, ptr)  # torch keeps one Python storage per live storage
            peak[0] = max(peak[0], now[0])
            return out

    with Count():
        fn()
    return peak[0]


@dataclasses.dataclass(frozen=True)
class BlockConstants:
    """Saved elements per token per unit of width: per block of each kind, and outside blocks."""

    per_block: dict[str, float]
    outside: float


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
        n = _saved_elements(m, lambda: m(
            hidden_states=x, encoder_hidden_states=torch.randn(1, txt, joint), pooled_projections=torch.randn(1, 32),
            timestep=torch.tensor([0.5]), img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(txt, 3), return_dict=False, **kw,
        )[0])
        return n / ((img + txt) * width)

    base = run(0, 0)
    return BlockConstants({"double": run(1, 0) - base, "single": run(0, 1) - base}, max(base, 0.0))


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
        n = _saved_elements(m, lambda: m(
            hidden_states=x, encoder_hidden_states=torch.randn(1, txt, joint), pooled_projections=torch.randn(1, 32),
            timestep=torch.tensor([500.0]), return_dict=False,
        )[0])
        return n / (((side // patch) ** 2 + txt) * width)

    # A one-layer SD3 is all "last layer" (context_pre_only); two layers give one ordinary block.
    one = run(1, False)
    joint_block = run(2, False) - one
    dual_block = run(2, True) - run(1, True) if cfg.get("dual_attention_layers") else joint_block
    return BlockConstants({"joint": joint_block, "dual": dual_block}, max(one - joint_block, 0.0))


# ---------------------------------------------------------------------------- memory specs

_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@functools.lru_cache(maxsize=8)
def _flux_constants(key: str) -> BlockConstants:
    return measure_flux_constants(json.loads(key))


@functools.lru_cache(maxsize=8)
def _sd3_constants(key: str) -> BlockConstants:
    return measure_sd3_constants(json.loads(key))


def _vae_facts(vae_cfg: dict[str, Any], height: int, width: int, compute: int) -> tuple[int, int]:
    """(scale factor, transient decode bytes per image). The decoder's last stage runs at full
    resolution with ``block_out_channels[0]`` channels and keeps about six such maps alive."""
    channels = list(vae_cfg.get("block_out_channels", [128, 256, 512, 512]))
    return 2 ** (len(channels) - 1), 6 * height * width * channels[0] * compute


def _frozen(cfgs, names, nbytes) -> dict[str, tuple[int, int]]:
    return {n: (count_parameters(cfgs[n]), nbytes) for n in names if n in cfgs}


def _packed_facts(config):
    """What the specs of the adapters whose transformer reads 2x2 patches of the VAE latent (FLUX.1,
    FLUX.2, Z-Image) start from: ``(pipeline configs, transformer config, compute bytes, storage
    bytes, VAE factor, decode bytes per image, image tokens)``."""
    cfgs = pipeline_configs(config.path, config.revision)
    compute, storage = _storage(config)
    scale, decode = _vae_facts(cfgs.get("vae", {}), config.height, config.width, compute)
    img = (config.height // (2 * scale)) * (config.width // (2 * scale))
    return cfgs, cfgs["transformer"], compute, storage, scale, decode, img


def flux_memory_spec(config):
    """:class:`flowrl.memory_plan.ModelMemory` of the ``flux`` adapter, without weights."""
    cfgs, t, compute, storage, scale, decode, img_tokens = _packed_facts(config)
    key = json.dumps({k: t.get(k) for k in ("attention_head_dim", "axes_dims_rope", "in_channels", "guidance_embeds")})
    consts = _flux_constants(key)
    width = int(t["num_attention_heads"]) * int(t["attention_head_dim"])
    return with_quantization(t, config, ModelMemory(
        **denoiser_counts(t), denoiser_bytes=storage, compute_bytes=compute, reference_bytes=compute,
        frozen=_frozen(cfgs, ("text_encoder", "text_encoder_2", "vae"), compute),
        offload_frozen=config.offload_encoders, lora_shapes=linear_shapes(t),
        default_lora_targets=preset_targets(config.lora_preset, ATTENTION, FEED_FORWARD),
        tokens=img_tokens + config.max_sequence_length, width=width,
        blocks={"double": int(t["num_layers"]), "single": int(t["num_single_layers"])},
        per_block=consts.per_block, outside=consts.outside, forwards_per_velocity=1,
        checkpoint_outside=29.7,  # measured: torch's MemTracker, full-size FLUX.1-dev (benchmarks/memory_plan.py)
        latent_elements=img_tokens * int(t["in_channels"]),
        text_bytes_per_prompt=(config.max_sequence_length * int(t["joint_attention_dim"]) + int(t["pooled_projection_dim"])) * compute,
        decode_bytes_per_image=decode, vae_batch=config.vae_batch_size,
        gradient_checkpointing=config.gradient_checkpointing,
        notes=[f"{img_tokens} image + {config.max_sequence_length} text tokens per sample; activation constants "
               f"measured on a one-block replica: {', '.join(f'{k} {v:.1f}' for k, v in consts.per_block.items())} "
               "widths per token"],
    ))


def sd3_memory_spec(config):
    """:class:`flowrl.memory_plan.ModelMemory` of the ``sd3`` adapter, without weights."""
    cfgs = dict(pipeline_configs(config.path, config.revision))
    if not config.use_t5:
        cfgs.pop("text_encoder_3", None)
    t = cfgs["transformer"]
    compute = _BYTES[config.dtype]
    storage = compute if config.denoiser_dtype == "auto" else _BYTES[config.denoiser_dtype]
    scale, decode = _vae_facts(cfgs.get("vae", {}), config.height, config.width, compute)
    patch = int(t.get("patch_size", 2))
    img_tokens = (config.height // scale // patch) * (config.width // scale // patch)
    txt_tokens = 77 + config.max_sequence_length
    key = json.dumps({k: t.get(k) for k in ("attention_head_dim", "patch_size", "in_channels", "qk_norm", "dual_attention_layers")})
    consts = _sd3_constants(key)
    dual = len(t.get("dual_attention_layers") or [])
    cfg_factor = 2 if config.cfg_scale != 1.0 else 1
    return ModelMemory(
        **denoiser_counts(t), denoiser_bytes=storage, compute_bytes=compute, reference_bytes=compute,
        frozen=_frozen(cfgs, ("text_encoder", "text_encoder_2", "text_encoder_3", "vae"), compute),
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
    )


# ---------------------------------------------------------------------------- newer models
# Qwen-Image (and -Edit), FLUX.2 [klein], Z-Image and FLUX.1 Kontext: the published configs (each
# model's transformer/config.json, text_encoder/config.json and vae/config.json on the hub, copied
# here so that `flowrl plan` needs no download) and one-block replicas for the activation constants.

_QWEN25_VL_7B = {
    "_class": "Qwen2_5_VLForConditionalGeneration", "vocab_size": 152064, "tie_word_embeddings": False,
    "text_config": {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                    "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 128000,
                    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "tie_word_embeddings": False},
    "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                      "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31]},
}
_QWEN_IMAGE = {
    "_class": "QwenImageTransformer2DModel", "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60,
    "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": False,
    "axes_dims_rope": [16, 56, 56],
}
_QWEN_VAE = {
    "_class": "AutoencoderKLQwenImage", "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
    "attn_scales": [], "temperal_downsample": [False, True, True],
}
_QWEN3_4B = {
    "_class": "Qwen3ForCausalLM", "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 40960, "tie_word_embeddings": True,
}
_FLUX2_KLEIN_4B = {
    "_class": "Flux2Transformer2DModel", "patch_size": 1, "in_channels": 128, "num_layers": 5, "num_single_layers": 20,
    "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 7680,
    "timestep_guidance_channels": 256, "mlp_ratio": 3.0, "axes_dims_rope": [32, 32, 32, 32], "rope_theta": 2000,
    "guidance_embeds": False,
}
_FLUX2_VAE = {
    "_class": "AutoencoderKLFlux2", "latent_channels": 32, "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2, "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
}
_ZIMAGE_TURBO = {
    "_class": "ZImageTransformer2DModel", "all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16,
    "dim": 3840, "n_layers": 30, "n_refiner_layers": 2, "n_heads": 30, "n_kv_heads": 30, "norm_eps": 1e-05,
    "qk_norm": True, "cap_feat_dim": 2560, "rope_theta": 256.0, "t_scale": 1000.0, "axes_dims": [32, 48, 48],
    "axes_lens": [1536, 512, 512],
}
_QWEN_IMAGE_PARTS = {"transformer": _QWEN_IMAGE, "text_encoder": _QWEN25_VL_7B, "vae": _QWEN_VAE}
_KLEIN_PARTS = {"transformer": _FLUX2_KLEIN_4B, "text_encoder": _QWEN3_4B, "vae": _FLUX2_VAE}
KNOWN.update({
    "Qwen/Qwen-Image": _QWEN_IMAGE_PARTS,
    "Qwen/Qwen-Image-2512": _QWEN_IMAGE_PARTS,
    "Qwen/Qwen-Image-Edit": _QWEN_IMAGE_PARTS,
    "black-forest-labs/FLUX.2-klein-base-4B": _KLEIN_PARTS,
    "black-forest-labs/FLUX.2-klein-4B": _KLEIN_PARTS,
    "Tongyi-MAI/Z-Image-Turbo": {"transformer": _ZIMAGE_TURBO, "text_encoder": dict(_QWEN3_4B, _class="Qwen3Model"),
                                 "vae": dict(_VAE16, scaling_factor=0.3611, shift_factor=0.1159)},
    "black-forest-labs/FLUX.1-Kontext-dev": KNOWN["black-forest-labs/FLUX.1-dev"],
})


def _replica_constants(run, kinds: tuple[str, ...], tokens: int, width: int, base_depth: int = 0) -> BlockConstants:
    """Saved elements per token per width: ``run(counts)`` builds a replica with ``counts[kind]``
    blocks of each kind and returns the elements one forward saves (Wan's: holds at its peak). Fitted from
    ``base_depth`` blocks of each kind and one more: a LoRA replica's first block saves less than
    the others (nothing before it needs a gradient), so its fit starts at 2 blocks, as the
    benchmark's tracker fit does."""
    start = {k: base_depth for k in kinds}
    base = run(start)
    per = {k: (run({**start, k: base_depth + 1}) - base) / (tokens * width) for k in kinds}
    outside = base / (tokens * width) - base_depth * sum(per.values())
    return BlockConstants(per, max(outside, 0.0))


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
        return _saved_elements(m, lambda: m(hidden_states=x, encoder_hidden_states=torch.randn(1, txt, joint),
                                            timestep=torch.tensor([0.5]), img_shapes=[[(1, side, side)]],
                                            return_dict=False)[0])

    return _replica_constants(run, ("joint",), side * side + txt, 2 * head)


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
        return _saved_elements(m, lambda: m(hidden_states=x, encoder_hidden_states=torch.randn(1, txt, joint),
                                            timestep=torch.tensor([0.5]), img_ids=ids.reshape(-1, len(axes)),
                                            txt_ids=txt_ids, guidance=None, return_dict=False)[0])

    return _replica_constants(run, ("double", "single"), side * side + txt, 2 * head)


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
        return _saved_elements(m, lambda: m(x, torch.tensor([0.5]), [torch.randn(txt, cap)], return_dict=False)[0][0])

    return _replica_constants(run, ("main", "refiner"), side * side + txt, dim)


def _storage(config) -> tuple[int, int]:
    compute = _BYTES[config.dtype]
    return compute, compute if config.denoiser_dtype == "auto" else _BYTES[config.denoiser_dtype]


def _measured_note(tokens: str, consts: BlockConstants) -> str:
    per = ", ".join(f"{k} {v:.1f}" for k, v in consts.per_block.items())
    return f"{tokens} per sample; activation constants measured on a one-block replica: {per} widths per token"


def qwen_image_memory_spec(config, lora_targets: list[str], *, condition_tokens: tuple[int, int] | None = None,
                           vision_tokens: int = 0):
    """:class:`flowrl.memory_plan.ModelMemory` of the ``qwen_image`` adapter; ``qwen_image_edit`` adds the
    condition's size in pixels (its latent tokens join every forward) and its vision tokens."""
    cfgs = pipeline_configs(config.path, config.revision)
    t = cfgs["transformer"]
    compute, storage = _storage(config)
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
        frozen=_frozen(cfgs, ("text_encoder", "vae"), compute), offload_frozen=config.offload_encoders,
        lora_shapes=linear_shapes(t), default_lora_targets=list(lora_targets),
        tokens=img + (condition_tokens or 0) + txt, width=int(t["num_attention_heads"]) * int(t["attention_head_dim"]),
        blocks={"joint": int(t["num_layers"])}, per_block=consts.per_block, outside=consts.outside,
        forwards_per_velocity=cfg, latent_elements=img * int(t["in_channels"]),
        inference_widths=15.4,  # measured: torch's MemTracker, full-size Qwen-Image, a group of 8 (docs/benchmarks.md)
        checkpoint_outside=37.3,  # measured likewise, LoRA on the bf16 base
        text_bytes_per_prompt=cfg * txt * (joint * compute + 1) + (condition_tokens or 0) * int(t["in_channels"]) * compute,
        decode_bytes_per_image=6 * config.height * config.width * int(vae.get("base_dim", 96)) * compute,
        vae_batch=config.vae_batch_size, gradient_checkpointing=config.gradient_checkpointing,
        notes=[_measured_note(f"{img} image + {condition_tokens or 0} condition + {txt} text tokens, x{cfg} for true CFG",
                              consts)],
    ))


def qwen_image_edit_memory_spec(config, lora_targets: list[str]):
    """The ``qwen_image_edit`` adapter: Qwen-Image plus the condition's tokens, and the condition's
    vision tokens in the text (Qwen2-VL: one per 28 x 28 pixels)."""
    ch, cw = config.condition_height or config.height, config.condition_width or config.width
    vision = max(round(ch / 28), 1) * max(round(cw / 28), 1)
    return qwen_image_memory_spec(config, lora_targets, condition_tokens=(ch, cw), vision_tokens=vision + 2)


def flux2_klein_memory_spec(config, lora_targets: list[str]):
    """:class:`flowrl.memory_plan.ModelMemory` of the ``flux2_klein`` adapter, without weights."""
    cfgs, t, compute, storage, scale, decode, img = _packed_facts(config)
    txt = config.max_sequence_length
    cfg = 2 if config.cfg_scale != 1.0 else 1
    consts = _flux2_constants(int(t["attention_head_dim"]), tuple(t["axes_dims_rope"]), int(t["in_channels"]),
                              float(t.get("mlp_ratio", 3.0)))
    return with_quantization(t, config, ModelMemory(
        **denoiser_counts(t), denoiser_bytes=storage, compute_bytes=compute, reference_bytes=compute,
        frozen=_frozen(cfgs, ("text_encoder", "vae"), compute), offload_frozen=config.offload_encoders,
        lora_shapes=linear_shapes(t), default_lora_targets=list(lora_targets),
        tokens=img + txt, width=int(t["num_attention_heads"]) * int(t["attention_head_dim"]),
        blocks={"double": int(t["num_layers"]), "single": int(t["num_single_layers"])},
        per_block=consts.per_block, outside=consts.outside, forwards_per_velocity=cfg,
        latent_elements=img * int(t["in_channels"]),
        inference_widths=49.7,  # measured: torch's MemTracker, full-size FLUX.2 [klein] (its 27648-wide fused projection)
        checkpoint_outside=48.7,  # measured likewise, LoRA on an NF4 base
        text_bytes_per_prompt=cfg * txt * int(t["joint_attention_dim"]) * compute,
        decode_bytes_per_image=decode, vae_batch=config.vae_batch_size,
        gradient_checkpointing=config.gradient_checkpointing,
        notes=[_measured_note(f"{img} image + {txt} text tokens, x{cfg} for true CFG", consts)],
    ))


def zimage_memory_spec(config, lora_targets: list[str]):
    """:class:`flowrl.memory_plan.ModelMemory` of the ``zimage`` adapter, without weights."""
    cfgs, t, compute, storage, scale, decode, img = _packed_facts(config)
    txt = config.max_sequence_length
    pad = lambda n: -(-n // 32) * 32  # noqa: E731  # the transformer pads both sequences to multiples of 32
    cfg = 2 if config.cfg_scale > 0 else 1
    axes = tuple(int(a) for a in t["axes_dims"])
    consts = _zimage_constants(axes, int(t["in_channels"]))
    return with_quantization(t, config, ModelMemory(
        **denoiser_counts(t), denoiser_bytes=storage, compute_bytes=compute, reference_bytes=compute,
        frozen=_frozen(cfgs, ("text_encoder", "vae"), compute), offload_frozen=config.offload_encoders,
        lora_shapes=linear_shapes(t), default_lora_targets=list(lora_targets),
        tokens=pad(img) + pad(txt), width=int(t["dim"]),
        blocks={"main": int(t["n_layers"]), "refiner": int(t["n_refiner_layers"])},
        per_block=consts.per_block, outside=consts.outside, forwards_per_velocity=cfg,
        latent_elements=int(t["in_channels"]) * (config.height // scale) * (config.width // scale),
        text_bytes_per_prompt=cfg * (txt * int(t["cap_feat_dim"]) * compute + 8),
        decode_bytes_per_image=decode, vae_batch=config.vae_batch_size,
        gradient_checkpointing=config.gradient_checkpointing,
        notes=[_measured_note(f"{img} image + up to {txt} text tokens, x{cfg} for CFG", consts)],
    ))


def kontext_memory_spec(config):
    """The ``flux_kontext`` adapter: FLUX.1 plus the condition's tokens in every forward."""
    spec = flux_memory_spec(config)
    ch, cw = config.condition_height or config.height, config.condition_width or config.width
    img = spec.tokens - config.max_sequence_length
    step = round((config.height * config.width / img) ** 0.5)  # pixels per token side
    cond = (ch // step) * (cw // step)
    channels = spec.latent_elements // max(img, 1)
    spec.tokens += cond
    spec.text_bytes_per_prompt += cond * channels * spec.compute_bytes
    spec.notes.append(f"+ {cond} condition-image tokens per sample")
    return spec


def with_quantization(t: dict[str, Any], config, spec: ModelMemory) -> ModelMemory:
    """``spec`` with the denoiser's bytes for a quantised base (``model.quantize``): the block
    Linear weights in bitsandbytes' storage (:func:`quantize.storage_model`), the rest in dtype."""
    kind = getattr(config, "quantize", "none")
    if kind == "none":
        return spec
    qbytes, qparams = quantized_weight_bytes(linear_shapes(t), kind)
    spec.denoiser_weight_bytes = qbytes + (spec.denoiser_params - qparams) * spec.compute_bytes
    spec.notes.append(f"quantised base ({kind}, bitsandbytes): {qparams / 1e9:.3f}e9 block weights at "
                      f"{qbytes / qparams:.4f} B each, {(spec.denoiser_params - qparams) / 1e6:.1f}e6 others at "
                      f"{spec.compute_bytes} B")
    return spec


# ---------------------------------------------------------------------------- Wan 2.1 (video)
# The published configs of Wan-AI/Wan2.1-T2V-{1.3B,14B}-Diffusers (transformer/, text_encoder/ and
# vae/config.json on the hub).

_UMT5_XXL = {
    "_class": "UMT5EncoderModel", "vocab_size": 256384, "d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64,
    "num_layers": 24, "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32,
}
_WAN_VAE = {
    "_class": "AutoencoderKLWan", "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
    "attn_scales": [], "temperal_downsample": [False, True, True],
}
_WAN21_1P3B = {
    "_class": "WanTransformer3DModel", "patch_size": [1, 2, 2], "num_attention_heads": 12, "attention_head_dim": 128,
    "in_channels": 16, "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960, "num_layers": 30,
    "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-06, "rope_max_seq_len": 1024,
}
_WAN21_14B = dict(_WAN21_1P3B, num_attention_heads=40, ffn_dim=13824, num_layers=40)
# Wan-AI/Wan2.2-TI2V-5B-Diffusers (transformer/ and vae/config.json, typed in: the hub is not
# reachable from where flowrl is tested). Instantiated on the meta device with the installed
# diffusers: transformer 4,999,787,712 parameters, VAE 704,688,668. The VAE's latents_mean /
# latents_std (48 values each) do not change any count and are left out.
_WAN22_VAE = {
    "_class": "AutoencoderKLWan", "base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2, "attn_scales": [], "temperal_downsample": [False, True, True], "is_residual": True,
    "in_channels": 12, "out_channels": 12, "patch_size": 2, "scale_factor_spatial": 16, "scale_factor_temporal": 4,
}
_WAN22_5B = dict(_WAN21_1P3B, num_attention_heads=24, in_channels=48, out_channels=48, ffn_dim=14336)
KNOWN.update({
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": {"transformer": _WAN21_1P3B, "text_encoder": _UMT5_XXL, "vae": _WAN_VAE},
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": {"transformer": _WAN21_14B, "text_encoder": _UMT5_XXL, "vae": _WAN_VAE},
    "Wan-AI/Wan2.2-TI2V-5B-Diffusers": {"transformer": _WAN22_5B, "text_encoder": _UMT5_XXL, "vae": _WAN22_VAE},
})


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
    holds depends on it, and its bytes are measured (:func:`_peak_forward_bytes`) and counted in
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
        peak = _peak_forward_bytes(m, lambda: m(hidden_states=x, timestep=t, encoder_hidden_states=text,
                                                return_dict=False)[0])
        return peak / _BYTES[dtype]

    return _replica_constants(run, ("block",), frames * side * side, width, base_depth=2)


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
    cfgs = pipeline_configs(config.path, config.revision)
    t, vae = cfgs["transformer"], cfgs.get("vae", _WAN_VAE)
    compute, storage = _storage(config)
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
    # convolutions: about six maps of the decoder's width for 4 frames at its last stage's
    # resolution (full; Wan 2.2's folds 2 x 2 pixels, so a quarter), plus the clip.
    tokens_note = (f"{video} video tokens ({f_lat} latent frames) with {txt} text tokens as cross-attention keys, "
                   f"x{cfg} for true CFG")
    vae_bytes = 4 if config.vae_dtype == "fp32" else compute
    hw = config.height * config.width
    fold = int(vae.get("patch_size") or 1) ** 2
    dec_dim = int(vae.get("decoder_base_dim") or vae.get("base_dim", 96))
    decode = 6 * 4 * hw // fold * dec_dim * vae_bytes + config.num_frames * 3 * hw * 4
    return ModelMemory(
        **denoiser_counts(t), denoiser_bytes=storage, compute_bytes=compute, reference_bytes=compute,
        frozen={**_frozen(cfgs, ("text_encoder",), compute), **_frozen(cfgs, ("vae",), vae_bytes)},
        offload_frozen=config.offload_encoders,
        lora_shapes=linear_shapes(t), default_lora_targets=list(lora_targets),
        tokens=video, width=width, blocks={"block": int(t["num_layers"])},
        # With checkpointing the plan's default applies: one block's recompute plus the outside,
        # both from the replica. The full-size tracker's figures are what benchmarks/memory_plan.py
        # checks this plan against, so none of them is used here.
        per_block=consts.per_block, outside=consts.outside, forwards_per_velocity=cfg,
        lora_per_block=lora.per_block, lora_outside=lora.outside,
        latent_elements=int(t["in_channels"]) * f_lat * (config.height // spatial) * (config.width // spatial),
        text_bytes_per_prompt=cfg * txt * int(t["text_dim"]) * compute,
        decode_bytes_per_image=decode, vae_batch=config.vae_batch_size,
        gradient_checkpointing=config.gradient_checkpointing,
        notes=[f"{tokens_note} per sample{'; a timestep per token' if per_token else ''}; activation constants "
               f"measured on a 2- and 3-block replica in {config.dtype} (bytes, in {config.dtype} elements): LoRA "
               f"block {lora.per_block['block']:.1f}, outside {lora.outside:.1f}; full fine-tuning block "
               f"{consts.per_block['block']:.1f}, outside {consts.outside:.1f} widths per token"],
    )


# ---------------------------------------------------------------------------- LTX-Video
# Lightricks/LTX-Video (0.9.x, 2B): the transformer's published config is diffusers'
# LTXVideoTransformer3DModel defaults (128 latent channels, 28 blocks of 32 x 64, T5-XXL captions);
# the VAE here is AutoencoderKLLTXVideo's defaults, the 0.9.0 VAE (later 0.9.x VAEs differ in
# their decoder, which only changes the frozen VAE's bytes). Typed in: no hub access offline.

_LTX_2B = {
    "_class": "LTXVideoTransformer3DModel", "in_channels": 128, "out_channels": 128, "patch_size": 1,
    "patch_size_t": 1, "num_attention_heads": 32, "attention_head_dim": 64, "cross_attention_dim": 2048,
    "num_layers": 28, "activation_fn": "gelu-approximate", "qk_norm": "rms_norm_across_heads",
    "norm_elementwise_affine": False, "norm_eps": 1e-6, "caption_channels": 4096, "attention_bias": True,
    "attention_out_bias": True,
}
_LTX_VAE = {"_class": "AutoencoderKLLTXVideo", "latent_channels": 128, "patch_size": 4, "patch_size_t": 1}
KNOWN["Lightricks/LTX-Video"] = {"transformer": _LTX_2B, "text_encoder": _T5_XXL, "vae": _LTX_VAE}


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
        return _saved_elements(m, lambda: m(hidden_states=x, timestep=t,
                                            encoder_hidden_states=torch.randn(1, txt, caption),
                                            encoder_attention_mask=torch.ones(1, txt), num_frames=frames,
                                            height=side, width=side, rope_interpolation_scale=(0.32, 32, 32),
                                            return_dict=False)[0])

    return _replica_constants(run, ("block",), frames * side * side, width)


def ltx_memory_spec(config, lora_targets: list[str]):
    """:class:`flowrl.memory_plan.ModelMemory` of the ``ltx`` adapter, without weights: a "sample" is a
    clip of ``F_lat * (H/32) * (W/32)`` tokens."""
    cfgs = pipeline_configs(config.path, config.revision)
    t, vae = cfgs["transformer"], cfgs.get("vae", _LTX_VAE)
    compute, storage = _storage(config)
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
    return ModelMemory(
        **denoiser_counts(t), denoiser_bytes=storage, compute_bytes=compute, reference_bytes=compute,
        frozen=_frozen(cfgs, ("text_encoder", "vae"), compute), offload_frozen=config.offload_encoders,
        lora_shapes=linear_shapes(t), default_lora_targets=list(lora_targets),
        tokens=video, width=width, blocks={"block": int(t["num_layers"])},
        per_block=consts.per_block, outside=consts.outside, forwards_per_velocity=cfg,
        latent_elements=video * int(t["in_channels"]),
        text_bytes_per_prompt=cfg * txt * (int(t["caption_channels"]) * compute + 1),
        decode_bytes_per_image=decode, vae_batch=config.vae_batch_size,
        gradient_checkpointing=config.gradient_checkpointing,
        notes=[_measured_note(f"{video} video tokens ({f_lat} latent frames{', a timestep per token' if per_token else ''})"
                              f" with {txt} text tokens as cross-attention keys, x{cfg} for true CFG", consts)],
    )
