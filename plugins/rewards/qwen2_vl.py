"""What the Qwen2-VL reward models (``hpsv3``, ``video_align``) share, on transformers' own classes.

- :func:`smart_resize`: Qwen2-VL's target size (sides multiples of the merged patch, area bounded).
- :func:`patchify`: frames ``[T, 3, H, W]`` to the vision tower's flattened patches and its grid.
- :func:`load_state_dict`, :func:`split_checkpoint`: a reward checkpoint's weights, mapped onto
  ``Qwen2VLModel`` names (pre-4.52 ``model.*`` / ``visual.*`` or 4.52+ ``model.language_model.*``
  / ``model.visual.*``), the reward head apart, ``lm_head.*`` skipped (never used to score).
- :class:`RewardHead`: a stack of Linear layers with ReLUs, built from the stored shapes.
- :func:`require_qwen2_vl`, :func:`build_core`: transformers >= 4.52 (or a clear message), and
  a ``Qwen2VLModel`` whose every parameter comes from the checkpoint (built on the meta device,
  so the base model's weights are never read or randomly initialised).
- :func:`read_preprocessor_config`: the base model's patch, merge and normalisation settings.
- :func:`language_forward`: the language model's hidden states with the vision embeddings
  scattered at their placeholder tokens and plain positions ``0..L-1`` on all three M-RoPE axes,
  which is what both upstream packages feed (they call the language model without positions).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from torch import nn

from flowrl.errors import FlowrlError, MissingDependencyError, require


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's target size: sides are multiples of ``factor`` and the area lies within
    ``[min_pixels, max_pixels]``, keeping the aspect ratio as closely as those allow."""
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / shrink / factor) * factor)
        w = max(factor, math.floor(width / shrink / factor) * factor)
    elif h * w < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * grow / factor) * factor
        w = math.ceil(width * grow / factor) * factor
    return h, w


def patchify(frames: torch.Tensor, patch: int, merge: int, temporal: int) -> tuple[torch.Tensor, list[int]]:
    """Normalised frames ``[T, 3, H, W]`` (or one image ``[3, H, W]``) to Qwen2-VL's flattened
    patches and their (t, h, w) grid.

    A still image is repeated ``temporal`` times along time; a clip whose frame count is not a
    multiple of ``temporal`` is padded with its last frame (as transformers' video processor
    does). Patches are ordered by time step, then merge window (row-major over windows, then
    row-major inside each ``merge x merge`` window), and each patch is flattened channel-major,
    then time, then its ``patch x patch`` pixels.
    """
    if frames.ndim == 3:
        frames = frames.unsqueeze(0).expand(temporal, *frames.shape)
    if pad := -frames.shape[0] % temporal:
        frames = torch.cat([frames, frames[-1:].expand(pad, *frames.shape[1:])])
    t, c, height, width = frames.shape
    gt, gh, gw = t // temporal, height // patch, width // patch
    x = frames.reshape(gt, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    # axes: grid_t, time, channel, window row, row in window, patch y, window col, col in window, patch x
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, c * temporal * patch * patch), [gt, gh, gw]


