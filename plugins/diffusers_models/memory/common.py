"""What every model family's memory facts are built from: pipeline configs, parameter counts on
the ``meta`` device, activation measurement on small replicas, and the pieces of a
:class:`flowrl.memory_plan.ModelMemory` that several families share.

- Parameter counts are exact: each component is instantiated from its config on the ``meta``
  device (no memory, no weights). Configs come from a local pipeline directory, from the
  built-in copies of public configs (:data:`KNOWN`: each family module's ``PIPELINES``, so that
  ``flowrl plan`` works offline and without access to gated repositories), or, for another hub
  id, from the hub (config files only).
- Activation constants are measured, not assumed: a small replica of the transformer (same
  classes, same head dimension and MLP ratio, 2 heads) runs a forward pass with autograd on the
  CPU, and the tensors autograd saves for backward (parameters and shared storage excluded) are
  counted per block, per token and per unit of width (:func:`saved_elements`,
  :func:`replica_constants`).
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

from ..loading import check_local_pipeline, looks_like_local_path
from ..quantize import quantized_weight_bytes

ensure_torchvision_importable()  # before diffusers imports transformers (flowrl.compat)

# ---------------------------------------------------------------------------- shared components
# Published configs of components that several pipelines share.

CLIP_L = {
    "_class": "CLIPTextModel", "vocab_size": 49408, "hidden_size": 768, "intermediate_size": 3072,
    "num_hidden_layers": 12, "num_attention_heads": 12, "max_position_embeddings": 77, "projection_dim": 768,
}
T5_XXL = {
    "_class": "T5EncoderModel", "vocab_size": 32128, "d_model": 4096, "d_ff": 10240, "d_kv": 64,
    "num_heads": 64, "num_layers": 24, "feed_forward_proj": "gated-gelu",
}
#: the 16-channel VAE of FLUX.1, SD3.x and Z-Image
VAE16 = {
    "_class": "AutoencoderKL", "in_channels": 3, "out_channels": 3, "latent_channels": 16,
    "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2,
    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
}
#: the text encoder of FLUX.2 [klein] 4B (a causal LM) and of Z-Image (its ``Qwen3Model``)
QWEN3_4B = {
    "_class": "Qwen3ForCausalLM", "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 40960, "tie_word_embeddings": True,
}

# ---------------------------------------------------------------------------- pipeline configs

#: Built-in copies of public pipeline configs (hub id -> component -> class and config): every
#: family module's ``PIPELINES``, gathered by this package's ``__init__`` in a fixed order.
KNOWN: dict[str, dict[str, dict[str, Any]]] = {}
_COMPONENTS = ("transformer", "transformer_2", "text_encoder", "text_encoder_2", "text_encoder_3", "vae")


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


# ---------------------------------------------------------------------------- parameter counts


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


def saved_elements(module: torch.nn.Module, fn) -> int:
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


def peak_forward_bytes(module: torch.nn.Module, fn) -> int:
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


def replica_constants(run, kinds: tuple[str, ...], tokens: int, width: int, base_depth: int = 0) -> BlockConstants:
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


def measured_note(tokens: str, consts: BlockConstants) -> str:
    per = ", ".join(f"{k} {v:.1f}" for k, v in consts.per_block.items())
    return f"{tokens} per sample; activation constants measured on a one-block replica: {per} widths per token"


# ---------------------------------------------------------------------------- pieces of a spec

#: bytes of an element of each of the recipes' dtypes
BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def compute_and_storage_bytes(config) -> tuple[int, int]:
    """Bytes of an element in the compute dtype (``dtype``) and in the denoiser's storage
    (``denoiser_dtype``; ``auto``: the compute dtype)."""
    compute = BYTES[config.dtype]
    return compute, compute if config.denoiser_dtype == "auto" else BYTES[config.denoiser_dtype]


def vae_facts(vae_cfg: dict[str, Any], height: int, width: int, compute: int) -> tuple[int, int]:
    """(scale factor, transient decode bytes per image). The decoder's last stage runs at full
    resolution with ``block_out_channels[0]`` channels and keeps about six such maps alive."""
    channels = list(vae_cfg.get("block_out_channels", [128, 256, 512, 512]))
    return 2 ** (len(channels) - 1), 6 * height * width * channels[0] * compute


def frozen_components(cfgs, names, nbytes) -> dict[str, tuple[int, int]]:
    """``{component: (parameters, bytes each)}`` of the frozen ``names`` the pipeline has."""
    return {n: (count_parameters(cfgs[n]), nbytes) for n in names if n in cfgs}


def packed_facts(config):
    """What the specs of the adapters whose transformer reads 2x2 patches of the VAE latent (FLUX.1,
    FLUX.2, Z-Image) start from: ``(pipeline configs, transformer config, compute bytes, storage
    bytes, VAE factor, decode bytes per image, image tokens)``."""
    cfgs = pipeline_configs(config.path, config.revision)
    compute, storage = compute_and_storage_bytes(config)
    scale, decode = vae_facts(cfgs.get("vae", {}), config.height, config.width, compute)
    img = (config.height // (2 * scale)) * (config.width // (2 * scale))
    return cfgs, cfgs["transformer"], compute, storage, scale, decode, img


def with_quantization(t: dict[str, Any] | None, config, spec: ModelMemory,
                      shapes: dict[str, tuple[int, int]] | None = None) -> ModelMemory:
    """``spec`` with the denoiser's bytes for a quantised base (``model.quantize``): the block
    Linear weights in bitsandbytes' storage (:func:`quantize.storage_model`), the rest in dtype.
    The Linear layers are those of the transformer config ``t``, or ``shapes`` (name -> (in, out))
    for a denoiser of several transformers (Wan 2.2 A14B's two experts)."""
    kind = getattr(config, "quantize", "none")
    if kind == "none":
        return spec
    qbytes, qparams = quantized_weight_bytes(linear_shapes(t) if shapes is None else shapes, kind)
    spec.denoiser_weight_bytes = qbytes + (spec.denoiser_params - qparams) * spec.compute_bytes
    spec.notes.append(f"quantised base ({kind}, bitsandbytes): {qparams / 1e9:.3f}e9 block weights at "
                      f"{qbytes / qparams:.4f} B each, {(spec.denoiser_params - qparams) / 1e6:.1f}e6 others at "
                      f"{spec.compute_bytes} B")
    return spec
