"""What the engine hands a selector (flowrl.objectives.policy_gradient.select_units): Flash-GRPO's
draw is seeded per (seed, iteration, group), so a group split over micro-batches or processes
trains one step; E-GRPO reads the kernel's std off the rollout's sigmas."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from flowrl.objectives.policy_gradient import select_units
from flowrl.sampling.kernels import FlowKernel, ODEKernel, kernel_std
from flowrl.sampling.trajectory import Trajectory
from flowrl_plugins.selectors import EntropyConfig, EntropySelector, FlashConfig, FlashSelector

SIZES = (1,) * 8


def _batch(iteration, indices, group_size=4, trajectory=None):
    return SimpleNamespace(iteration=iteration, indices=range(indices.start, indices.stop),
                           group_ids=torch.tensor([j // group_size for j in indices]), trajectory=trajectory)


def _flash(batch, rows, epoch=0):
    return select_units(FlashSelector(FlashConfig(span=1.0)), 42, batch, torch.tensor(rows), SIZES, epoch)


def test_flash_selection_does_not_depend_on_the_layout():
    # 12 samples, groups of 4; one process with one micro-batch ...
    one = _flash(_batch(3, range(0, 12)), list(range(12)))
    assert (one.sum(1) == 1).all()
    for g in range(3):
        assert torch.equal(one[4 * g: 4 * g + 4], one[4 * g: 4 * g + 1].expand(4, -1))
    # ... equals two processes of 6 samples (group 1 split between them), in micro-batches of 2
    parts = [_flash(_batch(3, range(lo, lo + 6)), rows) for lo in (0, 6) for rows in ([0, 1], [2, 3], [4, 5])]
    assert torch.equal(torch.cat(parts), one)
    # the same step in every pass over the rollout; a new draw next iteration
    assert torch.equal(_flash(_batch(3, range(0, 12)), list(range(12)), epoch=1), one)
    later = [_flash(_batch(it, range(0, 12)), list(range(12))) for it in range(4, 12)]
    assert any(not torch.equal(m, one) for m in later)


def test_entropy_selection_reads_the_kernels_std():
    # 4 steps; the flow kernel's std falls with sigma after the first steps
    sigmas = torch.tensor([1.0, 0.8, 0.5, 0.2, 0.0])
    kernels = (FlowKernel(a=0.7),) * 3 + (ODEKernel(),)
    traj = Trajectory(latents=torch.zeros(2, 5, 1, 2, 2), log_probs=torch.zeros(2, 4), sigmas=sigmas,
                      trainable=torch.tensor([True, True, True, False]), prompts=["a", "b"],
                      group_ids=torch.tensor([0, 0]), image_latents=torch.zeros(2, 1, 2, 2), kernels=kernels)
    std = traj.position_std(torch.tensor([0, 1]))
    # by hand: a sqrt(sigma / (1 - sigma)) sqrt(sigma - sigma_next), sigma = 1 using 1 - sigma_next
    by_hand = [0.7, 0.7 * math.sqrt(0.8 / 0.2) * math.sqrt(0.3), 0.7 * math.sqrt(0.5 / 0.5) * math.sqrt(0.3)]
    assert torch.allclose(std, torch.tensor([by_hand, by_hand]), rtol=1e-5)
    assert torch.allclose(kernel_std(FlowKernel(a=0.7), sigmas[:3], sigmas[1:4]), torch.tensor(by_hand), rtol=1e-5)
    batch = SimpleNamespace(iteration=0, indices=range(0, 2), group_ids=traj.group_ids, trajectory=traj)
    # std 0.7, 0.767, 0.383: the top one is step 1, the top two steps 0 and 1
    sel = EntropySelector(EntropyConfig(fraction=0.34))
    assert select_units(sel, 0, batch, torch.tensor([0, 1]), (1, 1, 1), 0).tolist() == [[False, True, False]] * 2
    sel = EntropySelector(EntropyConfig(fraction=0.67))
    assert select_units(sel, 0, batch, torch.tensor([1]), (1, 1, 1), 0).tolist() == [[True, True, False]]
