"""Image editing: FLUX.1 Kontext and Qwen-Image-Edit as flowrl model adapters.

Both generate an image from a prompt AND a condition image (the image to edit). The prompt rows
carry the condition (:class:`flowrl.prompts.PromptRow`, from ``[prompts].condition_column``); the
adapter's ``encode_prompts`` resizes it to ``condition_size``, encodes it with the VAE (the mode
of the latent distribution, as the pipelines do), normalises and packs it like the generated
latents, and returns it as ``condition_latents [B, S_c, C]`` beside the text embeddings. The
engine caches, stacks and indexes it like any embedding, so nothing in the engine changes.
``velocity`` appends the condition tokens to the noisy latent's tokens (the generated image's
first), runs the transformer, and keeps the generated image's tokens of the output.

- **FLUX.1 Kontext** (``flux_kontext``, FluxKontextPipeline): FLUX.1's conventions (timestep =
  sigma, embedded guidance, packed 2x2 tokens, the dynamic shift from the generated image's token
  count); condition tokens get image ids ``(1, row, col)`` (the generated image's are
  ``(0, row, col)``); the condition latent is ``(z - shift_factor) * scaling_factor``.
- **Qwen-Image-Edit** (``qwen_image_edit``, QwenImageEditPipeline): Qwen-Image's conventions (true
  CFG with per-token norm correction, timestep = sigma) plus: the text encoder (Qwen2.5-VL) reads
  the condition image too, inside the edit template (its first 64 tokens dropped), so the text
  embeddings hold the image's vision tokens and the prompt, and the negative prompt is encoded
  with the same image; the transformer's RoPE gets both grids, ``img_shapes = [(1, h, w),
  (1, h_c, w_c)]``; the condition latent is ``(z - latents_mean) / latents_std``.

Condition size: every row's condition is resized to the same ``condition_size`` (the engine stacks
rows), by default the generated image's size. The pipelines pick it per image: Kontext the
preferred Kontext resolution closest to the image's aspect ratio (about 1 megapixel), Qwen-Image-
Edit about 1024 x 1024 pixels at the image's aspect ratio; set ``condition_height`` /
``condition_width`` to match them (at the cost of that many more tokens per forward).
"""

from __future__ import annotations

import dataclasses

import torch

from flowrl.config import param
from flowrl.errors import FlowrlError
from flowrl.prompts import condition_of, load_condition_image

from .common import grid_ids
from .flux import FluxConfig, FluxModel
from .memory.editing import kontext_memory_spec, qwen_image_edit_memory_spec
from .qwen_image import QwenImageConfig, QwenImageModel, qwen_lora_targets

_CONDITION_HELP = (
    "Height of the condition image as the model sees it, in pixels (a multiple of 16); 0 = the generated "
    "image's height. Every condition is resized to this size."
)


def condition_size(adapter, config, step: int) -> tuple[int, int]:
    """``(height, width)`` of the condition, checked to be multiples of ``step`` pixels."""
    size = (config.condition_height or config.height, config.condition_width or config.width)
    for key, value in zip(("condition_height", "condition_width"), size):
        if value % step:
            raise FlowrlError(f"{key} = {value} is not a multiple of {step}", where=f"{adapter.where}.{key}",
                              hint=f"use a multiple of {step} (0 = the generated image's size)")
    return size