def load_state_dict(path: str, who: str) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors: ``.safetensors``, or a torch state dict (``.pt``, ``.pth``, ``.bin``,
    loaded with ``weights_only``; a training checkpoint's ``{"model": ...}`` wrapper is opened)."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(path, device="cpu")
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(state, dict) and isinstance(state.get("model"), dict):
            state = state["model"]  # training checkpoints wrap the weights
    if not isinstance(state, dict) or not state:
        raise FlowrlError(f"'{path}' holds no state dict", where=f"reward '{who}': checkpoint")
    return state


def split_checkpoint(
    state: dict[str, torch.Tensor], who: str, head: str = "rm_head"
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Map checkpoint keys onto ``Qwen2VLModel`` names; return (backbone, reward head) dicts."""
    backbone, head_state, unknown = {}, {}, []
    for key, value in state.items():
        if key.startswith(head + "."):
            head_state[key.removeprefix(head + ".")] = value
        elif key.startswith("model.language_model."):
            backbone["language_model." + key.removeprefix("model.language_model.")] = value
        elif key.startswith("model.visual."):
            backbone["visual." + key.removeprefix("model.visual.")] = value
        elif key.startswith("model."):
            backbone["language_model." + key.removeprefix("model.")] = value
        elif key.startswith("visual."):
            backbone[key] = value
        elif key.startswith("lm_head."):
            continue  # next-token logits: not used to score
        else:
            unknown.append(key)
    if unknown:
        raise FlowrlError(
            f"unexpected keys in the {who} checkpoint: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}",
            where=f"reward '{who}': checkpoint",
            hint=f"expected model.* / visual.* (or model.language_model.* / model.visual.*), lm_head.*, {head}.*",
        )
    if not head_state:
        raise FlowrlError(f"the checkpoint has no reward head ({head}.*)", where=f"reward '{who}': checkpoint")
    return backbone, head_state


def _module_order(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in name.split(".")]


class RewardHead(nn.Module):
    """A reward head as stored: Linear layers with ReLU between them (dropout is a no-op at
    inference). Built from the checkpoint's shapes, so HPSv3's ``hidden -> 1024 -> 16 -> 2``
    head (``rm_head.0``, ``.3``, ``.5``) and a single bias-free ``Linear`` (``rm_head.weight``,
    VideoReward's) both load."""

    def __init__(self, state: dict[str, torch.Tensor], who: str = "reward"):
        super().__init__()
        names = sorted({k.rsplit(".", 1)[0] if "." in k else "" for k in state}, key=_module_order)
        layers = []
        for name in names:
            prefix = f"{name}." if name else ""
            weight = state[prefix + "weight"]
            bias = state.get(prefix + "bias")
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
            with torch.no_grad():
                linear.weight.copy_(weight)
                if bias is not None:
                    linear.bias.copy_(bias)
            layers.append(linear)
        for a, b in zip(layers, layers[1:]):
            if a.out_features != b.in_features:
                raise FlowrlError(f"reward head layers do not chain: {a} then {b}", where=f"reward '{who}': checkpoint")
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


def require_qwen2_vl(who: str):
    """transformers with the 4.52+ Qwen2-VL layout (``Qwen2VLModel`` over ``Qwen2VLTextModel``)."""
    transformers = require("transformers", extra="rewards", purpose=f"the '{who}' reward")
    if not hasattr(transformers, "Qwen2VLModel") or not hasattr(transformers, "Qwen2VLTextModel"):
        raise MissingDependencyError(
            f"the '{who}' reward needs transformers >= 4.52 (found {transformers.__version__})",
            hint='pip install -U "transformers>=4.52", or serve the upstream package over HTTP (docs/rewards.md)',
        )
    return transformers


def build_core(transformers, model_config, backbone_state: dict[str, torch.Tensor], who: str, hint: str):
    """A ``Qwen2VLModel`` of ``model_config`` holding exactly ``backbone_state`` (the vocabulary
    size taken from its embeddings, which reward training resizes after adding tokens)."""
    text_config = getattr(model_config, "text_config", model_config)
    embed = backbone_state.get("language_model.embed_tokens.weight")
    if embed is None:
        raise FlowrlError("the checkpoint has no token embeddings (model.embed_tokens.weight)", where=f"reward '{who}': checkpoint")
    text_config.vocab_size = embed.shape[0]
    from accelerate import init_empty_weights

    # Parameters on the meta device, buffers (rotary frequencies) real: the checkpoint
    # provides every parameter, so a random init of billions of weights is skipped entirely.
    with init_empty_weights(include_buffers=False):
        core = transformers.Qwen2VLModel(model_config)
    missing, unexpected = core.load_state_dict(backbone_state, strict=False, assign=True)
    if missing or unexpected:
        raise FlowrlError(
            f"checkpoint does not match the Qwen2-VL architecture of the base model: "
            f"missing {missing[:4]}, unexpected {unexpected[:4]}",
            where=f"reward '{who}'", hint=hint,
        )
    return core


def read_preprocessor_config(base: str) -> dict:
    """The base model's ``preprocessor_config.json`` (a directory or a hub id); {} when absent,
    so the callers fall back to Qwen2-VL's own defaults."""
    if os.path.isdir(base):
        path = os.path.join(base, "preprocessor_config.json")
        return json.loads(Path(path).read_text(encoding="utf-8")) if os.path.isfile(path) else {}
    try:
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(base, "preprocessor_config.json")).read_text(encoding="utf-8"))
    except Exception:  # the defaults are Qwen2-VL's own
        return {}


def language_forward(core, ids: torch.Tensor, mask: torch.Tensor, patches: torch.Tensor, grid: torch.Tensor,
                     placeholder_id: int) -> torch.Tensor:
    """Last hidden states ``[B, L, D]``: the vision tower on ``patches`` (grid ``[N, 3]``), its
    embeddings scattered at the ``placeholder_id`` tokens, the language model on plain positions."""
    dtype = next(core.visual.parameters()).dtype
    vis = core.visual(patches.to(dtype), grid_thw=grid)
    vision_embeds = vis if isinstance(vis, torch.Tensor) else vis.pooler_output
    embeds = core.get_input_embeddings()(ids)
    if int((ids == placeholder_id).sum()) != vision_embeds.shape[0]:
        raise FlowrlError(f"{int((ids == placeholder_id).sum())} placeholder tokens for {vision_embeds.shape[0]} "
                          "vision embeddings (a prompt truncated, or holding the placeholder token itself?)")
    where = (ids == placeholder_id).unsqueeze(-1).expand_as(embeds)
    embeds = embeds.masked_scatter(where, vision_embeds.to(embeds.dtype))
    positions = torch.arange(ids.shape[1], device=ids.device)
    pos = positions.view(1, 1, -1).expand(3, ids.shape[0], -1)
    return core.language_model(inputs_embeds=embeds, attention_mask=mask, position_ids=pos).last_hidden_state
