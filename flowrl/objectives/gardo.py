"""Anti-reward-hacking pieces: GARDO's gated KL and reference reset, and a group-diversity bonus
(docs/objectives.md).

GARDO (flow_grpo, ``config/grpo_gardo.py``) regularises only where the proxy reward is least
trusted, and lets the reference follow the policy:

- **uncertainty** of each sample from descending reward ranks over the whole batch
  (rank 1 = highest; ties in sort order)::

      u_b = rank_main(b) - mean_k rank_aux_k(b)

  With ``sign = "code"`` (flow_grpo's script) ``u > 0`` marks samples whose main reward ranks
  WORSE than the auxiliary rewards'; ``sign = "proxy_high"`` uses ``-u`` (main ranks better than
  the auxiliaries: the proxy is high where the judges disagree). Which one the paper means is not
  settled by the code (docs/objectives.md).
- **gate**: of the non-negative ``u``, those above the ``100 (1 - q)`` percentile (linear
  interpolation, as numpy) get the KL term; ``q`` adapts (:class:`RiskCompensator`).
- **reference reset**: the reference becomes the current policy when the KL of some optimizer
  step exceeded ``kl_threshold`` (from the next iteration on) or after ``every`` iterations
  (:func:`reset_due`).
- **diversity-aware advantage**: within each group, ``d_b`` is the cosine distance of sample
  ``b``'s feature to its nearest other member; a non-negative advantage is multiplied by
  ``d_b / mean_group(d)`` (:func:`diversity_multipliers`), so among good samples the unusual
  ones count more and a diverse bad sample is not rewarded.

:class:`GatedKLPolicyGradient` is the objective the ``gardo`` loss runs as: the policy gradient
plus the gated KL to a reference that is reset as above.
"""

from __future__ import annotations

import math
from collections import deque

import torch

from flowrl import distributed
from flowrl.batch import Batch
from flowrl.objectives.advantages import group_means
from flowrl.objectives.base import MicroBatch, MicroBatchResult, UpdateContext
from flowrl.objectives.kl import live_state
from flowrl.objectives.policy_gradient import PolicyGradient

__all__ = [
    "descending_ranks",
    "uncertainty",
    "uncertainty_gate",
    "RiskCompensator",
    "reset_due",
    "nearest_cosine_distance",
    "diversity_multipliers",
    "gated_weights",
    "GatedKLPolicyGradient",
]

_SIGNS = ("code", "proxy_high")


def descending_ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks ``[B]`` (long, 1 = highest value; equal values keep their order in ``x``)."""
    x = torch.as_tensor(x).reshape(-1)
    order = torch.sort(-x.to(torch.float64), stable=True).indices
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(1, x.numel() + 1, device=order.device)
    return ranks


def uncertainty(main: torch.Tensor, aux: list[torch.Tensor], sign: str = "code") -> torch.Tensor:
    """``u_b = rank_main(b) - mean_k rank_aux_k(b)`` ``[B]`` float64 (``-u`` with
    ``sign = "proxy_high"``). At least one auxiliary reward is needed."""
    if sign not in _SIGNS:
        raise ValueError(f"sign must be one of {_SIGNS}, got {sign!r}")
    if not aux:
        raise ValueError("the uncertainty needs at least one auxiliary reward beside the main one")
    u = descending_ranks(main).to(torch.float64) - torch.stack(
        [descending_ranks(a).to(torch.float64) for a in aux]).mean(dim=0)
    return u if sign == "code" else -u


def uncertainty_gate(u: torch.Tensor, q: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate [B] bool, P)``: ``P`` = the non-negative ``u``, ``gate = u > percentile(P, 100 - 100 q)``
    (linear interpolation). ``0 < q <= 1``."""
    if not (isinstance(q, (int, float)) and 0 < q <= 1):
        raise ValueError(f"q must be in (0, 1], got {q!r}")
    u = torch.as_tensor(u, dtype=torch.float64).reshape(-1)
    positive = u[u >= 0]
    if positive.numel() == 0:
        return torch.zeros_like(u, dtype=torch.bool), positive
    threshold = torch.quantile(positive, 1.0 - q, interpolation="linear")
    return u > threshold, positive


