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
import json
import math
import os
from pathlib import Path

import torch
from torch import nn

from flowrl.compat import ensure_torchvision_importable
from flowrl.config import param
from flowrl.errors import FlowrlError, MissingDependencyError, require

from .clip import OPENAI_MEAN, OPENAI_STD
from .common import ModelReward, PlacementConfig, normalise, resize_to

REWARD_TOKEN = "<|Reward|>"
PROMPT_TEMPLATE_FILE = Path(__file__).with_name("hpsv3_prompt.txt")


def prompt_template() -> str:
    """The HPSv3 instruction, with ``{text_prompt}`` where the prompt goes.

    It is the model's input format, reproduced verbatim (the checkpoint was trained on it).
    """
    return PROMPT_TEMPLATE_FILE.read_text(encoding="utf-8")


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


def patchify(pixels: torch.Tensor, patch: int, merge: int, temporal: int) -> tuple[torch.Tensor, list[int]]:
    """One normalised image ``[3, H, W]`` to Qwen2-VL's flattened patches and its (t, h, w) grid.

    A still image is repeated ``temporal`` times along time. Patches are ordered by merge window
    (row-major over windows, then row-major inside each ``merge x merge`` window), and each patch
    is flattened channel-major, then time, then its ``patch x patch`` pixels.
    """
    c, height, width = pixels.shape
    gh, gw = height // patch, width // patch
    frames = pixels.unsqueeze(0).expand(temporal, c, height, width)
    x = frames.reshape(1, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    # axes: grid_t, time, channel, window row, row in window, patch y, window col, col in window, patch x
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gh * gw, c * temporal * patch * patch), [1, gh, gw]


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


def load_state_dict(path: str) -> dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(path, device="cpu")
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(state, dict) and isinstance(state.get("model"), dict):
            state = state["model"]  # training checkpoints wrap the weights
    if not isinstance(state, dict) or not state:
        raise FlowrlError(f"'{path}' holds no state dict", where="reward 'hpsv3': checkpoint")
    return state


def split_checkpoint(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Map checkpoint keys onto ``Qwen2VLModel`` names; return (backbone, reward head) dicts."""
    backbone, head, unknown = {}, {}, []
    for key, value in state.items():
        if key.startswith("rm_head."):
            head[key.removeprefix("rm_head.")] = value
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
            f"unexpected keys in the HPSv3 checkpoint: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}",
            where="reward 'hpsv3': checkpoint",
            hint="expected model.* / visual.* (or model.language_model.* / model.visual.*), lm_head.*, rm_head.*",
        )
    if not head:
        raise FlowrlError("the checkpoint has no reward head (rm_head.*)", where="reward 'hpsv3': checkpoint")
    return backbone, head


def _module_order(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in name.split(".")]


class RewardHead(nn.Module):
    """HPSv3's reward head as stored: Linear layers with ReLU between them (dropout is a no-op
    at inference). Built from the checkpoint's shapes, so the default ``hidden -> 1024 -> 16 ->
    2`` head and a single ``Linear`` (``rm_head.weight``) both load."""

    def __init__(self, state: dict[str, torch.Tensor]):
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
                raise FlowrlError(f"reward head layers do not chain: {a} then {b}", where="reward 'hpsv3': checkpoint")
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


def _read_preprocessor_config(base: str) -> dict:
    if os.path.isdir(base):
        path = os.path.join(base, "preprocessor_config.json")
        return json.loads(Path(path).read_text(encoding="utf-8")) if os.path.isfile(path) else {}
    try:
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(base, "preprocessor_config.json")).read_text(encoding="utf-8"))
    except Exception:  # the defaults below are Qwen2-VL's own
        return {}


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


class HPSv3(ModelReward):
    """HPSv3 human preference (Qwen2-VL reward model), native on transformers >= 4.52; score = mu."""

    Config = HPSv3Config

    def __init__(self, config: HPSv3Config):
        self.name = "hpsv3"
        ensure_torchvision_importable()  # a broken CUDA torchvision breaks transformers' imports
        transformers = require("transformers", extra="rewards", purpose="the 'hpsv3' reward")
        if not hasattr(transformers, "Qwen2VLModel") or not hasattr(transformers, "Qwen2VLTextModel"):
            raise MissingDependencyError(
                f"the 'hpsv3' reward needs transformers >= 4.52 (found {transformers.__version__})",
                hint='pip install -U "transformers>=4.52", or serve the upstream package over HTTP (docs/rewards.md)',
            )
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

        backbone_state, head_state = split_checkpoint(load_state_dict(_checkpoint_file(config.checkpoint)))
        text_config = getattr(model_config, "text_config", model_config)
        embed = backbone_state.get("language_model.embed_tokens.weight")
        if embed is None:
            raise FlowrlError("the checkpoint has no token embeddings (model.embed_tokens.weight)", where="reward 'hpsv3': checkpoint")
        text_config.vocab_size = embed.shape[0]
        if self.reward_token_id >= embed.shape[0]:
            raise FlowrlError(
                f"token {REWARD_TOKEN} has id {self.reward_token_id} but the checkpoint embeds only {embed.shape[0]} tokens",
                where="reward 'hpsv3'", hint="base_model must be the tokenizer HPSv3 was trained with (Qwen2-VL-7B-Instruct)",
            )
        from accelerate import init_empty_weights

        # Parameters on the meta device, buffers (rotary frequencies) real: the checkpoint
        # provides every parameter, so a random init of 7B weights is skipped entirely.
        with init_empty_weights(include_buffers=False):
            core = transformers.Qwen2VLModel(model_config)
        missing, unexpected = core.load_state_dict(backbone_state, strict=False, assign=True)
        if missing or unexpected:
            raise FlowrlError(
                f"checkpoint does not match the Qwen2-VL architecture of '{base}': "
                f"missing {missing[:4]}, unexpected {unexpected[:4]}",
                where="reward 'hpsv3'", hint="base_model must be the model HPSv3 was trained from",
            )
        self.head = RewardHead(head_state)
        self.core = core
        self.module = nn.ModuleDict({"core": core, "head": self.head})

        vision = model_config.vision_config
        pre = _read_preprocessor_config(base)
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

        core = self.core
        dtype = next(core.visual.parameters()).dtype
        grid = torch.tensor(grids, device=self.device)
        vis = core.visual(torch.cat(patches).to(dtype), grid_thw=grid)
        image_embeds = vis if isinstance(vis, torch.Tensor) else vis.pooler_output
        embeds = core.get_input_embeddings()(ids)
        image_mask = (ids == self.image_token_id).unsqueeze(-1).expand_as(embeds)
        embeds = embeds.masked_scatter(image_mask, image_embeds.to(embeds.dtype))
        # Plain positions 0..L-1 on the temporal, height and width axes, as the package feeds.
        pos = positions.view(1, 1, -1).expand(3, ids.shape[0], -1)
        hidden = core.language_model(inputs_embeds=embeds, attention_mask=mask, position_ids=pos).last_hidden_state
        picked = hidden[torch.arange(ids.shape[0], device=self.device), reward_at].float()
        out = self.head(picked)
        return {"scores": out[:, 0], "hpsv3_sigma": out[:, 1]} if out.shape[1] > 1 else {"scores": out[:, 0]}
