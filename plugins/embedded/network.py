"""The embedded default text-to-image model: a tiny FLUX transformer in pixel space.

Pieces (all on the real diffusers FLUX code path):

- ``WordTokenizer``: word-level tokenizer over the grammar vocabulary (lower-cased, whitespace
  split, unknown words -> ``<unk>``), padded / truncated to ``max_length`` = 8.
- ``TextEncoder``: learned token embeddings + learned text-position embeddings (the order of the
  two colour words matters, and FLUX's ``txt_ids`` are zeros, so position must be in the
  embedding) -> ``prompt_embeds [B, L, D]``; ``pooled [B, D]`` = a linear map of the flattened
  sequence (so the adaLN conditioning sees every attribute, in order).
- stand-in "VAE" (lossless, no parameters): image [B,3,32,32] in [0,1] -> scaled to [-1,1] ->
  2x2 pixel-unshuffle -> latent [B,12,16,16]; ``pack`` is FLUX's own 2x2 packing -> [B,64,48].
- ``FluxTransformer2DModel``: ``img_ids`` = (0, row, col) of the 8x8 token grid, ``txt_ids`` = 0,
  ``timestep = sigma``; no guidance embedding (``guidance_embeds=False``; the model is trained
  and sampled without guidance / CFG, velocity ``v ~ eps - x0``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from flowrl.compat import ensure_torchvision_importable
from flowrl.errors import FlowrlError

from .dataset import COLOUR_NAMES, IMAGE_SIZE, SHAPES

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
WEIGHTS_PATH = WEIGHTS_DIR / "embedded.safetensors"
CONFIG_PATH = WEIGHTS_DIR / "embedded.json"

DEFAULT_VOCAB = ["<pad>", "<unk>", "a", "on", "background"] + COLOUR_NAMES + SHAPES

DEFAULT_TRANSFORMER_CONFIG = dict(
    patch_size=1,
    in_channels=48,
    out_channels=48,
    num_layers=1,
    num_single_layers=2,
    attention_head_dim=32,
    num_attention_heads=4,
    joint_attention_dim=64,
    pooled_projection_dim=64,
    guidance_embeds=False,
    axes_dims_rope=[8, 12, 12],
)
DEFAULT_TEXT_CONFIG = dict(max_length=8, dim=64)


class WordTokenizer:
    def __init__(self, vocab: list[str] | None = None, max_length: int = 8):
        self.vocab = list(vocab or DEFAULT_VOCAB)
        self.index = {w: i for i, w in enumerate(self.vocab)}
        self.max_length = max_length
        self.pad_id = self.index["<pad>"]
        self.unk_id = self.index["<unk>"]

    def __call__(self, prompts: list[str]) -> torch.Tensor:
        ids = torch.full((len(prompts), self.max_length), self.pad_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            toks = [self.index.get(w, self.unk_id) for w in p.lower().split()][: self.max_length]
            ids[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
        return ids


class TextBlock(nn.Module):
    """A pre-norm self-attention block over the prompt's words, so that a word's embedding can carry
    its neighbours' (the colour of "red circle", the side of "left of") before the image sees it,
    as FLUX's T5 does for its prompts. Written out (not ``nn.TransformerEncoderLayer``, whose
    inference fast path rounds differently from its training path) so that a rollout and its
    update compute the same text embeddings."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, n, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        h = h + self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))
        return h + self.mlp(self.norm2(h))


