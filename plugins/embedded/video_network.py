"""The embedded text-to-video model: the embedded image model's tiny FLUX transformer over
space-time tokens.

- latent of a clip ``[F, 16, 48]``: every 16x16 frame goes through the image model's lossless
  stand-in "VAE" (2x2 pixel-unshuffle of [-1, 1] pixels -> 12 x 8 x 8) and FLUX's 2x2 packing
  (-> 16 tokens x 48 channels), so the frames axis stays a separate axis of the latent;
- the transformer sees the ``F * 16`` tokens of a clip as one sequence (full space-time
  attention), and tells them apart by FLUX's 3-axis RoPE, ids ``(frame, row, col)``: the first
  axis, which the image model leaves at 0, carries time here (as video DiTs' 3-D RoPE does);
- the text encoder is the image model's (token + position embeddings, pooled linear map) over the
  video grammar's vocabulary, 10 tokens.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from flowrl.compat import ensure_torchvision_importable

from .dataset import COLOUR_NAMES, SHAPES
from .network import TextEncoder, WordTokenizer, decode, encode_images, load_model, pack, save_model, unpack
from .video_dataset import DIRECTION_NAMES, FRAME_SIZE, FRAMES

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
WEIGHTS_PATH = WEIGHTS_DIR / "embedded_video.safetensors"

VIDEO_VOCAB = ["<pad>", "<unk>", "a", "on", "background", "moving"] + COLOUR_NAMES + SHAPES + DIRECTION_NAMES
#: the image model's transformer (so its weights can start the video model), 3-axis RoPE.
VIDEO_TRANSFORMER_CONFIG = dict(
    patch_size=1, in_channels=48, out_channels=48, num_layers=1, num_single_layers=2, attention_head_dim=32,
    num_attention_heads=4, joint_attention_dim=64, pooled_projection_dim=64, guidance_embeds=False,
    axes_dims_rope=[8, 12, 12],
)
VIDEO_TEXT_CONFIG = dict(max_length=10, dim=64)
LATENT_HW = FRAME_SIZE // 2  # 8: the unshuffled frame
TOKENS_PER_FRAME = (LATENT_HW // 2) ** 2  # 16


def encode_clips(clips: torch.Tensor) -> torch.Tensor:
    """Clips ``[B, F, 3, H, W]`` in [0, 1] -> latents ``[B, F, tokens, 48]``."""
    b, f = clips.shape[:2]
    packed = pack(encode_images(clips.flatten(0, 1)))
    return packed.view(b, f, *packed.shape[1:])


def decode_clips(latents: torch.Tensor) -> torch.Tensor:
    """Latents ``[B, F, tokens, 48]`` -> clips ``[B, F, 3, H, W]`` in [0, 1]."""
    b, f = latents.shape[:2]
    frames = decode(unpack(latents.flatten(0, 1), LATENT_HW, LATENT_HW))
    return frames.view(b, f, *frames.shape[1:])


def video_ids(frames: int = FRAMES, height: int = LATENT_HW, width: int = LATENT_HW) -> torch.Tensor:
    """RoPE ids ``[F * h * w, 3]`` = (frame, row, col) of the packed tokens, frame-major."""
    h, w = height // 2, width // 2
    ids = torch.zeros(frames, h, w, 3)
    ids[..., 0] = torch.arange(frames).view(frames, 1, 1)
    ids[..., 1] = torch.arange(h).view(1, h, 1)
    ids[..., 2] = torch.arange(w).view(1, 1, w)
    return ids.view(-1, 3)


class EmbeddedT2V(nn.Module):
    """Tokenizer + text encoder + tiny FLUX transformer with space-time RoPE + lossless pixel "VAE"."""

    frames = FRAMES
    frame_size = FRAME_SIZE
    latent_shape = (FRAMES, TOKENS_PER_FRAME, 48)

    def __init__(self, transformer_config: dict | None = None, text_config: dict | None = None, vocab=None):
        super().__init__()
        ensure_torchvision_importable()  # as the image model: a CUDA torchvision on a CPU machine breaks diffusers' import
        from diffusers import FluxTransformer2DModel

        self.transformer_config = dict(transformer_config or VIDEO_TRANSFORMER_CONFIG)
        self.text_config = dict(text_config or VIDEO_TEXT_CONFIG)
        self.tokenizer = WordTokenizer(vocab or VIDEO_VOCAB, self.text_config["max_length"])
        tc = dict(self.transformer_config, axes_dims_rope=tuple(self.transformer_config["axes_dims_rope"]))
        self.transformer = FluxTransformer2DModel(**tc)
        self.text_encoder = TextEncoder(len(self.tokenizer.vocab), self.text_config["max_length"], self.text_config["dim"])
        self.register_buffer("img_ids", video_ids(), persistent=False)
        self.register_buffer("txt_ids", torch.zeros(self.text_config["max_length"], 3), persistent=False)

    encode_clips = staticmethod(encode_clips)
    decode_clips = staticmethod(decode_clips)

    def encode_prompts(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.text_encoder(self.tokenizer(list(prompts)).to(self.img_ids.device))

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, prompt_embeds: torch.Tensor, pooled: torch.Tensor):
        """Velocity ``[B, F, tokens, 48]`` at ``latents`` of the same shape and ``sigma [B]`` (or scalar)."""
        b = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=latents.dtype, device=latents.device)
        if sigma.dim() == 0:
            sigma = sigma.expand(b)
        out = self.transformer(hidden_states=latents.flatten(1, 2), encoder_hidden_states=prompt_embeds,
                               pooled_projections=pooled, timestep=sigma, img_ids=self.img_ids,
                               txt_ids=self.txt_ids[: prompt_embeds.shape[1]], return_dict=False)[0]
        return out.view(latents.shape)

    def config_dict(self) -> dict:
        return {"transformer": self.transformer_config, "text": self.text_config, "vocab": self.tokenizer.vocab,
                "frames": FRAMES, "frame_size": FRAME_SIZE, "latent_shape": list(self.latent_shape)}


def save_video_weights(model: EmbeddedT2V, out_dir: str | os.PathLike, extra: dict | None = None) -> Path:
    return save_model(model, out_dir, WEIGHTS_PATH.name, extra)


def load_video_pretrained(path: str | os.PathLike | None = None, device: str | torch.device = "cpu") -> EmbeddedT2V:
    """Load the shipped video weights (offline). ``path`` is the safetensors file or its folder."""
    return load_model(EmbeddedT2V, path, WEIGHTS_PATH, device)
