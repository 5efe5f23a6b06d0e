"""What the engine hands an objective (:class:`flowrl.interfaces.Objective`) per micro-batch,
what it gets back, and the built-in objectives.

The update (:class:`flowrl.train.update.PolicyUpdate`) owns the optimizer: the passes over a
rollout, the optimizer steps, gradient averaging and clipping, skipping non-finite steps, the
on-policy check. The objective owns the loss: everything between "these rows of this rollout"
and ``.backward()``. The loop and the update call the same four methods whatever the
objective (``prepare``, ``start_rollout``, ``backward``, ``end_rollout``):

- :class:`PolicyGradient`: the ratio-based GRPO family (step GRPO, GSPO, fixed chunks,
  Chunk-GRPO, GRPO-Guard): selector -> chunk update -> KL pass. A recipe's ``[loss]`` that is a
  plain :class:`~flowrl.interfaces.PolicyLoss` runs through it.
- :class:`GatedKLPolicyGradient`: GARDO's anti-hacking regulariser on top: a KL to the reference
  applied only to the samples whose proxy reward is least trustworthy, and a reference that is
  reset to the current weights periodically or when the KL grows.
- :class:`ForwardProcessObjective`: DiffusionNFT, likelihood-free: trains on the rollout's clean
  samples with the flow-matching loss on implicit positive and negative policies; no trajectory
  log-probs, no units, sampling with an old copy of the weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

from .. import distributed
from ..chunking import chunk_index
from ..gardo import RiskCompensator, gated_weights, reset_due, uncertainty, uncertainty_gate
from ..guard import guard_log_ratio, inverse_step_weight, reweighted
from ..interfaces import KeepsRolloutMeans, NormalisesStepRatio, Objective, SelectsFromRollout, select_embeddings
from ..nft import DECAY_PRESETS, nft_loss, old_policy_decay, optimality_probability, velocity_kl
from ..seeding import generator
from ..selection import rollout_l1rel
from .reference import ReferencePolicy

__all__ = ["MicroBatch", "MicroBatchResult", "StepRecorder", "PolicyGradient", "GatedKLPolicyGradient",
           "ForwardProcessObjective", "guard_step_ratio", "objective_for"]


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch of an optimizer step.

    ``batch``: the iteration's :class:`flowrl.train.collect.Batch`; ``rows``: the micro-batch's
    rows in it (long, CPU); ``sizes``: the chunk layout (``()`` for objectives without units);
    ``epoch``: the pass over the rollout; ``normaliser``: the samples of the whole optimizer step
    on this process (divide the summed per-sample losses by it); ``first``: the first optimizer
    step after the rollout (exactly on-policy); ``probe``: an
    :class:`flowrl.train.update.OnPolicyProbe` to feed the re-scored log-probs of that step
    (None otherwise; objectives without log-probs leave it unfed)."""

    batch: object
    rows: torch.Tensor
    sizes: tuple[int, ...]
    epoch: int
    normaliser: float
    first: bool
    probe: object | None = None


@dataclasses.dataclass
class MicroBatchResult:
    """``losses``: the loss terms back-propagated, as floats, summed in this order into the
    step's logged ``loss``; ``metrics``: per-micro-batch metrics (in the order they are logged;
    combined over micro-batches and processes by ``flowrl.train.update.update_aggregate``);
    ``trained``: bool ``[len(rows), K]``, the units each row trained (K = ``len(sizes)``)."""

    losses: tuple[float, ...]
    metrics: dict[str, float]
    trained: torch.Tensor


def objective_for(loss):
    """The objective a recipe's ``[loss]`` component runs as: itself when it is an
    :class:`~flowrl.interfaces.Objective`, else :class:`PolicyGradient` around it."""
    return loss if isinstance(loss, Objective) else PolicyGradient(loss)


# ----------------------------------------------------------------------------- diagnostics


