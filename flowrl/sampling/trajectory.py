"""The record of a rollout: exactly what training needs (docs/api.md §1, §3, §4).

Shapes (``B`` samples, ``N`` sampling steps, latent shape ``...``, ``T`` trainable transitions):

===================  ===========================  =============================================
field                shape / type                 meaning
===================  ===========================  =============================================
``latents``          ``[B, N + 1, ...]`` float32  ``x_0 .. x_N``; transition ``i`` goes
                                                  ``latents[:, i] -> latents[:, i + 1]``.
                                                  Stored in float32: the very values that
                                                  were scored (section 3 pitfall: never cast
                                                  them to bf16 after computing log-probs).
``log_probs``        ``[B, N]`` float32           ``l_i`` at rollout (0 for deterministic
                                                  steps); the "old" log-probs.
``sigmas``           ``[N + 1]`` float32          the schedule, ``sigmas[N] == 0``.
``trainable``        ``[N]`` bool                 explicit set of trainable transitions
                                                  (shared by the batch); ``T = sum``.
``prompts``          ``list[str]`` of length B
``group_ids``        ``[B]`` long                 samples with the same id form one group
                                                  for advantages (section 7).
``image_latents``    ``[B, ...]`` float32         what gets decoded: the last step's
                                                  ``x0_hat`` (default) or ``x_N``.
``kernels``          ``tuple[Kernel]`` of len N   the kernel of each step, to re-score.
``reduction``        ``"mean"`` | ``"sum"``       log-prob reduction, identical at rollout and
                                                  training (section 3).
``image_from``       ``"x0_hat"`` | ``"final"``   how ``image_latents`` was made (section 4).
``positions``        ``[B, T]`` long or None      per-sample trainable transitions (a rollout
                                                  plan whose SDE window differs per sample,
                                                  :mod:`flowrl.sampling.plans`); ``trainable`` is then
                                                  their union. None: ``trainable`` for all.
``position_kernel``  ``Kernel`` or None           the kernel of every trainable transition
                                                  when ``positions`` is set.
``means``            ``[B, T, ...]`` or None      the rollout's proposal means ``mu_old`` at
                                                  the trainable transitions, kept when an
                                                  objective needs them (GRPO-Guard).
===================  ===========================  =============================================

Trainable position ``t`` (``0 <= t < T``) of sample ``b`` is transition
:meth:`Trajectory.position_index` ``(t)[b]``; :meth:`Trajectory.position` returns its states,
sigmas and kernel for a set of rows, whichever form the trajectory has.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from flowrl.interfaces import Kernel
from flowrl.sampling.kernels import kernel_std

__all__ = ["Trajectory", "Transition", "Position"]


@dataclass(frozen=True)
class Transition:
    """One transition ``i``: ``sample [B, ...] -> next_sample [B, ...]`` from ``sigma`` to
    ``sigma_next`` (0-d float32 tensors), its rollout ``log_prob [B]``, kernel, trainability."""

    index: int
    sample: torch.Tensor
    next_sample: torch.Tensor
    sigma: torch.Tensor
    sigma_next: torch.Tensor
    log_prob: torch.Tensor
    kernel: Kernel | None
    trainable: bool


@dataclass(frozen=True)
class Position:
    """Trainable position ``t`` of the samples ``rows``: ``sample [n, ...] -> next_sample``, per-row
    ``sigma [n]`` and ``sigma_next [n]`` (float32), the rollout ``log_prob [n]``, the proposal
    ``mean [n, ...]`` when the trajectory kept it (else None), the kernel, and the reduction the
    rollout's ``log_prob`` was taken with (``"mean"`` or ``"sum"`` over a sample's elements)."""

    sample: torch.Tensor
    next_sample: torch.Tensor
    sigma: torch.Tensor
    sigma_next: torch.Tensor
    log_prob: torch.Tensor
    mean: torch.Tensor | None
    kernel: Kernel | None
    reduction: str = "mean"


@dataclass
class Trajectory:
    """A batch of sampled trajectories; see the module docstring for every shape."""

    latents: torch.Tensor
    log_probs: torch.Tensor
    sigmas: torch.Tensor
    trainable: torch.Tensor
    prompts: list[str]
    group_ids: torch.Tensor
    image_latents: torch.Tensor
    kernels: tuple[Kernel, ...] = field(default=())
    reduction: str = "mean"
    image_from: str = "x0_hat"
    positions: torch.Tensor | None = None
    position_kernel: Kernel | None = None
    means: torch.Tensor | None = None

    def __post_init__(self) -> None:
        lat = self.latents
        if lat.ndim < 3:
            raise ValueError(
                f"latents must be [B, N + 1, ...] with at least 3 dims, got {tuple(lat.shape)}"
            )
        b, n1 = lat.shape[0], lat.shape[1]
        n = n1 - 1
        if n < 1:
            raise ValueError(f"latents must hold N + 1 >= 2 states, got {n1}")
        if tuple(self.log_probs.shape) != (b, n):
            raise ValueError(f"log_probs must be [B, N] = {(b, n)}, got {tuple(self.log_probs.shape)}")
        if tuple(self.sigmas.shape) != (n1,):
            raise ValueError(f"sigmas must be [N + 1] = ({n1},), got {tuple(self.sigmas.shape)}")
        if tuple(self.trainable.shape) != (n,) or self.trainable.dtype != torch.bool:
            raise ValueError(
                f"trainable must be a bool tensor [N] = ({n},), got {self.trainable.dtype} "
                f"{tuple(self.trainable.shape)}"
            )
        if len(self.prompts) != b:
            raise ValueError(f"prompts must have B = {b} entries, got {len(self.prompts)}")
        if tuple(self.group_ids.shape) != (b,):
            raise ValueError(f"group_ids must be [B] = ({b},), got {tuple(self.group_ids.shape)}")
        if tuple(self.image_latents.shape) != (b, *lat.shape[2:]):
            raise ValueError(
                f"image_latents must be [B, ...] = {(b, *lat.shape[2:])}, "
                f"got {tuple(self.image_latents.shape)}"
            )
        self.kernels = tuple(self.kernels)
        if self.kernels and len(self.kernels) != n:
            raise ValueError(f"kernels must hold one kernel per step (N = {n}), got {len(self.kernels)}")
        if self.reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {self.reduction!r}")
        if self.image_from not in ("x0_hat", "final"):
            raise ValueError(f"image_from must be 'x0_hat' or 'final', got {self.image_from!r}")
        if self.positions is not None:
            p = self.positions
            if p.ndim != 2 or p.shape[0] != b or p.dtype != torch.long:
                raise ValueError(f"positions must be a long tensor [B, T] with B = {b}, got {p.dtype} {tuple(p.shape)}")
            if p.numel() and (int(p.min()) < 0 or int(p.max()) >= n):
                raise ValueError(f"positions must index transitions in [0, {n - 1}]")
            if self.position_kernel is None:
                raise ValueError("per-sample positions need position_kernel (the kernel of the trainable steps)")
        if self.means is not None:
            t = self.num_trainable
            if tuple(self.means.shape) != (b, t, *lat.shape[2:]):
                raise ValueError(f"means must be [B, T, ...] = {(b, t, *lat.shape[2:])}, got {tuple(self.means.shape)}")

    # ---------------------------------------------------------------- sizes
    @property
    def batch_size(self) -> int:
        return int(self.latents.shape[0])

    @property
    def num_steps(self) -> int:
        """``N``, the number of transitions."""
        return int(self.latents.shape[1]) - 1

    @property
    def num_trainable(self) -> int:
        """``T``, the number of trainable transitions (of each sample)."""
        if self.positions is not None:
            return int(self.positions.shape[1])
        return int(self.trainable.sum())

    @property
    def trainable_indices(self) -> torch.Tensor:
        """LongTensor ``[T]``: transition index of each trainable position, in order (shared by
        the batch; a trajectory with per-sample ``positions`` has none: use :meth:`position_index`)."""
        if self.positions is not None:
            raise ValueError("this trajectory's trainable transitions differ per sample: use position_index(t)")
        return torch.nonzero(self.trainable.cpu(), as_tuple=False).flatten()

    @property
    def trainable_log_probs(self) -> torch.Tensor:
        """``[B, T]`` float32 rollout log-probs of the trainable transitions (old policy)."""
        if self.positions is not None:
            return self.log_probs.gather(1, self.positions.to(self.log_probs.device))
        return self.log_probs[:, self.trainable_indices.to(self.log_probs.device)]

    def position_index(self, t: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        """LongTensor ``[n]`` (CPU): the transition index of trainable position ``t`` for ``rows``
        (default all)."""
        T = self.num_trainable
        if not (isinstance(t, int) and 0 <= t < T):
            raise ValueError(f"trainable position must be an int in [0, {T - 1}], got {t!r}")
        idx = torch.arange(self.batch_size) if rows is None else torch.as_tensor(rows, dtype=torch.long).cpu()
        if self.positions is None:
            return self.trainable_indices[t].repeat(idx.numel())
        return self.positions.cpu()[idx, t]

    def position(self, t: int, rows: torch.Tensor) -> Position:
        """Trainable position ``t`` of ``rows`` (:class:`Position`)."""
        idx = torch.as_tensor(rows, dtype=torch.long).to(self.latents.device)
        steps = self.position_index(t, idx.cpu()).to(self.latents.device)
        kernel = self.position_kernel if self.positions is not None else (
            self.kernels[int(steps[0])] if self.kernels and steps.numel() else None)
        return Position(
            sample=self.latents[idx, steps],
            next_sample=self.latents[idx, steps + 1],
            sigma=self.sigmas[steps],
            sigma_next=self.sigmas[steps + 1],
            log_prob=self.log_probs[idx.to(self.log_probs.device), steps.to(self.log_probs.device)],
            mean=None if self.means is None else self.means[idx.to(self.means.device), t],
            kernel=kernel,
            reduction=self.reduction,
        )

    def position_std(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 ``[n, T]`` (CPU): the kernel's std at every trainable position of ``rows``
        (per-row sigmas, so per-sample windows are honoured)."""
        if self.positions is None and not self.kernels:
            raise ValueError("the trajectory holds no kernels: the step std is unknown")
        sigmas, cols = self.sigmas.detach().cpu(), []
        for t in range(self.num_trainable):
            steps = self.position_index(t, rows)
            kernel = self.position_kernel if self.positions is not None else self.kernels[int(steps[0])]
            cols.append(kernel_std(kernel, sigmas[steps], sigmas[steps + 1]))
        return torch.stack(cols, dim=1)

    # ---------------------------------------------------------------- access
    def transition(self, i: int) -> Transition:
        """Transition ``i`` (0 <= i < N): ``latents[:, i] -> latents[:, i + 1]``."""
        n = self.num_steps
        if not (isinstance(i, int) and 0 <= i < n):
            raise ValueError(f"transition index must be an int in [0, {n - 1}], got {i!r}")
        return Transition(
            index=i,
            sample=self.latents[:, i],
            next_sample=self.latents[:, i + 1],
            sigma=self.sigmas[i],
            sigma_next=self.sigmas[i + 1],
            log_prob=self.log_probs[:, i],
            kernel=self.kernels[i] if self.kernels else None,
            trainable=bool(self.trainable[i]),
        )

    def to(self, device) -> "Trajectory":
        """A copy with every tensor on ``device`` (dtypes unchanged)."""
        return replace(
            self,
            latents=self.latents.to(device),
            log_probs=self.log_probs.to(device),
            sigmas=self.sigmas.to(device),
            trainable=self.trainable.to(device),
            group_ids=self.group_ids.to(device),
            image_latents=self.image_latents.to(device),
            prompts=list(self.prompts),
            positions=None if self.positions is None else self.positions.to(device),
            means=None if self.means is None else self.means.to(device),
        )

    def select(self, indices) -> "Trajectory":
        """The sub-batch ``indices`` (list, LongTensor or bool mask [B]); shared fields kept."""
        idx = torch.as_tensor(indices)
        if idx.dtype == torch.bool:
            if tuple(idx.shape) != (self.batch_size,):
                raise ValueError(f"a bool mask must be [B] = ({self.batch_size},), got {tuple(idx.shape)}")
            idx = torch.nonzero(idx, as_tuple=False).flatten()
        idx = idx.to(torch.long).flatten()
        if idx.numel() and (int(idx.min()) < -self.batch_size or int(idx.max()) >= self.batch_size):
            raise ValueError(f"batch indices must be in [0, {self.batch_size - 1}], got {idx.tolist()}")
        idx_cpu = idx.cpu()
        dev = self.latents.device
        return replace(
            self,
            latents=self.latents[idx.to(dev)],
            log_probs=self.log_probs[idx.to(self.log_probs.device)],
            group_ids=self.group_ids[idx.to(self.group_ids.device)],
            image_latents=self.image_latents[idx.to(self.image_latents.device)],
            prompts=[self.prompts[int(j)] for j in idx_cpu],
            positions=None if self.positions is None else self.positions[idx.to(self.positions.device)],
            means=None if self.means is None else self.means[idx.to(self.means.device)],
        )

    @classmethod
    def cat(cls, parts: "list[Trajectory]") -> "Trajectory":
        """Concatenate trajectories of the same schedule along the batch (rollout micro-batches)."""
        if not parts:
            raise ValueError("nothing to concatenate")
        first = parts[0]
        for p in parts[1:]:
            same_trainable = first.positions is not None or torch.equal(p.trainable, first.trainable)
            if not torch.equal(p.sigmas, first.sigmas) or not same_trainable:
                raise ValueError("trajectories with different schedules cannot be concatenated")
            if p.kernels != first.kernels or p.reduction != first.reduction or p.image_from != first.image_from:
                raise ValueError("trajectories with different kernels or settings cannot be concatenated")
            if (p.positions is None) != (first.positions is None) or (p.means is None) != (first.means is None) \
                    or p.position_kernel != first.position_kernel:
                raise ValueError("trajectories with and without per-sample positions or means cannot be concatenated")
        return replace(
            first,
            latents=torch.cat([p.latents for p in parts]),
            log_probs=torch.cat([p.log_probs for p in parts]),
            group_ids=torch.cat([p.group_ids for p in parts]),
            image_latents=torch.cat([p.image_latents for p in parts]),
            prompts=[q for p in parts for q in p.prompts],
            trainable=torch.stack([p.trainable for p in parts]).any(dim=0),
            positions=None if first.positions is None else torch.cat([p.positions for p in parts]),
            means=None if first.means is None else torch.cat([p.means for p in parts]),
        )
