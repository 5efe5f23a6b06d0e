"""The shipped latent verifier agrees with the verifier it was trained from, on samples it never
saw, and scores the prompt as well as the picture."""

from __future__ import annotations

import pytest

import json

import torch

from flowrl.interfaces import scores_latents
from flowrl.plugins import get_registry
from flowrl_plugins.embedded.dataset import all_prompts
from flowrl_plugins.embedded.latent_verifier import LATENT_VERIFIER_PATH, LatentVerifier
from flowrl_plugins.embedded.network import decode, load_pretrained, unpack
from flowrl_plugins.embedded.train_latent_verifier import model_samples, pearson
from flowrl_plugins.embedded.verifier import verify


@pytest.mark.slow
def test_the_shipped_head_agrees_with_the_verifier_on_fresh_samples():
    component = get_registry().get("reward", "latent_verifier")
    reward = component.build(component.params())
    assert isinstance(reward, LatentVerifier) and scores_latents(reward)
    prompts = all_prompts()
    latents = model_samples(load_pretrained(), prompts, seed=90_001, steps=16)  # a seed no split used
    shuffled = prompts[1:] + prompts[:1]  # every sample against another prompt too
    predicted = torch.cat([reward(latents, prompts), reward(latents, shuffled)])
    truth = torch.cat([verify(decode(unpack(latents)), p).score.float() for p in (prompts, shuffled)])
    recorded = json.loads(LATENT_VERIFIER_PATH.with_suffix(".json").read_text())
    mae, r = float((predicted - truth).abs().mean()), pearson(predicted, truth)
    assert mae <= max(0.1, 1.5 * recorded["held_out_mae"]), (mae, recorded)
    assert r >= 0.9, (r, recorded)
    # the prompt matters: its own prompt scores above another's on average, as the verifier says
    assert float(predicted[:90].mean()) > float(predicted[90:].mean()) + 0.2
