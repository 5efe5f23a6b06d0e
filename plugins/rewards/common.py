"""What every model-backed reward shares: placement, dtype, batching, offload, image maths.

A model-backed reward subclasses :class:`ModelReward` and implements ``_score_batch`` on at
most ``batch_size`` images already on its device; this module does the rest:

- ``device = "auto"`` picks CUDA when there is one, else the CPU.
- ``dtype = "auto"`` picks bfloat16 on CUDA and float32 on the CPU (CPU half precision is slow
  and inexact). Scores are always returned as float32 on the CPU.
- ``offload = true`` keeps the model on the CPU between calls and moves it to the device only
  while it scores, which frees accelerator memory for the policy during the update.
- Scoring runs under ``torch.no_grad()`` in chunks of ``batch_size``; every computation is per
  image, so the scores do not depend on the batch size or the order of the batch.

The image helpers work on tensors (no PIL round trip): ``resize_shorter_side`` and
``center_crop`` reproduce the CLIP preprocessing geometry, ``normalise`` the channel maths.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from flowrl.config import param
from flowrl.errors import FlowrlError
from flowrl.interfaces import RewardOutput

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
    """Recipe keys shared by every model-backed reward (the reward dataclasses extend it)."""

    device: str = param("auto", "Device for the reward model: 'auto' (CUDA if available, else CPU), 'cpu', 'cuda', 'cuda:1', ...")
    dtype: str = param("auto", "Weights' dtype: 'auto' (bfloat16 on CUDA, float32 on CPU), 'float32', 'float16' or 'bfloat16'.")
    batch_size: int = param(32, "Images scored per forward pass (scores do not depend on it).", min=1)
    offload: bool = param(False, "Keep the model on the CPU between calls; move it to the device only while scoring.")

    def weight_bytes(self, parameters: float) -> int:
        """Bytes of ``parameters`` weights on an accelerator in this dtype ('auto' is bfloat16 there),
        for a reward's ``memory_bytes`` (:class:`flowrl.interfaces.PlansRewardMemory`)."""
        return int(parameters * (4 if self.dtype == "float32" else 2))


def checkpoint_parameters(directory: str) -> int | None:
    """The parameters a local checkpoint directory holds, read from its ``*.safetensors`` headers
    (shapes only; nothing is loaded), or None without such files."""
    from safetensors import safe_open

    folder = Path(directory) if directory else None
    files = sorted(folder.glob("*.safetensors")) if folder is not None and folder.is_dir() else []
    if not files:
        return None
    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as tensors:
            total += sum(math.prod(tensors.get_slice(key).get_shape()) for key in tensors.keys())
    return total


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise FlowrlError(f"unknown device '{name}'", hint="use 'auto', 'cpu', 'cuda' or 'cuda:N'") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FlowrlError(f"device '{name}' requested but CUDA is not available", hint="use device = 'auto' or 'cpu'")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise FlowrlError(f"unknown dtype '{name}'", hint="use 'auto', " + ", ".join(repr(k) for k in DTYPES))
    return DTYPES[name]


def check_images(images: torch.Tensor, prompts: Sequence[str], who: str) -> None:
    """Raise a clear error for inputs that break the Reward contract (shape, length)."""
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[1] != 3:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise FlowrlError(f"reward '{who}' expects images [B, 3, H, W] in [0, 1], got {shape}")
    if len(prompts) != images.shape[0]:
        raise FlowrlError(f"reward '{who}' got {images.shape[0]} images but {len(prompts)} prompts")


