"""Shared fixtures for the `flowrl profile` tests: a tiny prompt-aware model with no weights to load."""

import pytest
import torch


class TinyModel:
    """A model adapter small enough to profile in milliseconds.

    ``v = x * scale + bias(prompt)``: the prompt shifts the velocity by a per-prompt constant,
    so curves depend on the prompt a little, as a real model's do.
    """

    latent_shape = (4, 3)

    def __init__(self, prompt_strength: float = 0.05, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.denoiser = torch.nn.Linear(3, 3)
        with torch.no_grad():
            self.denoiser.weight.copy_(torch.eye(3) + 0.1 * torch.randn(3, 3, generator=g))
            self.denoiser.bias.zero_()
        self.prompt_strength = prompt_strength
        self.calls = []

    def encode_prompts(self, prompts):
        codes = torch.tensor([[float(sum(map(ord, p)) % 7)] for p in prompts])
        return {"code": codes}

    def velocity(self, latents, sigma, text):
        self.calls.append((latents.shape[0], float(sigma[0])))
        shift = self.prompt_strength * text["code"].reshape(-1, 1, 1)
        return self.denoiser(latents) * 0.5 + shift + latents * sigma.reshape(-1, 1, 1)

    def to(self, device):
        return self

    def prompt_source(self):
        return [f"prompt {i}" for i in range(10)]


@pytest.fixture
def tiny_model():
    return TinyModel()
