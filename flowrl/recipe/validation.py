"""The recipe's cross-checks: rules that span tables, checked by building the light components
(kernel, schedule, window planner, chunker, loss) before any model loads. :func:`cross_check`
runs them all (:func:`flowrl.recipe.loading.validate` calls it); :func:`build_component` is the
one way validation and training build a recipe's component.

What depends on this machine and its files (devices, prompt files, tables, profiles) is
checked by :mod:`flowrl.recipe.startable`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..dynamics.profile_file import read_profile, trainable_curve
from ..config import from_dict
from ..errors import FlowrlError, RecipeError
from ..interfaces import (
    AdvantagesOnTrees,
    KeepsRolloutMeans,
    KLRegularised,
    NeedsReferenceCopy,
    NeedsReferencePolicy,
    Objective,
    ProfilingChunker,
    SamplesTrees,
    SamplesWithOwnWeights,
    TrainsOnData,
    WarpsTime,
    trains_on_units,
)
from ..objectives.policy_gradient import PolicyGradient, objective_for
from ..plugins import Registry, get_registry
from ..sampling.branching import BranchConfig, steps_of_highest_dynamics
from ..sampling.plans import PlanContext
from ..sampling.rollout import make_kernels, trainable_mask
from .schema import COMPONENT_SECTIONS, LIST_SECTIONS, Recipe


def check_reward_weights(recipe: Recipe) -> None:
    """An online run trains on the weighted rewards: with every weight 0 (and every chunk weight,
    where given) every advantage is 0 and the run would learn nothing. An offline run (``[data]``)
    trains on its table, and its rewards only score the evaluation."""
    if recipe.data.enabled or not recipe.rewards:
        return
    if all(not any(r.chunk_weights) if r.chunk_weights else r.weight == 0 for r in recipe.rewards):
        labels = ", ".join(r.label for r in recipe.rewards)
        raise RecipeError(f"every [[rewards]] entry has weight 0 ({labels}): a weight of 0 logs a reward without "
                          "training on it, so every advantage would be 0 and the run would learn nothing",
                          where=f"{recipe.source}: [[rewards]]",
                          hint=f"give the reward to optimise a non-zero weight, e.g. --set rewards.0.weight=1.0 "
                               f"([[rewards]] #1, {recipe.rewards[0].label})")


def build_component(recipe: Recipe, registry: Registry, table: str, index: int | None = None) -> Any:
    """Build the component a recipe table chooses (``index``: the entry of a ``[[rewards]]`` or
    ``[[trackers]]`` array), the one way validation and training build components, so that every
    factory's error reads alike: a ``ValueError``/``TypeError`` (a parameter check that only the
    built component can make) or a :class:`FlowrlError` becomes one message naming the table,
    never a traceback. Parameter checks themselves belong in the params dataclass's
    ``__post_init__`` (then :func:`~flowrl.recipe.loading.validate` reports them while reading
    the table)."""
    if index is None:
        kind, choice = COMPONENT_SECTIONS[table], recipe.components[table]
        where = f"{recipe.source}: [{table}] ({kind} '{choice.use}')"
    else:
        kind, choice = LIST_SECTIONS[table], getattr(recipe, table)[index]
        where = f"{recipe.source}: [[{table}]] #{index + 1} ({choice.use})"
    try:
        return registry.get(kind, choice.use).build(choice.params)
    except FlowrlError as exc:
        raise type(exc)(exc.message, where=exc.where or where, hint=exc.hint) from exc
    except (ValueError, TypeError) as exc:
        raise RecipeError(str(exc), where=where) from exc


def build_loss(recipe: Recipe, registry: Registry) -> Any:
    """What the update runs for the recipe's ``[loss]``: the loss as its ``[likelihood]`` serves it
    (:class:`flowrl.interfaces.LikelihoodEstimator`; the loss itself under ``trajectory``, an
    objective around its unit objective under ``elbo``). A pairing the estimator cannot serve is
    one message naming both tables."""
    loss = build_component(recipe, registry, "loss")
    if "likelihood" not in recipe.components:
        return loss
    likelihood = build_component(recipe, registry, "likelihood")
    try:
        return likelihood.objective(loss)
    except ValueError as exc:
        name, estimator = recipe.components["loss"].use, recipe.components["likelihood"].use
        raise RecipeError(f"loss '{name}' cannot run on [likelihood] '{estimator}': {exc}",
                          where=f"{recipe.source}: [likelihood]",
                          hint="pair an ELBO with clipped, epg, pepg, par, dppo or vgrpo; everything else keeps "
                               "[likelihood] use = 'trajectory' (the default)") from exc


def plan_context(recipe: Recipe, registry: Registry) -> PlanContext:
    """What the ``[window]`` planner plans with, as training builds it
    (:func:`flowrl.train.session.plan_context`), on a stand-in schedule: trainability does not
    depend on the sigma values, and the schedule's time warp (MixGRPO-Flash's compression needs
    one) is the ``[schedule]``'s own."""
    kernel = build_component(recipe, registry, "kernel")
    s = recipe.sampler
    sde_window = tuple(s.sde_window) if s.sde_window else None
    try:
        kernels = make_kernels(s.steps, kernel, sde_window)
    except ValueError as exc:
        raise RecipeError(str(exc), where=f"{recipe.source}: [sampler]") from exc
    schedule = build_component(recipe, registry, "schedule")
    warp = schedule.sigma_at if isinstance(schedule, WarpsTime) else None
    times = torch.linspace(1.0, 0.0, s.steps + 1, dtype=torch.float64)
    # a warping schedule's sigmas are its warp of uniform time (WarpsTime); others need no exact values here
    sigmas = (torch.as_tensor(warp(times), dtype=torch.float64) if warp is not None else times).to(torch.float32)
    mask = trainable_mask(kernels, sigmas, s.image_from)
    return PlanContext(num_steps=s.steps, sigmas=sigmas, trainable=mask, warp=warp, seed=recipe.run.seed,
                       group_size=recipe.train.group_size, sde_window=tuple(s.sde_window))


