"""Tiny, randomly initialised reward models built offline, for tests and the HPSv3 parity check.

Qwen2-VL-based: :func:`build_tiny_qwen2_vl` (the base model HPSv3 and VideoReward start from),
:func:`tiny_hpsv3_head`, and :func:`build_tiny_video_align`, a VideoReward checkpoint directory in
the released layout.

Nothing here downloads anything: the tokenizers are written by hand (a byte-level BPE with no
merges, so every byte is a token) and the models are random. They exercise the real loading and
scoring code paths (``CLIPModel.from_pretrained``, ``AutoProcessor.from_pretrained``,
``open_clip.create_model_and_transforms``, Qwen2-VL) at a size that runs in milliseconds.

This module (test support, not a plugin) imports only torch, transformers and tokenizers (and peft,
for the VideoReward checkpoint), and runs on transformers 4.45+ as well as 5.x, because
``scripts/hpsv3_parity.py`` and ``scripts/video_align_parity.py`` load it by file path inside the
separate transformers 4.45 environment of the upstream code.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path


def _torchvision_shim() -> None:
    """Apply flowrl's torchvision shim when flowrl is importable (the parity script's upstream
    environment loads this file by path and applies the shim itself)."""
    try:
        from flowrl.compat import ensure_torchvision_importable
    except ImportError:
        return
    ensure_torchvision_importable()


def byte_unicode() -> dict[int, str]:
    """The reversible byte -> printable character map of byte-level BPE tokenizers."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, (chr(c) for c in chars)))


# ----------------------------------------------------------------------------- CLIP


def write_clip_tokenizer(directory: str | Path) -> int:
    """Write vocab.json / merges.txt of a CLIP tokenizer with no merges; returns the vocab size.

    CLIP marks the last character of each word with ``</w>``, so every byte appears twice.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    symbols = list(byte_unicode().values())
    vocab: dict[str, int] = {}
    for s in symbols:
        vocab[s] = len(vocab)
    for s in symbols:
        vocab[s + "</w>"] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (directory / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    return len(vocab)


def build_tiny_clip(directory: str | Path, *, image_size: int = 32, seed: int = 0, logit_scale: float | None = None):
    """Save a tiny ``CLIPModel`` and its ``CLIPProcessor`` to ``directory``; returns the path.

    The processor resizes the shorter side to ``image_size`` and centre-crops ``image_size``.
    """
    _torchvision_shim()
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    directory = Path(directory)
    vocab_size = write_clip_tokenizer(directory / "tok")
    tokenizer = CLIPTokenizer(str(directory / "tok" / "vocab.json"), str(directory / "tok" / "merges.txt"))
    text = dict(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, projection_dim=16,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=image_size, patch_size=8, projection_dim=16,
    )
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    torch.manual_seed(seed)
    model = CLIPModel(config).eval()
    if logit_scale is not None:
        with torch.no_grad():
            model.logit_scale.fill_(logit_scale)
    tokenizer.model_max_length = 64
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    processor = CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def write_tiny_open_clip_config(directory: str | Path, name: str = "flowrl-tiny-clip", *, image_size: int = 32) -> Path:
    """Write an open_clip model config JSON (the model name is the file stem); returns its path.

    ``vocab_size`` stays 49408 so open_clip's bundled tokenizer fits its embedding table.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = {
        "embed_dim": 16,
        "vision_cfg": {"image_size": image_size, "layers": 2, "width": 32, "patch_size": 8, "head_width": 8},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 4, "layers": 2},
    }
    path = directory / f"{name}.json"
    path.write_text(json.dumps(cfg), encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- Qwen2-VL (HPSv3)

#: Qwen2-VL's special tokens, in the order the tiny tokenizer appends them after the 256 bytes.
QWEN_SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|image_pad|>", "<|video_pad|>",
]

