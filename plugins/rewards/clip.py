"""CLIP-family rewards: ``pickscore`` and ``clip`` (open_clip or transformers backends).

Both score an image by the cosine similarity of its CLIP image embedding with the embedding of
its prompt; they differ in weights and in the scale they report (``scale``, see
docs/rewards.md). Images stay tensors: resize (shorter side, bicubic, antialiased), centre crop
and normalisation run in torch on the reward's device, so there is no PIL round trip and each
image is processed alone (the scores do not depend on batch size or order). Prompts are
embedded once per distinct prompt per call (a GRPO group repeats its prompt).

Scales (``logit_scale`` is the model's learned temperature, ``exp(logit_scale)``; 100 for
PickScore and OpenAI/LAION CLIP):

- ``cosine``: ``cos(image, text)`` in [-1, 1].
- ``logit``: ``logit_scale * cos``, PickScore's published scale (about 18-24 on real images).
- ``logit/26``: ``logit_scale * cos / 26``, the scale Flow-GRPO trains its PickScore reward on.
- ``(logit-18)/8``: ``(logit_scale * cos - 18) / 8``, which maps typical PickScores to about [0, 1].
- ``clipscore``: ``2.5 * max(cos, 0)``, the CLIPScore of Hessel et al. (2021).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import torch

from flowrl.compat import ensure_torchvision_importable
from flowrl.config import param
from flowrl.errors import FlowrlError, require

from .common import ModelReward, PlacementConfig, center_crop, features, normalise, resize_shorter_side

PickScale = Literal["logit", "cosine", "logit/26", "(logit-18)/8"]
ClipScale = Literal["cosine", "logit", "clipscore", "logit/26", "(logit-18)/8"]

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
#: Parameters of the CLIP architectures (image and text towers), for ``flowrl plan``.
CLIP_PARAMETERS = {"ViT-B-32": 151.3e6, "ViT-B-16": 149.6e6, "ViT-L-14": 427.6e6, "ViT-H-14": 986.1e6,
                   "ViT-g-14": 1.367e9, "ViT-bigG-14": 2.540e9}
#: How hub ids spell those architectures (open_clip names them directly).
_HUB_SPELLINGS = {"vit-base-patch32": "ViT-B-32", "vit-b-32": "ViT-B-32", "vit-base-patch16": "ViT-B-16",
                  "vit-b-16": "ViT-B-16", "vit-large-patch14": "ViT-L-14", "vit-l-14": "ViT-L-14",
                  "vit-h-14": "ViT-H-14", "vit-huge-patch14": "ViT-H-14", "vit-bigg-14": "ViT-bigG-14",
                  "vit-g-14": "ViT-g-14"}


def _clip_family(name: str) -> str | None:
    """The architecture an open_clip name or a hub id names (``None`` for a local directory or
    an architecture not in :data:`CLIP_PARAMETERS`)."""
    if name in CLIP_PARAMETERS:
        return name
    lowered = name.lower()
    return next((arch for spelling, arch in _HUB_SPELLINGS.items() if spelling in lowered), None)


def apply_scale(cos: torch.Tensor, logit_scale: torch.Tensor | float, scale: str) -> torch.Tensor:
    """Map cosine similarities ``[B]`` to the reported score (the formulas in the module doc)."""
    logit = float(logit_scale) * cos
    if scale == "cosine":
        return cos
    if scale == "logit":
        return logit
    if scale == "logit/26":
        return logit / 26.0
    if scale == "(logit-18)/8":
        return (logit - 18.0) / 8.0
    if scale == "clipscore":
        return 2.5 * cos.clamp(min=0)
    raise FlowrlError(f"unknown scale '{scale}'", hint="see docs/rewards.md for the scales")


@dataclasses.dataclass(frozen=True)
class ImageGeometry:
    """CLIP preprocessing: shorter side to ``resize``, centre crop ``crop``, then normalise."""

    resize: int
    crop_h: int
    crop_w: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return normalise(center_crop(resize_shorter_side(images, self.resize), self.crop_h, self.crop_w), self.mean, self.std)


def _size_field(size, key: str):
    if size is None:
        return None
    if isinstance(size, dict):
        return size.get(key)
    return getattr(size, key, None)


def geometry_from_hf(image_processor) -> ImageGeometry:
    """Read the resize/crop/normalise settings of a transformers CLIP image processor."""
    size, crop = getattr(image_processor, "size", None), getattr(image_processor, "crop_size", None)
    resize = _size_field(size, "shortest_edge") or _size_field(size, "height")
    crop_h = _size_field(crop, "height") or resize
    crop_w = _size_field(crop, "width") or resize
    if not getattr(image_processor, "do_center_crop", True):
        crop_h = crop_w = resize
    if not resize:
        raise FlowrlError(f"cannot read the image size from {type(image_processor).__name__}: size={size!r}")
    mean = tuple(getattr(image_processor, "image_mean", None) or OPENAI_MEAN)
    std = tuple(getattr(image_processor, "image_std", None) or OPENAI_STD)
    return ImageGeometry(int(resize), int(crop_h), int(crop_w), mean, std)


class _ClipScorer(ModelReward):
    """Shared scoring: cached text embeddings per call, per-image embeddings, then the scale."""

    scale: str

    def prepare(self, prompts: list[str]) -> None:
        unique = list(dict.fromkeys(prompts))
        emb = torch.cat([self._encode_text(unique[i : i + self.batch_size]).float()
                         for i in range(0, len(unique), self.batch_size)])
        emb = emb / emb.norm(dim=-1, keepdim=True)
        self._text = dict(zip(unique, emb))

    def _score_batch(self, images, prompts, metadata):
        emb = self._encode_images(self.geometry(images).to(self.dtype)).float()
        emb = emb / emb.norm(dim=-1, keepdim=True)
        text = torch.stack([self._text[p] for p in prompts])
        cos = (emb * text).sum(-1)
        return {"scores": apply_scale(cos, self._logit_scale(), self.scale), "cosine": cos}

    def _encode_text(self, prompts: Sequence[str]) -> torch.Tensor:
        raise NotImplementedError

    def _encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _logit_scale(self) -> float:
        raise NotImplementedError


# ----------------------------------------------------------------------------- transformers backend


def _load_hf_clip(model_path: str, processor_path: str, who: str):
    # A broken CUDA torchvision (installed with open_clip) would break the image processors too.
    ensure_torchvision_importable()
    transformers = require("transformers", extra="rewards", purpose=f"the '{who}' reward")
    hint = (
        "pass a local directory (model = '/path', processor = '/path'), or make sure the "
        "Hugging Face Hub is reachable (HF_HUB_OFFLINE unset)"
    )
    try:
        model = transformers.CLIPModel.from_pretrained(model_path)
    except (OSError, ValueError) as exc:
        raise FlowrlError(f"reward '{who}': cannot load CLIP model '{model_path}': {exc}", hint=hint) from exc
    try:
        processor = transformers.AutoProcessor.from_pretrained(processor_path)
    except (OSError, ValueError) as exc:
        raise FlowrlError(f"reward '{who}': cannot load CLIP processor '{processor_path}': {exc}", hint=hint) from exc
    tokenizer = getattr(processor, "tokenizer", None)
    image_processor = getattr(processor, "image_processor", None)
    if tokenizer is None or image_processor is None:
        raise FlowrlError(
            f"reward '{who}': '{processor_path}' is not a CLIP processor (needs a tokenizer and an image processor)",
            hint="point processor at a CLIPProcessor directory or hub id",
        )
    return model, tokenizer, geometry_from_hf(image_processor)


class HFClipScorer(_ClipScorer):
    """A transformers ``CLIPModel`` + ``CLIPProcessor`` scorer (PickScore, or any CLIP)."""

    def __init__(self, model_path: str, processor_path: str, scale: str, config: PlacementConfig, who: str):
        self.name = who
        self.scale = scale
        self.module, self.tokenizer, self.geometry = _load_hf_clip(model_path, processor_path, who)
        text_cfg = self.module.config.text_config
        # Pad every prompt to the same length so a prompt's embedding does not depend on the
        # other prompts in the call (CLIP's causal text model ignores padding, but this also
        # keeps the arithmetic identical).
        self.max_length = min(int(getattr(self.tokenizer, "model_max_length", 77) or 77), text_cfg.max_position_embeddings)
        self._setup_placement(config)

    def _encode_text(self, prompts):
        tok = self.tokenizer(
            list(prompts), padding="max_length", truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        return features(self.module.get_text_features(
            input_ids=tok["input_ids"].to(self.device), attention_mask=tok["attention_mask"].to(self.device)
        ))

    def _encode_images(self, pixels):
        return features(self.module.get_image_features(pixel_values=pixels))

    def _logit_scale(self):
        return self.module.logit_scale.exp().item()


@dataclasses.dataclass(frozen=True)
class PickScoreConfig(PlacementConfig):
    model: str = param("yuvalkirstain/PickScore_v1", "PickScore CLIPModel: a Hugging Face hub id or a local directory.", path="hub")
    processor: str = param(
        "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
        "CLIP processor (tokenizer + image settings): a hub id or a local directory.", path="hub",
    )
    scale: PickScale = param(
        "logit",
        "Reported scale: 'logit' (logit_scale*cos, PickScore's published ~18-24), 'cosine', "
        "'logit/26' (Flow-GRPO), '(logit-18)/8' (about [0, 1]). See docs/rewards.md.",
    )

    memory_note = "CLIP ViT-H-14, 0.99e9 params"

    def memory_bytes(self) -> int:
        return self.weight_bytes(CLIP_PARAMETERS["ViT-H-14"])  # PickScore is a fine-tuned CLIP-H


class PickScore(HFClipScorer):
    """PickScore (Kirstain et al. 2023): human-preference CLIP-H; transformers CLIPModel."""

    Config = PickScoreConfig

    def __init__(self, config: PickScoreConfig):
        super().__init__(config.model, config.processor, config.scale, config, "pickscore")


# ----------------------------------------------------------------------------- open_clip backend


def load_open_clip():
    """Import open_clip, first making a broken CPU torchvision importable (see flowrl.compat)."""
    ensure_torchvision_importable()
    return require("open_clip", extra="clip", purpose="the 'clip' reward with backend 'open_clip'")


def geometry_from_open_clip(open_clip, model) -> ImageGeometry:
    """Read open_clip's preprocessing (size, mean, std) from the model's preprocess config."""
    cfg = {}
    getter = getattr(open_clip, "get_model_preprocess_cfg", None)
    if getter is not None:
        cfg = dict(getter(model))
    size = cfg.get("size") or getattr(model.visual, "image_size", 224)
    if isinstance(size, (tuple, list)):
        h, w = int(size[0]), int(size[-1])
    else:
        h = w = int(size)
    mean = tuple(cfg.get("mean") or getattr(model.visual, "image_mean", None) or OPENAI_MEAN)
    std = tuple(cfg.get("std") or getattr(model.visual, "image_std", None) or OPENAI_STD)
    return ImageGeometry(min(h, w), h, w, mean, std)


class OpenClipScorer(_ClipScorer):
    def __init__(self, model_name: str, pretrained: str, scale: str, config: PlacementConfig, who: str):
        self.name = who
        self.scale = scale
        open_clip = load_open_clip()
        try:
            model = open_clip.create_model(model_name, pretrained=pretrained or None)
        except (RuntimeError, OSError, ValueError) as exc:
            raise FlowrlError(
                f"reward '{who}': cannot create open_clip model '{model_name}' (pretrained '{pretrained}'): {exc}",
                hint="list names with open_clip.list_pretrained(); pretrained may be a tag or a local "
                ".safetensors/.pt file; a custom architecture needs open_clip.add_model_config(json)",
            ) from exc
        self.module = model
        self.tokenizer = open_clip.get_tokenizer(model_name)
        self.geometry = geometry_from_open_clip(open_clip, model)
        self._setup_placement(config)

    def _encode_text(self, prompts):
        return self.module.encode_text(self.tokenizer(list(prompts)).to(self.device))

    def _encode_images(self, pixels):
        return self.module.encode_image(pixels)

    def _logit_scale(self):
        return self.module.logit_scale.exp().item()


@dataclasses.dataclass(frozen=True)
class ClipConfig(PlacementConfig):
    backend: Literal["open_clip", "transformers"] = param(
        "open_clip", "'open_clip' (needs flowrl-diffusion[clip], which brings torchvision) or 'transformers' (CLIPModel, no torchvision)."
    )
    model: str = param(
        "",
        "open_clip: architecture name (default 'ViT-H-14'); transformers: hub id or directory "
        "(default 'openai/clip-vit-large-patch14').", path="hub",
    )
    pretrained: str = param(
        "", "open_clip only: pretrained tag or local weights file (default 'laion2b_s32b_b79k' for ViT-H-14).", path="hub"
    )
    processor: str = param("", "transformers only: CLIP processor hub id or directory (default: same as model).", path="hub")
    scale: ClipScale = param(
        "cosine", "Reported scale: 'cosine', 'logit' (logit_scale*cos), 'clipscore' (2.5*max(cos,0)), 'logit/26', '(logit-18)/8'."
    )

    @property
    def architecture(self) -> str:
        """The CLIP the defaults resolve to: open_clip's architecture name, or the transformers model."""
        if self.backend == "open_clip":
            return self.model or "ViT-H-14"
        return self.model or "openai/clip-vit-large-patch14"

    @property
    def parameters(self) -> float | None:
        """The parameters of :attr:`architecture` (None when it is not one of :data:`CLIP_PARAMETERS`)."""
        return CLIP_PARAMETERS.get(_clip_family(self.architecture))

    @property
    def memory_note(self) -> str:
        size = self.parameters
        return f"CLIP {self.architecture}, {size / 1e9:.2f}e9 params" if size else f"CLIP {self.architecture}"

    def memory_bytes(self) -> int | None:
        return None if self.parameters is None else self.weight_bytes(self.parameters)


class Clip:
    """CLIP image-text similarity: open_clip (default) or transformers CLIPModel backend."""

    Config = ClipConfig

    def __init__(self, config: ClipConfig):
        if config.backend == "open_clip":
            if config.processor:
                raise FlowrlError("key 'processor' applies to backend 'transformers' only", where="reward 'clip'",
                                  hint="remove it, or set backend = 'transformers'")
            model = config.model or "ViT-H-14"
            pretrained = config.pretrained or ("laion2b_s32b_b79k" if model == "ViT-H-14" else "")
            self.scorer = OpenClipScorer(model, pretrained, config.scale, config, "clip")
        else:
            if config.pretrained:
                raise FlowrlError("key 'pretrained' applies to backend 'open_clip' only", where="reward 'clip'",
                                  hint="remove it; the transformers backend loads weights from 'model'")
            model = config.model or "openai/clip-vit-large-patch14"
            self.scorer = HFClipScorer(model, config.processor or model, config.scale, config, "clip")
        self.name = "clip"

    def __call__(self, images, prompts, metadata=None):
        return self.scorer(images, prompts, metadata)