def trainable_transitions(recipe: Recipe, registry: Registry, context: PlanContext | None = None) -> int:
    """T for this recipe's sampler, decided by the kernel itself (an ``ode`` kernel or noise 0
    trains nothing; ``cps`` into sigma = 0 is deterministic) and the ``[window]`` planner, exactly
    as the engine decides it (:func:`plan_context`)."""
    context = context or plan_context(recipe, registry)
    planner = build_component(recipe, registry, "window")
    try:
        return int(planner.num_trainable(context))
    except ValueError as exc:
        raise RecipeError(str(exc), where=f"{recipe.source}: [window]") from exc


def window_plans(recipe: Recipe, registry: Registry, context: PlanContext) -> bool:
    """Whether the ``[window]`` planner plans its own windows (a RolloutPlan), as the first
    rollout asks it: what a plan can only find then (a compression without a time warp) is
    refused here, before any model loads."""
    planner = build_component(recipe, registry, "window")
    try:
        return planner.plan(0, list(range(recipe.train.group_size)), context) is not None
    except ValueError as exc:
        raise RecipeError(str(exc), where=f"{recipe.source}: [window]") from exc


def uses_units(recipe: Recipe, registry: Registry) -> bool:
    """False when the ``[loss]`` is an objective that trains without trajectory log-probs
    (DiffusionNFT): then the sampler may leave nothing trainable and the chunk layout is unused."""
    return trains_on_units(build_loss(recipe, registry))


def cross_check(recipe: Recipe, registry: Registry) -> None:
    """Rules that span tables, checked by building the light components (kernel, chunker)."""
    context = plan_context(recipe, registry)
    T = trainable_transitions(recipe, registry, context)
    recipe.num_trainable = T
    plans = window_plans(recipe, registry, context)
    where = f"{recipe.source}: [chunker]"
    _check_sharding(recipe)
    _check_context_parallel(recipe)
    _check_data(recipe, registry)
    _check_reference_copy_needed(recipe, registry)
    _check_kl_monitor(recipe, registry)
    _check_memory_knobs(recipe, registry)  # every objective's (NFT's too, which trains no units)
    _check_replay(recipe, registry, T)
    _check_pipeline(recipe, registry)
    _tree_from_profile(recipe, T)
    _check_trees(recipe, registry, context.trainable, plans)
    _check_group_can_differ(recipe, T)
    _check_paired_rollouts(recipe, registry, T)
    _check_rollout_precision(recipe, registry, plans)
    if recipe.log.eval_steps == 1:
        raise RecipeError("eval_steps = 1: a sampling schedule needs at least 2 steps",
                          where=f"{recipe.source}: [log].eval_steps", hint="use 0 (the sampler's steps) or >= 2")
    if not uses_units(recipe, registry):
        _refuse_unit_layout(recipe, registry)
        return
    if T < 1:
        raise RecipeError(
            "the sampler leaves no trainable transition",
            where=f"{recipe.source}: [sampler]",
            hint="use a stochastic kernel with noise > 0, more steps or a wider sde_window "
            "(with image_from = 'x0_hat' the last step is not trainable), or read the likelihood from the final "
            "image instead of the trajectory: [likelihood] use = 'elbo' (docs/objectives.md)",
        )
    if recipe.train.micro_batch_size > recipe.train.prompts_per_iteration * recipe.train.group_size:
        raise RecipeError(
            f"micro_batch_size ({recipe.train.micro_batch_size}) exceeds the samples per iteration "
            f"({recipe.train.prompts_per_iteration} x {recipe.train.group_size})",
            where=f"{recipe.source}: [train].micro_batch_size",
        )
    chunker = build_component(recipe, registry, "chunker")
    if isinstance(chunker, ProfilingChunker) and chunker.needs_model:
        return  # boundaries come from profiling the model at start
    try:
        sizes = chunker.sizes(T)
    except FlowrlError as exc:  # a profile's own message: located in this recipe
        raise type(exc)(exc.message, where=located(recipe, exc.where or "[chunker]"), hint=exc.hint) from exc
    except (ValueError, FileNotFoundError) as exc:
        raise RecipeError(
            f"{exc} (the sampler has T = {T} trainable transitions: steps = {recipe.sampler.steps}, "
            f"image_from = '{recipe.sampler.image_from}')",
            where=where,
        ) from exc
    for i, reward in enumerate(recipe.rewards):
        if reward.chunk_weights and len(reward.chunk_weights) != len(sizes):
            raise RecipeError(
                f"chunk_weights has {len(reward.chunk_weights)} entries but the chunker makes "
                f"{len(sizes)} chunks {list(sizes)}",
                where=f"{recipe.source}: [[rewards]] #{i + 1} ({reward.label}).chunk_weights",
                hint=f"give one weight per chunk, in sampling order (high noise first): {len(sizes)} numbers",
            )


