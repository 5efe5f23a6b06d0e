"""``video_align``: VideoReward, the video reward model of VideoAlign (Liu et al. 2025,
arXiv 2501.13918), natively on transformers >= 4.52; it scores whole clips.

VideoReward is Qwen2-VL-2B-Instruct fine-tuned (LoRA on the language model, the vision tower
trained in full) as a reward model. Its input is one chat turn holding the clip and a fixed
instruction (``video_align_prompt.txt``, the checkpoint's input format, reproduced verbatim from
the MIT-licensed upstream repository) that quotes the prompt and holds three special tokens,
``<|VQ_reward|>``, ``<|MQ_reward|>`` and ``<|TA_reward|>``. A bias-free ``Linear(hidden, 1)``
head reads the language model's last hidden state at each of them: visual quality (VQ), motion
quality (MQ) and text alignment (TA). Each is normalised with the mean and standard deviation
stored in the checkpoint's ``model_config.json`` (``inference_config``), and the overall score is
their sum, as upstream's inference does.

The checkpoint (``KwaiVGI/VideoReward``) is a directory of ``model_config.json`` (the training's
data, model, LoRA and inference settings) and ``checkpoint-<step>/``, holding ``model.pth``: the
state dict of the PEFT-wrapped model (``base_model.model.`` prefix, pre-4.52 Qwen2-VL names, LoRA
factors unmerged: ``<layer>.base_layer.weight``, ``<layer>.lora_A.default.weight``, ...,
``rm_head.weight``) and ``tokenizer/`` (Qwen2-VL's tokenizer with the three tokens added). This
module merges the LoRA factors into their layers (``W + alpha / r * B @ A``, in float32), maps
the names onto transformers' own ``Qwen2VLModel`` (``qwen2_vl.py``) and reads only the base
model's config and preprocessor settings, never its weights.

A clip ``[F, 3, H, W]`` in [0, 1] is prepared as upstream prepares a decoded video:

- frames sampled uniformly at ``sample_fps`` frames per second of a clip at ``fps`` (between 4 and
  768 frames, an even number, at most F; or ``num_frames``), at indices
  ``round(linspace(0, F - 1, n))``;
- each frame resized (bicubic, antialiased) to sides multiples of 28 and an area within
  ``[min_pixels, max_pixels]`` (upstream: 128*28*28 and the checkpoint's 200704 = 448 x 448),
  8-bit values before and after the resize (``quantize``: upstream decodes 8-bit video and resizes
  8-bit frames);
- then what transformers' video processor does: scaled to [0, 1], normalised with the CLIP mean
  and std, cut into 2-frame x 14 x 14 patches in 2 x 2 merge windows.

The language model gets plain positions ``0..L-1`` on all three M-RoPE axes (upstream's reward
model calls the language model without positions, so its M-RoPE positions are never computed),
and prompts are right-padded (attention is causal, so padding never reaches the reward tokens).
Differences from upstream: the head runs in float32 on the hidden states (upstream: the model's
dtype); the LoRA layers are merged (upstream adds the LoRA branch at each call: equal in float32);
frames come from float tensors (``quantize = false`` keeps them so).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from flowrl.compat import ensure_torchvision_importable
from flowrl.config import param
from flowrl.errors import FlowrlError, require

from .clip import OPENAI_MEAN, OPENAI_STD
from .common import ModelReward, PlacementConfig, normalise, resize_to
from .qwen2_vl import (
    RewardHead,
    build_core,
    language_forward,
    load_state_dict,
    patchify,
    read_preprocessor_config,
    require_qwen2_vl,
    smart_resize,
    split_checkpoint,
)

WHO = "video_align"
#: The reward tokens, in the order of the instruction (and of the head's outputs when it has three).
REWARD_TOKENS = ("<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>")
DIMENSIONS = ("vq", "mq", "ta")
PROMPT_TEMPLATE_FILE = Path(__file__).with_name("video_align_prompt.txt")
#: qwen-vl-utils' video constants, which upstream fixes: frames come in pairs (the temporal patch),
#: at least 4 and at most 768 are sampled by fps, and a frame's area is at least 128 merged patches.
FRAME_FACTOR, MIN_FRAMES, MAX_FRAMES = 2, 4, 768
VIDEO_MIN_PIXELS = 128 * 28 * 28
PEFT_PREFIX = "base_model.model."


def prompt_template() -> str:
    """VideoReward's instruction (``detailed_special``), with ``{text_prompt}`` where the prompt goes."""
    return PROMPT_TEMPLATE_FILE.read_text(encoding="utf-8")


