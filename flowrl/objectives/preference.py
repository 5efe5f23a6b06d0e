"""What the preference objectives share (online DPO, :mod:`flowrl.objectives.dpo`; DGPO,
:mod:`flowrl.objectives.dgpo`; docs/objectives.md): points of the forward process shared by a
prompt group, the flow-matching error at them, and the rollout's errors of the policy and the
frozen reference at every trained point, gathered over processes.

Both objectives compare samples of one prompt group AT THE SAME NOISE AND SIGMA (Diffusion-DPO
noises the winner and the loser alike; DGPO shares its noise within a group): so the ``K``
sigmas and noises of a point are drawn from one generator per (seed, tag, iteration, group) and
every member of the group gets the same ones (``x = (1 - sigma) x0 + sigma eps`` with its own
clean latent ``x0``). The velocity target is ``eps - x0`` and the flow-matching error of a point
is ``e = mean((v - (eps - x0))^2)`` over its elements.

A sample's loss depends on its group mates' errors (the pair's margin, the group's preference),
but a micro-batch holds a random subset of the samples. So, once per rollout and before any
update, :class:`RolloutErrors` takes every trained point's error under the rollout policy (the
"anchor", no gradient) and under the reference, and gathers them over processes. In a
micro-batch a sample then uses its OWN current error (with gradient) and its mates' anchors: on
the first, on-policy optimizer step the anchors are the current errors, so the summed gradient
is exactly the loss's; on later steps the mates' errors lag by the steps taken since the rollout.
The pre-pass costs one policy forward without gradient per trained point (counted in the update
phase: ``compute/ratio`` shows it).
"""

from __future__ import annotations

import dataclasses

import torch

from flowrl import distributed
from flowrl.batch import Batch
from flowrl.interfaces import select_embeddings
from flowrl.objectives.chunk_gradient import any_process, pad_rows
from flowrl.objectives.forward_process import ForwardPoints, forward_process_points

__all__ = ["group_points", "selected_points", "flow_error", "RolloutErrors"]


def group_points(seed: int, tag: str, batch: Batch, idx: torch.Tensor, sigmas: torch.Tensor, timesteps: int,
                 leading: int = 0) -> ForwardPoints:
    """The forward-process points of the batch rows ``idx``, shared by each prompt group: ``K =
    min(timesteps, n)`` sigmas drawn without replacement from the first ``n`` sigmas of the
    sampling schedule (``n = leading``, or all but the final 0 when ``leading`` is 0), each with
    its own noise, all from the generator of (seed, tag, iteration, the row's group)."""
    return forward_process_points(seed, tag, batch, idx, sigmas, timesteps, leading=leading, by_group=True)


def selected_points(ctx, micro, tag: str, selected: torch.Tensor, timesteps: int,
                    leading: int = 0) -> tuple[torch.Tensor, bool, ForwardPoints] | None:
    """What a preference objective forwards in a micro-batch: ``(rows, stand_in, points)`` of the
    ``selected`` rows (:func:`group_points`), or of one stand-in row with weight 0 where this
    process has none and another (in lockstep) has some; None when no process has a selected row."""
    if not any_process(bool(selected.numel()), ctx.lockstep):
        return None
    rows, stand_in = pad_rows(selected)
    sigmas = micro.batch.trajectory.sigmas.to(ctx.device)
    return rows, stand_in, group_points(ctx.seed, tag, micro.batch, rows, sigmas, timesteps, leading)


def flow_error(v: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """The flow-matching error per point ``[N]``: ``mean((v - (eps - x0))^2)`` over each point's
    elements (float32; ``v`` carries the gradient, ``x0`` and ``eps`` are detached)."""
    vv = v.to(torch.float32)
    target = eps.detach().to(torch.float32) - x0.detach().to(torch.float32)
    if vv.shape != target.shape or vv.ndim < 2:
        raise ValueError(f"v, x0 and eps must be [N, ...] of one shape, got {tuple(vv.shape)} and {tuple(target.shape)}")
    return ((vv - target) ** 2).reshape(vv.shape[0], -1).mean(dim=1)


@dataclasses.dataclass
class RolloutErrors:
    """The rollout's errors at every trained point, over all processes (global sample order):
    ``policy`` and ``reference`` ``[N, K]`` (0 for an untrained sample), ``trained`` ``[N]``,
    ``advantages`` ``[N]`` and ``groups`` ``[N]``; ``offset`` is this process's first global row."""

    policy: torch.Tensor
    reference: torch.Tensor
    trained: torch.Tensor
    advantages: torch.Tensor
    groups: torch.Tensor
    offset: int
    K: int

    @classmethod
    def measure(cls, ctx, batch: Batch, tag: str, timesteps: int, leading: int, trained: torch.Tensor,
                reference) -> RolloutErrors:
        """One forward of the policy (no gradient) and one of ``reference`` per local trained
        sample (its ``K`` points in one call), then gathered. ``trained``: bool ``[B_local]``.
        Under FSDP2 every process forwards as often as the busiest one (a stand-in row, unused,
        where it has none left): a sharded forward is a collective."""
        device, B = ctx.device, len(batch.indices)
        sigmas = batch.trajectory.sigmas.to(device)
        K = group_points(ctx.seed, tag, batch, torch.zeros(1, dtype=torch.long), sigmas, timesteps, leading).K
        pol = torch.zeros(B, K, dtype=torch.float32)
        ref = torch.zeros(B, K, dtype=torch.float32)
        rows = torch.nonzero(trained.cpu(), as_tuple=False).flatten()
        ctx.counter.expect("reference", int(rows.numel()) * K * ctx.rows_per_sample)
        i = 0
        while any_process(i < rows.numel(), ctx.lockstep):
            r, stand_in = pad_rows(rows[i : i + 1])
            pts = group_points(ctx.seed, tag, batch, r, sigmas, timesteps, leading)
            text = select_embeddings(batch.text, pts.rows.to(device))
            with torch.no_grad():
                e = flow_error(ctx.model.velocity(pts.x, pts.sigma, text), pts.x0, pts.eps)
                with ctx.counter.phase("reference"):
                    e_ref = flow_error(reference.velocity(pts.x, pts.sigma, text), pts.x0, pts.eps)
            if not stand_in:
                pol[int(r)], ref[int(r)] = e.cpu(), e_ref.cpu()
            i += 1
        adv = batch.advantages.reshape(B, -1)[:, 0].detach().to(torch.float32).cpu()
        gather = lambda t: distributed.all_gather_cat(t, ctx.process)  # noqa: E731
        # gloo gathers no bool tensors: the mask travels as integers
        return cls(policy=gather(pol), reference=gather(ref), trained=gather(trained.cpu().to(torch.long)).bool(),
                   advantages=gather(adv), groups=gather(batch.group_ids.cpu().to(torch.long)),
                   offset=ctx.process.rank * ctx.samples_per_process, K=K)

    @staticmethod
    def gathered(ctx, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(advantages [N], groups [N])`` over all processes, before any forward (what decides
        which samples train)."""
        adv = batch.advantages.reshape(len(batch.indices), -1)[:, 0].detach().to(torch.float32).cpu()
        return (distributed.all_gather_cat(adv, ctx.process),
                distributed.all_gather_cat(batch.group_ids.cpu().to(torch.long), ctx.process))

    def group_size(self) -> torch.Tensor:
        """``[N]``: the size of each sample's group (all its samples, trained or not)."""
        _, inverse, counts = torch.unique(self.groups, return_inverse=True, return_counts=True)
        return counts[inverse]