#: The tables that lay a trajectory's transitions out in units.
UNIT_LAYOUT_TABLES = ("chunker", "selector")


def _refuse_unit_layout(recipe: Recipe, registry: Registry) -> None:
    """An objective without units (``uses_units`` False: DiffusionNFT, AWM, DPO, DGPO, FDFO, SFT,
    and any loss on the ELBO) never consults the chunk layout. A chunker, selector or
    ``chunk_weights`` chosen away from the defaults was meant to change the run and would not:
    refused by name. The defaults pass, so a resolved recipe (every table written out) loads."""
    loss = recipe.components["loss"].use
    likelihood = recipe.components.get("likelihood")
    objective = f"loss '{loss}'" + (f" on [likelihood] '{likelihood.use}'" if likelihood and
                                     likelihood.use != registry.default("likelihood") else "")
    why = f"{objective} trains without per-transition units, so the chunk layout never applies"
    for table in UNIT_LAYOUT_TABLES:
        kind = COMPONENT_SECTIONS[table]
        choice, name = recipe.components[table], registry.default(kind)
        if name is None:  # no default: the table had to be written, so it says nothing
            continue
        default = registry.get(kind, name)
        default_params = None if default.params is None else from_dict(default.params, {}, where=table)
        if choice.use == name and choice.params == default_params:
            continue
        raise RecipeError(f"[{table}] use = '{choice.use}' is not used: {why}",
                          where=f"{recipe.source}: [{table}]",
                          hint=f"remove the [{table}] table, or choose a loss that trains on units (docs/objectives.md)")
    for i, reward in enumerate(recipe.rewards):
        if reward.chunk_weights:
            raise RecipeError(f"chunk_weights are not used: {why}",
                              where=f"{recipe.source}: [[rewards]] #{i + 1} ({reward.label}).chunk_weights",
                              hint="remove chunk_weights; the reward's weight applies to the whole sample")


def _check_rollout_precision(recipe: Recipe, registry: Registry, plans: bool) -> None:
    """FP8 rollouts (``[sampler].rollout_precision``; :mod:`flowrl.sampling.precision`) re-score
    or importance-weight the plain trajectory's log-probs: what else reads the rollout is refused."""
    if recipe.sampler.rollout_precision == "train":
        return
    where = f"{recipe.source}: [sampler].rollout_precision"
    loss, name = build_loss(recipe, registry), recipe.components["loss"].use
    window = build_component(recipe, registry, "window")
    quantised = getattr(recipe.components["model"].params, "quantize", None)
    reads = ("the [window] plans per-sample SDE windows" if plans else
             "the [window] samples trees" if isinstance(window, SamplesTrees) else
             f"loss '{name}' reads the rollout's Gaussian means" if isinstance(loss, KeepsRolloutMeans) and loss.keep_means else
             f"loss '{name}' samples with weights of its own" if isinstance(loss, SamplesWithOwnWeights) else
             "[replay] trains on kept rollouts again" if recipe.replay.enabled else
             "[pipeline] rolls out beside the update" if recipe.pipeline.enabled else
             f"the model's base is already quantised (quantize = '{quantised}')" if quantised not in (None, "none") else None)
    if reads is not None:
        raise RecipeError(f"rollout_precision = 'fp8' corrects the plain rollout's log-probs, and {reads}",
                          where=where, hint="remove rollout_precision (rollouts then run in the training precision)")
    # FP8 layers hold bfloat16 scales and take bfloat16 activations: a float32 forward cannot call them
    bf16_base = recipe.train.finetune == "lora" and getattr(recipe.components["model"].params, "dtype", None) == "bf16"
    if recipe.distributed.mixed_precision != "bf16" and not bf16_base:
        raise RecipeError("rollout_precision = 'fp8' needs a run that computes in bfloat16 (its FP8 layers take "
                          "bfloat16 activations), and this one computes in float32",
                          where=where, hint="set [distributed] mixed_precision = 'bf16' (or train a LoRA on a model "
                                            "with dtype = 'bf16'), or remove rollout_precision")


