"""Tiny, randomly initialised diffusers pipelines built offline, for tests.

:func:`build_tiny_flux` and :func:`build_tiny_sd3` write a complete pipeline directory (real
diffusers / transformers classes, a few thousand parameters each) that ``from_pretrained``
loads with ``HF_HUB_OFFLINE=1``. Nothing is downloaded: the tokenizers are written here (a CLIP
byte-level BPE vocabulary with a handful of merges, a T5 Unigram vocabulary of a few words and
the letters), the weights are random with a fixed seed.

The shape rules these follow (environment.md, "Tiny offline models"):

- FLUX: transformer ``in_channels`` = 4 x the VAE's ``latent_channels`` (2x2 packing);
  ``sum(axes_dims_rope)`` = ``attention_head_dim``; the CLIP ``eos_token_id`` is the tokenizer's;
  ``max_position_embeddings`` >= the CLIP tokenizer's length (77, what the pipeline pads to);
  a dynamic-shift scheduler carries its ``base_*`` / ``max_*`` keys.
- SD3: two ``CLIPTextModelWithProjection`` and a T5; T5 width >= 2 x the CLIP hidden size;
  ``joint_attention_dim`` = T5 ``d_model``; ``pooled_projection_dim`` = 2 x CLIP ``projection_dim``.

Images are 32 x 32 by default (VAE scale factor 2: latents 16 x 16).
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["build_tiny_flux", "build_tiny_sd3", "clip_tokenizer", "t5_tokenizer", "TINY_PROMPTS"]

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
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    path = Path(path)
    torch.manual_seed(seed)
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
    pipe = FluxPipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok,
        text_encoder_2=text_encoder_2, tokenizer_2=tok2, transformer=transformer,
    )
    pipe.save_pretrained(path)
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
