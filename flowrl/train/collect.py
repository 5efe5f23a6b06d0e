"""Collecting one iteration's samples: prompts, rollout, images, rewards, advantages; or, for an
offline run (``[data]``), the iteration's rows of the table, encoded (no rollout, no reward).

With ``[sampler].overlap_rewards`` the images of each rollout sub-batch are decoded and scored
while the next sub-batch samples (:mod:`flowrl.train.overlap`); otherwise after the rollout.

Every random draw is keyed by the GLOBAL sample index (:mod:`flowrl.seeding`): a sample gets
the same starting noise, SDE noise and prompt on any number of processes and after a resume.
The result is a :class:`~flowrl.batch.Batch`, which the update consumes as it is.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from .. import distributed
from ..batch import Batch  # defined below the objectives, which read it; imported from here too
from ..objectives.advantages import advantages_for
from ..interfaces import (
    AdvantagesOnTrees,
    KeepsRolloutMeans,
    SamplesTrees,
    SamplesWithOwnWeights,
    TextEmbeddings,
    UsesImageFeatures,
    select_embeddings,
    trains_on_units,
)
from ..offline import encode_rows, iteration_rows
from ..sampling.plans import rollout_plan
from ..sampling.precision import fp8_quantiser, rescore_log_probs, sampling_with
from ..prompts import prompts_for_iteration
from ..rewards import needs_images
from ..sampling.branching import branch_rollout
from ..sampling.rollout import rollout
from ..seeding import generator, sample_generators
from ..sampling.trajectory import Trajectory
from ..stop_points import stoppable
from .compute import network_rows_per_sample
from .overlap import OverlappedScoring, score_part
from .run import Run


def initial_noise(seed: int, iteration: int, indices, group_size: int, shape, same_in_group: bool) -> torch.Tensor:
    """Starting noise ``[len(indices), *shape]`` of the samples with these GLOBAL indices.

    Sample ``j`` draws from a generator seeded by (seed, iteration, j), or by its group's first
    index with ``same_in_group`` (every sample of a prompt starts from the same noise and the
    groups differ only through the SDE noise): the same on any process layout.
    """
    keys = [(j // group_size) * group_size if same_in_group else j for j in indices]
    return torch.stack([torch.randn(tuple(shape), generator=generator(seed, "noise", iteration, k)) for k in keys])


def collect(run: Run, prompts: list[str], iteration: int, timer) -> Batch:
    """This process's samples of the iteration: prompts and text embeddings (``encode``), the
    rollout (``rollout``), the decoded images (``decode``) and their rewards (``reward``), each
    phase timed by ``timer``. With ``[sampler].overlap_rewards`` decoding and scoring run beside
    the rollout, and ``reward`` times only the wait for the last sub-batch's scores. An offline
    run (``[data]``) collects its table's rows instead (:func:`collect_rows`)."""
    if run.data is not None:
        return collect_rows(run, iteration, timer)
    session, geometry = run.session, run.geometry
    rewards = session.components.rewards
    with timer("encode"):
        batch = encode(run, prompts, iteration)
    if session.recipe.sampler.overlap_rewards:
        with OverlappedScoring(session.model, rewards, iteration=iteration, decode=decodes_in_training(session)) as scoring:
            with timer("rollout"):
                sample(session, batch, geometry.group_size, on_part=scoring.submit)
            with timer("reward"):
                batch.images, batch.rewards, batch.reward_extras = scoring.gather()
        if rescores_rollout(session):
            with timer("rescore"):
                rescore(session, batch, timer)
        if batch.images is not None:
            count_decoded(timer, len(batch.images))
        return batch
    with timer("rollout"):
        sample(session, batch, geometry.group_size)
    if rescores_rollout(session):
        with timer("rescore"):  # FP8 rollouts: the trained policy's log-probs replace the rollout's
            rescore(session, batch, timer)
    if decodes_in_training(session):  # rewards that all score latents need no images
        with timer("decode"):
            batch.images = session.model.decode(batch.trajectory.image_latents)
        count_decoded(timer, len(batch.images))
    with timer("reward"):
        score_rewards(batch, rewards)
    return batch


def collect_rows(run: Run, iteration: int, timer) -> Batch:
    """This process's rows of an offline table for the iteration (``encode``): the iteration's
    ``prompts_per_iteration`` rows drawn over the whole table (:func:`flowrl.offline.iteration_rows`,
    seeded by (seed, iteration): the same on any process layout and after a resume), this
    process's share of them, their text embeddings and their images encoded into clean latents."""
    session, geometry, ctx = run.session, run.geometry, run.ctx
    local = geometry.local_sample_range(ctx.rank)
    with timer("encode"):
        everyone = iteration_rows(len(run.data), seed=session.recipe.run.seed, iteration=iteration,
                                  count=geometry.prompts_per_iteration)
        rows = encode_rows(run.data, session.model, [everyone[j] for j in local], session.device, run.table_latents)
        rows.sigmas = session.sampler.sigmas
        text = session.cache.get(rows.prompts, session.device)
    return Batch(iteration=iteration, indices=local, prompts=rows.prompts, group_ids=torch.tensor(list(local)),
                 text=text, data=rows)