def frame_indices(total: int, *, fps: float, sample_fps: float, num_frames: int = 0) -> list[int]:
    """The frames upstream samples from a clip of ``total`` frames at ``fps`` (``num_frames`` > 0:
    that many, rounded to even, instead of ``sample_fps``)."""
    if num_frames:
        n = round(num_frames / FRAME_FACTOR) * FRAME_FACTOR
    else:
        low = math.ceil(MIN_FRAMES / FRAME_FACTOR) * FRAME_FACTOR
        high = math.floor(min(MAX_FRAMES, total) / FRAME_FACTOR) * FRAME_FACTOR
        n = round(min(max(total / fps * sample_fps, low), high) / FRAME_FACTOR) * FRAME_FACTOR
    n = min(n, total)
    if not FRAME_FACTOR <= n <= total:
        raise FlowrlError(f"cannot sample {n} frames from a clip of {total}", where=f"reward '{WHO}'",
                          hint=f"the reward needs clips of at least {FRAME_FACTOR} frames")
    return torch.linspace(0, total - 1, n).round().long().tolist()


def merge_peft_state(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A PEFT model's state dict as the plain model's: the ``base_model.model.`` prefix dropped,
    every LoRA pair merged into its layer (``W + scale * B @ A`` in float32), a
    ``modules_to_save`` copy in place of its original."""
    plain, saved, lora, adapters = {}, {}, {}, set()
    for key, value in state.items():
        key = key.removeprefix(PEFT_PREFIX)
        if ".lora_A." in key or ".lora_B." in key:
            module, rest = key.split(".lora_", 1)  # rest: "A.default.weight"
            side, adapter, _ = rest.split(".", 2)
            adapters.add(adapter)
            lora.setdefault(module, {})[side] = value
        elif ".lora_" in key:
            raise FlowrlError(f"unsupported LoRA tensor '{key}' (only Linear LoRA factors are merged)",
                              where=f"reward '{WHO}': checkpoint")
        elif ".base_layer." in key:
            plain[key.replace(".base_layer.", ".")] = value
        elif ".modules_to_save." in key:
            module, rest = key.split(".modules_to_save.", 1)
            saved[module + "." + rest.split(".", 1)[1]] = value
        elif ".original_module." not in key:
            plain[key] = value
    if len(adapters) > 1:
        raise FlowrlError(f"the checkpoint holds several LoRA adapters {sorted(adapters)}", where=f"reward '{WHO}': checkpoint")
    for module, pair in lora.items():
        weight = plain.get(module + ".weight")
        if weight is None or set(pair) != {"A", "B"}:
            raise FlowrlError(f"LoRA factors of '{module}' without its weight or one of A/B",
                              where=f"reward '{WHO}': checkpoint")
        plain[module + ".weight"] = weight.float() + scale * (pair["B"].float() @ pair["A"].float())
    plain.update(saved)
    return plain


def _download(repo: str) -> str:
    hub = require("huggingface_hub", extra="rewards", purpose="downloading the VideoReward checkpoint")
    patterns = ["model_config.json", "checkpoint-*/model.pth", "checkpoint-*/model.safetensors", "checkpoint-*/tokenizer/*"]
    try:
        return hub.snapshot_download(repo, allow_patterns=patterns)
    except Exception as exc:  # offline, unknown repo, gated: all mean "no checkpoint"
        raise FlowrlError(
            f"cannot get the VideoReward checkpoint '{repo}': {type(exc).__name__}: {exc}", where=f"reward '{WHO}': checkpoint",
            hint="pass a local directory (a clone of the KwaiVGI/VideoReward hub repo): checkpoint = '/path/VideoReward'",
        ) from exc


def checkpoint_files(checkpoint: str, step: int = 0) -> tuple[dict, Path]:
    """``(model_config.json as a dict, the checkpoint-<step> directory)`` of a local directory or
    hub repo; ``step`` 0 takes the highest step, as upstream does."""
    root = Path(checkpoint if os.path.isdir(checkpoint) else _download(checkpoint))
    where = f"reward '{WHO}': checkpoint"
    if not (root / "model_config.json").is_file():
        raise FlowrlError(f"no model_config.json in '{root}'", where=where,
                          hint="checkpoint is the VideoReward directory (model_config.json, checkpoint-<step>/)")
    settings = json.loads((root / "model_config.json").read_text(encoding="utf-8"))
    steps = {int(p.name.split("-", 1)[1]): p for p in root.glob("checkpoint-*") if p.name.split("-", 1)[1].isdigit()}
    if not steps:
        raise FlowrlError(f"no checkpoint-<step> directory in '{root}'", where=where)
    if step and step not in steps:
        raise FlowrlError(f"no checkpoint-{step} in '{root}' (found {sorted(steps)})", where=where)
    return settings, steps[step or max(steps)]


def weights_file(directory: Path) -> str:
    for name in ("model.safetensors", "model.pth"):
        if (directory / name).is_file():
            return str(directory / name)
    hint = ("a LoRA-only checkpoint (adapter_model.safetensors) needs the base model's weights, which this "
            "reward does not load: merge it with upstream's code and save the full state dict as model.pth"
            if (directory / "adapter_model.safetensors").is_file() else "the hub repo KwaiVGI/VideoReward has it")
    raise FlowrlError(f"no model.pth (or model.safetensors) in '{directory}'", where=f"reward '{WHO}': checkpoint", hint=hint)


@dataclasses.dataclass(frozen=True)
class VideoAlignConfig(PlacementConfig):
    checkpoint: str = param(
        "KwaiVGI/VideoReward",
        "VideoReward checkpoint: a local directory (model_config.json, checkpoint-<step>/model.pth) or a hub "
        "repo id (downloads model_config.json and checkpoint-*/model.pth and tokenizer/).", path="hub",
    )
    checkpoint_step: int = param(0, "Which checkpoint-<step> to load (its step number); 0 = the highest step (as upstream).", min=0)
    base_model: str = param(
        "", "Qwen2-VL config and preprocessor settings (hub id or directory); its weights are never loaded. "
        "Empty: model_config.json's model_name_or_path (Qwen/Qwen2-VL-2B-Instruct).", path="hub",
    )
    score: Literal["overall", "vq", "mq", "ta"] = param(
        "overall", "The score returned: 'vq' visual quality, 'mq' motion quality, 'ta' text alignment, or 'overall' "
        "(their sum). All four are logged as extras.")
    normalise: bool = param(True, "Normalise VQ/MQ/TA with model_config.json's inference_config mean and std (upstream's default).")
    fps: float = param(16.0, "Frame rate of the clips scored (Wan 2.1: 16); with sample_fps it sets how many frames are read.",
                       min=0.0, exclusive_min=True)
    sample_fps: float = param(0.0, "Frames per second read from a clip (at least 4, at most 768, an even number); "
                              "0 = model_config.json's data_config.fps (2.0).", min=0.0)
    num_frames: int = param(0, "Read this many frames (rounded to even) instead of sampling by fps; 0 = by fps "
                            "(or data_config.num_frames when the checkpoint sets it).", min=0)
    max_pixels: int = param(0, "Largest frame area after resizing; 0 = data_config.max_frame_pixels (200704 = 448 x 448).", min=0)
    min_pixels: int = param(VIDEO_MIN_PIXELS, "Smallest frame area after resizing (upstream fixes 128*28*28 = 100352).", min=784)
    quantize: bool = param(True, "Round frames to 8 bits before and after the resize, as upstream (decoded 8-bit video) does.")
    batch_size: int = param(4, "Clips scored per forward pass (scores do not depend on it).", min=1)

    memory_note = "Qwen2-VL-2B, 2.21e9 params"

    def memory_bytes(self) -> int:
        return self.weight_bytes(2.21e9)  # VideoReward is Qwen2-VL-2B-Instruct with LoRA merged and a head

    def __post_init__(self):
        if self.sample_fps and self.num_frames:
            raise ValueError("sample_fps and num_frames are exclusive: set one (upstream refuses both)")
        if self.max_pixels and self.max_pixels < self.min_pixels:
            raise ValueError(f"max_pixels {self.max_pixels} is below min_pixels {self.min_pixels}")


@dataclasses.dataclass(frozen=True)
class Preprocessing:
    """How a clip becomes patches (the resolved keys, the checkpoint's where a key is 0)."""

    fps: float
    sample_fps: float
    num_frames: int
    min_pixels: int
    max_pixels: int
    quantize: bool
    patch: int
    merge: int
    temporal: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


class VideoAlign(ModelReward):
    """VideoReward (VideoAlign; Qwen2-VL-2B reward model) on whole clips: VQ, MQ, TA or overall."""

    Config = VideoAlignConfig
    scores_clips = True  # flowrl.interfaces.ScoresClips: it watches the whole clip

    def __init__(self, config: VideoAlignConfig):
        self.name = WHO
        self.config = config
        ensure_torchvision_importable()  # a broken CUDA torchvision breaks transformers' imports
        transformers = require_qwen2_vl(WHO)
        settings, directory = checkpoint_files(config.checkpoint, config.checkpoint_step)
        model, data, peft = (settings.get(k) or {} for k in ("model_config", "data_config", "peft_lora_config"))
        self.stats = settings.get("inference_config") if config.normalise else None
        missing = [f"{d.upper()}_{m}" for d in DIMENSIONS for m in ("mean", "std") if f"{d.upper()}_{m}" not in (self.stats or {})]
        if self.stats and missing:
            raise FlowrlError(f"model_config.json's inference_config lacks {missing}", where=f"reward '{WHO}': checkpoint",
                              hint="normalise = false scores without it")
        if model.get("reward_token", "special") != "special" or data.get("prompt_template_type", "detailed_special") != "detailed_special":
            raise FlowrlError("only checkpoints that read the three reward tokens (reward_token 'special', prompt "
                              "template 'detailed_special') are supported", where=f"reward '{WHO}': checkpoint")
        base = config.base_model or model.get("model_name_or_path") or "Qwen/Qwen2-VL-2B-Instruct"
        model_config, self.tokenizer = self._config_and_tokenizer(transformers, base, directory)
        self.token_ids = [self.tokenizer.convert_tokens_to_ids(t) for t in REWARD_TOKENS]
        self.video_token_id = model_config.video_token_id

        rank = peft.get("lora_r", 1)
        scale = peft.get("lora_alpha", rank) / (math.sqrt(rank) if peft.get("use_rslora") else rank)
        state = merge_peft_state(load_state_dict(weights_file(directory), WHO), scale)
        backbone_state, head_state = split_checkpoint(state, WHO)
        self.core = build_core(transformers, model_config, backbone_state, WHO,
                               hint="base_model must be the model VideoReward was trained from (Qwen2-VL-2B-Instruct)")
        self.head = RewardHead(head_state, WHO)
        rows = self.core.get_input_embeddings().weight.shape[0]
        if len(set(self.token_ids)) != 3 or not all(isinstance(i, int) and 0 <= i < rows for i in self.token_ids):
            raise FlowrlError(f"the reward tokens have ids {self.token_ids}, not three distinct ids below the checkpoint's "
                              f"{rows} embeddings", where=f"reward '{WHO}'", hint="use the checkpoint's tokenizer/ directory")
        if self.head.layers[-1].out_features not in (1, 3):
            raise FlowrlError(f"the head has {self.head.layers[-1].out_features} outputs (expected 1, or 3: VQ, MQ, TA)",
                              where=f"reward '{WHO}': checkpoint")
        self.module = nn.ModuleDict({"core": self.core, "head": self.head})
        self.prep = self._preprocessing(config, data, read_preprocessor_config(base), model_config.vision_config)
        self.template = prompt_template()
        self._setup_placement(config)

    @staticmethod
    def _config_and_tokenizer(transformers, base: str, directory: Path):
        """The base model's config; the checkpoint's own tokenizer (``tokenizer/``, saved by the
        training with the reward tokens), else the base model's with the tokens added as upstream does."""
        own = directory / "tokenizer"
        try:
            model_config = transformers.AutoConfig.from_pretrained(base)
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(own) if own.is_dir() else base)
        except (OSError, ValueError) as exc:
            raise FlowrlError(f"cannot load the Qwen2-VL config/tokenizer '{base}': {exc}", where=f"reward '{WHO}': base_model",
                              hint="pass a local directory with config.json and the tokenizer files") from exc
        if not own.is_dir():
            tokenizer.add_special_tokens({"additional_special_tokens": list(REWARD_TOKENS)})
        elif not getattr(tokenizer, "chat_template", None):  # saved without it: the base model's
            tokenizer.chat_template = transformers.AutoTokenizer.from_pretrained(base).chat_template
        tokenizer.padding_side = "right"
        return model_config, tokenizer

    @staticmethod
    def _preprocessing(config: VideoAlignConfig, data: dict, pre: dict, vision) -> Preprocessing:
        num_frames = config.num_frames or (0 if config.sample_fps else int(data.get("num_frames") or 0))
        max_pixels = config.max_pixels or int(data.get("max_frame_pixels") or 200704)
        if max_pixels < config.min_pixels:
            raise FlowrlError(f"the checkpoint's max_frame_pixels {max_pixels} is below min_pixels {config.min_pixels}",
                              where=f"reward '{WHO}'", hint="set min_pixels (and max_pixels) in the [[rewards]] table")
        return Preprocessing(
            fps=config.fps, sample_fps=config.sample_fps or float(data.get("fps") or 2.0), num_frames=num_frames,
            min_pixels=config.min_pixels, max_pixels=max_pixels,
            quantize=config.quantize,
            patch=int(pre.get("patch_size", getattr(vision, "patch_size", 14))),
            merge=int(pre.get("merge_size", getattr(vision, "spatial_merge_size", 2))),
            temporal=int(pre.get("temporal_patch_size", getattr(vision, "temporal_patch_size", 2))),
            mean=tuple(pre.get("image_mean", OPENAI_MEAN)), std=tuple(pre.get("image_std", OPENAI_STD)),
        )

    def _setup_placement(self, config):
        super()._setup_placement(config)
        self.head.float()  # a scalar score: read in float32 whatever the backbone's dtype

    # ---- inputs

    def check_inputs(self, images, prompts) -> None:
        if not isinstance(images, torch.Tensor) or images.ndim != 5 or images.shape[2] != 3 or images.shape[1] < 2:
            shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
            raise FlowrlError(f"reward '{WHO}' scores clips [B, F, 3, H, W] of at least 2 frames in [0, 1] "
                              f"(a video model's), got {shape}")
        if len(prompts) != images.shape[0]:
            raise FlowrlError(f"reward '{WHO}' got {images.shape[0]} clips but {len(prompts)} prompts")

    def frames(self, clips: torch.Tensor) -> torch.Tensor:
        """Clips ``[b, F, 3, H, W]`` in [0, 1] to the frames the model sees, ``[b, n, 3, h, w]``
        in [0, 1]: sampled, resized, and (``quantize``) 8-bit values."""
        p = self.prep
        b, total, _, height, width = clips.shape
        x = clips[:, frame_indices(total, fps=p.fps, sample_fps=p.sample_fps, num_frames=p.num_frames)]
        n = x.shape[1]
        h, w = smart_resize(height, width, p.patch * p.merge, p.min_pixels, p.max_pixels)
        x = x.flatten(0, 1)
        if p.quantize:
            x = (x * 255).round()
            if (h, w) != (height, width):  # what torchvision does to 8-bit frames: clamp, round
                x = F.interpolate(x, size=(h, w), mode="bicubic", antialias=True, align_corners=False).clamp(0, 255).round()
            x = x / 255
        else:
            x = resize_to(x, h, w)
        return x.view(b, n, 3, h, w)

    def _text(self, prompt: str, video_tokens: int) -> str:
        if any(t in prompt for t in REWARD_TOKENS):
            raise FlowrlError(f"prompt {prompt!r} holds a reward token itself", where=f"reward '{WHO}'")
        messages = [{"role": "user", "content": [
            {"type": "video"}, {"type": "text", "text": self.template.replace("{text_prompt}", prompt)}]}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if isinstance(text, list):
            text = text[0]
        if text.count("<|video_pad|>") != 1:
            raise FlowrlError("the chat template must place exactly one video", where=f"reward '{WHO}': base_model")
        return text.replace("<|video_pad|>", "<|video_pad|>" * video_tokens)

    def raw_scores(self, clips: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """The head's VQ, MQ, TA ``[b, 3]`` (float32, before normalisation) of clips on the device."""
        p = self.prep
        frames = self.frames(clips)
        b, n, c, h, w = frames.shape
        pixels = normalise(frames.flatten(0, 1), p.mean, p.std).view(b, n, c, h, w)
        patches, grids = zip(*(patchify(clip, p.patch, p.merge, p.temporal) for clip in pixels))
        video_tokens = math.prod(grids[0]) // p.merge**2
        tok = self.tokenizer([self._text(q, video_tokens) for q in prompts], padding=True, return_tensors="pt",
                             add_special_tokens=False)
        ids, mask = tok["input_ids"].to(self.device), tok["attention_mask"].to(self.device)
        at = []
        for token, token_id in zip(REWARD_TOKENS, self.token_ids):
            hits = ids == token_id
            if not bool((hits.sum(1) == 1).all()):
                raise FlowrlError(f"a prompt lost the {token} token (truncated?)", where=f"reward '{WHO}'")
            at.append(hits.int().argmax(1))
        hidden = language_forward(self.core, ids, mask, torch.cat(patches), torch.tensor(grids, device=self.device),
                                  self.video_token_id)
        rows = torch.arange(b, device=self.device)
        out = self.head(torch.stack([hidden[rows, a] for a in at], dim=1).float())  # [b, 3 tokens, 1 or 3 outputs]
        # one output: each token's; three (VQ, MQ, TA): token k's k-th, as upstream's diagonal
        return out[..., 0] if out.shape[-1] == 1 else out.diagonal(dim1=1, dim2=2)

    def _score_batch(self, images, prompts, metadata):
        raw = self.raw_scores(images, prompts)
        scores = {}
        for i, name in enumerate(DIMENSIONS):
            value = raw[:, i]
            if self.stats:
                key = name.upper()
                value = (value - self.stats[f"{key}_mean"]) / self.stats[f"{key}_std"]
            scores[name] = value
        scores["overall"] = scores["vq"] + scores["mq"] + scores["ta"]
        return {"scores": scores[self.config.score], **scores}