class StepRecorder:
    """Per-step and per-unit statistics of the log-ratio ``l_theta - l_old`` seen while
    re-scoring (for GRPO-Guard: the normalised ratio). Within one micro-batch each (row,
    position) keeps its last value; the values of the transitions each row trained are then
    accumulated per position ``t`` and per unit ``k`` (the unit log-ratio is the mean over the
    unit's positions). ``metrics`` all-reduces the sums over processes."""

    def __init__(self, T: int, sizes):
        self.T, self.sizes = T, tuple(sizes)
        self.step = torch.zeros(3, T, dtype=torch.float64)  # n, sum, sum of squares
        self.unit = torch.zeros(3, len(self.sizes), dtype=torch.float64)
        self.cur = None

    def start(self, n_rows: int) -> None:
        self.cur = torch.full((n_rows, self.T), float("nan"), dtype=torch.float64)

    def observe(self, t: int, b: torch.Tensor, lp: torch.Tensor, old: torch.Tensor) -> None:
        self.cur[b.cpu(), t] = (lp.detach().double() - old.detach().double()).cpu()

    def wrap(self, fn, old_lp: torch.Tensor):
        def recorded(t, b, grad):
            lp = fn(t, b, grad)
            self.observe(t, b, lp, old_lp[b, t])
            return lp
        return recorded

    def wrap_forward(self, forward, old_lp: torch.Tensor):
        def recorded(t, b):
            lp, extra = forward(t, b)
            self.observe(t, b, lp, old_lp[b, t])
            return lp, extra
        return recorded

    def wrap_many(self, many, old_lp: torch.Tensor):
        def recorded(ts, b):
            lp = many(ts, b)
            if b is None:  # every row
                b = torch.arange(old_lp.shape[0])
            for j, t in enumerate(ts):
                self.observe(t, b, lp[j], old_lp[b, t])
            return lp
        return recorded

    def finish(self, mask: torch.Tensor) -> None:
        """Accumulate the micro-batch (``mask [n, K]``: the units each row trained)."""
        cur, self.cur = self.cur, None
        if cur is None:
            return
        if not self.sizes:
            return
        idx = chunk_index(self.sizes)
        m = mask.cpu().bool()
        # only the transitions of the units each row trained: what is re-scored besides them
        # depends on the update path and the micro-batching, what is trained does not
        seen = ~torch.isnan(cur) & m[:, idx]
        vals = torch.where(seen, cur, torch.zeros_like(cur))
        self.step += torch.stack([seen.sum(0).double(), vals.sum(0), (vals**2).sum(0)])
        for k in range(len(self.sizes)):
            cols = (idx == k).nonzero().flatten()
            ok = m[:, k] & seen[:, cols].all(1)
            z = vals[:, cols].mean(1)[ok]
            self.unit[:, k] += torch.stack([torch.tensor(float(z.numel()), dtype=torch.float64), z.sum(), (z**2).sum()])

    def metrics(self, ctx) -> dict:
        step = torch.tensor([distributed.all_reduce_scalar(float(x), ctx) for x in self.step.flatten()]).reshape(3, -1)
        unit = torch.tensor([distributed.all_reduce_scalar(float(x), ctx) for x in self.unit.flatten()]).reshape(3, -1) \
            if self.unit.numel() else self.unit

        def stats(a):
            n = a[0].clamp(min=1)
            mean = a[1] / n
            std = (a[2] / n - mean**2).clamp(min=0).sqrt()
            none = a[0] == 0
            return ([None if e else float(v) for v, e in zip(mean, none)], [None if e else float(v) for v, e in zip(std, none)])

        out = {}
        total = step.sum(1)
        if float(total[0]) > 0:
            mean = float(total[1] / total[0])
            out["diag/log_ratio_mean"] = mean
            out["diag/log_ratio_std"] = math.sqrt(max(float(total[2] / total[0]) - mean**2, 0.0))
        out["diag/step_log_ratio_mean"], out["diag/step_log_ratio_std"] = stats(step)
        if unit.numel():
            out["diag/unit_log_ratio_mean"], out["diag/unit_log_ratio_std"] = stats(unit)
        return out


def guard_step_ratio(out, old, reduction: str = "mean", reweight: bool = True) -> torch.Tensor:
    """GRPO-Guard's re-scored step as a "log-prob" relative to the rollout's: ``l_old + zh`` with
    ``zh = reduce(eps * (mu - mu_old))`` (:func:`flowrl.guard.guard_log_ratio`) and its gradient
    scaled by ``1 / h`` (``reweight``). ``out``: the kernel's StepOutput with gradient, ``old``:
    the :class:`flowrl.trajectory.Position` (its ``mean`` kept at rollout)."""
    if old.mean is None:
        raise ValueError("GRPO-Guard needs the rollout's proposal means (keep_means)")
    zh = guard_log_ratio(old.next_sample, out.mean, old.mean, out.std, reduction)
    if reweight:
        zh = reweighted(zh, inverse_step_weight(old.sigma, old.sigma_next).to(zh.device))
    return old.log_prob.to(zh.device) + zh


# ----------------------------------------------------------------------------- the GRPO family