def _check_paired_rollouts(recipe: Recipe, registry: Registry, T: int) -> None:
    """An objective that trains on pairs of rollouts from one starting noise (FDFO:
    ``paired_rollouts``) needs groups of 2 sharing their noise, and stochastic steps (which make
    the pair differ, and whose states it trains: ``trains_trajectory_states``)."""
    loss = build_loss(recipe, registry)
    name = recipe.components["loss"].use
    if getattr(loss, "trains_trajectory_states", False) and T < 1:
        raise RecipeError(f"loss '{name}' trains the rollout's stochastic states, and the sampler has none",
                          where=f"{recipe.source}: [sampler]",
                          hint="use a stochastic kernel (e.g. [kernel] use = 'flow') over the steps, not [window] "
                               "use = 'ode'")
    if not getattr(loss, "paired_rollouts", False):
        return
    t = recipe.train
    if t.group_size != 2 or not t.same_noise_in_group:
        raise RecipeError(f"loss '{name}' trains on pairs of rollouts from one starting noise: group_size = 2 and "
                          f"same_noise_in_group = true (this recipe: {t.group_size}, {str(t.same_noise_in_group).lower()})",
                          where=f"{recipe.source}: [train]", hint="set train.group_size = 2 and "
                          "train.same_noise_in_group = true")


def located(recipe: Recipe, where: str) -> str:
    """``where`` within the recipe file: a component's bare ``[chunker].profile`` becomes
    ``recipes/x.toml: [chunker].profile``."""
    return f"{recipe.source}: {where}" if where.startswith("[") else where


def data_kind(recipe: Recipe, registry: Registry) -> str | None:
    """The kind of offline table the ``[loss]`` trains on (:class:`flowrl.interfaces.TrainsOnData`:
    ``"images"`` or ``"pairs"``), or None for a loss that trains on rollouts."""
    loss = build_loss(recipe, registry)
    return loss.data_kind if isinstance(loss, TrainsOnData) else None


#: how to fix a recipe whose [data] and [loss] disagree
DATA_HINT = ("an offline run names its table in [data] path = \"TABLE.jsonl\" and trains it with [loss] use = 'sft' "
             "(a table of prompt, image) or 'offline_dpo' (prompt, chosen, rejected); docs/objectives.md, "
             "\"Offline SFT and DPO\"")


def _check_data(recipe: Recipe, registry: Registry) -> None:
    """``[data]`` and the ``[loss]`` go together: an offline loss needs a table, a table needs an
    offline loss of its kind, and a row is one sample (``group_size = 1``). The table itself is
    read by :func:`~flowrl.recipe.startable.check_startable` (a run's recipe stays loadable after
    its table is gone)."""
    data, name = recipe.data, recipe.components["loss"].use
    wants = data_kind(recipe, registry)
    if not data.enabled:
        if wants is not None:
            raise RecipeError(f"loss '{name}' trains on an offline table of {wants}, and the recipe names none "
                              "(no [data] path)", where=f"{recipe.source}: [data].path", hint=DATA_HINT)
        return
    if wants is None:
        raise RecipeError(f"[data] names an offline table, but loss '{name}' trains on rollouts and their rewards",
                          where=f"{recipe.source}: [loss]",
                          hint=f"use loss 'sft' or 'offline_dpo' with [data], or remove [data] for an online run")
    if data.kind not in ("auto", wants):
        raise RecipeError(f"kind = '{data.kind}', but loss '{name}' trains on a table of {wants}",
                          where=f"{recipe.source}: [data].kind", hint=DATA_HINT)


def no_reference_copy_because(recipe: Recipe, registry: Registry | None = None) -> tuple[str, str, str] | None:
    """Why the run keeps no frozen copy of the denoiser as its KL reference, as ``(key, reason,
    how to get one)``, or None when it keeps one: as :class:`flowrl.objectives.kl.KLSettings` and
    :class:`~flowrl.objectives.kl.ReferencePolicy` decide it (a reference only with a loss of
    ``beta > 0`` and a reference KL kind, or ``[log].kl_every`` measuring against one, or an
    objective that runs one itself and says so,
    :class:`flowrl.interfaces.NeedsReferencePolicy`: DiffusionNFT with ``beta_kl > 0``; a copy
    only without LoRA, whose reference is the base with the adapter off)."""
    loss = recipe.components["loss"].params
    if isinstance(loss, KLRegularised):  # a KL term, or [log].kl_every's measurement, to a reference
        wants = (float(loss.beta or 0.0) > 0 or recipe.log.kl_every > 0) and loss.kl != "old_policy_k3"
    else:  # the built objective says whether it runs a reference of its own
        built = build_loss(recipe, registry or get_registry())
        wants = isinstance(built, NeedsReferencePolicy) and built.needs_reference() or (
            recipe.log.kl_every > 0 and isinstance(built, KLRegularised) and built.kl != "old_policy_k3")
    if not wants:
        return ("[loss].beta", "the [loss] has no KL term to a reference model and measures none (beta = 0 or "
                "kl = 'old_policy_k3', and no [log].kl_every; nft: beta_kl = 0)",
                "give the [loss] beta > 0 (or [log].kl_every > 0) and kl = 'flow_grpo' or 'gaussian_exact' "
                "(nft: beta_kl > 0)")
    if recipe.train.finetune != "full":
        return ("[train].finetune", f"finetune = '{recipe.train.finetune}': the reference is the base with the "
                "adapter off, not a copy of the weights", "use finetune = 'full'")
    return None


