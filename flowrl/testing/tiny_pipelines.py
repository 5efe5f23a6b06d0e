"""Tiny, randomly initialised diffusers pipelines built offline, for tests.

:func:`build_tiny_flux` and :func:`build_tiny_sd3` write a complete pipeline directory (real
diffusers / transformers classes, a few thousand parameters each) that ``from_pretrained``
loads with ``HF_HUB_OFFLINE=1``. Nothing is downloaded: the tokenizers are written here (a CLIP
byte-level BPE vocabulary with a handful of merges, a T5 Unigram vocabulary of a few words and
the letters), the weights are random with a fixed seed.

The shape rules these follow (found by building them; each is checked by diffusers or transformers):

- FLUX: transformer ``in_channels`` = 4 x the VAE's ``latent_channels`` (2x2 packing);
  ``sum(axes_dims_rope)`` = ``attention_head_dim``; the CLIP ``eos_token_id`` is the tokenizer's;
  ``max_position_embeddings`` >= the CLIP tokenizer's length (77, what the pipeline pads to);
  a dynamic-shift scheduler carries its ``base_*`` / ``max_*`` keys.
- SD3: two ``CLIPTextModelWithProjection`` and a T5; T5 width >= 2 x the CLIP hidden size;
  ``joint_attention_dim`` = T5 ``d_model``; ``pooled_projection_dim`` = 2 x CLIP ``projection_dim``.

Images are 32 x 32 by default (VAE scale factor 2: latents 16 x 16).

:func:`build_tiny_qwen_image`, :func:`build_tiny_flux2_klein` and :func:`build_tiny_zimage`
write Qwen-Image, FLUX.2 [klein] and Z-Image pipelines the same way. Their text encoders are
tiny Qwen models behind a byte-level BPE Qwen2 tokenizer written here (:func:`qwen_tokenizer`,
every byte a token, the chat special tokens, a chat template with the ``enable_thinking``
switch). Their rules:

- Qwen-Image: transformer ``in_channels`` = 4 x the VAE's ``z_dim`` and ``out_channels`` = ``z_dim``;
  ``sum(axes_dims_rope)`` = ``attention_head_dim``; ``joint_attention_dim`` = the Qwen2.5-VL text
  width; the pipeline drops the first 34 tokens of its system template, so the tokenizer here
  reads that template prefix as exactly 34 tokens (one added token covers most of it) and the
  embeddings hold only the prompt; the VAE's spatial factor is ``2 ** len(temperal_downsample)``.
- FLUX.2 [klein]: transformer ``in_channels`` = 4 x the VAE's ``latent_channels``;
  ``sum(axes_dims_rope)`` (4 axes) = ``attention_head_dim``; the pipeline concatenates Qwen3 hidden
  states 9, 18 and 27, so the Qwen3 has 28 layers and ``joint_attention_dim`` = 3 x its width;
  the VAE's batch-norm statistics are set to non-trivial values so that decoding tests them.
- Z-Image: transformer ``in_channels`` = the VAE's ``latent_channels``; ``dim / n_heads`` =
  ``sum(axes_dims)``; ``cap_feat_dim`` = the Qwen3 width (its second-to-last hidden state is used).

:func:`build_tiny_wan` writes a Wan 2.1 text-to-video pipeline: a UMT5 encoder behind the T5
tokenizer above, a Wan VAE and a WanTransformer3DModel. Its rules: transformer ``in_channels`` =
``out_channels`` = the VAE's ``z_dim``; ``text_dim`` = the UMT5 ``d_model``; the VAE's spatial
factor is ``2 ** len(temperal_downsample)`` and its temporal factor ``2 ** sum(temperal_downsample)``
(here both 4, like the real VAE's time axis: 5 frames of 32 x 32 are latents ``[4, 2, 8, 8]``);
``latents_mean`` / ``latents_std`` have ``z_dim`` entries (non-trivial here, so that decoding tests
the de-normalisation).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..compat import ensure_torchvision_importable

# every builder imports diffusers, which imports transformers, which imports torchvision
ensure_torchvision_importable()

__all__ = [
    "build_tiny_flux", "build_tiny_sd3", "build_tiny_qwen_image", "build_tiny_flux2_klein", "build_tiny_zimage",
    "build_tiny_flux_kontext", "build_tiny_qwen_image_edit", "build_tiny_wan", "build_tiny_wan22", "build_tiny_wan22_a14b",
    "build_tiny_ltx",
    "clip_tokenizer", "t5_tokenizer", "qwen_tokenizer", "TINY_PROMPTS",
]

#: Prompts whose words the tiny tokenizers know (any text works; unknown words split into letters).
TINY_PROMPTS = ["a red cat", "the blue dog", "a dog on the red mat", "a cat"]

_CLIP_MAX_LENGTH = 77  # FluxPipeline / SD3 pad CLIP prompts to the tokenizer's model_max_length


def _byte_alphabet() -> list[str]:
    """The 256 printable stand-ins of GPT-2 / CLIP byte-level BPE, in byte order."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def clip_tokenizer():
    """A CLIP tokenizer: every byte (plain and word-final), three merges, the two specials."""
    from transformers import CLIPTokenizer

    alphabet = _byte_alphabet()
    vocab: dict[str, int] = {}
    for c in alphabet:
        vocab[c] = len(vocab)
    for c in alphabet:
        vocab[c + "</w>"] = len(vocab)
    merges = [("t", "h"), ("th", "e</w>"), ("c", "a")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=_CLIP_MAX_LENGTH)