def set_condition_size(adapter, config) -> None:
    """Set ``condition_size`` (pixels, checked) and ``condition_grid`` (2x2-packed tokens) of an editing
    adapter whose generated image is set up (``vae_scale`` known)."""
    step = adapter.vae_scale * 2
    adapter.condition_size = condition_size(adapter, config, step)
    adapter.condition_grid = (adapter.condition_size[0] // step, adapter.condition_size[1] // step)


def condition_pictures(adapter, prompts, processor=None) -> list:
    """Each prompt's condition image, RGB, resized by the pipeline's own image processor (or
    ``processor``: a video pipeline's)."""
    h, w = adapter.condition_size
    processor = processor or adapter.pipe.image_processor
    out = []
    for p in prompts:
        path = condition_of(p)
        if path is None:
            raise FlowrlError(
                f"the model needs a condition image for every prompt; {str(p)!r} has none",
                where=adapter.where,
                hint="give a prompt table with a condition image column ([prompts].condition_column)",
            )
        out.append(processor.resize(load_condition_image(path), h, w))
    return out


def encode_condition_frame(adapter, prompts) -> torch.Tensor:
    """``[B, C, 1, h, w]`` float32 on the CPU, not normalised: each prompt's condition image resized
    to ``condition_size`` by the video pipeline's processor and encoded by the VAE as one latent
    frame (its mode, where the image-to-video pipelines sample): ``wan22`` and ``ltx``."""
    h, w = adapter.condition_size
    processor = adapter.pipe.video_processor
    pixels = processor.preprocess(condition_pictures(adapter, prompts, processor), height=h, width=w)
    vae = adapter.pipe.vae
    with adapter._visiting(vae):
        z = vae.encode(pixels.unsqueeze(2).to(adapter.device, vae.dtype), return_dict=False)[0].mode()
    return z.float().cpu()


# ----------------------------------------------------------------------------- FLUX.1 Kontext


@dataclasses.dataclass(frozen=True)
class FluxKontextConfig(FluxConfig):
    path: str = param(
        "black-forest-labs/FLUX.1-Kontext-dev",
        "Hub id or local pipeline directory (model_index.json). FLUX.1-Kontext-dev is gated: accept its licence on "
        "the model page and `huggingface-cli login`.", path="hub",
    )
    guidance: float = param(2.5, "Embedded guidance scale (the FLUX.1 Kontext model card uses 2.5).", min=0.0)
    condition_height: int = param(0, _CONDITION_HELP, min=0)
    condition_width: int = param(0, "Width of the condition image, in pixels (a multiple of 16); 0 = width.", min=0)

    def memory_spec(self):
        """What ``flowrl plan`` needs, from the published configuration (no weights)."""
        return kontext_memory_spec(self)


class FluxKontextModel(FluxModel):
    """FLUX.1 Kontext through diffusers: FLUX.1 with the condition image's tokens appended."""

    task = "image-to-image"  # the model card's pipeline tag (flowrl.hub)

    Config = FluxKontextConfig
    pipeline_class_name = "FluxKontextPipeline"

    def __init__(self, config: FluxKontextConfig, where: str = "[model] (model 'flux_kontext')"):
        super().__init__(config, where)
        set_condition_size(self, config)

    def condition_ids(self) -> torch.Tensor:
        """``[S_c, 3]`` ids ``(1, row, col)`` of the condition's token grid."""
        return self._device_constant("cond_ids", lambda: grid_ids(self.condition_grid, 3, first=1.0).to(self.device))

    @torch.no_grad()
    def encode_prompts(self, prompts):
        prompts = list(prompts)
        out = super().encode_prompts(prompts)
        out["condition_latents"] = self.encode_conditions(prompts)
        return out

    @torch.no_grad()
    def encode_conditions(self, prompts) -> torch.Tensor:
        """Packed condition latents ``[B, S_c, 4C]``: VAE mode, ``(z - shift) * scale``."""
        h, w = self.condition_size
        pixels = self.pipe.image_processor.preprocess(condition_pictures(self, prompts), h, w)
        vae = self.pipe.vae
        with self._visiting(vae):
            z = vae.encode(pixels.to(self.device, self.dtype), return_dict=False)[0].mode()
        return self._from_vae(vae, z).to(self.device)

    def _image_inputs(self, latents, text):
        cond = text["condition_latents"].to(self.device, latents.dtype)
        return torch.cat([latents, cond], dim=1), torch.cat([self.image_ids(), self.condition_ids()])


# ----------------------------------------------------------------------------- Qwen-Image-Edit


@dataclasses.dataclass(frozen=True)
class QwenImageEditConfig(QwenImageConfig):
    path: str = param(
        "Qwen/Qwen-Image-Edit",
        "Hub id or local pipeline directory (model_index.json): Qwen/Qwen-Image-Edit (Apache-2.0, not gated).", path="hub",
    )
    max_sequence_length: int = param(
        256, "Text tokens kept per prompt besides the condition image's vision tokens (template and prompt); the "
        "embeddings are padded to the vision tokens plus this.", min=1, max=1024,
    )
    condition_height: int = param(0, _CONDITION_HELP, min=0)
    condition_width: int = param(0, "Width of the condition image, in pixels (a multiple of 16); 0 = width.", min=0)

    def memory_spec(self):
        """What ``flowrl plan`` needs, from the published configuration (no weights)."""
        return qwen_image_edit_memory_spec(self, qwen_lora_targets(self.lora_preset))


class QwenImageEditModel(QwenImageModel):
    """Qwen-Image-Edit through diffusers: Qwen-Image whose text encoder also reads the condition
    image, with the condition's latent tokens appended to the generated image's."""

    task = "image-to-image"  # the model card's pipeline tag (flowrl.hub)

    Config = QwenImageEditConfig
    pipeline_class_name = "QwenImageEditPipeline"

    def __init__(self, config: QwenImageEditConfig, where: str = "[model] (model 'qwen_image_edit')"):
        super().__init__(config, where)
        set_condition_size(self, config)
        self.vision_tokens = self.count_vision_tokens()
        self.text_length = self.vision_tokens + config.max_sequence_length

    def count_vision_tokens(self) -> int:
        """Vision tokens the text encoder gets for a condition of ``condition_size`` (the processor's rule)."""
        from PIL import Image

        h, w = self.condition_size
        proc = self.pipe.processor
        inputs = proc(text=[self.pipe.prompt_template_encode.format("")], images=[Image.new("RGB", (w, h))],
                      return_tensors="pt")
        return int((inputs["input_ids"] == proc.image_token_id).sum())

    def _encode_row(self, text: str, picture) -> tuple[torch.Tensor, torch.Tensor]:
        """``[1, text_length, D]`` embeddings of one prompt with its image (zeros after it) and a bool mask."""
        embeds, mask = self.pipe.encode_prompt(prompt=[text], image=[picture], device=self.device)
        n = embeds.shape[1]
        if n > self.text_length:
            raise FlowrlError(
                f"prompt {text[:60]!r} with its image is {n} tokens, more than the {self.text_length} kept "
                f"({self.vision_tokens} vision tokens + max_sequence_length {self.config.max_sequence_length})",
                where=f"{self.where}.max_sequence_length", hint=f"raise it to at least {n - self.vision_tokens}",
            )
        out = embeds.new_zeros(1, self.text_length, embeds.shape[2])
        out[:, :n] = embeds
        full = torch.zeros(1, self.text_length, dtype=torch.bool, device=embeds.device)
        full[:, :n] = True if mask is None else mask.bool()
        return out * full[..., None], full

    @torch.no_grad()
    def encode_prompts(self, prompts):
        prompts = list(prompts)
        pictures = condition_pictures(self, prompts)
        with self._visiting(self.pipe.text_encoder):
            rows = [self._encode_row(str(p), pic) for p, pic in zip(prompts, pictures)]
            out = {"prompt_embeds": torch.cat([e for e, _ in rows]), "prompt_mask": torch.cat([m for _, m in rows])}
            if self.uses_cfg:  # the negative prompt is encoded with each row's image
                negs = [self._encode_row(self.config.negative_prompt, pic) for pic in pictures]
                out.update(negative_prompt_embeds=torch.cat([e for e, _ in negs]),
                           negative_prompt_mask=torch.cat([m for _, m in negs]))
        out["condition_latents"] = self.encode_conditions(pictures)
        return {k: v.to(self.device) for k, v in out.items()}

    @torch.no_grad()
    def encode_conditions(self, pictures) -> torch.Tensor:
        """Packed condition latents ``[B, S_c, 4C]``: VAE mode of a one-frame video, ``(z - mean) / std``."""
        h, w = self.condition_size
        pixels = self.pipe.image_processor.preprocess(pictures, h, w).unsqueeze(2)
        vae = self.pipe.vae
        with self._visiting(vae):
            z = vae.encode(pixels.to(self.device, self.dtype), return_dict=False)[0].mode().float()
        return self._from_vae(vae, z).to(self.device, self.dtype)

    def _image_inputs(self, x, text):
        cond = text["condition_latents"].to(self.device, x.dtype)
        if x.shape[0] == 2 * cond.shape[0]:  # true CFG: [uncond; cond] share the condition
            cond = torch.cat([cond, cond])
        return torch.cat([x, cond], dim=1), [(1, *self.grid), (1, *self.condition_grid)]
