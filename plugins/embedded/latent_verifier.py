"""A reward that scores the embedded model's latents: no decode.

``latent_verifier`` predicts the verifier's soft prompt-correctness (:mod:`.verifier`) from the
clean latents ``[B, 64, 48]`` (the packed ``[B, 12, 16, 16]`` grid) and the prompt's attributes.
It is a small convolutional head trained offline on the embedded model's own samples, labelled by
the verifier on their decoded images (``python -m flowrl_plugins.embedded.train_latent_verifier``;
the weights ship beside this file in ``weights/latent_verifier.safetensors``, with the script's
settings and its held-out agreement with the verifier in the ``.json`` beside them).

It declares :class:`flowrl.interfaces.ScoresLatents`, so a run whose rewards all score latents
never decodes during training (``time/decode`` is absent, ``compute/decoded`` is 0).

Network: the latent grid and the prompt's one-hot attributes (background and foreground colour
over the 6 colours, shape over the 3 shapes; 15 channels broadcast over the grid) concatenated,
three 3x3 convolutions (27 -> 32 -> 64 -> 64 channels, the last two with stride 2: 16 -> 8 -> 4),
then 1024 -> 64 -> 1 with SiLU between and a sigmoid at the end.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from flowrl.config import param
from flowrl.errors import FlowrlError

from .dataset import COLOUR_NAMES, SHAPES, parse_prompt
from .network import WEIGHTS_DIR, unpack

LATENT_VERIFIER_PATH = WEIGHTS_DIR / "latent_verifier.safetensors"
#: one-hot channels of the prompt: background colour, foreground colour, shape
PROMPT_CHANNELS = 2 * len(COLOUR_NAMES) + len(SHAPES)


def prompt_features(prompts: list[str]) -> torch.Tensor:
    """``[B, 15]`` float32: one-hot background colour, foreground colour and shape."""
    out = torch.zeros(len(prompts), PROMPT_CHANNELS)
    for i, p in enumerate(prompts):
        a = parse_prompt(p)
        out[i, a.bg_index] = 1.0
        out[i, len(COLOUR_NAMES) + a.fg_index] = 1.0
        out[i, 2 * len(COLOUR_NAMES) + a.shape_index] = 1.0
    return out


class LatentVerifierNet(nn.Module):
    """``(grid [B, 12, 16, 16], prompt features [B, 15]) -> score [B]`` in (0, 1)."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.conv1 = nn.Conv2d(12 + PROMPT_CHANNELS, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1)
        self.conv3 = nn.Conv2d(2 * width, 2 * width, 3, stride=2, padding=1)
        self.fc1 = nn.Linear(2 * width * 16, 64)
        self.fc2 = nn.Linear(64, 1)

    def forward(self, grid: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
        b, _, h, w = grid.shape
        x = torch.cat([grid, prompt[:, :, None, None].expand(b, -1, h, w)], dim=1)
        x = F.silu(self.conv1(x))
        x = F.silu(self.conv2(x))
        x = F.silu(self.conv3(x))
        return torch.sigmoid(self.fc2(F.silu(self.fc1(x.flatten(1))))).squeeze(1)


def load_latent_verifier(path: str | os.PathLike | None = None) -> LatentVerifierNet:
    """The shipped head (offline), or the one at ``path`` (its ``.json`` beside it)."""
    from safetensors.torch import load_file

    p = Path(path) if path else LATENT_VERIFIER_PATH
    settings = json.loads(p.with_suffix(".json").read_text())
    net = LatentVerifierNet(width=settings["width"])
    net.load_state_dict(load_file(str(p)))
    return net.eval().requires_grad_(False)


@dataclasses.dataclass(frozen=True)
class LatentVerifierConfig:
    weights: str = param("", "Path to latent_verifier.safetensors (its .json beside it); empty = the one shipped.",
                         path=True)


class LatentVerifier:
    """The ``latent_verifier`` reward: the head's estimate of the verifier's score, from latents."""

    Config = LatentVerifierConfig
    scores_latents = True

    def __init__(self, config: LatentVerifierConfig = LatentVerifierConfig()):
        path = Path(config.weights) if config.weights else LATENT_VERIFIER_PATH
        if not path.is_file() or not path.with_suffix(".json").is_file():
            raise FlowrlError(f"no latent verifier weights at '{path}' (and its .json)",
                              hint="retrain them: python -m flowrl_plugins.embedded.train_latent_verifier")
        self.net = load_latent_verifier(path)
        self.name = "latent_verifier"

    @torch.no_grad()
    def __call__(self, latents: torch.Tensor, prompts, metadata=None) -> torch.Tensor:
        grid = unpack(latents.detach().float().cpu())
        return self.net(grid, prompt_features(list(prompts))).float()