def t5_tokenizer():
    """A T5 (Unigram) tokenizer over a few whole words and the 26 letters."""
    from transformers import T5Tokenizer

    words = ["a", "the", "red", "blue", "cat", "dog", "on", "mat"]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [("\u2581" + w, -2.0) for w in words] + [("\u2581", -3.0)]
    vocab += [(chr(c), -5.0) for c in range(ord("a"), ord("z") + 1)]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=512)


def _clip_config(tok, *, hidden: int, projection: int):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=_CLIP_MAX_LENGTH,
        projection_dim=projection,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )


def _t5(tok, d_model: int):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=len(tok), d_model=d_model, d_ff=2 * d_model, d_kv=d_model // 2, num_layers=1,
        num_heads=2, relative_attention_num_buckets=8, decoder_start_token_id=0,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    )
    return T5EncoderModel(config)


def _vae(latent_channels: int, *, scaling_factor: float, shift_factor: float | None, quant_conv: bool):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16), layers_per_block=1, latent_channels=latent_channels,
        norm_num_groups=8, sample_size=32, scaling_factor=scaling_factor, shift_factor=shift_factor,
        use_quant_conv=quant_conv, use_post_quant_conv=quant_conv,
    )


def build_tiny_flux(path: str | Path, *, guidance_embeds: bool = True, seed: int = 0) -> Path:
    """Write a tiny FLUX.1 pipeline to ``path`` (guidance-distilled like FLUX.1-dev by default;
    ``guidance_embeds=False`` is schnell-like). Returns ``path``."""
    from diffusers import FluxPipeline

    path = Path(path)
    torch.manual_seed(seed)
    FluxPipeline(**_flux_parts(guidance_embeds)).save_pretrained(path)
    return path


def _flux_parts(guidance_embeds: bool) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel

    tok, tok2 = clip_tokenizer(), t5_tokenizer()
    text_encoder = CLIPTextModel(_clip_config(tok, hidden=32, projection=32))
    text_encoder_2 = _t5(tok2, 32)
    latent_channels = 4
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * latent_channels, num_layers=1, num_single_layers=1,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
        pooled_projection_dim=32, guidance_embeds=guidance_embeds, axes_dims_rope=[4, 6, 6],
    )
    vae = _vae(latent_channels, scaling_factor=0.5, shift_factor=0.1, quant_conv=False)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok,
                text_encoder_2=text_encoder_2, tokenizer_2=tok2, transformer=transformer)


def build_tiny_flux_kontext(path: str | Path, *, seed: int = 0) -> Path:
    """Write a tiny FLUX.1 Kontext pipeline to ``path``: the tiny FLUX.1 parts (guidance-distilled
    like Kontext-dev) in a FluxKontextPipeline. Returns ``path``."""
    from diffusers import FluxKontextPipeline

    path = Path(path)
    torch.manual_seed(seed)
    FluxKontextPipeline(**_flux_parts(True)).save_pretrained(path)
    return path