def keeps_reference_copy(recipe: Recipe, registry: Registry | None = None) -> bool:
    """True when training keeps a frozen copy of the denoiser as its KL reference."""
    return no_reference_copy_because(recipe, registry) is None


def _check_reference_copy_needed(recipe: Recipe, registry: Registry) -> None:
    """An objective that declares it needs the reference as a frozen copy
    (:class:`flowrl.interfaces.NeedsReferenceCopy`: GARDO's reference reset) refuses, in its
    ``prepare``, a run that keeps none: only after the model has loaded. Refused here from the
    declaration and the recipe, for every such objective."""
    loss = build_loss(recipe, registry)
    if not (isinstance(loss, NeedsReferenceCopy) and loss.needs_reference_copy):
        return
    why = no_reference_copy_because(recipe, registry)
    if why is None:
        return
    key, reason, fix = why
    name = recipe.components["loss"].use
    raise RecipeError(
        f"loss '{name}' needs its KL reference as a frozen copy of the denoiser (it resets the reference to "
        f"the current weights), and this recipe keeps none: {reason}",
        where=f"{recipe.source}: {key}", hint=f"{fix} with this loss, or use another [loss]",
    )


def _check_kl_monitor(recipe: Recipe, registry: Registry) -> None:
    """``[log].kl_every`` measures the KL to the reference of the policy-gradient family (the
    ratio-based update around a ``[loss]`` with ``beta`` and ``kl``), in a kind that has a
    reference: refused elsewhere, where it would do nothing."""
    if recipe.log.kl_every == 0:
        return
    name, where = recipe.components["loss"].use, f"{recipe.source}: [log].kl_every"
    built = build_loss(recipe, registry)
    if not (isinstance(built, KLRegularised) and isinstance(objective_for(built), PolicyGradient)):
        raise RecipeError(
            f"kl_every = {recipe.log.kl_every}, but loss '{name}' is not a ratio-based policy gradient with a KL "
            "kind to measure (it keeps its own KL settings, e.g. nft's or awm's beta_kl, or trains on an ELBO)",
            where=where, hint="remove kl_every, or use a loss with beta and kl (clipped, guard, dppo) on the "
                              "trajectory likelihood")
    if built.kl == "old_policy_k3":
        raise RecipeError(
            f"kl_every = {recipe.log.kl_every}, but [loss].kl = 'old_policy_k3' measures against the rollout "
            "policy, not a reference (every run logs a k3 estimate to the rollout policy as approx_kl_old)",
            where=where, hint="set [loss].kl = 'gaussian_exact' or 'flow_grpo' to log the KL to the reference, "
                              "or remove kl_every")
    every = recipe.log.every
    if recipe.log.kl_every % every:
        raise RecipeError(
            f"kl_every = {recipe.log.kl_every} is not a multiple of [log].every = {every}: the KL of an iteration "
            "whose metrics row is not written would be measured and thrown away",
            where=where, hint=f"use a multiple of {every}, e.g. kl_every = {every * max(1, recipe.log.kl_every // every)}")


def _check_memory_knobs(recipe: Recipe, registry: Registry) -> None:
    """[train].reference_on_cpu and .optimizer only where they apply (never silently ignored)."""
    t = recipe.train
    if t.reference_on_cpu:
        if not keeps_reference_copy(recipe, registry):
            raise RecipeError(
                "reference_on_cpu = true, but this recipe keeps no reference copy (only full fine-tuning with a "
                "KL term to a reference does: [loss].beta > 0 and a reference KL kind, or [log].kl_every measuring "
                "one, or nft's beta_kl > 0; "
                "LoRA's reference is the base with the adapter off)",
                where=f"{recipe.source}: [train].reference_on_cpu", hint="remove it",
            )


def _check_replay(recipe: Recipe, registry: Registry, T: int) -> None:
    """``[replay]`` only where a replayed rollout can be re-weighted exactly (:func:`_refuse_off_policy`);
    a sequence weight no longer than the sampler's T."""
    r, where = recipe.replay, f"{recipe.source}: [replay]"
    if not r.enabled:
        return
    _refuse_off_policy(recipe, registry, "[replay]", f"{where}.size", "set size = 0", "the replay buffer")
    if r.weight_steps > T > 0:
        raise RecipeError(f"weight_steps = {r.weight_steps} exceeds the sampler's T = {T} trainable transitions",
                          where=f"{where}.weight_steps", hint=f"at most {T}; 0 = all")


