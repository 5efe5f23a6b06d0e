"""What the Wan adapter tests (test_wan.py, test_wan22.py, test_wan22_a14b.py) share: the pipeline
sampling on flowrl's grid, flowrl's own ODE frames, and prompt rows carrying one image."""

from __future__ import annotations

import numpy as np


def euler_on_flowrl_grid(pipe, shift: float):
    """``pipe`` with diffusers' FlowMatchEuler scheduler on flowrl's grid (shifted linspace(1, 1/N, N),
    then 0): WanPipeline asks its scheduler for N steps and passes no sigmas, and the published
    UniPC is a multistep solver, so this is the pipeline's sampler that flowrl's ODE equals."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(shift=shift)
    set_timesteps = sched.set_timesteps
    sched.set_timesteps = lambda n, device=None: set_timesteps(sigmas=np.linspace(1.0, 1.0 / n, n), device=device)
    pipe.scheduler = sched
    return pipe


def ode_frames(model, prompts, noise, steps: int):
    """flowrl's ODE sample of ``model`` from ``noise``, decoded to clips."""
    from flowrl.sampling.rollout import ode_sample

    text = model.encode_prompts(prompts)
    return model.decode(ode_sample(lambda i, x, s: model.velocity(x, s, text), noise, model.sigmas(steps)))


def image_prompts(prompts, seed=0):
    """Prompt rows that all carry one seeded random 32 x 32 image (the image-to-video pipelines
    encode one image for a whole batch), and that image's path."""
    from flowrl.prompts import PromptRow
    from flowrl.testing.conformance import condition_image_paths

    path = condition_image_paths((32, 32), seed + 1)[seed]
    return [PromptRow(p, path) for p in prompts], path
