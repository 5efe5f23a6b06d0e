"""``hpsv3``: the HPSv3 human-preference score, natively on current transformers (>= 4.52).

HPSv3 (Ma et al. 2025) is Qwen2-VL-7B-Instruct fine-tuned as a reward model. Its input is a chat
turn holding the image and a fixed instruction that quotes the prompt and ends with a special
token ``<|Reward|>``. The language model's last hidden state at that token goes through a small
MLP head, ``hidden -> 1024 -> 16 -> 2`` with ReLUs (kept in float32), whose two outputs are the
mean ``mu`` and the uncertainty ``sigma`` of the preference score. The reward is ``mu``;
``sigma`` is logged as the extra ``hpsv3_sigma``.

Why a native scorer: the ``hpsv3`` package pins transformers 4.45.2 and its model code needs the
pre-4.52 Qwen2-VL module layout, so it cannot share an environment with current diffusers. This
module loads the official checkpoint (``HPSv3.safetensors``, or a ``.pt``/``.pth`` state dict)
into transformers' own ``Qwen2VLModel``:

- checkpoint keys ``model.*`` (the language model, pre-4.52 layout) become
  ``language_model.*``; ``visual.*`` stays ``visual.*``; the 4.52+ layout
  (``model.language_model.*``, ``model.visual.*``) is accepted as well; ``lm_head.*`` is not
  needed for scoring and is skipped; ``rm_head.*`` is the reward head.
- the vocabulary size comes from the checkpoint (HPSv3 resized the embeddings after adding
  ``<|Reward|>``), so only the base model's config and tokenizer are read, never its weights.

Behaviour matched to the package (``scripts/hpsv3_parity.py`` checks it on a tiny model):

- images are resized to an area of ``pixels`` (the package fixes 256 * 28 * 28 = 200704, i.e.
  448 x 448 for a square image) with sides multiples of 28, Qwen2-VL's "smart resize";
- the language model gets plain positions ``0..L-1`` on all three M-RoPE axes (the package calls
  the language model without ``position_ids``), not the image-aware M-RoPE positions;
- prompts are right-padded; attention is causal, so padding never reaches the reward token.

Differences: images are resized in torch (bicubic, antialiased) from float tensors; the package
resizes 8-bit PIL images. For images already of the target size the inputs are identical.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
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

__all__ = ["HPSv3", "HPSv3Config", "REWARD_TOKEN", "patchify", "prompt_template", "smart_resize"]

REWARD_TOKEN = "<|Reward|>"
PROMPT_TEMPLATE_FILE = Path(__file__).with_name("hpsv3_prompt.txt")


def prompt_template() -> str:
    """The HPSv3 instruction, with ``{text_prompt}`` where the prompt goes.

    It is the model's input format, reproduced verbatim (the checkpoint was trained on it).
    """
    return PROMPT_TEMPLATE_FILE.read_text(encoding="utf-8")


def _checkpoint_file(checkpoint: str) -> str:
    if os.path.isfile(checkpoint):
        return checkpoint
    if os.path.isdir(checkpoint):
        for name in ("HPSv3.safetensors", "model.safetensors"):
            if os.path.isfile(os.path.join(checkpoint, name)):
                return os.path.join(checkpoint, name)
        raise FlowrlError(f"no HPSv3.safetensors in directory '{checkpoint}'", where="reward 'hpsv3': checkpoint")
    hub = require("huggingface_hub", extra="rewards", purpose="downloading the HPSv3 checkpoint")
    try:
        return hub.hf_hub_download(checkpoint, "HPSv3.safetensors")
    except Exception as exc:  # offline, unknown repo, gated: all mean "no checkpoint"
        raise FlowrlError(
            f"cannot get the HPSv3 checkpoint '{checkpoint}': {type(exc).__name__}: {exc}",
            where="reward 'hpsv3': checkpoint",
            hint="pass a local file: checkpoint = '/path/HPSv3.safetensors' (from the MizzenAI/HPSv3 hub repo)",
        ) from exc


@dataclasses.dataclass(frozen=True)
class HPSv3Config(PlacementConfig):
    checkpoint: str = param(
        "MizzenAI/HPSv3",
        "HPSv3 weights: a local HPSv3.safetensors (or .pt) file or directory, or a hub repo id "
        "(downloads HPSv3.safetensors, 16.5 GB).", path="hub",
    )
    base_model: str = param(
        "Qwen/Qwen2-VL-7B-Instruct",
        "Qwen2-VL config and tokenizer (hub id or directory); its weights are not loaded.", path="hub",
    )
    pixels: int = param(200704, "Image area the model sees (HPSv3 fixes 256*28*28 = 200704: 448x448 for a square image).", min=784)
    batch_size: int = param(8, "Images scored per forward pass (scores do not depend on it).", min=1)

    memory_note = "Qwen2-VL-7B, 8.29e9 params"

    def memory_bytes(self) -> int:
        return self.weight_bytes(8.29e9)  # Qwen2-VL-7B-Instruct and HPSv3's head


class HPSv3(ModelReward):
    """HPSv3 human preference (Qwen2-VL reward model), native on transformers >= 4.52; score = mu."""

    Config = HPSv3Config

    def __init__(self, config: HPSv3Config):
        self.name = "hpsv3"
        ensure_torchvision_importable()  # a broken CUDA torchvision breaks transformers' imports
        transformers = require_qwen2_vl("hpsv3")
        base = config.base_model
        try:
            model_config = transformers.AutoConfig.from_pretrained(base)
            tokenizer = transformers.AutoTokenizer.from_pretrained(base)
        except (OSError, ValueError) as exc:
            raise FlowrlError(f"cannot load the Qwen2-VL config/tokenizer '{base}': {exc}", where="reward 'hpsv3': base_model",
                              hint="pass a local directory with config.json and the tokenizer files") from exc
        tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
        tokenizer.padding_side = "right"
        self.tokenizer = tokenizer
        self.reward_token_id = tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.image_token_id = model_config.image_token_id

        state = load_state_dict(_checkpoint_file(config.checkpoint), "hpsv3")
        backbone_state, head_state = split_checkpoint(state, "hpsv3")
        core = build_core(transformers, model_config, backbone_state, "hpsv3",
                          hint="base_model must be the model HPSv3 was trained from")
        rows = core.get_input_embeddings().weight.shape[0]
        if self.reward_token_id >= rows:
            raise FlowrlError(
                f"token {REWARD_TOKEN} has id {self.reward_token_id} but the checkpoint embeds only {rows} tokens",
                where="reward 'hpsv3'", hint="base_model must be the tokenizer HPSv3 was trained with (Qwen2-VL-7B-Instruct)",
            )
        self.head = RewardHead(head_state, "hpsv3")
        self.core = core
        self.module = nn.ModuleDict({"core": core, "head": self.head})

        vision = model_config.vision_config
        pre = read_preprocessor_config(base)
        self.patch = int(pre.get("patch_size", getattr(vision, "patch_size", 14)))
        self.merge = int(pre.get("merge_size", getattr(vision, "spatial_merge_size", 2)))
        self.temporal = int(pre.get("temporal_patch_size", getattr(vision, "temporal_patch_size", 2)))
        self.mean = tuple(pre.get("image_mean", OPENAI_MEAN))
        self.std = tuple(pre.get("image_std", OPENAI_STD))
        self.pixels = config.pixels
        self.template = prompt_template()
        self._setup_placement(config)

    def _setup_placement(self, config):
        super()._setup_placement(config)
        self.head.float()  # the package keeps the head in float32 whatever the backbone's dtype

    # ---- inputs

    def _text(self, prompt: str, image_tokens: int) -> str:
        messages = [{"role": "user", "content": [
            {"type": "image"},
            {"type": "text", "text": self.template.replace("{text_prompt}", prompt)},
        ]}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if isinstance(text, list):
            text = text[0]
        if text.count("<|image_pad|>") != 1:
            raise FlowrlError("the chat template must place exactly one image", where="reward 'hpsv3': base_model")
        return text.replace("<|image_pad|>", "<|image_pad|>" * image_tokens)

    def _score_batch(self, images, prompts, metadata):
        factor = self.patch * self.merge
        h, w = smart_resize(images.shape[-2], images.shape[-1], factor, self.pixels, self.pixels)
        pixels = normalise(resize_to(images, h, w), self.mean, self.std)
        patches, grids = [], []
        for image in pixels:
            p, grid = patchify(image, self.patch, self.merge, self.temporal)
            patches.append(p)
            grids.append(grid)
        image_tokens = (h // self.patch) * (w // self.patch) // self.merge**2
        texts = [self._text(p, image_tokens) for p in prompts]
        tok = self.tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
        ids = tok["input_ids"].to(self.device)
        mask = tok["attention_mask"].to(self.device)
        is_reward = ids == self.reward_token_id
        if not bool(is_reward.any(dim=1).all()):
            raise FlowrlError(f"a prompt lost the {REWARD_TOKEN} token (truncated?)", where="reward 'hpsv3'")
        # The last <|Reward|> of each row (a prompt could itself contain the literal token).
        positions = torch.arange(ids.shape[1], device=self.device)
        reward_at = torch.where(is_reward, positions, -1).max(dim=1).values

        grid = torch.tensor(grids, device=self.device)
        hidden = language_forward(self.core, ids, mask, torch.cat(patches), grid, self.image_token_id)
        picked = hidden[torch.arange(ids.shape[0], device=self.device), reward_at].float()
        out = self.head(picked)
        return {"scores": out[:, 0], "hpsv3_sigma": out[:, 1]} if out.shape[1] > 1 else {"scores": out[:, 0]}