def build_tiny_sd3(path: str | Path, *, seed: int = 0) -> Path:
    """Write a tiny Stable Diffusion 3 pipeline to ``path``. Returns ``path``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    path = Path(path)
    torch.manual_seed(seed)
    tok, tok_2, tok_3 = clip_tokenizer(), clip_tokenizer(), t5_tokenizer()
    clip_hidden, clip_proj, t5_width = 16, 16, 32
    text_encoder = CLIPTextModelWithProjection(_clip_config(tok, hidden=clip_hidden, projection=clip_proj))
    text_encoder_2 = CLIPTextModelWithProjection(_clip_config(tok_2, hidden=clip_hidden, projection=clip_proj))
    text_encoder_3 = _t5(tok_3, t5_width)
    latent_channels = 4
    transformer = SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=latent_channels, num_layers=1,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=t5_width,
        caption_projection_dim=16, pooled_projection_dim=2 * clip_proj, out_channels=latent_channels,
        pos_embed_max_size=16,
    )
    vae = _vae(latent_channels, scaling_factor=1.5, shift_factor=0.05, quant_conv=False)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=vae,
        text_encoder=text_encoder, tokenizer=tok, text_encoder_2=text_encoder_2, tokenizer_2=tok_2,
        text_encoder_3=text_encoder_3, tokenizer_3=tok_3,
    )
    pipe.save_pretrained(path)
    return path


# ---------------------------------------------------------------- Qwen-Image, FLUX.2 [klein], Z-Image

#: A Qwen-style chat template: user / assistant turns, and an empty think block when the caller
#: passes ``enable_thinking=False`` (what FLUX.2 [klein] does; Z-Image passes True).
_QWEN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
_QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
#: What QwenImagePipeline puts before the prompt; it drops the first 34 tokens of the encoding.
_QWEN_IMAGE_PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)
_QWEN_IMAGE_DROP = 34
#: Qwen-Image-Edit's prefix up to the user turn; the pipeline drops the first 64 tokens, so the kept
#: embeddings start at the condition image's vision tokens.
_QWEN_EDIT_PREFIX = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n"
)
_QWEN_EDIT_DROP = 64
_QWEN_VISION_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def qwen_tokenizer(*, image_template_tokens: int | None = None, edit_template_tokens: int | None = None,
                   vision_tokens: bool = False):
    """A byte-level BPE Qwen2 tokenizer: every byte a token (no merges), the chat specials and a
    chat template. With ``image_template_tokens = n``, Qwen-Image's system-template prefix
    tokenizes to exactly ``n`` tokens (one added token stands for a stretch of its text); with
    ``edit_template_tokens = n`` the same for Qwen-Image-Edit's prefix (up to the user turn).
    ``vision_tokens`` adds Qwen2-VL's ``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>`` and ``<|video_pad|>``."""
    from transformers import Qwen2Tokenizer

    vocab = {c: i for i, c in enumerate(_byte_alphabet())}  # no merges: one token per byte
    specials = _QWEN_SPECIALS + (_QWEN_VISION_SPECIALS if vision_tokens else [])
    for token in specials:
        vocab[token] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], additional_special_tokens=specials[1:], model_max_length=4096)
    tok.chat_template = _QWEN_CHAT_TEMPLATE
    for prefix, wanted in ((_QWEN_IMAGE_PREFIX, image_template_tokens), (_QWEN_EDIT_PREFIX, edit_template_tokens)):
        if wanted is not None:
            _shorten_template(tok, prefix, wanted)
    return tok


def _shorten_template(tok, prefix: str, wanted: int) -> None:
    """Add one token for the start of ``prefix``'s system text so that ``prefix`` is ``wanted`` tokens."""
    n = len(tok(prefix).input_ids)
    text = prefix[len("<|im_start|>system\n"):]
    # replacing k plain characters (one token each) by one added token removes k - 1 tokens
    k = n - wanted + 1
    if not 1 <= k <= text.index("<|im_end|>"):
        raise ValueError(f"cannot make the template {wanted} tokens long (it is {n})")
    tok.add_tokens([text[:k]])
    assert len(tok(prefix).input_ids) == wanted