def _check_pipeline(recipe: Recipe, registry: Registry) -> None:
    """``[pipeline]`` with staleness 1 trains on rollouts of an older policy, corrected like a
    replayed one: refused where replay is refused; and not together with ``[replay]`` (a kept
    rollout's staleness would count iterations, not the policy versions that drew it)."""
    if not recipe.pipeline.enabled:
        return
    where = f"{recipe.source}: [pipeline].staleness"
    _refuse_off_policy(recipe, registry, "[pipeline] staleness = 1", where, "set staleness = 0",
                       "the rollout policy's weights")
    if recipe.replay.enabled:
        raise RecipeError("[pipeline] staleness = 1 and [replay] cannot be combined yet", where=where,
                          hint="set pipeline.staleness = 0 or replay.size = 0")


def _refuse_off_policy(recipe: Recipe, registry: Registry, what: str, where: str, off: str, kept: str) -> None:
    """Training on a rollout sampled by an older policy (``[replay]``, ``[pipeline]``) corrects it
    by re-scoring and importance weights, which needs a ratio-based ``[loss]`` (a plain policy
    loss, which trains through the chunk ratio) whose only memory of the rollout is its
    log-probs (not GRPO-Guard's proposal means), and an unsharded run (its checkpoint keeps
    ``kept``). One message each, naming ``what`` and how to turn it ``off``."""
    loss = build_loss(recipe, registry)
    name = recipe.components["loss"].use
    if isinstance(loss, Objective):
        likelihood = recipe.components.get("likelihood")
        # (build_loss has refused an objective with its own update on another likelihood)
        how = (f"runs on [likelihood] '{likelihood.use}' (its own old policy, not the rollout's log-probs)"
               if likelihood is not None and likelihood.use != "trajectory"
               else "owns its update (its own old policy or anchors, not the rollout's log-probs)")
        raise RecipeError(f"{what} needs a ratio-based policy loss; loss '{name}' {how}", where=where,
                          hint=f"use loss 'clipped' on [likelihood] 'trajectory', or {off}")
    if isinstance(loss, KeepsRolloutMeans) and loss.keep_means:
        raise RecipeError(f"{what} cannot re-weight loss '{name}': its step ratio uses the rollout's proposal "
                          "means, which an off-policy update would have to re-sample", where=where,
                          hint=f"use loss 'clipped', or {off}")
    if recipe.distributed.strategy == "fsdp2":
        raise RecipeError(f"{what} is not supported with strategy = 'fsdp2' (its sharded checkpoint cannot hold "
                          f"{kept} yet)", where=where, hint="use strategy 'ddp' or 'none'")


def check_launched_strategy(recipe: Recipe, registry: Registry, strategy: str) -> None:
    """What validation refuses beside ``strategy = "fsdp2"``, checked again when the recipe says
    ``"auto"`` and the launcher chose FSDP2 (an accelerate FSDP config): sharded weights beside 8-bit
    AdamW, a CPU EMA or a quantised base, and the off-policy features whose state a sharded
    checkpoint cannot hold ([replay], [pipeline]). ``strategy``: the one the launch resolved."""
    if strategy != "fsdp2" or recipe.distributed.strategy == "fsdp2":
        return
    sharded = dataclasses.replace(recipe, distributed=dataclasses.replace(recipe.distributed, strategy="fsdp2"))
    try:
        _check_sharding(sharded)
        _check_replay(sharded, registry, recipe.num_trainable)
        _check_pipeline(sharded, registry)
    except RecipeError as exc:
        raise RecipeError(f"{exc.message} (strategy = 'auto' became 'fsdp2': the launcher's accelerate config asks "
                          "for FSDP)", where=exc.where, hint=f"{exc.hint}; or launch without FSDP (DDP)") from exc


def _tree_from_profile(recipe: Recipe, T: int) -> None:
    """``[window] use = "branch"`` with ``profile``: fill in its ``steps`` (the ``count`` trainable
    transitions where the profile's l1rel curve is highest, in step order) and ``factors`` (2
    each). A recipe that already names them (the run's own resolved recipe) must name these."""
    choice = recipe.components.get("window")
    params = choice.params if choice is not None else None
    if not isinstance(params, BranchConfig) or not params.profile:
        return
    where = f"{recipe.source}: [window].profile"
    data = read_profile(params.profile, where=where)
    curve = trainable_curve(data, "l1rel", T, source=params.profile, where=where)
    positions = [i for i, t in enumerate(data["trainable"]) if t]
    if params.count > len(positions):
        raise RecipeError(f"count = {params.count} exceeds the sampler's {len(positions)} trainable transitions",
                          where=f"{recipe.source}: [window].count")
    steps = steps_of_highest_dynamics(curve, positions, params.count)
    factors = [2] * params.count
    if (params.steps or params.factors) and (list(params.steps), list(params.factors)) != (steps, factors):
        raise RecipeError(f"steps {list(params.steps)} and factors {list(params.factors)} are not what the profile "
                          f"gives ({steps}, {factors})", where=where, hint="give profile or steps, not both")
    choice.params = dataclasses.replace(params, steps=steps, factors=factors)


