"""What the objective tests share: a tiny batch with a trajectory, a linear "model adapter" that
counts its forwards, and the update context and micro-batch an objective is handed."""

from __future__ import annotations

import contextlib

import torch

from flowrl.batch import Batch


class Trajectory:
    """The parts of a rollout's trajectory the forward-process objectives read."""

    def __init__(self, latents, sigmas):
        self.image_latents = latents
        self.sigmas = sigmas


def tiny_batch(n=4, groups=(0, 0, 1, 1), advantages=None, seed=0, trajectory=None):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(n, 3, 2, 2, generator=g)
    sigmas = torch.linspace(1.0, 0.0, 7)
    adv = torch.tensor(advantages if advantages is not None else [1.0, -1.0, 0.5, -0.5])
    return Batch(iteration=3, indices=range(n), prompts=["p"] * n, group_ids=torch.tensor(groups),
                 text={"t": torch.zeros(n, 1)}, trajectory=trajectory or Trajectory(latents, sigmas), advantages=adv)


class Linear:
    """A model adapter whose velocity is a linear map of (x, sigma), counting its calls."""

    def __init__(self, seed=0):
        torch.manual_seed(seed)
        self.denoiser = torch.nn.Linear(12, 12)
        self.calls = 0

    def velocity(self, x, sigma, text):
        self.calls += 1
        flat = x.reshape(x.shape[0], -1)
        return (self.denoiser(flat) * (1 + sigma.reshape(-1, 1))).reshape(x.shape)


class Counter:
    def __init__(self):
        self.minimum = {}

    def expect(self, phase, rows):
        self.minimum[phase] = self.minimum.get(phase, 0) + rows

    def phase(self, name):
        return contextlib.nullcontext()

    def measuring(self, name):
        return contextlib.nullcontext()


class Ctx:
    """The update context (flowrl.objectives.base.UpdateContext) an objective uses, on the CPU."""

    def __init__(self, model, steps=0):
        self.model, self.device, self.seed = model, torch.device("cpu"), 11
        self.params = list(model.denoiser.parameters())
        self.counter, self.lockstep, self.rows_per_sample = Counter(), None, 1
        self.kl = None
        self.steps = steps

    def optimizer_steps(self):
        return self.steps


class Micro:
    def __init__(self, batch, rows, normaliser):
        self.batch, self.rows, self.normaliser, self.sizes = batch, rows, normaliser, (1,)
