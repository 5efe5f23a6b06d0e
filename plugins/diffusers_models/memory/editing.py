"""The editing models' memory facts, for the adapters of plugins/diffusers_models/editing.py:
FLUX.1 Kontext (``flux_kontext``: FLUX.1's facts, :mod:`.flux`, plus the condition's tokens) and
Qwen-Image-Edit (``qwen_image_edit``: Qwen-Image's, :mod:`.qwen_image`, plus the condition's
tokens and its vision tokens in the text)."""

from __future__ import annotations

from .flux import PIPELINES as FLUX_PIPELINES
from .flux import flux_memory_spec
from .qwen_image import qwen_image_memory_spec

#: Built-in copies of the public pipeline configs: FLUX.1 Kontext [dev] has FLUX.1-dev's
#: architecture (Qwen-Image-Edit's are Qwen-Image's, in :mod:`.qwen_image`).
PIPELINES = {
    "black-forest-labs/FLUX.1-Kontext-dev": FLUX_PIPELINES["black-forest-labs/FLUX.1-dev"],
}


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


def qwen_image_edit_memory_spec(config, lora_targets: list[str]):
    """The ``qwen_image_edit`` adapter: Qwen-Image plus the condition's tokens, and the condition's
    vision tokens in the text (Qwen2-VL: one per 28 x 28 pixels)."""
    ch, cw = config.condition_height or config.height, config.condition_width or config.width
    vision = max(round(ch / 28), 1) * max(round(cw / 28), 1)
    return qwen_image_memory_spec(config, lora_targets, condition_tokens=(ch, cw), vision_tokens=vision + 2)