def _check_group_can_differ(recipe: Recipe, T: int) -> None:
    """A rollout with no stochastic step (T = 0: an ODE window) makes a group's samples differ only
    by their starting noise; with the same noise for the whole group they are one image, every
    advantage is 0 and nothing would train."""
    if T == 0 and recipe.train.same_noise_in_group and not recipe.data.enabled:
        raise RecipeError("same_noise_in_group = true with a rollout that adds no noise (no stochastic step): "
                          "every sample of a group would be the same image, so every advantage would be 0",
                          where=f"{recipe.source}: [train].same_noise_in_group",
                          hint="set same_noise_in_group = false (each sample from its own noise)")


def _check_trees(recipe: Recipe, registry: Registry, trainable: torch.Tensor, plans: bool) -> None:
    """BranchGRPO as components: a tree advantage (:class:`~flowrl.interfaces.AdvantagesOnTrees`,
    ``[advantage] use = "tree"``) runs on tree rollouts only, and a window that samples trees
    (:class:`~flowrl.interfaces.SamplesTrees`, ``[window] use = "branch"``) splits: one
    message each. A tree splits whole groups on one process, sampled in whole-group sub-batches with
    the sampler's own kernels (no plan of its own); a split must leave the copies a stochastic step
    that reaches the image, or they stay one image; a tree advantage needs step units and one
    reward per leaf, and its pruning must fit the tree (its ``check_tree``; ``trainable``: the
    sampler's trainable steps)."""
    window, advantage = build_component(recipe, registry, "window"), build_component(recipe, registry, "advantage")
    G, s = recipe.train.group_size, recipe.sampler
    w_name, a_name = recipe.components["window"].use, recipe.components["advantage"].use
    on_tree = isinstance(advantage, AdvantagesOnTrees)
    if not isinstance(window, SamplesTrees):
        if on_tree:
            raise RecipeError(f"advantage '{a_name}' gives each transition of a tree rollout its own advantage, and "
                              f"[window] '{w_name}' samples no trees", where=f"{recipe.source}: [advantage]",
                              hint="sample trees with [window] use = 'branch' (steps and factors), or use a per-sample "
                                   "advantage such as 'group_zscore'")
        return
    tree, where = window.tree(), f"{recipe.source}: [window]"
    if not tree.steps:
        raise RecipeError(f"[window] '{w_name}' samples trees and this one never splits", where=where,
                          hint="give steps and factors (e.g. steps = [2, 6], factors = [2, 2]), or profile and count; "
                               "or sample without trees: [window] use = 'fixed'")
    try:
        tree.check(s.steps, G)
    except ValueError as exc:
        raise RecipeError(str(exc).replace("the group size", "group_size"), where=where) from exc
    if s.batch_size % G:
        raise RecipeError(f"batch_size ({s.batch_size}) must be 0 or a multiple of group_size ({G}) with tree "
                          "rollouts: a group's tree is sampled in one sub-batch",
                          where=f"{recipe.source}: [sampler].batch_size")
    if plans:
        raise RecipeError(f"[window] '{w_name}' samples trees and plans its own windows too; a tree samples with the "
                          "sampler's kernels and [sampler].sde_window", where=where,
                          hint="a window that samples trees returns no plan")
    steps = [i for i, t in enumerate(trainable.tolist()) if t]
    splits = [b for b, f in zip(tree.steps, tree.factors) if f > 1]
    if splits and (not steps or splits[-1] > steps[-1]):
        last = (f"the sampler's last stochastic step that reaches the image is step {steps[-1]}" if steps else
                "the sampler has no stochastic step that reaches the image")
        raise RecipeError(
            f"branch step {splits[-1]} splits where no noise is drawn any more: {last}, so the copies "
            "would stay one image (the group's samples would repeat each other)",
            where=f"{where}.steps",
            hint=(f"branch at steps <= {steps[-1]}" if steps else "use a stochastic kernel (e.g. 'flow')")
            + " (image_from = 'x0_hat' leaves the last step's noise out of the image; sde_window bounds the "
              "stochastic steps)")
    if not on_tree:
        return
    where = f"{recipe.source}: [advantage]"
    try:
        advantage.check_tree(tree, steps, s.steps, G)
    except ValueError as exc:
        raise RecipeError(str(exc), where=where) from exc
    if recipe.components["chunker"].use != "step":
        raise RecipeError(f"advantage '{a_name}' gives each transition its own advantage: it needs step units, not "
                          f"chunker '{recipe.components['chunker'].use}'", where=where,
                          hint="set chunker.use = 'step', or a per-sample advantage such as 'group_zscore'")
    if any(any(r.chunk_weights) for r in recipe.rewards):
        raise RecipeError(f"advantage '{a_name}' fuses one reward per leaf; a reward with chunk_weights gives one per "
                          "chunk", where=where, hint="drop chunk_weights, or use a per-sample advantage such as "
                                                     "'group_zscore'")