class RiskCompensator:
    """GARDO's adaptive gate fraction ``q``: starts at ``base``; each iteration, with ``m`` the
    mean of the non-negative uncertainties and the last ``window`` means remembered: no history
    -> ``base``; ``m`` above all of them -> ``q * up``; below all -> ``q * down``; then clipped to
    ``[low, high]`` and ``m`` remembered."""

    def __init__(self, base: float = 0.1, window: int = 20, up: float = 1.1, down: float = 0.9,
                 low: float = 0.02, high: float = 0.2):
        if not 0 < low <= base <= high <= 1:
            raise ValueError(f"need 0 < low <= base <= high <= 1, got {low}, {base}, {high}")
        self.base, self.up, self.down, self.low, self.high = base, up, down, low, high
        self.q = base
        self.history: deque[float] = deque(maxlen=window)

    def update(self, m: float) -> float:
        if not self.history:
            self.q = self.base
        elif m > max(self.history):
            self.q *= self.up
        elif m < min(self.history):
            self.q *= self.down
        self.q = min(max(self.q, self.low), self.high)
        self.history.append(float(m))
        return self.q

    def state_dict(self) -> dict:
        return {"q": self.q, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.q = float(state["q"])
        self.history.clear()
        self.history.extend(float(m) for m in state["history"])


def reset_due(iteration: int, last_reset: int, flagged: bool, every: int) -> bool:
    """GARDO's reference reset rule: ``(iteration != 0 and flagged) or iteration - last_reset > every``."""
    return (iteration != 0 and flagged) or (iteration - last_reset) > every


def nearest_cosine_distance(features: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``d_b = min_{j in group(b), j != b} (1 - cos(f_b, f_j))`` ``[B]`` float64; NaN for a sample
    alone in its group. A zero feature vector has cosine 0 with everything."""
    f = torch.as_tensor(features, dtype=torch.float64)
    f = f.reshape(f.shape[0], -1)
    g = torch.as_tensor(group_ids).reshape(-1).to(f.device)
    if g.numel() != f.shape[0]:
        raise ValueError(f"group_ids must have B = {f.shape[0]} entries, got {g.numel()}")
    norm = f.norm(dim=1, keepdim=True)
    unit = torch.where(norm > 0, f / torch.where(norm > 0, norm, torch.ones_like(norm)), torch.zeros_like(f))
    dist = 1.0 - unit @ unit.T
    other = (g[:, None] == g[None, :]) & ~torch.eye(len(g), dtype=torch.bool, device=f.device)
    dist = torch.where(other, dist, torch.full_like(dist, math.inf))
    d = dist.min(dim=1).values
    return torch.where(torch.isinf(d), torch.full_like(d, math.nan), d)


def diversity_multipliers(features: torch.Tensor, group_ids: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """``m_b = d_b / mean_{j in group(b)} d_j`` where ``A_b >= 0`` and the group's mean distance is
    > 0; ``1`` otherwise (negative advantages, identical images, a group of one). float64 ``[B]``."""
    d = nearest_cosine_distance(features, group_ids)
    g = torch.as_tensor(group_ids).reshape(-1).to(d.device)
    a = torch.as_tensor(advantages, dtype=torch.float64).reshape(-1).to(d.device)
    mean = group_means(torch.nan_to_num(d, nan=0.0), g)  # a sample alone in its group counts 0
    ok = (a >= 0) & (mean > 0) & ~torch.isnan(d)
    return torch.where(ok, d / torch.where(mean > 0, mean, torch.ones_like(mean)), torch.ones_like(d))


def gated_weights(gate: torch.Tensor) -> torch.Tensor:
    """Per-sample KL weights ``gate_b * B / |G|`` (float32): the KL term, averaged over all samples
    with these weights, is its mean over the gated samples (0 when none is gated)."""
    g = torch.as_tensor(gate, dtype=torch.bool).reshape(-1)
    n = int(g.sum())
    if n == 0:
        return torch.zeros(g.numel(), dtype=torch.float32)
    return g.to(torch.float32) * (g.numel() / n)


class GatedKLPolicyGradient(PolicyGradient):
    """GARDO (flow_grpo ``config/grpo_gardo.py``): the policy-gradient loss plus a KL to the
    reference on the gated samples only (averaged over them), a gate from the rank disagreement
    between the proxy (main) reward and auxiliary rewards (:func:`uncertainty`) with
    an adaptive share ``q`` (:class:`RiskCompensator`), and a reference reset to the
    current weights every ``reset_every`` iterations or after an iteration whose KL exceeded
    ``kl_threshold`` (:func:`reset_due`)."""

    #: the reference reset loads the current weights into a frozen copy (NeedsReferenceCopy)
    needs_reference_copy = True

    def __init__(self, loss, *, main: str, auxiliary, sign: str, q: float, reset_every: int, kl_threshold: float):
        super().__init__(loss)
        self.beta, self.kl = loss.beta, loss.kl
        self.main, self.auxiliary, self.sign = main, tuple(auxiliary), sign
        self.compensator = RiskCompensator(base=q)
        self.reset_every, self.kl_threshold = reset_every, kl_threshold
        self.last_reset, self.flagged, self.gate, self.reset_now = 0, False, None, False
        self.gate_fraction = 0.0
        self.kl_seen: list[float] = []
        self.reference = None  # the update's ReferencePolicy (ctx.kl.reference), from prepare()

    @property
    def objective(self):  # the PolicyLoss's unit objective, for code that reads [loss] directly
        return self.loss.objective

    def prepare(self, ctx: UpdateContext) -> None:
        self.reference = ctx.kl.reference
        if self.reference is None or self.reference.frozen is None:
            raise ValueError("gardo's reference reset needs the reference as a frozen copy of the denoiser: "
                             "[train].finetune = 'full', beta > 0 and kl = 'gaussian_exact' or 'flow_grpo'")

    def start_rollout(self, ctx: UpdateContext, batch: Batch, sizes) -> None:
        super().start_rollout(ctx, batch, sizes)
        it = batch.iteration
        self.reset_now = reset_due(it, self.last_reset, self.flagged, self.reset_every)
        if self.reset_now:  # the reference becomes the current policy
            self.reference.reset_to_current()
            self.last_reset, self.flagged = it, False
        everyone = {k: distributed.all_gather_cat(v, ctx.process) for k, v in batch.rewards.items()}
        main = self.main or next(iter(everyone))
        for name in (main, *self.auxiliary):
            if name not in everyone:
                raise ValueError(f"gardo: no reward labelled {name!r} (rewards: {sorted(everyone)})")
        u = uncertainty(everyone[main], [everyone[a] for a in self.auxiliary], self.sign)
        q = self.compensator.update(float(u[u >= 0].mean()))
        gate, _ = uncertainty_gate(u, q)
        # Normalised over the whole batch, then sliced: each process divides its KL by its own
        # samples and the processes' gradients are averaged, so weights normalised per slice would
        # scale the term by how the gated samples happen to fall across processes.
        offset = ctx.process.rank * ctx.samples_per_process
        self.gate = gated_weights(gate)[offset: offset + len(batch.indices)].to(ctx.device)
        self.gate_fraction = float(gate.float().mean())  # of the whole batch, the same on every process
        self.kl_seen = []

    def kl_weights(self):
        return self.gate

    def backward(self, ctx: UpdateContext, micro: MicroBatch) -> MicroBatchResult:
        res = super().backward(ctx, micro)
        kl = res.metrics.get(f"kl/{ctx.kl.kind}")
        if kl is not None:
            self.kl_seen.append(kl)
        return res

    def end_rollout(self, ctx: UpdateContext, batch: Batch) -> dict:
        out = super().end_rollout(ctx, batch)
        kl = distributed.all_reduce_scalar(max(self.kl_seen, default=0.0), ctx.process, "max")
        if kl > self.kl_threshold:  # the reference is reset before the next rollout
            self.flagged = True
        out["gardo/gate_fraction"] = self.gate_fraction
        out["gardo/q"] = float(self.compensator.q)
        out["gardo/reset"] = bool(self.reset_now)
        return out

    def state_dict(self) -> dict:
        return {"last_reset": self.last_reset, "flagged": self.flagged, "compensator": self.compensator.state_dict()}

    def tensors(self) -> dict:
        # the reference as the last reset left it (the live tensors: a sharded resume loads into them)
        ref = live_state(self.reference.frozen) if self.reference is not None else {}
        return {f"reference.{k}": v for k, v in ref.items()}

    def load_state(self, state, tensors) -> None:
        self.last_reset, self.flagged = int(state["last_reset"]), bool(state["flagged"])
        self.compensator.load_state_dict(state["compensator"])
        ref = {k[len("reference."):]: v for k, v in tensors.items() if k.startswith("reference.")}
        if ref and self.reference is not None:
            live = live_state(self.reference.frozen)
            with torch.no_grad():
                for k, v in ref.items():
                    if live[k] is not v:
                        live[k].copy_(v)
