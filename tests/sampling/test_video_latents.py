"""Latents with a frames axis ``[B, F, T, C]`` go through the sampler like any other ``*L``: the
rollout, its log-probs, re-scoring and the ODE sampler equal those of the same latents flattened
to ``[B, F * T * C]`` (a second route: the kernels never look inside ``*L``)."""

import torch

from flowrl.sampling.kernels import FlowKernel
from flowrl.sampling.rollout import make_kernels, ode_sample, rescore_transitions, rollout
from flowrl.sampling.schedules import shifted_sigmas

FRAMES, TOKENS, CHANNELS = 3, 4, 2
D = FRAMES * TOKENS * CHANNELS


def velocity_flat(x, sigma):
    """A fixed nonlinear field on flat latents [B, D], mixing frames (as space-time attention does)."""
    w = torch.linspace(-1, 1, D * D, dtype=torch.float32).view(D, D) / D
    return torch.tanh(x @ w) + sigma[:, None] * x


def velocity_frames(x, sigma):
    return velocity_flat(x.reshape(x.shape[0], -1), sigma).view(x.shape)


def test_rollout_with_a_frames_axis_equals_the_flat_rollout():
    b, sig = 3, shifted_sigmas(8, 3.0)
    noise = torch.randn(b, FRAMES, TOKENS, CHANNELS, generator=torch.Generator().manual_seed(0))
    kernels = make_kernels(8, FlowKernel(0.7), sde_window=(0, 4))  # SDE then ODE, as the video quickstart
    gens = lambda: [torch.Generator().manual_seed(10 + i) for i in range(b)]  # noqa: E731
    video = rollout(velocity_frames, noise, sig, kernels, generators=gens())
    flat = rollout(velocity_flat, noise.reshape(b, -1), sig, kernels, generators=gens())
    assert video.latents.shape == (b, 9, FRAMES, TOKENS, CHANNELS)
    assert video.image_latents.shape == (b, FRAMES, TOKENS, CHANNELS)
    assert torch.equal(video.latents.reshape(b, 9, -1), flat.latents)
    assert torch.equal(video.log_probs, flat.log_probs) and video.log_probs.shape == (b, 8)
    steps, idx = [0, 2, 5], torch.tensor([2, 0])
    again = rescore_transitions(velocity_frames, video, steps, idx)  # the field needs no per-sample conditioning
    assert again.shape == (3, 2)
    assert torch.allclose(again, video.log_probs[idx][:, steps].T, atol=1e-5)


def test_ode_sample_with_a_frames_axis_equals_the_flat_one():
    sig = shifted_sigmas(6, 3.0)
    noise = torch.randn(2, FRAMES, TOKENS, CHANNELS, generator=torch.Generator().manual_seed(1))
    out = ode_sample(lambda i, x, s: velocity_frames(x, s), noise, sig)
    ref = ode_sample(lambda i, x, s: velocity_flat(x, s), noise.reshape(2, -1), sig)
    assert out.shape == noise.shape and torch.equal(out.reshape(2, -1), ref)