#: A minimal chat template in the Qwen2-VL format (system turn, image or video placeholder, text).
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_qwen2_vl(
    directory: str | Path, *, seed: int = 0, min_pixels: int = 56 * 56, max_pixels: int = 28 * 28 * 1280,
    init_std: float = 0.2,
):
    """Save a tiny ``Qwen2VLForConditionalGeneration`` with its processor to ``directory``.

    Vision: width 32, depth 2, patch 14, merge 2 (as the real model). Language model: width 64,
    2 layers, M-RoPE sections summing to half the head dim. The tokenizer is byte-level BPE with
    no merges plus Qwen2-VL's special tokens. ``init_std`` is larger than the usual 0.02 so the
    random model's output visibly depends on the image and the prompt.
    """
    _torchvision_shim()
    import torch
    import transformers
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    symbols = list(byte_unicode().values())
    vocab = {s: i for i, s in enumerate(symbols)}
    (directory / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (directory / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    major = int(transformers.__version__.split(".")[0])
    specials = dict(unk_token=None, bos_token=None, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    if major >= 5:  # transformers 5 builds tokenizers from in-memory vocab and merges
        tokenizer = transformers.Qwen2Tokenizer(vocab=dict(vocab), merges=[], **specials)
    else:
        tokenizer = transformers.Qwen2TokenizerFast(
            vocab_file=str(directory / "vocab.json"), merges_file=str(directory / "merges.txt"), **specials
        )
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL[1:]})
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    hidden, heads = 64, 4
    head_dim = hidden // heads
    text = dict(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=4096,
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"], initializer_range=init_std,
    )
    assert sum(text["rope_scaling"]["mrope_section"]) * 2 == head_dim
    vision = dict(
        depth=2, embed_dim=32, hidden_size=hidden, num_heads=4, mlp_ratio=2, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, in_channels=3, initializer_range=init_std,
    )
    special = dict(
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )
    if major >= 5:
        config = Qwen2VLConfig(text_config=text, vision_config=vision, **special)
    else:  # 4.x keeps the language model's keys at the top level
        config = Qwen2VLConfig(vision_config=vision, **text, **special)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).eval()
    model.save_pretrained(directory)
    image_processor = _qwen_image_processor(min_pixels=min_pixels, max_pixels=max_pixels)
    if major >= 5:
        # Without torchvision, transformers 5 cannot build Qwen2VLProcessor (its video processor
        # needs torchvision); the native scorer needs only the tokenizer and the image config.
        tokenizer.save_pretrained(directory)
        image_processor.save_pretrained(directory)
    else:
        processor = Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=QWEN_CHAT_TEMPLATE)
        processor.save_pretrained(directory)
    return directory


def _qwen_image_processor(**kwargs):
    import transformers

    # transformers 5 names the PIL backend explicitly; 4.x has only the PIL one.
    cls = getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor
    return cls(**kwargs)