class ModelReward:
    """Base class of the model-backed rewards: batching, no_grad, placement and offload.

    Subclasses set ``self.module`` (everything that moves between devices), call
    :meth:`_setup_placement` once the module exists, and implement :meth:`_score_batch` (on
    at most ``batch_size`` items: images, or clips for a reward that overrides :meth:`check_inputs`).
    """

    name = "model_reward"
    module: torch.nn.Module

    def _setup_placement(self, config: PlacementConfig) -> None:
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.batch_size = config.batch_size
        self.offload = config.offload
        self.module.requires_grad_(False).eval()
        self.module.to(dtype=self.dtype)
        self.module.to("cpu" if self.offload else self.device)

    @contextlib.contextmanager
    def _placed(self) -> Iterator[None]:
        if not self.offload or self.device.type == "cpu":
            yield
            return
        self.module.to(self.device)
        try:
            yield
        finally:
            self.module.to("cpu")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _score_batch(
        self, images: torch.Tensor, prompts: list[str], metadata: Mapping[str, Any] | None
    ) -> dict[str, torch.Tensor]:
        """Scores of ``images [b, 3, H, W]`` (float32 in [0, 1] on the device): ``{"scores": [b], ...extras}``."""
        raise NotImplementedError

    def prepare(self, prompts: list[str]) -> None:
        """Hook run once per call with all prompts (text caches); default: nothing."""

    def check_inputs(self, images: torch.Tensor, prompts: list[str]) -> None:
        """Raise for inputs the reward cannot score; default: images ``[B, 3, H, W]`` (a reward of
        whole clips overrides it)."""
        check_images(images, prompts, self.name)

    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        prompts = list(prompts)
        self.check_inputs(images, prompts)
        parts: dict[str, list[torch.Tensor]] = {}
        with torch.no_grad(), self._placed():
            self.prepare(prompts)
            for start in range(0, images.shape[0], self.batch_size):
                chunk = images[start : start + self.batch_size].to(self.device, torch.float32).clamp(0, 1)
                out = self._score_batch(chunk, prompts[start : start + self.batch_size], metadata)
                for key, value in out.items():
                    parts.setdefault(key, []).append(value.detach().float().reshape(-1).cpu())
        merged = {k: torch.cat(v) for k, v in parts.items()}
        scores = merged.pop("scores")
        return RewardOutput(scores=scores, extras=merged)


# ----------------------------------------------------------------------------- image maths


def resize_shorter_side(images: torch.Tensor, size: int) -> torch.Tensor:
    """Resize so the shorter side is ``size`` (aspect kept), bicubic with antialiasing.

    The longer side is ``int(size * long / short)``, the rounding of the CLIP image processors.
    Images already of that size are returned unchanged, so no interpolation error is added.
    """
    h, w = images.shape[-2:]
    if h <= w:
        new_h, new_w = size, int(size * w / h)
    else:
        new_h, new_w = int(size * h / w), size
    return resize_to(images, new_h, new_w)


def resize_to(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Bicubic, antialiased resize to ``height x width``; a no-op when the size already matches."""
    if tuple(images.shape[-2:]) == (height, width):
        return images
    out = F.interpolate(images, size=(height, width), mode="bicubic", antialias=True, align_corners=False)
    # Bicubic overshoots; the reference processors work on 8-bit images, which cannot leave [0, 1].
    return out.clamp(0, 1)


def center_crop(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Crop the centre ``height x width`` (top-left offset rounded down, as CLIP processors do)."""
    h, w = images.shape[-2:]
    if h < height or w < width:
        images = F.pad(images, (max(0, (width - w) // 2), max(0, (width - w + 1) // 2),
                                max(0, (height - h) // 2), max(0, (height - h + 1) // 2)))
        h, w = images.shape[-2:]
    top, left = (h - height) // 2, (w - width) // 2
    return images[..., top : top + height, left : left + width]


def normalise(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    mean_t = torch.tensor(list(mean), dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    std_t = torch.tensor(list(std), dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    return (images - mean_t) / std_t


def features(output: Any) -> torch.Tensor:
    """A CLIP feature tensor from ``get_*_features``: transformers 5 returns an output object
    whose ``pooler_output`` holds the projected features; 4.x returns the tensor itself."""
    if isinstance(output, torch.Tensor):
        return output
    pooled = getattr(output, "pooler_output", None)
    if pooled is None:
        raise TypeError(f"unexpected CLIP feature output {type(output).__name__}")
    return pooled
