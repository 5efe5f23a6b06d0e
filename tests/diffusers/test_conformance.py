"""The adapter conformance suite passes on every built-in adapter and catches broken ones."""

from __future__ import annotations

import copy

import pytest
import torch

from flowrl.testing.conformance import CHECK_NAMES, check_adapter, run_check


@pytest.fixture(scope="module")
def embedded():
    from flowrl_plugins.embedded.plugin import EmbeddedConfig, EmbeddedModel

    return EmbeddedModel(EmbeddedConfig(random_init=True))


def _passes(adapter):
    report = check_adapter(adapter)  # raises with the full summary on any failure
    assert [r.name for r in report.results] == list(CHECK_NAMES)
    return {r.name: r.message for r in report.results}


def test_flux_conforms(flux_model):
    notes = _passes(flux_model)
    assert "timestep = 1 * sigma" in notes["sigma_direction"]
    assert notes["reference_model"] == "reference = lora_disabled, frozen_copy"


def test_flux_schnell_without_guidance_conforms(tiny_flux_schnell):
    from flowrl_plugins.diffusers_models.flux import FluxConfig, FluxModel

    _passes(FluxModel(FluxConfig(path=str(tiny_flux_schnell), dtype="fp32", height=32, width=32,
                                 max_sequence_length=16, guidance=0.0)))


def test_sd3_with_true_cfg_conforms(sd3_model):
    notes = _passes(sd3_model)
    assert "timestep = 1000 * sigma" in notes["sigma_direction"]


def test_sd3_without_cfg_conforms(make_sd3):
    _passes(make_sd3(cfg_scale=1.0))


def test_embedded_conforms(embedded):
    notes = _passes(embedded)
    assert notes["reference_model"].startswith("skipped")


# ---- the suite must fail adapters that break the engine's assumptions -------------------------


class Broken:
    """Delegates to a working adapter, with one thing broken by the subclass."""

    def __init__(self, inner):
        self.inner = inner
        self.denoiser = inner.denoiser
        self.latent_shape = inner.latent_shape
        self.lora_targets = inner.lora_targets

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def velocity(self, latents, sigma, text):
        return self.inner.velocity(latents, sigma, text)

    def __deepcopy__(self, memo):
        new = type(self)(copy.deepcopy(self.inner, memo))
        return new


class OneMinusSigma(Broken):
    """Feeds the denoiser 1 - sigma: the classic flipped-direction bug."""

    def velocity(self, latents, sigma, text):
        return self.inner.velocity(latents, 1.0 - sigma * 0.999, text)


class BatchNormalised(Broken):
    """Normalises the velocity over the batch: each sample depends on the others."""

    def velocity(self, latents, sigma, text):
        v = self.inner.velocity(latents, sigma, text)
        return v / v.std() if v.shape[0] > 1 else v


class Noisy(Broken):
    """Dropout-like randomness at every call: rollout and re-scoring disagree."""

    def velocity(self, latents, sigma, text):
        v = self.inner.velocity(latents, sigma, text)
        return v + 1e-3 * torch.randn_like(v)


class Bypass(Broken):
    """Calls a private copy of the network instead of self.denoiser (LoRA would never train)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.private = copy.deepcopy(inner.denoiser)
        self.denoiser = torch.nn.Linear(1, 1)  # what the engine would wrap and train

    def velocity(self, latents, sigma, text):
        real, self.inner.denoiser = self.inner.denoiser, self.private
        try:
            return self.inner.velocity(latents, sigma, text)
        finally:
            self.inner.denoiser = real


class ForeignBlocks(Broken):
    """Names blocks that are not part of its denoiser: FSDP2 would shard modules the model
    never calls."""

    def shardable_blocks(self):
        return [torch.nn.Linear(4, 4)]


class Unclamped(Broken):
    def decode(self, latents):
        return self.inner.decode(latents) * 2 - 0.5


@pytest.mark.parametrize(
    "wrapper, check, message",
    [
        (OneMinusSigma, "sigma_direction", "does not grow with sigma"),
        (BatchNormalised, "batch_independence", "alone differs from in-batch"),
        (Noisy, "on_policy_ratio", "on-policy"),
        (Noisy, "sde_noise0_equals_ode", "differs from ODE"),
        (Bypass, "velocity_calls_denoiser", "did not call adapter.denoiser"),
        (Unclamped, "decode", "outside [0, 1]"),
        (ForeignBlocks, "shardable_blocks", "must return submodules of its denoiser"),
    ],
)
def test_suite_catches_broken_adapters(embedded, wrapper, check, message):
    with pytest.raises(AssertionError, match=message.replace("[", r"\[").replace("]", r"\]")):
        run_check(wrapper(embedded), check)


def test_report_lists_failures_without_raising(embedded):
    report = check_adapter(OneMinusSigma(embedded), checks=["decode", "sigma_direction"], raise_on_failure=False)
    assert not report.passed and [r.name for r in report.failures] == ["sigma_direction"]
    assert "FAIL sigma_direction" in report.summary()