class PolicyGradient:
    """The ratio-based family: per micro-batch the selector picks each row's units, the chunk
    update back-propagates the loss over them and the KL pass adds the loss's KL term
    (docs/architecture.md). Also records the per-step/per-unit log-ratio diagnostics."""

    uses_units = True

    def __init__(self, loss):
        self.loss = loss
        self.keep_means = bool(isinstance(loss, KeepsRolloutMeans) and loss.keep_means)
        self.kl_direction = getattr(loss, "kl_direction", "old_theta")
        self.scorer = self.old_lp = self.recorder = None

    # the objective protocol
    def prepare(self, update) -> None:
        """The KL reference is fixed by the update (:class:`flowrl.train.reference.ReferencePolicy`)."""

    def step_transform(self):
        """The scorer's step transform (GRPO-Guard's normalised ratio) or None."""
        if isinstance(self.loss, NormalisesStepRatio):
            return self.loss.step_ratio
        return None

    def start_rollout(self, update, batch, sizes) -> None:
        self.scorer = update.make_scorer(batch, step_ratio=self.step_transform())
        self.old_lp = batch.trajectory.trainable_log_probs.to(update.session.device)
        self.recorder = StepRecorder(batch.trajectory.num_trainable, sizes)

    def kl_weights(self):
        """Per-sample KL weights ``[B]`` (None: every sample); GARDO's gate."""
        return None

    def backward(self, update, micro: MicroBatch) -> MicroBatchResult:
        seed, batch = update.session.recipe.run.seed, micro.batch
        idx = micro.rows
        gens = [generator(seed, "select", batch.iteration, micro.epoch, batch.indices[int(i)]) for i in idx]
        selector = update.session.components.selector
        if isinstance(selector, SelectsFromRollout):  # GCPO: each sample's L1rel over its own rollout
            traj = batch.trajectory
            l1rel = torch.stack([rollout_l1rel(p.sample, p.next_sample) for p in
                                 (traj.position(t, idx) for t in range(traj.num_trainable))], dim=1)
            mask = selector.select_from_rollout(len(idx), micro.sizes, gens, l1rel.cpu()).cpu()
        else:
            mask = selector.select(len(idx), micro.sizes, gens).cpu()
        device = update.session.device
        idx_d, mask_d = idx.to(device), mask.to(device)
        update.expect_update(batch.advantages[idx_d], mask_d, micro.sizes)
        self.recorder.start(len(idx))
        loss, m, kl = update.micro_batch_backward(
            self.scorer, self.old_lp, batch.advantages, idx_d, mask_d, micro.sizes, micro.probe,
            fast=micro.first and update.fast_path, normaliser=micro.normaliser, recorder=self.recorder,
            kl_direction=self.kl_direction, kl_weights=self.kl_weights())
        self.recorder.finish(mask)
        metrics = {} if kl is None else {f"kl/{update.kl_kind}": kl[0]}  # the order rows have always had
        metrics.update({k: float(v) for k, v in m.items()})
        losses = (float(loss),) if kl is None else (float(loss), update.beta * kl[1])
        return MicroBatchResult(losses=losses, metrics=metrics, trained=mask)

    def end_rollout(self, update, batch) -> dict:
        out = self.recorder.metrics(update.ctx) if self.recorder is not None else {}
        self.scorer = None
        return out