def _qwen3(tok, *, hidden: int, layers: int, model: str = "Qwen3Model"):
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2, max_position_embeddings=1024,
        bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    return getattr(transformers, model)(config)


def build_tiny_qwen_image(path: str | Path, *, seed: int = 0) -> Path:
    """Write a tiny Qwen-Image pipeline to ``path`` (Qwen2.5-VL text encoder, Wan-style 3-D VAE,
    dynamic-shift scheduler with a terminal shift like Qwen-Image's). Returns ``path``."""
    from diffusers import QwenImagePipeline

    path = Path(path)
    torch.manual_seed(seed)
    tok = qwen_tokenizer(image_template_tokens=_QWEN_IMAGE_DROP)
    parts = _qwen_image_parts(tok)
    QwenImagePipeline(tokenizer=tok, **parts).save_pretrained(path)
    return path


def build_tiny_qwen_image_edit(path: str | Path, *, seed: int = 0) -> Path:
    """Write a tiny Qwen-Image-Edit pipeline to ``path``: Qwen-Image's parts, a Qwen2.5-VL whose
    vision tower reads the condition image (patch 4, merge 2, so a 32 x 32 image is 16 vision
    tokens), and a Qwen2-VL processor. Returns ``path``."""
    from diffusers import QwenImageEditPipeline
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    path = Path(path)
    torch.manual_seed(seed)
    tok = qwen_tokenizer(edit_template_tokens=_QWEN_EDIT_DROP, vision_tokens=True)
    parts = _qwen_image_parts(tok, vision=True)
    images = Qwen2VLImageProcessor(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8,
                                   max_pixels=64 * 64)
    videos = Qwen2VLVideoProcessor(patch_size=4, merge_size=2, temporal_patch_size=2)
    processor = Qwen2VLProcessor(image_processor=images, tokenizer=tok, video_processor=videos)
    QwenImageEditPipeline(tokenizer=tok, processor=processor, **parts).save_pretrained(path)
    return path


def _qwen_image_parts(tok, *, vision: bool = False) -> dict:
    """Text encoder, VAE, transformer and scheduler of the tiny Qwen-Image pipelines."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    width = 32
    ids = dict(bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if vision:  # the vision tower reads the image between these tokens
        ids.update({f"{name}_token_id": tok.convert_tokens_to_ids(token) for name, token in (
            ("image", "<|image_pad|>"), ("vision_start", "<|vision_start|>"), ("vision_end", "<|vision_end|>"))})
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=width, intermediate_size=2 * width, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                         **{k: v for k, v in ids.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=width,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2, window_size=16,
                           fullatt_block_indexes=[0]),
        vocab_size=len(tok), **ids,
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(config)
    z_dim = 4
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=z_dim, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[], temperal_downsample=[False],
        latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 1.2, 2.0],
    )
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * z_dim, out_channels=z_dim, num_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=width, axes_dims_rope=(4, 6, 6),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
        max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    )
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, transformer=transformer)


def build_tiny_flux2_klein(path: str | Path, *, distilled: bool = False, seed: int = 0) -> Path:
    """Write a tiny FLUX.2 [klein] pipeline to ``path``: undistilled like klein-base (CFG) by
    default, step-distilled (``is_distilled``, no CFG) with ``distilled=True``. Returns ``path``."""
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )

    path = Path(path)
    torch.manual_seed(seed)
    tok = qwen_tokenizer()
    width = 16
    text_encoder = _qwen3(tok, hidden=width, layers=28, model="Qwen3ForCausalLM")  # layers 9, 18, 27 are read
    latent_channels = 4
    vae = AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16), layers_per_block=1, latent_channels=latent_channels, norm_num_groups=8,
        sample_size=32,
    )
    with torch.no_grad():  # random statistics, so that decoding exercises the de-normalisation
        vae.bn.running_mean.copy_(0.1 * torch.randn(4 * latent_channels))
        vae.bn.running_var.copy_(0.5 + torch.rand(4 * latent_channels))
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * latent_channels, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=3 * width, timestep_guidance_channels=32, mlp_ratio=2.0,
        axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, time_shift_type="exponential", base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    pipe = Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok,
                              transformer=transformer, is_distilled=distilled)
    pipe.save_pretrained(path)
    return path


def build_tiny_zimage(path: str | Path, *, seed: int = 0) -> Path:
    """Write a tiny Z-Image pipeline to ``path`` (Qwen3 text encoder, AutoencoderKL, static shift 3
    like Z-Image-Turbo's scheduler). Returns ``path``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    path = Path(path)
    torch.manual_seed(seed)
    tok = qwen_tokenizer()
    width = 32
    text_encoder = _qwen3(tok, hidden=width, layers=2)  # hidden_states[-2] is read
    latent_channels = 4
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=latent_channels, dim=32, n_layers=1,
        n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=width, axes_dims=[4, 6, 6], axes_lens=[256, 64, 64],
    )
    vae = _vae(latent_channels, scaling_factor=0.6, shift_factor=0.1, quant_conv=False)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok,
                          transformer=transformer)
    pipe.save_pretrained(path)
    return path