class TextEncoder(nn.Module):
    def __init__(self, vocab_size: int, max_length: int = 8, dim: int = 64, layers: int = 0, heads: int = 4):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.zeros(max_length, dim))
        self.pool = nn.Linear(max_length * dim, dim)
        nn.init.normal_(self.tok.weight, std=1.0)
        nn.init.normal_(self.pos, std=1.0)
        self.blocks = nn.ModuleList(TextBlock(dim, heads) for _ in range(layers))

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.tok(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            h = block(h)
        pooled = self.pool(h.flatten(1))
        return h, pooled


# ---------------------------------------------------------------- stand-in VAE and packing
def encode_images(images: torch.Tensor) -> torch.Tensor:
    """Images [B,3,H,W] in [0,1] -> latents [B,12,H/2,W/2] in [-1,1] (2x2 pixel-unshuffle)."""
    return F.pixel_unshuffle(images * 2.0 - 1.0, 2)


def decode(latents: torch.Tensor) -> torch.Tensor:
    """Latents [B,12,h,w] (or packed [B,T,48]) -> images [B,3,2h,2w] in [0,1]."""
    if latents.dim() == 3:
        latents = unpack(latents)
    return ((F.pixel_shuffle(latents, 2) + 1.0) / 2.0).clamp(0.0, 1.0)


def pack(latents: torch.Tensor) -> torch.Tensor:
    """FLUX 2x2 packing: [B,C,h,w] -> [B,(h/2)(w/2),4C]."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(packed: torch.Tensor, height: int = IMAGE_SIZE // 2, width: int = IMAGE_SIZE // 2) -> torch.Tensor:
    """Inverse of ``pack``: [B,T,4C] -> [B,C,h,w] (h, w = latent size, default 16x16)."""
    b, t, c4 = packed.shape
    c = c4 // 4
    x = packed.view(b, height // 2, width // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, height, width)


def image_ids(height: int = IMAGE_SIZE // 2, width: int = IMAGE_SIZE // 2) -> torch.Tensor:
    """RoPE ids [T,3] = (0, row, col) of the packed token grid."""
    h, w = height // 2, width // 2
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h).view(h, 1)
    ids[..., 2] = torch.arange(w).view(1, w)
    return ids.view(h * w, 3)


# ---------------------------------------------------------------- the model
class EmbeddedT2I(nn.Module):
    """Tokenizer + text encoder + tiny FLUX transformer + lossless pixel "VAE"."""

    latent_channels = 12
    packed_channels = 48
    image_size = IMAGE_SIZE

    def __init__(self, transformer_config: dict | None = None, text_config: dict | None = None, vocab=None):
        super().__init__()
        ensure_torchvision_importable()  # with flowrl-diffusion[clip] on a CPU machine, a CUDA torchvision breaks diffusers' import
        from diffusers import FluxTransformer2DModel

        self.transformer_config = dict(transformer_config or DEFAULT_TRANSFORMER_CONFIG)
        self.text_config = dict(text_config or DEFAULT_TEXT_CONFIG)
        self.tokenizer = WordTokenizer(vocab, self.text_config["max_length"])
        tc = dict(self.transformer_config)
        tc["axes_dims_rope"] = tuple(tc["axes_dims_rope"])
        self.transformer = FluxTransformer2DModel(**tc)
        self.text_encoder = TextEncoder(len(self.tokenizer.vocab), self.text_config["max_length"], self.text_config["dim"],
                                        self.text_config.get("layers", 0), self.text_config.get("heads", 4))
        self.register_buffer("img_ids", image_ids(), persistent=False)
        self.register_buffer("txt_ids", torch.zeros(self.text_config["max_length"], 3), persistent=False)

    # static helpers exposed as methods too
    pack = staticmethod(pack)
    unpack = staticmethod(unpack)
    decode = staticmethod(decode)
    encode_images = staticmethod(encode_images)

    def encode_prompts(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.tokenizer(list(prompts)).to(self.img_ids.device)
        return self.text_encoder(ids)

    def velocity(
        self, packed_latents: torch.Tensor, sigma: torch.Tensor, prompt_embeds: torch.Tensor, pooled: torch.Tensor
    ) -> torch.Tensor:
        """Predicted velocity (eps - x0) [B,T,C] at noise level ``sigma`` [B] (or scalar)."""
        b = packed_latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=packed_latents.dtype, device=packed_latents.device)
        if sigma.dim() == 0:
            sigma = sigma.expand(b)
        return self.transformer(
            hidden_states=packed_latents,
            encoder_hidden_states=prompt_embeds,
            pooled_projections=pooled,
            timestep=sigma,
            img_ids=self.img_ids,
            txt_ids=self.txt_ids[: prompt_embeds.shape[1]],
            return_dict=False,
        )[0]

    def forward(self, packed_latents, sigma, prompt_embeds, pooled):
        return self.velocity(packed_latents, sigma, prompt_embeds, pooled)

    def config_dict(self) -> dict:
        return {
            "transformer": self.transformer_config,
            "text": self.text_config,
            "vocab": self.tokenizer.vocab,
            "image_size": IMAGE_SIZE,
            "latent": {"channels": 12, "height": 16, "width": 16, "packed_tokens": 64, "packed_channels": 48},
        }


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def save_model(model: nn.Module, out_dir: str | os.PathLike, filename: str, extra: dict | None = None) -> Path:
    """Write ``filename`` (the weights in float32, safetensors) and beside it its ``.json``
    (``model.config_dict()``, the parameter count, then ``extra``) in ``out_dir``; return the weights' path."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().float() for k, v in model.state_dict().items()}
    save_file(state, str(out / filename))
    cfg = model.config_dict()
    cfg["num_parameters"] = num_parameters(model)
    if extra:
        cfg.update(extra)
    (out / filename).with_suffix(".json").write_text(json.dumps(cfg, indent=2))
    return out / filename


def load_model(model_class, path: str | os.PathLike | None, default: Path, device: str | torch.device):
    """A ``model_class`` built from the ``.json`` beside the weights ``path`` (a safetensors file, or
    the folder that holds one named as ``default``; ``None``: ``default``) and loaded from them."""
    from safetensors.torch import load_file

    p = Path(path) if path is not None else default
    if p.is_dir():
        p = p / default.name
    missing = [f for f in (p, p.with_suffix(".json")) if not f.is_file()]
    if missing:
        given = f"'{path}'" if path is not None else "the package's shipped weights"
        raise FlowrlError(f"model weights not found: {', '.join(str(f) for f in missing)} (from {given})",
                          where="[model].weights",
                          hint=f"give the path of a {default.name} with its {default.with_suffix('.json').name} beside it "
                               "(or its folder), or leave weights empty for the shipped ones")
    cfg = json.loads(p.with_suffix(".json").read_text())
    model = model_class(cfg["transformer"], cfg["text"], cfg["vocab"])
    model.load_state_dict(load_file(str(p)))
    return model.to(device).eval()


def save_weights(model: EmbeddedT2I, out_dir: str | os.PathLike, extra: dict | None = None) -> Path:
    return save_model(model, out_dir, WEIGHTS_PATH.name, extra)


def load_pretrained(path: str | os.PathLike | None = None, device: str | torch.device = "cpu") -> EmbeddedT2I:
    """Load the committed weights (offline). ``path`` is the safetensors file or its folder."""
    return load_model(EmbeddedT2I, path, WEIGHTS_PATH, device)