def _check_context_parallel(recipe: Recipe) -> None:
    """Context parallelism (flowrl.train.context_parallel) before anything loads: whole groups of
    processes, and no second copy of the policy that would run without the split (a pipelined
    rollout, an FP8 rollout copy); the model's heads and tokens are checked when it is built."""
    cp, where = recipe.distributed.context_parallel, f"{recipe.source}: [distributed].context_parallel"
    ring = recipe.distributed.context_parallel_ring
    if cp % ring:
        raise RecipeError(
            f"context_parallel_ring = {ring} does not divide context_parallel = {cp}: a group is rings of "
            f"{ring} processes times the processes that split heads", where=f"{recipe.source}: [distributed]"
            ".context_parallel_ring", hint=f"use a divisor of {cp}" + ("" if cp > 1 else
                                                                     ", after setting context_parallel"))
    if ring > 1 and recipe.train.attention_backend not in ("auto", "flash", "cudnn"):
        raise RecipeError(
            f"context_parallel_ring = {ring} merges partial attentions by their log-sum-exp, and attention_backend "
            f"= {recipe.train.attention_backend!r} returns none", where=f"{recipe.source}: [train].attention_backend",
            hint="use 'auto' or 'flash' (or 'cudnn' on a GPU), or set context_parallel_ring = 1")
    if ring > 1 and recipe.distributed.mixed_precision == "bf16" and recipe.distributed.strategy in ("none", "ddp"):
        raise RecipeError(
            f"context_parallel_ring = {ring} calls its attention kernels outside autocast, and mixed_precision = "
            f"'bf16' with strategy = '{recipe.distributed.strategy}' computes a float32 model under autocast: the "
            "queries, keys and values would reach them in different dtypes",
            where=f"{recipe.source}: [distributed].context_parallel_ring",
            hint="use strategy = 'fsdp2' (its mixed precision casts the weights), or mixed_precision = 'no', or "
                 "context_parallel_ring = 1")
    if cp == 1:
        return
    if recipe.distributed.num_processes % cp:
        raise RecipeError(
            f"context_parallel = {cp} does not divide num_processes = {recipe.distributed.num_processes} into groups",
            where=where, hint=f"set [distributed] num_processes to a multiple of {cp}",
        )
    other = ("[pipeline] draws rollouts with a copy of the policy" if recipe.pipeline.enabled else
             "[sampler] rollout_precision = 'fp8' draws rollouts with a quantised copy"
             if recipe.sampler.rollout_precision == "fp8" else None)
    if other is not None:
        raise RecipeError(f"context_parallel = {cp} splits the trained denoiser's sequences, and {other} that would "
                          "run unsplit", where=where, hint="set context_parallel = 1, or remove that setting")


#: A base quantised by bitsandbytes (``[model].quantize``) keeps its quantisation statistics outside
#: its parameters, which FSDP2 shards; its forward then fails. DDP replicates it and works.
QUANTISED_UNDER_FSDP2 = ("a quantised base (model.quantize) cannot be sharded by FSDP2: bitsandbytes keeps its "
                         "quantisation statistics beside the weights, not in them")
QUANTISED_UNDER_FSDP2_HINT = ("use strategy = 'ddp' (each process holds the quantised base, small by design) or "
                              "'none' on one process, or set quantize = 'none' to shard the bf16 base")


def _check_sharding(recipe: Recipe) -> None:
    """What cannot work beside sharded (DTensor) weights, refused before any model loads; the
    optimizer and :meth:`flowrl.train.ema.WeightEMA.attach` would refuse it only after. (With
    strategy 'auto' a launcher may still choose fsdp2: training checks again then.)"""
    if recipe.distributed.strategy != "fsdp2":
        return
    if getattr(recipe.components["model"].params, "quantize", "none") not in (None, "none"):
        raise RecipeError(QUANTISED_UNDER_FSDP2, where=f"{recipe.source}: [distributed].strategy",
                          hint=QUANTISED_UNDER_FSDP2_HINT)
    if recipe.train.optimizer == "adamw_8bit":
        raise RecipeError(
            "optimizer = 'adamw_8bit' cannot hold sharded (DTensor) parameters",
            where=f"{recipe.source}: [train].optimizer",
            hint="use 'adamw' with strategy = 'fsdp2' (its AdamW state is sharded already), or strategy 'ddp'/'none'",
        )
    if recipe.ema.enabled and recipe.ema.on_cpu:
        raise RecipeError(
            "[ema] on_cpu = true is not supported with strategy = 'fsdp2': the EMA is sharded like the weights "
            "and lives next to them",
            where=f"{recipe.source}: [ema].on_cpu",
            hint="set on_cpu = false (each process then holds 1/N of the EMA), or use strategy 'ddp'",
        )