def tiny_hpsv3_head(hidden_size: int, *, seed: int = 1, output_dim: int = 2):
    """A random HPSv3 "ranknet" reward head state dict (hidden -> 1024 -> 16 -> 2 with ReLUs).

    Keys are the official checkpoint's: ``rm_head.0`` (in -> 1024), ``rm_head.3`` (1024 -> 16),
    ``rm_head.5`` (16 -> out); indices 1, 2 and 4 are the ReLU, dropout and ReLU.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    shapes = {"0": (1024, hidden_size), "3": (16, 1024), "5": (output_dim, 16)}
    out = {}
    for idx, (o, i) in shapes.items():
        out[f"rm_head.{idx}.weight"] = torch.randn(o, i, generator=g) / i**0.5
        out[f"rm_head.{idx}.bias"] = torch.randn(o, generator=g) * 0.1
    return out


# ----------------------------------------------------------------------------- VideoReward (VideoAlign)

#: VideoReward's reward tokens, added to Qwen2-VL's tokenizer by its training.
VIDEO_ALIGN_TOKENS = ["<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>"]


def build_tiny_video_align(
    directory: str | Path, *, seed: int = 0, pixels: int = 56 * 56, lora_rank: int = 4, lora_alpha: float = 8.0,
    output_dim: int = 1, step: int = 8, stats: dict[str, float] | None = None,
) -> Path:
    """Write a tiny random VideoReward checkpoint to ``directory`` in the released layout; returns it.

    - ``qwen2-vl/``: the tiny base model (:func:`build_tiny_qwen2_vl`, frames of ``pixels`` area);
    - ``model_config.json``: the training's ``data_config``, ``training_args``, ``model_config``
      (``model_name_or_path`` = the tiny base), ``peft_lora_config`` and ``inference_config``
      (``stats``: ``VQ_mean``, ``VQ_std``, ... ), with the released checkpoint's keys;
    - ``checkpoint-<step>/model.pth``: the state dict of the PEFT-wrapped reward model as the
      training saves it: ``base_model.model.`` prefix, pre-4.52 Qwen2-VL names (``model.layers.*``,
      ``visual.*``), LoRA (``lora_rank``, ``lora_alpha``) on every Linear of the language model
      unmerged (``base_layer``, ``lora_A.default``, ``lora_B.default``; B random, not zero, so
      that merging matters), the embeddings grown by the three reward tokens, ``lm_head`` and a
      bias-free ``rm_head`` ``Linear(hidden, output_dim)``;
    - ``checkpoint-<step>/tokenizer/``: the tokenizer with the reward tokens.
    """
    _torchvision_shim()
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    directory = Path(directory)
    base = build_tiny_qwen2_vl(directory / "qwen2-vl", seed=seed, min_pixels=pixels, max_pixels=pixels)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.add_special_tokens({"additional_special_tokens": VIDEO_ALIGN_TOKENS})
    model = Qwen2VLForConditionalGeneration.from_pretrained(base).eval()
    g = torch.Generator().manual_seed(seed + 1)
    old = model.get_input_embeddings().weight.shape[0]
    # (transformers 4.46+ would fill the new rows from the old ones' statistics: they are overwritten below)
    model.resize_token_embeddings(len(tokenizer), **({"mean_resizing": False} if "mean_resizing" in
                                                     inspect.signature(model.resize_token_embeddings).parameters else {}))
    hidden = model.get_input_embeddings().weight.shape[1]
    with torch.no_grad():
        for weight in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
            weight[old:] = 0.5 * torch.randn(weight.shape[0] - old, hidden, generator=g)
        model.rm_head = torch.nn.Linear(hidden, output_dim, bias=False)
        model.rm_head.weight.copy_(torch.randn(output_dim, hidden, generator=g) / hidden**0.5)
    excluded = ["lm_head", "rm_head", "embed_tokens", "visual"]
    targets = [name for name, module in model.named_modules()
               if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and not any(e in name for e in excluded)]
    peft_model = get_peft_model(model, LoraConfig(target_modules=targets, r=lora_rank, lora_alpha=lora_alpha,
                                                  lora_dropout=0.05, task_type="CAUSAL_LM", bias="none"))
    state = {}
    for key, value in peft_model.state_dict().items():
        if ".lora_B." in key:
            value = 0.2 * torch.randn(value.shape, generator=g)
        for new, legacy in (("base_model.model.model.language_model.", "base_model.model.model."),
                            ("base_model.model.model.visual.", "base_model.model.visual.")):
            if key.startswith(new):
                key = legacy + key.removeprefix(new)
        state[key] = value.detach().clone().contiguous()
    checkpoint = directory / f"checkpoint-{step}"
    checkpoint.mkdir(parents=True, exist_ok=True)
    torch.save(state, checkpoint / "model.pth")
    tokenizer.save_pretrained(checkpoint / "tokenizer")
    settings = _video_align_settings(str(base.resolve()), pixels, lora_rank, lora_alpha, output_dim, stats)
    (directory / "model_config.json").write_text(json.dumps(settings, indent=4), encoding="utf-8")
    return directory


def _video_align_settings(base: str, pixels: int, rank: int, alpha: float, output_dim: int, stats) -> dict:
    """``model_config.json`` with the sections and keys of the released VideoReward checkpoint."""
    stats = stats or {"VQ_mean": 0.5, "VQ_std": 2.0, "MQ_mean": -0.25, "MQ_std": 0.5, "TA_mean": 1.0, "TA_std": 4.0}
    return {
        "data_config": {
            "meta_data": "/path/to/dataset/meta_data.csv", "data_dir": "/path/to/dataset", "meta_data_test": None,
            "max_frame_pixels": pixels, "num_frames": None, "fps": 2.0, "p_shuffle_frames": 0.0, "p_color_jitter": 0.0,
            "eval_dim": ["VQ", "MQ", "TA"], "prompt_template_type": "detailed_special", "add_noise": False,
            "sample_type": "uniform", "use_tied_data": True,
        },
        "training_args": {"output_dir": "rm_output", "bf16": True, "num_train_epochs": 3, "learning_rate": 2e-06,
                          "per_device_train_batch_size": 1, "gradient_accumulation_steps": 4},
        "model_config": {
            "model_name_or_path": base, "model_revision": "main", "output_dim": output_dim, "use_special_tokens": True,
            "freeze_vision_tower": False, "freeze_llm": False, "tune_merger": True, "torch_dtype": "bfloat16",
            "trust_remote_code": False, "attn_implementation": None, "load_in_8bit": False, "load_in_4bit": False,
            "bnb_4bit_quant_type": "nf4", "use_bnb_nested_quant": False, "reward_token": "special", "loss_type": "btt",
        },
        "peft_lora_config": {
            "lora_enable": True, "vision_lora": False, "lora_r": rank, "lora_alpha": alpha, "lora_dropout": 0.05,
            "lora_target_modules": None, "lora_namespan_exclude": ["lm_head", "rm_head", "embed_tokens", "visual"],
            "lora_modules_to_save": None, "lora_task_type": "CAUSAL_LM", "use_rslora": False, "num_lora_modules": -1,
        },
        "inference_config": stats,
    }