def count_decoded(timer, samples: int) -> None:
    """Tell the compute accounting (the phase timer's counter, when it has one) what was decoded."""
    counter = getattr(timer, "counter", None)
    if counter is not None:
        counter.decoded(samples)


def decodes_in_training(session) -> bool:
    """Whether an iteration decodes its samples: a reward scores images, or the advantage
    estimator needs image features (:class:`~flowrl.interfaces.UsesImageFeatures`)."""
    return needs_images(session.components.rewards) or isinstance(session.components.advantage, UsesImageFeatures)


def encode(run: Run, prompts: list[str], iteration: int) -> Batch:
    """This process's prompts of the iteration and their (cached) text embeddings."""
    session, geometry, ctx = run.session, run.geometry, run.ctx
    local, G = geometry.local_sample_range(ctx.rank), geometry.group_size
    global_prompts = prompts_for_iteration(prompts, session.recipe.run.seed, iteration, geometry.prompts_per_iteration)
    sample_prompts = [global_prompts[j // G] for j in local]
    return Batch(iteration=iteration, indices=local, prompts=sample_prompts,
                 group_ids=torch.tensor([j // G for j in local]), text=session.cache.get(sample_prompts, session.device))


def sample(session, batch: Batch, group_size: int, on_part=None) -> None:
    """Roll out every local sample with the training sampler, in ``[sampler].batch_size``
    micro-batches (0 = all at once); fills ``batch.trajectory``. ``on_part(image_latents,
    prompts)`` is called after each micro-batch (overlapped rewards). A run may stop before each
    denoiser forward (:mod:`flowrl.stop_points`)."""
    recipe, model, sampler = session.recipe, session.model, session.sampler
    n = len(batch.indices)
    noise = initial_noise(recipe.run.seed, batch.iteration, batch.indices, group_size, model.latent_shape,
                          recipe.train.same_noise_in_group).to(session.device)
    gens = sample_generators(recipe.run.seed, "rollout", batch.iteration, batch.indices)
    size = recipe.sampler.batch_size or n
    # what the objective asks of the rollout: the proposal means (GRPO-Guard), other weights (NFT)
    loss = session.components.loss
    keep_means = bool(isinstance(loss, KeepsRolloutMeans) and loss.keep_means)
    weights = loss.rollout_weights() if isinstance(loss, SamplesWithOwnWeights) else nullcontext()
    if recipe.sampler.rollout_precision == "fp8":  # a quantised copy of the denoiser samples (validation: not both)
        weights = sampling_with(model, fp8_quantiser())
    # the [window] component's plan for this iteration (None: one kernel per step, [sampler].sde_window),
    # or its tree (BranchGRPO, [window] use = "branch": one tree per group, prefixes computed once)
    window = session.components.window
    plan = window.plan(batch.iteration, list(batch.indices), session.plan_context)
    tree = window.tree() if isinstance(window, SamplesTrees) else None
    parts = []
    with weights:
        for lo in range(0, n, size):
            b = torch.arange(lo, min(lo + size, n))
            text = select_embeddings(batch.text, b) if size < n else batch.text
            common = dict(generators=gens[lo : lo + len(b)], image_from=sampler.image_from, reduction=sampler.reduction,
                          prompts=batch.prompts[lo : lo + len(b)], group_ids=batch.group_ids[lo : lo + len(b)],
                          keep_means=keep_means)
            velocity = stoppable(lambda x, s, text=text: model.velocity(x, s, text))
            if tree is not None:  # validation: a window that samples trees has no plan of its own
                parts.append(branch_rollout(
                    lambda rows, text=text, n_all=len(b): velocity_for_rows(model, text, rows, n_all),
                    noise[lo : lo + len(b)], sampler.sigmas, sampler.kernels, group_size=group_size,
                    branch_steps=tree.steps, branch_factors=tree.factors, **common))
            elif plan is None:
                parts.append(rollout(velocity, noise[lo : lo + len(b)], sampler.sigmas, sampler.kernels, **common))
            else:
                part_plan = plan.for_samples(slice(lo, lo + len(b)))
                parts.append(rollout_plan(velocity, noise[lo : lo + len(b)], part_plan, session.components.kernel,
                                          **common))
            if on_part is not None:  # [sampler].overlap_rewards: decode and score this part meanwhile
                on_part(parts[-1].image_latents, parts[-1].prompts)
    batch.trajectory = parts[0] if len(parts) == 1 else Trajectory.cat(parts)


def rescores_rollout(session) -> bool:
    """FP8 rollouts with the ``rescore`` correction, for an objective that reads the trajectory's
    log-probs (:mod:`flowrl.sampling.precision`)."""
    s = session.recipe.sampler
    return s.rollout_precision == "fp8" and s.rollout_correction == "rescore" and trains_on_units(session.components.loss)


def rescore(session, batch: Batch, timer) -> None:
    """The trained transitions' log-probs from the trained weights (no grad), in
    ``[sampler].batch_size`` sub-batches; their forwards are the ``rescore`` phase's minimum."""
    model, text = session.model, batch.text
    rescore_log_probs(lambda rows: stoppable(lambda x, s, t=select_embeddings(text, rows): model.velocity(x, s, t)),
                      batch.trajectory, session.recipe.sampler.batch_size)
    if timer.counter is not None:
        trained = int(batch.trajectory.trainable.sum()) * len(batch.indices)
        timer.counter.expect("rescore", trained * network_rows_per_sample(model))


def velocity_for_rows(model, text: TextEmbeddings, rows: torch.Tensor, n_all: int):
    """The velocity closure over the text embeddings of ``rows`` of a sub-batch of ``n_all``
    (a branch rollout's live rows), with a stop point before each call; all rows use the
    sub-batch's embeddings as they are."""
    if len(rows) != n_all:
        text = select_embeddings(text, rows.cpu())
    return stoppable(lambda x, s: model.velocity(x, s, text))


def score_rewards(batch: Batch, rewards) -> None:
    """Score the decoded images with every reward; fills ``batch.rewards`` and ``reward_extras``.
    A reward that raises stops the run naming it (:class:`flowrl.train.overlap.RewardFailedError`)."""
    scores, extras = score_part(rewards, batch.images, batch.prompts, f"iteration {batch.iteration}",
                                latents=batch.trajectory.image_latents)
    batch.rewards.update(scores)
    batch.reward_extras.update(extras)


def assign_advantages(run: Run, batch: Batch, num_chunks: int, record: dict) -> None:
    """Advantages over whole groups, from the rewards of every process; logs reward and
    advantage statistics. Leaves ``batch.advantages`` None when a reward is not finite. Offline
    rows have neither: nothing to do."""
    if batch.data is not None:
        return
    session, geometry, ctx = run.session, run.geometry, run.ctx
    all_rewards = {k: distributed.all_gather_cat(v, ctx) for k, v in batch.rewards.items()}
    all_groups = distributed.all_gather_cat(batch.group_ids, ctx)
    finite = all(bool(torch.isfinite(v).all()) for v in all_rewards.values())
    for label, v in all_rewards.items():
        record.update({f"reward/{label}/{k}": x for k, x in summary_stats(v).items()})
    # a reward's extras may differ by process (reported only for some images): reduced by key
    extras = {f"{key}/{part}": x for key, v in batch.reward_extras.items()
              for part, x in (("sum", float(v.double().sum())), ("count", float(v.numel())))}
    extras = distributed.reduce_metrics(extras, dict.fromkeys(extras, "sum"), ctx)
    for key in dict.fromkeys(k.rsplit("/", 1)[0] for k in extras):
        record[f"reward/{key}/mean"] = extras[f"{key}/sum"] / extras[f"{key}/count"]
    record["groups/all_equal_fraction"] = all_equal_fraction(all_rewards, session.recipe.rewards, all_groups)
    if not finite:
        return
    estimator, features = session.components.advantage, None
    if isinstance(estimator, UsesImageFeatures):  # a diversity bonus: image features, gathered like the rewards
        features = distributed.all_gather_cat(estimator.features(batch.images).float(), ctx)
    everyone = advantages_for(estimator, all_rewards, session.recipe.rewards, all_groups, num_chunks, features=features)
    offset = ctx.rank * geometry.samples_per_process
    batch.advantages = everyone[offset : offset + geometry.samples_per_process].to(session.device)
    record.update({f"advantage/{k}": x for k, x in summary_stats(everyone).items()})
    if isinstance(estimator, AdvantagesOnTrees):  # BranchGRPO's tree advantage, on this process's whole groups
        # (validation: it runs on a window that samples trees, with step units)
        tree = estimator.on_tree(batch.advantages, batch.trajectory, session.components.window.tree(),
                                 geometry.group_size, batch.iteration)
        batch.advantages = tree.advantages
        # over every process's groups, as the advantages above (each process holds [B, T] of them)
        every_tree = distributed.all_gather_cat(tree.advantages.cpu(), ctx)
        every_kept = distributed.all_gather_cat(tree.trained.cpu(), ctx)
        record.update({f"advantage/tree/{k}": x for k, x in summary_stats(every_tree[every_kept]).items()})
        record.update(tree.metrics)


def all_equal_fraction(rewards: dict[str, torch.Tensor], choices, group_ids: torch.Tensor) -> float:
    """The fraction of groups whose rewards with a non-zero weight are all equal within the
    group (their advantages are all zero: the group teaches nothing)."""
    used = [rewards[c.label] for c in choices if (c.weight or any(c.chunk_weights)) and c.label in rewards]
    if not used:
        return 0.0
    groups = torch.unique(group_ids)
    flat = [sum(bool((r[group_ids == g] == r[group_ids == g][0]).all()) for r in used) == len(used) for g in groups]
    return float(sum(flat)) / max(1, len(flat))


def summary_stats(x: torch.Tensor) -> dict[str, float]:
    """``mean``, ``std`` (population), ``min`` and ``max`` of a tensor, as floats."""
    x = x.float()
    return {
        "mean": x.mean().item(),
        "std": x.std(unbiased=False).item() if x.numel() > 1 else 0.0,
        "min": x.min().item(),
        "max": x.max().item(),
    }
