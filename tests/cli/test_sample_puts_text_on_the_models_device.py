"""``flowrl sample`` / ``flowrl eval`` hand each batch's text embeddings to the model on its device
(the sampling grid's): the embedded adapters use them as given, so on CUDA they crashed with a
device mismatch when the prompt cache returned them on the CPU (found running the suite on an H200)."""

from __future__ import annotations

import torch

from flowrl.commands import inference
from flowrl.train import session as session_module


class _Model:
    latent_shape = (2,)

    def encode_prompts(self, prompts):
        return {"embeds": torch.ones(len(prompts), 3)}

    def velocity(self, x, sigma, text):
        return torch.zeros_like(x)

    def decode(self, latents):
        return torch.zeros(latents.shape[0], 3, 1, 1)


def test_generate_asks_the_cache_for_the_text_on_the_sampling_device(monkeypatch):
    asked = []
    original = session_module.PromptCache.get

    def get(self, prompts, device=None):  # None: left to the cache's default, the CPU
        asked.append(device)
        return original(self, prompts, device if device is not None else "cpu")

    monkeypatch.setattr(session_module.PromptCache, "get", get)
    sigmas = torch.linspace(1.0, 0.0, 3)
    items = [inference.Item(0, 0, "a cat", 0), inference.Item(1, 0, "a cat", 1)]
    out = list(inference.generate(_Model(), items, sigmas, seed=0, batch_size=2, noise_of=lambda it: torch.zeros(2)))
    assert len(out) == 1 and asked == [sigmas.device]