class GatedKLPolicyGradient(PolicyGradient):
    """GARDO (flow_grpo ``config/grpo_gardo.py``): the policy-gradient loss plus a KL to the
    reference on the gated samples only (averaged over them), a gate from the rank disagreement
    between the proxy (main) reward and auxiliary rewards (:func:`flowrl.gardo.uncertainty`) with
    an adaptive share ``q`` (:class:`flowrl.gardo.RiskCompensator`), and a reference reset to the
    current weights every ``reset_every`` iterations or after an iteration whose KL exceeded
    ``kl_threshold`` (:func:`flowrl.gardo.reset_due`)."""

    def __init__(self, loss, *, main: str, auxiliary, sign: str, q: float, reset_every: int, kl_threshold: float):
        super().__init__(loss)
        self.beta, self.kl = loss.beta, loss.kl
        self.main, self.auxiliary, self.sign = main, tuple(auxiliary), sign
        self.compensator = RiskCompensator(base=q)
        self.reset_every, self.kl_threshold = reset_every, kl_threshold
        self.last_reset, self.flagged, self.gate, self.reset_now = 0, False, None, False
        self.kl_seen: list[float] = []
        self.reference = None  # the update's ReferencePolicy, from prepare()

    @property
    def objective(self):  # the PolicyLoss's unit objective, for code that reads [loss] directly
        return self.loss.objective

    def prepare(self, update) -> None:
        self.reference = update.reference
        if update.reference is None or update.reference.copy is None:
            raise ValueError("gardo's reference reset needs the reference as a frozen copy of the denoiser: "
                             "[train].finetune = 'full', beta > 0 and kl = 'gaussian_exact' or 'flow_grpo'")

    def start_rollout(self, update, batch, sizes) -> None:
        super().start_rollout(update, batch, sizes)
        it = batch.iteration
        self.reset_now = reset_due(it, self.last_reset, self.flagged, self.reset_every)
        if self.reset_now:  # the reference becomes the current policy
            update.reference.copy.load_state_dict(update.session.model.denoiser.state_dict())
            self.last_reset, self.flagged = it, False
        everyone = {k: distributed.all_gather_cat(v, update.ctx) for k, v in batch.rewards.items()}
        main = self.main or next(iter(everyone))
        for name in (main, *self.auxiliary):
            if name not in everyone:
                raise ValueError(f"gardo: no reward labelled {name!r} (rewards: {sorted(everyone)})")
        u = uncertainty(everyone[main], [everyone[a] for a in self.auxiliary], self.sign)
        q = self.compensator.update(float(u[u >= 0].mean()))
        gate, _ = uncertainty_gate(u, q)
        offset = update.ctx.rank * update.geometry.samples_per_process
        self.gate = gated_weights(gate[offset: offset + len(batch.indices)]).to(update.session.device)
        self.kl_seen = []

    def kl_weights(self):
        return self.gate

    def backward(self, update, micro):
        res = super().backward(update, micro)
        kl = res.metrics.get(f"kl/{update.kl_kind}")
        if kl is not None:
            self.kl_seen.append(kl)
        return res

    def end_rollout(self, update, batch) -> dict:
        out = super().end_rollout(update, batch)
        kl = distributed.all_reduce_scalar(max(self.kl_seen, default=0.0), update.ctx, "max")
        if kl > self.kl_threshold:  # the reference is reset before the next rollout
            self.flagged = True
        out["gardo/gate_fraction"] = float((self.gate > 0).float().mean())
        out["gardo/q"] = float(self.compensator.q)
        out["gardo/reset"] = bool(self.reset_now)
        return out

    def state_dict(self) -> dict:
        return {"last_reset": self.last_reset, "flagged": self.flagged, "compensator": self.compensator.state_dict()}

    def tensors(self) -> dict:
        # the reference as the last reset left it (the live tensors: a sharded resume loads into them)
        ref = self.reference.copy.state_dict() if self.reference is not None else {}
        return {f"reference.{k}": v for k, v in ref.items()}

    def load_state(self, state, tensors) -> None:
        self.last_reset, self.flagged = int(state["last_reset"]), bool(state["flagged"])
        self.compensator.load_state_dict(state["compensator"])
        ref = {k[len("reference."):]: v for k, v in tensors.items() if k.startswith("reference.")}
        if ref and self.reference is not None:
            live = self.reference.copy.state_dict()
            with torch.no_grad():
                for k, v in ref.items():
                    if live[k] is not v:
                        live[k].copy_(v)


# ----------------------------------------------------------------------------- DiffusionNFT


