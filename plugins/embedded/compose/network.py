"""The compositional model's network: the embedded model's pieces (word tokenizer, text encoder,
lossless pixel "VAE", FLUX packing and a diffusers ``FluxTransformer2DModel``) with the compositional
grammar's vocabulary and two double-stream blocks instead of one, for the binding of colours to
shapes and of shapes to places. Same 32 x 32 canvas, so the same ``[64, 48]`` token latent and the
same adapter code path as ``embedded``."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..network import EmbeddedT2I, load_model, save_model
from .grammar import MAX_WORDS, VOCAB

WEIGHTS_DIR = Path(__file__).resolve().parents[1] / "weights"
WEIGHTS_PATH = WEIGHTS_DIR / "compose.safetensors"

COMPOSE_TRANSFORMER_CONFIG = dict(
    patch_size=1, in_channels=48, out_channels=48, num_layers=2, num_single_layers=2, attention_head_dim=32,
    num_attention_heads=4, joint_attention_dim=64, pooled_projection_dim=64, guidance_embeds=False,
    axes_dims_rope=[8, 12, 12],
)
COMPOSE_TEXT_CONFIG = dict(max_length=MAX_WORDS + 1, dim=64)


class ComposeT2I(EmbeddedT2I):
    """The embedded network with the compositional grammar's vocabulary and depth."""

    def __init__(self, transformer_config: dict | None = None, text_config: dict | None = None, vocab=None):
        super().__init__(transformer_config or COMPOSE_TRANSFORMER_CONFIG, text_config or COMPOSE_TEXT_CONFIG,
                         vocab or VOCAB)


def save_compose_weights(model: ComposeT2I, out_dir: str | os.PathLike, extra: dict | None = None) -> Path:
    return save_model(model, out_dir, WEIGHTS_PATH.name, extra)


def load_compose_pretrained(path: str | os.PathLike | None = None, device: str | torch.device = "cpu") -> ComposeT2I:
    """The shipped weights (offline), or those at ``path`` (the safetensors file or its folder)."""
    return load_model(ComposeT2I, path, WEIGHTS_PATH, device)
