"""rescore_transitions (one batched velocity call over a chunk's steps) gives the rollout's own
log-probs: for one sample (the states are then views of the trajectory) and several, for
consecutive and scattered steps, with one kernel (one batched kernel step) and with mixed
kernels (an sde_window: one kernel step per transition)."""

from __future__ import annotations

import pytest
import torch

from flowrl.interfaces import select_embeddings
from flowrl.sampling.rollout import make_kernels, rescore_transitions, rollout
from flowrl.sampling.schedules import shifted_sigmas
from flowrl.sampling.kernels import FlowKernel


@pytest.fixture(scope="module")
def model():
    from flowrl_plugins.embedded.plugin import EmbeddedConfig, EmbeddedModel

    return EmbeddedModel(EmbeddedConfig())


@pytest.mark.parametrize("sde_window", [None, (2, 6)])
@pytest.mark.parametrize("rows", [[2], [0, 2]])
@pytest.mark.parametrize("steps", [[1, 2, 3], [0, 3, 5], [3, 4, 5, 6, 7]])
def test_rescored_log_probs_equal_the_rollout(model, sde_window, rows, steps):
    prompts = ["a red circle", "a blue square", "a green triangle", "a red square"]
    text = model.encode_prompts(prompts)
    noise = torch.randn(4, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    traj = rollout(lambda x, s: model.velocity(x, s, text), noise, shifted_sigmas(9, 3.0),
                   make_kernels(9, FlowKernel(0.7), sde_window), generators=torch.Generator().manual_seed(1),
                   prompts=prompts)
    b = torch.tensor(rows)
    with torch.no_grad():
        got = rescore_transitions(lambda x, s: model.velocity(x, s, select_embeddings(text, b.repeat(len(steps)))),
                                  traj, steps, b)
    want = torch.stack([traj.log_probs[b, i] for i in steps])
    assert got.shape == (len(steps), len(rows))
    # the rollout scored each step on all 4 samples; measured bit-equal on this CPU, allowed one
    # float32 ulp of rounding by batch composition
    torch.testing.assert_close(got, want, rtol=0, atol=2.5e-7)


def test_one_sample_states_are_views_with_gradients(model):
    """The view path keeps gradients flowing to the denoiser like the copying path."""
    prompts = ["a red circle", "a blue square"]
    text = model.encode_prompts(prompts)
    noise = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(3))
    traj = rollout(lambda x, s: model.velocity(x, s, text), noise, shifted_sigmas(6, 3.0),
                   make_kernels(6, FlowKernel(0.7)), generators=torch.Generator().manual_seed(4), prompts=prompts)
    grads = []
    model.denoiser.requires_grad_(True)
    for rows in ([1], [1, 1]):  # [1, 1]: two rows, the copying path; half the sum equals one row
        b = torch.tensor(rows)
        model.denoiser.zero_grad(set_to_none=True)
        with torch.enable_grad():
            lp = rescore_transitions(lambda x, s: model.velocity(x, s, select_embeddings(text, b.repeat(3))),
                                     traj, [1, 2, 3], b)
            (lp.sum() / len(rows)).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.denoiser.parameters() if p.grad is not None]))
    model.denoiser.requires_grad_(False).zero_grad(set_to_none=True)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)
