"""The forward process on a rollout's clean samples, shared by the likelihood-free objectives
(DiffusionNFT, :mod:`flowrl.objectives.nft`; AWM, :mod:`flowrl.objectives.awm`).

Per sample of the rollout (its clean latent ``x0 = image_latents``) and each of ``K`` trained
sigmas (a per-sample random subset of the sampling schedule's, without 0), fresh noise ``eps``
and the noisy point ``x = (1 - sigma) x0 + sigma eps``. Everything is drawn from one generator
per (seed, tag, iteration, global sample index), so every pass over a rollout trains the same
points, on any number of processes and after a resume.
"""

from __future__ import annotations

import dataclasses

import torch

from flowrl.batch import Batch
from flowrl.seeding import generator

__all__ = ["ForwardPoints", "forward_process_points", "stratified_pick", "velocity_kl"]


@dataclasses.dataclass
class ForwardPoints:
    """The trained points of a micro-batch, rows repeated ``K`` times (row-major):
    ``x0``, ``eps``, ``x`` ``[n K, *L]``, ``sigma`` ``[n K]``, ``rows`` ``[n K]`` (long, CPU: the
    batch rows each point belongs to) and ``K``."""

    x0: torch.Tensor
    eps: torch.Tensor
    x: torch.Tensor
    sigma: torch.Tensor
    rows: torch.Tensor
    K: int


def stratified_pick(n: int, K: int, g: torch.Generator) -> torch.Tensor:
    """``K`` indices of ``range(n)``, one drawn uniformly in each of ``K`` consecutive strata of
    (nearly) equal size (stratum ``k`` is ``[floor(k n / K), floor((k + 1) n / K))``): every part
    of the schedule is trained in every sample, with less variance than ``K`` draws without
    replacement (V-GRPO's stratified timestep sampling)."""
    edges = [(k * n) // K for k in range(K + 1)]
    return torch.tensor([edges[k] + int(torch.randint(edges[k + 1] - edges[k], (1,), generator=g))
                         for k in range(K)], dtype=torch.long)


def forward_process_points(seed: int, tag: str, batch: Batch, idx: torch.Tensor, sigmas: torch.Tensor,
                           timesteps: int, *, leading: int = 0, by_group: bool = False,
                           stratified: bool = False) -> ForwardPoints:
    """The forward-process points of the batch rows ``idx`` (module docstring): ``K = min(timesteps,
    n)`` sigmas per sample, drawn without replacement from the first ``n`` sigmas of the sampling
    schedule (``n = leading``, or all but the final 0 when ``leading`` is 0), or one per stratum
    with ``stratified`` (:func:`stratified_pick`), each with its own noise, from the generator of
    (seed, tag, iteration, the sample's global index), or of its prompt group with ``by_group``
    (every sample of a group noised alike: the preference objectives, V-GRPO)."""
    x0 = batch.trajectory.image_latents[idx].to(torch.float32)
    grid = sigmas[:-1]  # no sigma = 0
    if leading:
        grid = grid[: int(leading)]
    K = min(int(timesteps), grid.numel())
    xs, es, ss, x0s, rows = [], [], [], [], []
    for j, r in enumerate(idx.tolist()):
        g = generator(seed, tag, batch.iteration, int(batch.group_ids[r]) if by_group else batch.indices[r])
        pick = stratified_pick(grid.numel(), K, g) if stratified else torch.randperm(grid.numel(), generator=g)[:K]
        for k in range(K):
            s = grid[int(pick[k])]
            eps = torch.randn(tuple(x0.shape[1:]), generator=g).to(x0.device)
            xs.append((1 - s) * x0[j] + s * eps)
            es.append(eps)
            ss.append(s)
            x0s.append(x0[j])
            rows.append(r)
    return ForwardPoints(torch.stack(x0s), torch.stack(es), torch.stack(xs), torch.stack(ss).to(x0.device),
                         torch.tensor(rows, dtype=torch.long), K)


def velocity_kl(v: torch.Tensor, v_ref: torch.Tensor) -> torch.Tensor:
    """The velocity KL surrogate to a reference: ``mean((v - v_ref)^2)`` per sample ``[B]``
    (NFT's ``beta_kl`` term; AWM's ``Uniform`` KL weighting)."""
    d = v.to(torch.float32) - v_ref.detach().to(torch.float32)
    return (d**2).reshape(d.shape[0], -1).mean(dim=1)