def _umt5(tok, width: int):
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(
        vocab_size=len(tok), d_model=width, d_ff=2 * width, d_kv=width // 2, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    ))


def build_tiny_wan(path: str | Path, *, seed: int = 0) -> Path:
    """Write a tiny Wan 2.1 text-to-video pipeline to ``path`` (UMT5 text encoder, Wan VAE with 4x
    temporal compression, the published UniPC flow scheduler with shift 3). Returns ``path``."""
    from diffusers import WanPipeline

    path = Path(path)
    WanPipeline(**_tiny_wan_parts(seed)).save_pretrained(path)
    return path


def _tiny_wan_parts(seed: int) -> dict:
    """The components of :func:`build_tiny_wan`'s pipeline, built with ``seed``."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel

    torch.manual_seed(seed)
    tok = t5_tokenizer()
    width = 32
    text_encoder = _umt5(tok, width)
    z_dim = 4
    vae = AutoencoderKLWan(
        base_dim=8, z_dim=z_dim, dim_mult=[1, 2, 2], num_res_blocks=1, attn_scales=[],
        temperal_downsample=[True, True], latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 1.2, 2.0],
        scale_factor_spatial=4, scale_factor_temporal=4,  # what the pipelines read (their defaults: 8 and 4)
    )
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=z_dim, out_channels=z_dim,
        text_dim=width, freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=32,
    )
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                        num_train_timesteps=1000)
    return {"tokenizer": tok, "text_encoder": text_encoder, "vae": vae, "transformer": transformer,
            "scheduler": scheduler}


def build_tiny_wan22_a14b(path: str | Path, *, seed: int = 0, image_to_video: bool = False) -> Path:
    """Write a tiny Wan 2.2 A14B-like pipeline to ``path``: :func:`build_tiny_wan`'s components with a
    second transformer of the same architecture and its own random weights (``transformer_2``, the
    low-noise expert) and the pipeline's ``boundary_ratio`` (T2V A14B's 0.875). With
    ``image_to_video``, a WanImageToVideoPipeline as Wan2.2-I2V-A14B's: boundary 0.9, no image
    encoder, transformers reading latents + 4 mask + image-latent channels. Returns ``path``."""
    from diffusers import WanImageToVideoPipeline, WanPipeline, WanTransformer3DModel

    path = Path(path)
    parts = _tiny_wan_parts(seed)
    config = dict(parts["transformer"].config)
    if image_to_video:
        z = config["out_channels"]
        config["in_channels"] = z + 4 + z  # the VAE's temporal factor of mask channels
        torch.manual_seed(seed + 2)
        parts["transformer"] = WanTransformer3DModel.from_config(config)
    torch.manual_seed(seed + 1)
    second = WanTransformer3DModel.from_config(config)
    if image_to_video:
        WanImageToVideoPipeline(**parts, transformer_2=second, boundary_ratio=0.9).save_pretrained(path)
    else:
        WanPipeline(**parts, transformer_2=second, boundary_ratio=0.875).save_pretrained(path)
    return path


def build_tiny_wan22(path: str | Path, *, seed: int = 0) -> Path:
    """Write a tiny Wan 2.2 TI2V-5B-like pipeline to ``path``: the 2.2 VAE's architecture (residual
    blocks, 2 x 2 pixels folded into 12 input channels, ``patch_size = 2``), the pipeline's
    ``expand_timesteps``, UniPC with shift 5. Returns ``path``."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    path = Path(path)
    torch.manual_seed(seed)
    tok = t5_tokenizer()
    width = 32
    z_dim = 6
    vae = AutoencoderKLWan(
        base_dim=8, decoder_base_dim=12, z_dim=z_dim, dim_mult=[1, 2, 2], num_res_blocks=1, attn_scales=[],
        temperal_downsample=[True, True], is_residual=True, in_channels=12, out_channels=12, patch_size=2,
        scale_factor_spatial=8, scale_factor_temporal=4,
        latents_mean=[0.1, -0.2, 0.3, 0.0, 0.05, -0.1], latents_std=[1.5, 0.8, 1.2, 2.0, 0.9, 1.1],
    )
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=z_dim, out_channels=z_dim,
        text_dim=width, freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=32,
    )
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0,
                                        num_train_timesteps=1000)
    WanPipeline(tokenizer=tok, text_encoder=_umt5(tok, width), vae=vae, transformer=transformer,
                scheduler=scheduler, expand_timesteps=True).save_pretrained(path)
    return path