class ForwardProcessObjective:
    """DiffusionNFT (NVlabs/DiffusionNFT ``train_nft_sd3.py``), likelihood-free.

    Per sample of the rollout (its clean latent ``x0 = image_latents``) and each of ``K`` trained
    sigmas (a per-sample random subset of the sampling schedule's, without 0), fresh noise
    ``eps`` (seeded by (seed, "nft", iteration, sample)), ``x = (1 - sigma) x0 + sigma eps``;
    the loss :func:`flowrl.nft.nft_loss` of the current velocity against the old policy's, with
    ``r`` the optimality probability of the sample's advantage, plus ``beta_kl`` times the
    velocity KL to the reference. Rollouts are drawn with the old weights
    (:meth:`rollout_weights`); after each rollout the old weights move towards the trained ones
    with NFT's decay schedule on the optimizer-step counter."""

    uses_units = False
    keep_means = False

    def __init__(self, *, beta: float, clip: float, timesteps: int, decay_type: int, beta_kl: float,
                 weight_min: float = 1e-5):
        self.beta, self.clip, self.K, self.beta_kl = beta, clip, timesteps, beta_kl
        self.decay = DECAY_PRESETS[decay_type]
        self.weight_min = weight_min
        self.params, self.old, self.reference, self.steps = None, None, None, 0

    def prepare(self, update) -> None:
        self.params = [p for p in update.params]
        self.old = [p.detach().clone() for p in self.params]
        self.model = update.session.model
        if self.beta_kl > 0:
            self.reference = ReferencePolicy(update.session.model)

    @contextlib.contextmanager
    def rollout_weights(self):
        """The old weights in place of the trained ones (restored after)."""
        if self.old is None:
            yield
            return
        with torch.no_grad():
            saved = [p.detach().clone() for p in self.params]
            for p, o in zip(self.params, self.old):
                p.copy_(o)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(self.params, saved):
                    p.copy_(s)

    def start_rollout(self, update, batch, sizes) -> None:
        """Nothing to prepare: the rollout was drawn with the old weights."""

    def _points(self, update, batch, idx, sigmas):
        """``(x0, x, sigma, rows, K)`` for every (row, k), rows repeated K times (row-major): the
        sigmas and noises are drawn from one generator per (seed, "nft", iteration, sample), so
        every pass over the rollout trains the same points."""
        seed = update.session.recipe.run.seed
        x0 = batch.trajectory.image_latents[idx].to(torch.float32)
        grid = sigmas[:-1]  # no sigma = 0
        K = min(self.K, grid.numel())
        xs, ss, x0s, rows = [], [], [], []
        for j, r in enumerate(idx.tolist()):
            g = generator(seed, "nft", batch.iteration, batch.indices[r])
            pick = torch.randperm(grid.numel(), generator=g)[:K]
            for k in range(K):
                s = grid[int(pick[k])]
                eps = torch.randn(tuple(x0.shape[1:]), generator=g).to(x0.device)
                xs.append((1 - s) * x0[j] + s * eps)
                ss.append(s)
                x0s.append(x0[j])
                rows.append(r)
        return (torch.stack(x0s), torch.stack(xs), torch.stack(ss).to(x0.device), torch.tensor(rows), K)

    def backward(self, update, micro: MicroBatch) -> MicroBatchResult:
        batch, device = micro.batch, update.session.device
        idx = micro.rows
        sigmas = batch.trajectory.sigmas.to(device)
        x0, x, s, rows, K = self._points(update, batch, idx, sigmas)
        text = select_embeddings(batch.text, rows.to(device))
        r = optimality_probability(batch.advantages[rows.to(device)].reshape(len(rows), -1)[:, 0], self.clip)
        model = update.session.model
        with torch.no_grad(), self.rollout_weights():
            v_old = model.velocity(x, s, text).to(torch.float32)
        v_ref = None
        if self.reference is not None:
            v_ref = self.reference.velocity(x, s, text).to(torch.float32)
        with torch.enable_grad():
            v = model.velocity(x, s, text).to(torch.float32)
            loss, parts = nft_loss(v, v_old, x, x0, s, r, beta=self.beta, clip=self.clip, weight_min=self.weight_min)
            total = loss
            if v_ref is not None:
                total = total + self.beta_kl * velocity_kl(v, v_ref)
            scaled = total.sum() / (micro.normaliser * K)
            scaled.backward()
        dev = float(((v.detach() - v_old) ** 2).mean())
        metrics = {"nft/positive": float(parts["positive"].mean()), "nft/negative": float(parts["negative"].mean()),
                   "nft/old_deviation": dev, "nft/r_mean": float(r.mean())}
        if v_ref is not None:
            metrics["nft/kl_ref"] = float(velocity_kl(v.detach(), v_ref).mean())
        return MicroBatchResult(losses=(float(scaled.detach()),), metrics=metrics,
                                trained=torch.zeros(len(idx), len(micro.sizes), dtype=torch.bool))

    def end_rollout(self, update, batch) -> dict:
        self.steps = int(update.scheduler.last_epoch)
        d = old_policy_decay(self.steps, *self.decay)
        with torch.no_grad():
            for o, p in zip(self.old, self.params):
                o.mul_(d).add_(p.detach(), alpha=1.0 - d)
        return {"nft/decay": d}

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def tensors(self) -> dict:
        return {f"old.{i}": t for i, t in enumerate(self.old or [])}

    def load_state(self, state, tensors) -> None:
        self.steps = int(state.get("steps", 0))
        if tensors and self.old is not None:
            for i, o in enumerate(self.old):
                o.copy_(tensors[f"old.{i}"])
