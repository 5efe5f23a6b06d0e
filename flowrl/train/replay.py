"""Bounded off-policy reuse (``[replay]``): recent rollouts trained on again, importance-weighted.

After an iteration's own update, up to ``per_iteration`` rollouts kept from the last
``max_staleness`` iterations are trained on once more (``updates_per_rollout`` passes each):

1. re-score: every trainable transition of the kept rollout is scored with the current weights,
   without gradient (timed as ``replay``); those log-probs become the replayed update's "old"
   policy, so its first optimizer step is exactly on-policy (the engine's on-policy check runs on
   it) and the ratio clip works as in any update;
2. weigh: the distance from the policy that sampled the rollout is corrected by a detached
   importance weight per unit or per sample, truncated (:mod:`flowrl.objectives.importance`),
   which multiplies the advantage computed when the rollout was collected;
3. update: :meth:`flowrl.train.update.PolicyUpdate.run` on the re-weighted rollout, its passes
   numbered after the ones it was already trained with (new chunk selections and orders).

The buffer keeps each process's own samples (their global indices, so every seeded draw is
the same on any process layout); its checkpoint gathers them from every process into
``replay.safetensors`` (and ``state.json``'s ``replay`` entry), and each process takes its
rows back on resume. With ``size = 0`` or ``max_staleness = 0`` nothing is built and the run is
the on-policy run, bit for bit.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .. import distributed
from ..interfaces import TextEmbeddings
from ..objectives.importance import log_weights, truncate_weights, weighted_advantages
from ..prompts import prompts_for_iteration
from ..sampling.rollout import rescore_position
from ..sampling.trajectory import Trajectory
from ..seeding import generator
from ..stop_points import stop_point
from .collect import Batch
from .run import Run

#: The name the buffer is checkpointed under (``replay.safetensors``, ``state.json``'s ``replay``).
REPLAY = "replay"
#: The trajectory's tensors a kept rollout needs (``positions`` only for a per-sample plan).
TRAJECTORY_TENSORS = ("latents", "log_probs", "sigmas", "trainable", "group_ids", "image_latents", "positions")


def replayed_rollouts(config, iteration: int) -> int:
    """How many kept rollouts iteration ``iteration`` replays (assuming every earlier iteration's
    rewards were finite): the rollouts of the last ``min(size, max_staleness)`` iterations, at
    most ``per_iteration``."""
    if not config.enabled:
        return 0
    return min(config.per_iteration, iteration, config.size, config.max_staleness)


def replay_optimizer_steps(config, iterations: int, geometry) -> int:
    """The optimizer steps a whole run takes on replayed rollouts (for the LR schedule)."""
    rollouts = sum(replayed_rollouts(config, i) for i in range(iterations))
    return rollouts * geometry.updates_per_rollout * geometry.optimizer_steps_per_update


@dataclasses.dataclass
class Kept:
    """One kept rollout: this process's samples of iteration ``iteration`` as the update saw them
    (the behaviour policy's log-probs in ``trajectory``, the advantages of that iteration)."""

    iteration: int
    batch: Batch


class ReplayBuffer:
    """The kept rollouts, oldest first, and how an iteration chooses among them."""

    def __init__(self, config, seed: int):
        self.config, self.seed = config, seed
        self.kept: list[Kept] = []

    def add(self, batch: Batch) -> None:
        """Keep the iteration's rollout (not one whose rewards were not finite: it has no
        advantages), and drop what can no longer be replayed: rollouts beyond ``max_staleness``
        from the next iteration, and the oldest beyond ``size``."""
        if batch.advantages is not None:
            traj = batch.trajectory
            # only what a replay reads: no images, rewards or proposal means
            kept = dataclasses.replace(traj, latents=traj.latents.detach(), log_probs=traj.log_probs.detach(), means=None)
            self.kept.append(Kept(batch.iteration, Batch(
                iteration=batch.iteration, indices=batch.indices, prompts=list(batch.prompts),
                group_ids=batch.group_ids, text=batch.text, trajectory=kept, advantages=batch.advantages.detach())))
        self.evict(batch.iteration + 1)

    def evict(self, next_iteration: int) -> None:
        self.kept = [k for k in self.kept if next_iteration - k.iteration <= self.config.max_staleness]
        self.kept = self.kept[-self.config.size:]

    def choose(self, iteration: int) -> list[Kept]:
        """The kept rollouts iteration ``iteration`` replays, in the order it trains on them
        (oldest first). ``uniform`` draws from a generator seeded by (seed, iteration): the same
        choice on every process and after a resume."""
        usable = [k for k in self.kept if 1 <= iteration - k.iteration <= self.config.max_staleness]
        n = min(self.config.per_iteration, len(usable))
        if self.config.sample == "newest" or n == len(usable):
            return usable[len(usable) - n:]
        picks = torch.randperm(len(usable), generator=generator(self.seed, "replay", iteration))[:n]
        return [usable[i] for i in sorted(picks.tolist())]

    # ---------------------------------------------------------------------- checkpointed state

    def state_dict(self) -> dict[str, Any]:
        """``state.json``'s ``replay`` entry: the iterations kept and their text embeddings' keys."""
        return {REPLAY: {"iterations": [k.iteration for k in self.kept],
                         "text_keys": [sorted(k.batch.text) for k in self.kept]}}

    def checkpoint_tensors(self, ctx) -> dict[str, torch.Tensor]:
        """Every kept rollout's tensors, gathered from all processes (global sample order). A
        collective: every process calls it."""
        out: dict[str, torch.Tensor] = {}
        for n, k in enumerate(self.kept):
            traj = k.batch.trajectory
            for name in TRAJECTORY_TENSORS:
                value = getattr(traj, name)
                if value is None:
                    continue
                shared = name in ("sigmas", "trainable")  # the same on every process
                # a copy: the schedule's tensors are shared by every kept rollout (safetensors refuses aliases)
                out[f"{n}.{name}"] = value.detach().cpu().clone() if shared else distributed.all_gather_cat(value.detach(), ctx).cpu()
            out[f"{n}.advantages"] = distributed.all_gather_cat(k.batch.advantages.detach(), ctx).cpu()
            for key, value in k.batch.text.items():
                out[f"{n}.text.{key}"] = distributed.all_gather_cat(value.detach(), ctx).cpu()
        return out

    def load_state_dict(self, state: dict[str, Any], tensors: dict[str, torch.Tensor], restore) -> None:
        """Refill the buffer from a checkpoint: ``restore(iteration, tensors)`` rebuilds this
        process's :class:`Batch` of one kept rollout from its gathered tensors."""
        saved = state.get(REPLAY) or {"iterations": [], "text_keys": []}
        self.kept = []
        for n, (iteration, text_keys) in enumerate(zip(saved["iterations"], saved["text_keys"])):
            prefix = f"{n}."
            mine = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            missing = [key for key in ("latents", "log_probs", "advantages") if key not in mine]
            missing += [f"text.{key}" for key in text_keys if f"text.{key}" not in mine]
            if missing:
                raise ValueError(f"the checkpoint's replay buffer lacks {missing} of kept rollout {n}")
            self.kept.append(Kept(iteration, restore(iteration, mine)))


class Replay:
    """The ``[replay]`` phase of the loop: the buffer, and training on its rollouts."""

    def __init__(self, run: Run, prompts):
        self.run, self.prompts = run, prompts
        self.config = run.session.recipe.replay
        self.buffer = ReplayBuffer(self.config, run.session.recipe.run.seed)

    @classmethod
    def attach(cls, run: Run, prompts) -> "Replay | None":
        """The replay phase, or None when ``[replay]`` is off (the run is then on-policy)."""
        return cls(run, prompts) if run.session.recipe.replay.enabled else None

    def __call__(self, update, batch: Batch, sizes: tuple[int, ...], timer) -> tuple[dict, int]:
        """Train on the kept rollouts this iteration replays, then keep the iteration's own.
        Returns the metrics (``replay/*``) and the number of skipped non-finite updates."""
        chosen = self.buffer.choose(batch.iteration)
        record: dict[str, Any] = {"replay/rollouts": len(chosen)}
        stats = WeightStats()
        skipped = 0
        passes = self.run.geometry.updates_per_rollout
        for kept in chosen:
            staleness = batch.iteration - kept.iteration
            with timer("replay"):
                replayed, w, truncated = self.reweighted(kept.batch, sizes, update)
            stats.add(w, truncated, staleness)
            with timer("update"):
                # its passes follow the ones it had: on collection (0 .. passes - 1) and at each earlier replay
                outcome = update.run(replayed, sizes, first_epoch=passes * staleness)
            skipped += outcome.skipped
            if outcome.on_policy is not None:  # the largest over the replayed rollouts
                key = "replay/on_policy/max_abs_log_ratio"
                record[key] = max(record.get(key, 0.0), outcome.on_policy)
            # with per_iteration > 1: the last replayed update's own metrics (the weights' cover all)
            record.update({f"replay/{k}": v for k, v in outcome.metrics.items()})
        record.update(stats.metrics(self.run.ctx))
        self.buffer.add(batch)
        return record, skipped

    def reweighted(self, kept: Batch, sizes, update) -> tuple[Batch, torch.Tensor, torch.Tensor]:
        """The kept rollout re-scored and importance-weighted (:func:`importance_corrected`)."""
        c = self.config
        return importance_corrected(kept, sizes, self.run.session.model, self.run.session.recipe.train.micro_batch_size,
                                    c.weight_level, c.weight_steps, c.truncate)

    # ---------------------------------------------------------------------- checkpointed state

    def state_dict(self) -> dict[str, Any]:
        return self.buffer.state_dict()

    def checkpoint_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        return {REPLAY: self.buffer.checkpoint_tensors(self.run.ctx)}

    def load_state_dict(self, state: dict[str, Any], tensors: dict[str, dict[str, torch.Tensor]]) -> None:
        self.buffer.load_state_dict(state, tensors.get(REPLAY) or {}, self.restore)

    def restore(self, iteration: int, saved: dict[str, torch.Tensor]) -> Batch:
        """This process's rows of a kept rollout, from the tensors gathered at the checkpoint;
        its prompts are the iteration's (:func:`flowrl.prompts.prompts_for_iteration`) and its
        kernels the run's (the sampler's, or the ``[kernel]`` for a per-sample plan)."""
        session, geometry, ctx = self.run.session, self.run.geometry, self.run.ctx
        local = geometry.local_sample_range(ctx.rank)
        rows = slice(local.start, local.stop)
        device = session.device
        G, seed = geometry.group_size, session.recipe.run.seed
        global_prompts = prompts_for_iteration(self.prompts, seed, iteration, geometry.prompts_per_iteration)
        prompts = [global_prompts[j // G] for j in local]
        per_sample = "positions" in saved
        traj = Trajectory(
            latents=saved["latents"][rows].to(device), log_probs=saved["log_probs"][rows].to(device),
            sigmas=saved["sigmas"].to(device), trainable=saved["trainable"].to(device), prompts=prompts,
            group_ids=saved["group_ids"][rows].to(device), image_latents=saved["image_latents"][rows].to(device),
            kernels=() if per_sample else session.sampler.kernels, reduction=session.sampler.reduction,
            image_from=session.sampler.image_from, positions=saved["positions"][rows].to(device) if per_sample else None,
            position_kernel=session.components.kernel if per_sample else None)
        text: TextEmbeddings = {k[len("text."):]: v[rows].to(device) for k, v in saved.items() if k.startswith("text.")}
        return Batch(iteration=iteration, indices=local, prompts=prompts,
                     group_ids=torch.tensor([j // G for j in local]), text=text, trajectory=traj,
                     advantages=saved["advantages"][rows].to(device))


def importance_corrected(kept: Batch, sizes, model, batch_size: int, level: str, steps: int,
                         cap: float) -> tuple[Batch, torch.Tensor, torch.Tensor]:
    """A rollout sampled by an older policy, made ready for an update with the current weights
    (``[replay]``, ``[pipeline]``): re-scored with them (its new "old" log-probs, so the update's
    first step is on-policy) and its advantages multiplied by the truncated importance weights
    against the policy that sampled it (its recorded log-probs); the weights and where the
    truncation acted."""
    traj = kept.trajectory
    current = rescored_log_probs(model, traj, kept.text, batch_size)
    log_w = log_weights(current, traj.trainable_log_probs, sizes, level, steps)
    w, truncated = truncate_weights(log_w, cap)
    log_probs = traj.log_probs.clone()
    if traj.positions is not None:
        log_probs.scatter_(1, traj.positions.to(log_probs.device), current.to(log_probs.device))
    else:
        log_probs[:, traj.trainable_indices.to(log_probs.device)] = current.to(log_probs.device)
    corrected = dataclasses.replace(kept, trajectory=dataclasses.replace(traj, log_probs=log_probs),
                                    advantages=weighted_advantages(kept.advantages, w.to(kept.advantages.device)))
    return corrected, w, truncated


def rescored_log_probs(model, traj: Trajectory, text: TextEmbeddings, batch_size: int) -> torch.Tensor:
    """``[B, T]`` log-probs of every trainable transition under the current weights, without
    gradient, ``batch_size`` samples at a time (the re-scoring an update's step makes, so the
    replayed update's first step reproduces them); the run may stop before each batch
    (:mod:`flowrl.stop_points`)."""
    B, T = traj.batch_size, traj.num_trainable
    out = torch.empty(B, T, dtype=torch.float32, device=traj.log_probs.device)
    with torch.no_grad():
        for lo in range(0, B, batch_size):
            stop_point()
            rows = torch.arange(lo, min(lo + batch_size, B))
            sub = {k: v.index_select(0, rows.to(v.device)) for k, v in text.items()}
            for t in range(T):
                lp = rescore_position(lambda x, s, sub=sub: model.velocity(x, s, sub), traj, t, rows).log_prob
                out[rows.to(out.device), t] = lp.float()
    return out


class WeightStats:
    """The diagnostics of off-policy updates over an iteration: the importance weights (count,
    sums, extremes, truncations) and the staleness of the rollouts, reduced over processes,
    logged as ``<prefix>/*`` (``replay/*``, ``pipeline/*``)."""

    def __init__(self, prefix: str = REPLAY):
        self.prefix = prefix
        self.n = self.sum = self.sq = self.truncated = 0.0
        self.min, self.max = float("inf"), float("-inf")
        self.staleness: list[int] = []

    def add(self, w: torch.Tensor, truncated: torch.Tensor, staleness: int) -> None:
        w = w.detach().double().flatten().cpu()
        self.n += w.numel()
        self.sum += float(w.sum())
        self.sq += float((w * w).sum())
        self.truncated += float(truncated.sum())
        if w.numel():
            self.min, self.max = min(self.min, float(w.min())), max(self.max, float(w.max()))
        self.staleness.append(staleness)

    def metrics(self, ctx) -> dict[str, float]:
        if not self.staleness:
            return {}
        local = {"n": self.n, "sum": self.sum, "sq": self.sq, "truncated": self.truncated, "min": self.min,
                 "max": self.max}
        g = distributed.reduce_metrics(local, {"n": "sum", "sum": "sum", "sq": "sum", "truncated": "sum",
                                               "min": "min", "max": "max"}, ctx)
        n = max(g["n"], 1.0)
        mean = g["sum"] / n
        ess = g["sum"] ** 2 / g["sq"] if g["sq"] > 0 else 0.0
        out = {
            "weights": g["n"],
            "ess": ess,
            "ess_fraction": ess / n,
            "weight_mean": mean,
            "weight_std": max(g["sq"] / n - mean * mean, 0.0) ** 0.5,
            "weight_min": g["min"],
            "weight_max": g["max"],
            "truncated_fraction": g["truncated"] / n,
            "staleness_mean": sum(self.staleness) / len(self.staleness),
            "staleness_max": float(max(self.staleness)),
        }
        return {f"{self.prefix}/{k}": v for k, v in out.items()}


__all__ = ["REPLAY", "Replay", "ReplayBuffer", "Kept", "WeightStats", "replayed_rollouts", "replay_optimizer_steps",
           "importance_corrected", "rescored_log_probs"]