def build_tiny_ltx(path: str | Path, *, timestep_conditioning: bool = False, seed: int = 0) -> Path:
    """Write a tiny LTX-Video pipeline to ``path``: a T5 encoder, an LTX VAE with the published
    layout (4 x 4 pixels folded into channels, causal encoder, non-trivial latent statistics) but
    two down-sampling stages (spatial factor 16, temporal 4), an LTXVideoTransformer3DModel, and
    FlowMatchEuler with the published dynamic shift and shift_terminal. ``timestep_conditioning``:
    a VAE whose decoder takes a timestep (LTX-Video 0.9.1+), with three stages (the published
    factors 32 and 8; diffusers' timestep-conditioned decoder wants equal decoder widths).
    Returns ``path``."""
    from diffusers import (
        AutoencoderKLLTXVideo,
        FlowMatchEulerDiscreteScheduler,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )

    path = Path(path)
    torch.manual_seed(seed)
    tok = t5_tokenizer()
    width = 32
    channels = 8
    if timestep_conditioning:
        vae = AutoencoderKLLTXVideo(
            latent_channels=channels, block_out_channels=(8, 16, 16, 16), decoder_block_out_channels=(16, 16, 16),
            layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
            spatio_temporal_scaling=(True, True, True, False), decoder_spatio_temporal_scaling=(True, True, True),
            decoder_inject_noise=(False,) * 4, upsample_residual=(False,) * 3, upsample_factor=(1,) * 3,
            timestep_conditioning=True,
        )
    else:
        vae = AutoencoderKLLTXVideo(
            latent_channels=channels, block_out_channels=(8, 16, 16), decoder_block_out_channels=(8, 16, 16),
            layers_per_block=(1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
            spatio_temporal_scaling=(True, True, False), decoder_spatio_temporal_scaling=(True, True, False),
            decoder_inject_noise=(False, False, False, False), down_block_types=("LTXVideoDownBlock3D",) * 3,
            downsample_type=("conv",) * 3, upsample_residual=(False,) * 3, upsample_factor=(1,) * 3,
            patch_size=4, patch_size_t=1,
        )
    with torch.no_grad():
        vae.latents_mean.copy_(torch.linspace(-0.3, 0.3, channels))
        vae.latents_std.copy_(torch.linspace(0.6, 1.8, channels))
    transformer = LTXVideoTransformer3DModel(
        in_channels=channels, out_channels=channels, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, num_layers=1, caption_channels=width,
    )
    # Lightricks/LTX-Video's scheduler config (the dynamic shift's constants, shift_terminal 0.1)
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_image_seq_len=1024, max_image_seq_len=4096, base_shift=0.95, max_shift=2.05,
        shift_terminal=0.1,
    )
    LTXPipeline(tokenizer=tok, text_encoder=_t5(tok, width), vae=vae, transformer=transformer,
                scheduler=scheduler).save_pretrained(path)
    return path
