"""The KL term to the reference policy (docs/api.md §8): the reference (:class:`ReferencePolicy`),
a ``[loss]``'s KL settings (:class:`KLSettings`) and a micro-batch's term (:class:`KLTerm`).

The reference is the model before RL: with LoRA, the same denoiser with its adapters disabled
(nothing copied); with full fine-tuning, a frozen copy of the denoiser taken before the first
update. Adapters may provide their own (:class:`flowrl.interfaces.HasReferencePolicy`, as the
diffusers adapters do); otherwise :class:`ReferencePolicy` does it for any adapter that calls
``self.denoiser(...)`` in ``velocity`` (the interface contract).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys

import torch

from flowrl.chunking import chunk_index
from flowrl.distributed import drop_gathered_weights
from flowrl.interfaces import HasReferencePolicy, KLRegularised, NeedsReferencePolicy, ScalesFlowGRPOKL
from flowrl.objectives.losses import kl_flow_grpo, kl_gaussian_exact, kl_old_policy_k3
from flowrl.objectives.chunk_gradient import any_process, pad_rows


def _lora_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """peft's adapter layers in ``module``. A process that never imported peft attached no
    adapter, and importing it here would cost seconds (it imports transformers)."""
    peft_layers = sys.modules.get("peft.tuners.tuners_utils")
    if peft_layers is None:
        return []
    return [m for m in module.modules() if isinstance(m, peft_layers.BaseTunerLayer)]


@contextlib.contextmanager
def adapters_disabled(module: torch.nn.Module):
    """Temporarily run ``module`` without its LoRA adapters."""
    layers = _lora_layers(module)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def frozen_copy(module: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A frozen copy of ``module`` (no grad, eval mode): the KL reference. ``dtype``: its
    floating-point parameters and buffers are made directly in that dtype, one tensor at a time,
    so that no whole copy in the module's own dtype ever exists (the diffusers adapters keep their
    reference in the compute dtype while the denoiser holds float32 master weights); None copies
    them as they are. A tensor shared by several submodules stays shared; a ``meta`` tensor (a
    process that receives rank 0's weights) stays on ``meta``."""
    memo: dict[int, object] = {}
    if dtype is not None:
        with torch.no_grad():
            for sub in module.modules():
                for store in (sub._parameters, sub._buffers):
                    for t in store.values():
                        if t is None or id(t) in memo or not t.is_floating_point() or t.dtype == dtype:
                            continue
                        made = t.detach().to(dtype)
                        memo[id(t)] = torch.nn.Parameter(made, requires_grad=False) if isinstance(t, torch.nn.Parameter) else made
    return copy.deepcopy(module, memo).requires_grad_(False).eval()


#: The attribute a module kept in CPU memory by accelerate's ``cpu_offload`` carries (set by
#: :meth:`flowrl.train.parallel.Strategy.prepare_frozen`): the dict of CPU tensors its hooks read.
#: Its parameters are then on the meta device, so reading or writing them would do nothing.
OFFLOADED_WEIGHTS = "flowrl_offloaded_weights"


def live_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors that hold ``module``'s weights, by state-dict name: its ``state_dict()``, or,
    for a module offloaded to CPU memory, the CPU tensors each forward copies to the device."""
    offloaded = getattr(module, OFFLOADED_WEIGHTS, None)
    return offloaded if offloaded is not None else module.state_dict()


class ReferencePolicy:
    """``velocity(x, sigma, text)`` of the reference model, without gradient."""

    def __init__(self, model):
        self.model = model
        if isinstance(model, HasReferencePolicy):
            model.snapshot_reference()
            self.mode, self.copy = "adapter", None
        elif _lora_layers(model.denoiser):
            self.mode, self.copy = "lora_disabled", None
        else:
            self.mode = "frozen_copy"  # as the denoiser is stored (the plan's ModelMemory.reference_bytes = None)
            self.copy = frozen_copy(model.denoiser)

    @property
    def frozen(self) -> torch.nn.Module | None:
        """The frozen copy of the denoiser this reference runs, whoever holds it (this object, or an
        adapter that keeps its own as ``reference_module``); None when there is none (LoRA disabled)."""
        if self.mode == "frozen_copy":
            return self.copy
        return getattr(self.model, "reference_module", None) if self.mode == "adapter" else None

    @frozen.setter
    def frozen(self, module: torch.nn.Module) -> None:
        if self.mode == "frozen_copy":
            self.copy = module
        else:
            self.model.reference_module = module

    @torch.no_grad()
    def reset_to_current(self) -> None:
        """The reference becomes the current policy (GARDO's reset; a frozen copy only)."""
        offloaded = getattr(self.frozen, OFFLOADED_WEIGHTS, None)
        if offloaded is not None:  # its parameters are meta: the weights its forwards read are these
            current = self.model.denoiser.state_dict()
            for name, tensor in offloaded.items():
                tensor.copy_(current[name])
            return
        self.frozen.load_state_dict(self.model.denoiser.state_dict())
        drop_gathered_weights(self.frozen)  # under FSDP2 its root still holds the weights gathered before

    @torch.no_grad()
    def velocity(self, latents, sigma, text):
        if self.mode == "adapter":
            return self.model.reference_velocity(latents, sigma, text)
        if self.mode == "lora_disabled":
            with adapters_disabled(self.model.denoiser):
                return self.model.velocity(latents, sigma, text)
        trained = self.model.denoiser
        self.model.denoiser = self.copy  # the adapter calls self.denoiser(...)
        try:
            return self.model.velocity(latents, sigma, text)
        finally:
            self.model.denoiser = trained


@dataclasses.dataclass(frozen=True)
class KLSettings:
    """A ``[loss]``'s KL term: its weight ``beta`` (0: no KL term), its ``kind`` (docs/api.md §8)
    and the ``reference`` policy it is taken to (None for ``old_policy_k3``, which needs none, and
    without a KL term or a monitor). ``monitor_every``: ``[log].kl_every``, the KL measured
    without gradient every that many iterations when there is no term (0: never)."""

    beta: float = 0.0
    kind: str = "gaussian_exact"
    reference: ReferencePolicy | None = None
    monitor_every: int = 0

    @classmethod
    def of(cls, loss, model, monitor_every: int = 0) -> KLSettings:
        """The KL term of the ``[loss]`` component (:class:`flowrl.interfaces.KLRegularised`, else
        none), and its monitor (``[log].kl_every``; validation allows it only on the
        policy-gradient family, with a reference kind). Fixes the reference to ``model``'s current
        weights, so call it before any update (and before a resume loads trained weights) and
        before the denoiser is sharded (a frozen copy is a plain module)."""
        if not isinstance(loss, KLRegularised):
            # an objective with a KL term of its own (NFT) still gets the one reference the engine places
            wants = isinstance(loss, NeedsReferencePolicy) and loss.needs_reference()
            return cls(reference=ReferencePolicy(model)) if wants else cls()
        beta, kind = float(loss.beta or 0.0), loss.kl
        wants = (beta > 0 or monitor_every > 0) and kind != "old_policy_k3"
        return cls(beta, kind, ReferencePolicy(model) if wants else None, monitor_every if beta == 0 else 0)

    def monitors(self, iteration: int) -> bool:
        """Whether the KL is measured (not optimised) in this iteration's update."""
        return self.beta == 0 and self.reference is not None and self.monitor_every > 0 \
            and iteration % self.monitor_every == 0


def step_kl(kind: str, out, ref_out, log_ratio: torch.Tensor, sigma, sigma_next, kernel=None,
            direction: str = "old_theta") -> torch.Tensor:
    """One transition's KL ``[b]`` of the named kind, with its gradient (docs/api.md §8).

    ``flow_grpo`` divides by Flow-GRPO's ``std_dev_t``: the kernel's
    :meth:`~flowrl.interfaces.ScalesFlowGRPOKL.flow_grpo_scale` (``g`` for the SDE kernels, the
    step std for ``cps``), else ``g = std / sqrt(sigma - sigma_next)``. ``direction`` is
    ``old_policy_k3``'s (:func:`flowrl.objectives.losses.kl_old_policy_k3`)."""
    if kind == "old_policy_k3":
        return kl_old_policy_k3(log_ratio, direction)
    if kind == "gaussian_exact":
        return kl_gaussian_exact(out.mean, ref_out.mean, out.std)
    if kind == "flow_grpo":
        if isinstance(kernel, ScalesFlowGRPOKL):
            g = kernel.flow_grpo_scale(out.std, sigma, sigma_next)
        else:  # g from the step std: s = g sqrt(sigma - sigma_next)
            g = torch.as_tensor(out.std, dtype=torch.float32) / torch.sqrt(
                torch.as_tensor(sigma - sigma_next, dtype=torch.float32))
        return kl_flow_grpo(out.mean, ref_out.mean, g)
    raise ValueError(f"unknown KL kind {kind!r}")


class KLTerm:
    """The KL term of one micro-batch: ``beta * mean over trained transitions of KL`` (docs/api.md §8).

    ``scorer`` is the objective's :class:`flowrl.objectives.policy_gradient.TransitionScorer` (it
    re-scores a stored transition with the policy, or with the reference), ``batch_idx [m]`` the
    micro-batch's rows, ``unit_mask [m, K]`` its trained chunks and ``old_lp [B, T]`` the rollout
    log-probs. Averaged like the policy loss: over the trained transitions of each sample, then
    summed over samples and divided by ``normaliser``. ``direction``: ``old_policy_k3``'s
    direction. ``sample_weights`` (``[B]`` over the whole batch, indexed by ``batch_idx``): each
    sample's KL is multiplied by its weight (GARDO's gate, :func:`flowrl.objectives.gardo.gated_weights`);
    the logged mean KL is over the samples with a weight.

    Two ways to back-propagate it, one per update path:

    - :meth:`forward` is ``forward_with_extra`` for :mod:`flowrl.objectives.chunk_gradient` (the
      fast path and the chunk-graph update): the step log-prob and the per-sample weighted KL of
      that step from the policy's own forward, back-propagated with the policy loss, so the KL
      costs no second policy forward;
    - :meth:`backward` is a pass of its own after the lean update: one forward + backward per
      trained transition, one step's graph at a time.

    Both do one reference forward per trained transition for the reference kinds. Each keeps the
    reduction order it has always had (a per-sample term in one, a summed scalar in the other), so
    that runs keep their bits. :meth:`result` is ``(mean KL over the trained transitions seen,
    the term as optimised without beta)``.
    """

    def __init__(self, scorer, batch_idx, unit_mask, sizes, old_lp, kind: str, beta: float, normaliser: float,
                 direction: str = "old_theta", sample_weights: torch.Tensor | None = None):
        self.scorer, self.batch_idx, self.old_lp = scorer, batch_idx, old_lp
        self.kind, self.beta, self.normaliser, self.direction = kind, beta, normaliser, direction
        self.trans = unit_mask[:, chunk_index(sizes, device=unit_mask.device)]  # [m, T]
        self.per_sample = self.trans.sum(1).clamp(min=1).float()
        self.weights = None if sample_weights is None else sample_weights.to(self.per_sample.device)[batch_idx]
        self.total, self.count, self.term = 0.0, 0, 0.0

    def _step(self, t: int, rows: torch.Tensor, grad: bool = True):
        """The policy's re-scored step (with grad) and its KL ``[len(rows)]`` at position ``t``:
        the reference forward first, then the policy's."""
        tr = self.scorer.trajectory.position(t, rows)
        ref_out = None if self.kind == "old_policy_k3" else self.scorer.step(t, rows, grad=False, reference=True)
        out = self.scorer.step(t, rows, grad=grad)
        kl = step_kl(self.kind, out, ref_out, out.log_prob - self.old_lp[rows, t], tr.sigma, tr.sigma_next, tr.kernel,
                     self.direction)
        return out, kl

    def forward(self, t: int, b: torch.Tensor):
        """``(log_prob [n], beta * weighted KL [n])`` of the micro-batch rows ``b`` at position ``t``
        (a lockstep stand-in row, not trained at ``t``, gets weight 0)."""
        out, kl = self._step(t, self.batch_idx[b])
        mask = self.trans[b, t].to(kl.dtype)  # 0 for a lockstep stand-in row
        if self.weights is not None:
            mask = mask * self.weights[b].to(kl.dtype)
        weighted = kl * mask / self.per_sample[b].to(kl.device) / self.normaliser
        self.term += float(weighted.detach().sum())
        counted = mask != 0
        self.total += float(kl.detach()[counted].sum())
        self.count += int(counted.sum())
        return out.log_prob, self.beta * weighted

    def backward(self, lockstep=None) -> tuple[float, float]:
        """Back-propagate the whole term, position by position; returns :meth:`result`.
        ``lockstep`` (:class:`flowrl.objectives.chunk_gradient.Lockstep`): a process without rows
        at a position where another has some forwards a stand-in row with weight 0."""
        for t in range(self.scorer.trajectory.num_trainable):
            b = torch.nonzero(self.trans[:, t], as_tuple=False).flatten()
            if self.weights is not None:
                b = b[self.weights.to(b.device)[b] != 0]
            if not any_process(bool(b.numel()), lockstep):
                continue
            b, stand_in = pad_rows(b)
            with torch.enable_grad():
                _, kl = self._step(t, self.batch_idx[b])
                w = self.per_sample[b].to(kl.device)
                if self.weights is not None and not stand_in:
                    w = w / self.weights[b].to(kl.device)
                weighted = (kl / w).sum() / self.normaliser * (0.0 if stand_in else 1.0)
                (self.beta * weighted).backward()
            if stand_in:
                continue
            self.term += float(weighted.detach())
            self.total += float(kl.detach().sum())
            self.count += kl.numel()
        return self.result()

    @torch.no_grad()
    def measure(self, lockstep=None) -> tuple[float, float]:
        """The term's KL over the micro-batch's trained transitions, measured without gradient
        (``[log].kl_every`` with ``beta = 0``: nothing is back-propagated), position by position
        as :meth:`backward` visits them, with the same stand-in rows under ``lockstep``; returns
        :meth:`result` (its term 0: nothing was optimised)."""
        for t in range(self.scorer.trajectory.num_trainable):
            b = torch.nonzero(self.trans[:, t], as_tuple=False).flatten()
            if not any_process(bool(b.numel()), lockstep):
                continue
            b, stand_in = pad_rows(b)
            _, kl = self._step(t, self.batch_idx[b], grad=False)
            if stand_in:
                continue
            self.total += float(kl.sum())
            self.count += kl.numel()
        return self.result()

    def result(self) -> tuple[float, float]:
        """(mean KL over the trained transitions seen, the term as optimised without beta)."""
        return self.total / max(self.count, 1), self.term
