"""Conformance checks for the small components: schedules, kernels, chunkers, selectors, advantage
estimators, losses, rewards and trackers, and every optional capability (protocol) they claim.

A plugin author runs them on their component in a test::

    from flowrl.testing.components import check_component

    def test_my_chunker_conforms():
        check_component("chunker", MyChunker(MyChunker.Config()))

Each check raises ``AssertionError`` saying what is wrong, and returns the names of the
protocols it checked. Model adapters have their own, larger suite: :mod:`flowrl.testing.conformance`.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from flowrl.interfaces import (
    scores_latents,
    AdaptiveChunker,
    AdvantageEstimator,
    AdvantagesOnTrees,
    CheckpointsState,
    ChoosesKLForm,
    Chunker,
    ChunkSelector,
    CurveSource,
    CurveWeightedSelector,
    KeepsRolloutMeans,
    Kernel,
    KLRegularised,
    LikelihoodEstimator,
    NeedsRunDir,
    RewindsOnResume,
    NormalisesStepRatio,
    Objective,
    PolicyLoss,
    ProfilingChunker,
    ReportsClipping,
    NeedsReferenceCopy,
    NeedsReferencePolicy,
    SamplesTrees,
    SamplesWithOwnWeights,
    TrainsOnData,
    ScalesFlowGRPOKL,
    ScoresClips,
    Schedule,
    SelectsByStepStd,
    SelectsFromRollout,
    SelectsPerGroup,
    Tracker,
    UsesImageFeatures,
    WarpsTime,
    WindowPlanner,
)
from flowrl.objectives.losses import ClippedObjective
from flowrl.rewards import score
from flowrl.sampling.branching import Tree, branch_rollout
from flowrl.sampling.plans import PlanContext, RolloutPlan
from flowrl.sampling.rollout import make_kernels
from flowrl.sampling.schedules import shifted_sigmas, validate_sigmas
from flowrl.sampling.kernels import FlowKernel, StepOutput
from flowrl.sampling.trajectory import Position

__all__ = ["check_component", "KL_KINDS"]

#: The KL kinds the engine implements (:mod:`flowrl.objectives.kl`).
KL_KINDS = ("gaussian_exact", "flow_grpo", "old_policy_k3")


def _gens(n: int, seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def check_schedule(schedule, model=None, **_) -> list[str]:
    """``model``: the adapter a schedule may read (its own sigmas, its image sequence length)."""
    assert isinstance(schedule, Schedule), "a schedule has sigmas(num_steps, model)"
    for n in (1, 4, 17):
        sig = validate_sigmas(schedule.sigmas(n, model))  # decreasing, 1 to 0, float32
        assert sig.numel() == n + 1, f"sigmas({n}) must have {n + 1} entries, got {sig.numel()}"
    if isinstance(schedule, WarpsTime):  # sigmas(N) is sigma_at on the uniform grid
        sig = schedule.sigmas(8, model)
        warped = schedule.sigma_at(torch.linspace(1.0, 0.0, 9, dtype=torch.float64))
        torch.testing.assert_close(warped.to(torch.float32), sig.to(torch.float32), rtol=0, atol=1e-6,
                                   msg="sigma_at(linspace(1, 0, N + 1)) must reproduce sigmas(N)")
        return ["Schedule", "WarpsTime"]
    return ["Schedule"]


def check_kernel(kernel, **_) -> list[str]:
    assert isinstance(kernel, Kernel), "a kernel has step(...) and stochastic_at(sigma, sigma_next)"
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 4, 5, generator=g), torch.randn(3, 4, 5, generator=g)
    out = kernel.step(v, x, 0.8, 0.6, generator=_gens(3))
    assert out.next_sample.shape == x.shape and out.log_prob.shape == (3,), "step shapes: next_sample [B, ...], log_prob [B]"
    assert out.log_prob.dtype == torch.float32 and bool(torch.isfinite(out.log_prob).all())
    again = kernel.step(v, x, 0.8, 0.6, generator=_gens(3))
    assert torch.equal(out.next_sample, again.next_sample), "the same generators must give the same sample"
    scored = kernel.step(v, x, 0.8, 0.6, next_sample=out.next_sample)
    torch.testing.assert_close(scored.log_prob, out.log_prob, rtol=0, atol=1e-6,
                               msg="scoring the sampled x' must reproduce the log-prob of sampling it")
    if kernel.stochastic_at(0.8, 0.6):
        assert bool((out.std > 0).all()), "a stochastic step has std > 0"
    if isinstance(kernel, ScalesFlowGRPOKL):
        scale = kernel.flow_grpo_scale(out.std, 0.8, 0.6)
        assert bool((torch.as_tensor(scale) > 0).all() or not kernel.stochastic_at(0.8, 0.6))
        return ["Kernel", "ScalesFlowGRPOKL"]
    return ["Kernel"]


def check_chunker(chunker, **_) -> list[str]:
    assert isinstance(chunker, Chunker), "a chunker has sizes(num_transitions)"
    claimed = ["Chunker"]
    if isinstance(chunker, ProfilingChunker):
        claimed.append("ProfilingChunker")
        assert isinstance(chunker.needs_model, bool)
    for T in (16, 8):
        try:
            sizes = tuple(chunker.sizes(T))
        except ValueError:
            continue  # a layout for another T (explicit sizes, a profile): saying so is allowed
        assert sizes and all(isinstance(s, int) and s >= 1 for s in sizes), f"sizes({T}) = {sizes}: positive ints"
        assert sum(sizes) == T, f"sizes({T}) = {sizes} must sum to {T}"
        if isinstance(chunker, CurveSource):
            claimed.append("CurveSource")
            curve = chunker.l1rel(T)
            assert curve.shape == (T,) and curve.dtype == torch.float32, "l1rel(T) is float32 [T]"
            assert bool(torch.isfinite(curve).all()) and bool((curve >= 0).all()), "l1rel is finite and >= 0"
        if isinstance(chunker, AdaptiveChunker):
            claimed.append("AdaptiveChunker")
            assert isinstance(chunker.reprofile_every, int) and chunker.reprofile_every >= 0
            pinned = (T - 1, 1)
            chunker.set_sizes(pinned)
            assert tuple(chunker.sizes(T)) == pinned, "set_sizes pins the layout"
        return claimed
    raise AssertionError("the chunker gave no layout for T = 16 or 8")


def check_selector(selector, sizes=(2, 3, 4, 7), **_) -> list[str]:
    assert isinstance(selector, ChunkSelector), "a selector has select(num_samples, sizes, generator)"
    claimed = ["ChunkSelector"]
    if isinstance(selector, CurveWeightedSelector):
        claimed.append("CurveWeightedSelector")
        assert isinstance(selector.has_own_profile, bool)
        if selector.l1rel is None and not selector.has_own_profile:
            selector.l1rel = torch.linspace(0.5, 0.1, sum(sizes))  # what the engine hands over
    if isinstance(selector, SelectsByStepStd):
        claimed.append("SelectsByStepStd")
        std = torch.rand(6, sum(sizes), generator=torch.Generator().manual_seed(4)) + 0.05

        def select(gens):
            return selector.select_from_std(6, sizes, gens, std)
    else:
        def select(gens):
            return selector.select(6, sizes, gens)
    mask = select(_gens(6))
    assert mask.dtype == torch.bool and tuple(mask.shape) == (6, len(sizes)), f"select returns bool [B, K], got {mask.shape}"
    assert bool(mask.any(dim=1).all()), "every sample selects at least one chunk"
    assert torch.equal(mask, select(_gens(6))), "the same generators give the same selection"
    if isinstance(selector, SelectsPerGroup):
        claimed.append("SelectsPerGroup")
        groups = torch.tensor([0, 0, 0, 1, 1, 1])
        m = selector.select_per_group(6, sizes, _gens(6), groups)
        assert m.dtype == torch.bool and tuple(m.shape) == (6, len(sizes)) and bool(m.any(dim=1).all())
        assert torch.equal(m[:3], m[:1].expand(3, -1)) and torch.equal(m[3:], m[3:4].expand(3, -1)), \
            "the samples of one group share their selection"
    if isinstance(selector, SelectsFromRollout):
        claimed.append("SelectsFromRollout")
        l1rel = torch.rand(6, sum(sizes), generator=torch.Generator().manual_seed(3))
        m = selector.select_from_rollout(6, sizes, _gens(6), l1rel)
        assert m.dtype == torch.bool and tuple(m.shape) == (6, len(sizes)) and bool(m.any(dim=1).all())
        assert torch.equal(m, selector.select_from_rollout(6, sizes, _gens(6), l1rel))
    return claimed


def check_advantage(estimator, **_) -> list[str]:
    assert isinstance(estimator, AdvantageEstimator), "an estimator is called as (rewards, weights, group_ids)"
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    rewards = {"r": torch.tensor([0.1, 0.5, 0.9, 0.3, 0.3, 0.3])}
    adv = estimator(rewards, {"r": 1.0}, groups)
    assert adv.shape == (6,) and adv.dtype == torch.float32 and bool(torch.isfinite(adv).all())
    assert bool((adv[3:] == 0).all()), "a group whose rewards are all equal gets advantage 0"
    assert adv[2] > adv[1] > adv[0], "a higher reward in the group gets a higher advantage"
    if isinstance(estimator, UsesImageFeatures):
        images = torch.rand(6, 3, 8, 8, generator=torch.Generator().manual_seed(0))
        f = estimator.features(images)
        assert f.ndim == 2 and f.shape[0] == 6, "features(images [B, 3, H, W]) -> [B, F]"
        shaped = estimator(rewards, {"r": 1.0}, groups, features=f)
        assert shaped.shape == (6,) and bool((shaped[3:] == 0).all()) and bool((torch.sign(shaped) == torch.sign(adv)).all()), \
            "features may rescale advantages but not flip their sign or revive an all-equal group"
        return ["AdvantageEstimator", "UsesImageFeatures"]
    if isinstance(estimator, AdvantagesOnTrees):
        return ["AdvantageEstimator", *_check_tree_advantage(estimator)]
    return ["AdvantageEstimator"]


def _check_tree_advantage(estimator) -> list[str]:
    """On a real tree rollout (two groups of 4, each from 2 roots split in 2 before step 1): one
    advantage per trainable transition, the untrained ones 0, a transition the two samples of a
    block share trained at most once."""
    tree, steps, group = Tree((1,), (2,)), 6, 4
    sigmas = shifted_sigmas(steps, 3.0)
    noise = torch.randn(2 * group, 2, 3, generator=torch.Generator().manual_seed(0))
    traj = branch_rollout(lambda rows: (lambda x, sigma: -x), noise, sigmas, make_kernels(steps, FlowKernel(0.7)),
                          group_size=group, branch_steps=tree.steps, branch_factors=tree.factors,
                          generators=_gens(2 * group), group_ids=[j // group for j in range(2 * group)])
    trainable = torch.nonzero(traj.trainable).flatten().tolist()
    estimator.check_tree(tree, trainable, steps, group)  # a tree that fits: no error
    groups = torch.arange(2 * group) // group
    adv = estimator({"r": torch.linspace(0.0, 1.0, 2 * group)}, {"r": 1.0}, groups)
    out = estimator.on_tree(adv, traj, tree, group, 0)
    shape = (2 * group, len(trainable))
    assert out.advantages.shape == shape and out.trained.shape == shape and out.trained.dtype == torch.bool, \
        "on_tree gives advantages and trained [B, T]"
    assert bool(torch.isfinite(out.advantages).all()) and bool((out.advantages[~out.trained] == 0).all()), \
        "an untrained transition has advantage 0"
    assert bool((out.trained[:, trainable.index(0)].view(-1, 2).sum(1) <= 1).all()), \
        "a transition before the split is shared by its block: trained at most once"
    assert bool(out.trained.any()) and all(isinstance(k, str) for k in out.metrics)
    return ["AdvantagesOnTrees"]


def check_objective(objective) -> list[str]:
    """An objective that owns the backward (flowrl.interfaces.Objective): its hooks exist, and the
    optional parts it claims behave."""
    assert isinstance(objective, Objective), "an objective has uses_units, prepare, start_rollout, backward, end_rollout"
    assert isinstance(objective.uses_units, bool), "uses_units must be a bool"
    claimed = ["Objective"]
    if isinstance(objective, SamplesWithOwnWeights):
        claimed.append("SamplesWithOwnWeights")
        with objective.rollout_weights():  # before prepare: nothing to swap, must not fail
            pass
    if isinstance(objective, TrainsOnData):
        claimed.append("TrainsOnData")
        assert objective.data_kind in ("images", "pairs"), "data_kind is 'images' (SFT) or 'pairs' (DPO)"
        assert not objective.uses_units, "an objective on offline rows has no trajectory, so no units"
    if isinstance(objective, CheckpointsState):
        claimed.append("CheckpointsState")
        state, tensors = objective.state_dict(), objective.tensors()
        json.dumps(state)  # JSON-able
        assert all(isinstance(t, torch.Tensor) for t in tensors.values())
        objective.load_state(state, tensors)
    return claimed


def check_loss(loss, **_) -> list[str]:
    claimed = []
    # what the engine and validation read of a loss's reference needs, before any model loads
    if isinstance(loss, NeedsReferenceCopy):
        claimed.append("NeedsReferenceCopy")
        assert isinstance(loss.needs_reference_copy, bool), "needs_reference_copy must be a bool"
    if isinstance(loss, NeedsReferencePolicy):
        claimed.append("NeedsReferencePolicy")
        assert isinstance(loss.needs_reference(), bool), "needs_reference() must return a bool"
    if isinstance(loss, Objective):
        claimed += check_objective(loss)
        if not loss.uses_units:
            return claimed
    assert isinstance(loss, PolicyLoss), "a loss has objective(log_ratio [B, K], advantages [B, K])"
    claimed.append("PolicyLoss")
    if isinstance(loss, ChoosesKLForm):
        claimed.append("ChoosesKLForm")
        assert loss.kl_direction in ("old_theta", "theta_old")
    if isinstance(loss, KeepsRolloutMeans):
        claimed.append("KeepsRolloutMeans")
        assert isinstance(loss.keep_means, bool)
    if isinstance(loss, NormalisesStepRatio):
        claimed.append("NormalisesStepRatio")
        claimed += _check_step_ratio(loss)
    z = torch.zeros(3, 2, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [0.0, 0.0]])
    per_unit = loss.objective(z, adv)
    assert per_unit.shape == (3, 2), "the objective is per unit: [B, K]"
    (grad,) = torch.autograd.grad(per_unit.sum(), z)
    assert bool((grad[0] < 0).all()) and bool((grad[1] > 0).all()), "at ratio 1, a positive advantage pushes z up"
    # elementwise in the units: unit 0's value does not depend on unit 1's log-ratio
    other = loss.objective(torch.tensor([[0.0, 0.3], [0.0, -0.3], [0.0, 0.1]]), adv)
    torch.testing.assert_close(other[:, 0], per_unit.detach()[:, 0], msg="the objective must be elementwise in the units")
    if isinstance(loss, KLRegularised):
        claimed.append("KLRegularised")
        assert loss.beta >= 0 and loss.kl in KL_KINDS, f"beta >= 0 and kl in {KL_KINDS}"
    if isinstance(loss.objective, ReportsClipping):
        claimed.append("ReportsClipping")
        clipped = loss.objective.clip_mask(z.detach(), adv)
        assert clipped.dtype == torch.bool and clipped.shape == z.shape and not bool(clipped.any())
    return claimed


def _check_step_ratio(loss) -> list[str]:
    """On-policy (the re-scored mean equals the rollout's) the transformed step equals the
    rollout's log-prob; it carries the gradient of the mean."""

    g = torch.Generator().manual_seed(0)
    mu_old = torch.randn(2, 4, 3, generator=g)
    x1 = mu_old + 0.3 * torch.randn(2, 4, 3, generator=g)
    old = Position(sample=torch.zeros_like(x1), next_sample=x1, sigma=torch.tensor([0.8, 0.8]),
                   sigma_next=torch.tensor([0.6, 0.6]), log_prob=torch.tensor([0.1, -0.2]), mean=mu_old, kernel=None)
    mu = mu_old.clone().requires_grad_(True)
    out = StepOutput(next_sample=x1, mean=mu, std=torch.tensor([0.3, 0.3]), log_prob=torch.zeros(2))
    lp = loss.step_ratio(out, old)
    torch.testing.assert_close(lp.detach(), old.log_prob, msg="on-policy the step ratio must be exactly the rollout's")
    (grad,) = torch.autograd.grad(lp.sum(), mu)
    assert bool(torch.isfinite(grad).all()) and float(grad.abs().sum()) > 0, "the step ratio must carry the mean's gradient"
    return []


def check_window(planner, **_) -> list[str]:
    """A window planner: T is fixed, and every plan's windows have that length, fit the
    trainable steps and depend only on (seed, iteration, keys)."""

    assert isinstance(planner, WindowPlanner), "a window planner has num_trainable(context) and plan(iteration, keys, context)"
    sig = shifted_sigmas(10, 3.0)
    trainable = torch.ones(10, dtype=torch.bool)
    trainable[-1] = False
    ctx = PlanContext(num_steps=10, sigmas=sig, trainable=trainable, warp=lambda t: 3 * t / (1 + 2 * t), seed=0,
                      group_size=4)
    T = planner.num_trainable(ctx)
    assert isinstance(T, int) and 0 <= T <= 9
    for it in (0, 7, 31):
        plan = planner.plan(it, list(range(8)), ctx)
        if plan is None:
            continue
        assert isinstance(plan, RolloutPlan) and plan.sde_windows.shape == (8, 2)
        assert plan.num_trainable == T or T == 0 and bool((plan.sde_windows[:, 0] == plan.sde_windows[:, 1]).all())
        assert bool((plan.sde_windows[:, 1] <= ctx.trainable_prefix).all()), "windows must sit on trainable steps"
        again = planner.plan(it, list(range(4, 8)), ctx)
        torch.testing.assert_close(again.sde_windows, plan.sde_windows[4:],
                                   msg="a sample's window must not depend on the batch")
    if isinstance(planner, SamplesTrees):
        tree = planner.tree()
        assert len(tree.steps) == len(tree.factors) >= 1, "a tree splits at its steps, one factor each"
        assert list(tree.steps) == sorted(set(tree.steps)) and all(f >= 1 for f in tree.factors)
        assert tree.last_step == max(tree.steps)
        assert planner.plan(0, list(range(8)), ctx) is None, "a tree samples with the sampler's kernels: plan is None"
        return ["WindowPlanner", "SamplesTrees"]
    return ["WindowPlanner"]


def check_reward(reward, images=None, prompts=None, metadata=None, latents=None, **_) -> list[str]:
    """``metadata``: what the engine would pass (e.g. ``condition_images`` for editing rewards).
    A reward that declares :class:`ScoresClips` is called with clips ``[3, 4, 3, 16, 16]``; one
    that declares :class:`ScoresLatents` with ``latents``, its model's clean latents ``[B, *L]``
    (the engine passes them instead of images)."""
    g = torch.Generator().manual_seed(0)
    clips = isinstance(reward, ScoresClips) and bool(reward.scores_clips)
    claimed = ["Reward", "ScoresClips"] if clips else ["Reward"]
    if scores_latents(reward):
        assert latents is not None, "a reward that scores latents is checked on its model's latents: pass latents="
        images, claimed = latents, ["Reward", "ScoresLatents"]
    if images is None:
        images = torch.rand(3, 4, 3, 16, 16, generator=g) if clips else torch.rand(3, 3, 32, 32, generator=g)
    prompts = ["a red circle on a blue background"] * images.shape[0] if prompts is None else prompts
    out = score(reward, images, prompts, metadata)  # checks one score per image (per clip)
    assert bool(torch.isfinite(out.scores).all()), f"scores must be finite, got {out.scores}"
    return claimed


def check_likelihood(estimator, **_) -> list[str]:
    """A likelihood estimator: ``objective(loss)`` serves a plain ratio loss (the clipped
    surrogate) as that loss or as an objective, and refuses an objective that owns its update with
    a ``ValueError`` (the message validation shows)."""
    assert isinstance(estimator, LikelihoodEstimator), "a likelihood estimator has objective(loss)"

    class _Ratio:
        objective = ClippedObjective(0.2, 0.2)
        beta, kl = 0.0, "gaussian_exact"

    served = estimator.objective(_Ratio())
    assert isinstance(served, (PolicyLoss, Objective)), "objective(loss) returns the loss or an Objective around it"
    claimed = ["LikelihoodEstimator"]
    if isinstance(served, Objective):
        claimed += check_objective(served)

    class _OwnsUpdate:
        uses_units = False

        def prepare(self, ctx): ...

        def start_rollout(self, ctx, batch, sizes): ...

        def backward(self, ctx, micro): ...

        def end_rollout(self, ctx, batch): ...

    try:
        estimator.objective(_OwnsUpdate())
    except ValueError as exc:
        assert str(exc), "a refusal says why"
    else:  # serving an objective that owns its update is allowed only by returning it unchanged
        assert estimator.objective(_OwnsUpdate()).__class__ is _OwnsUpdate
    return claimed


def check_tracker(tracker, **_) -> list[str]:
    assert isinstance(tracker, Tracker), "a tracker has log_metrics, log_image and close"
    claimed = ["Tracker"]
    with tempfile.TemporaryDirectory() as tmp:
        if isinstance(tracker, RewindsOnResume):
            claimed.append("RewindsOnResume")
            tracker.rewind(1)
        if isinstance(tracker, NeedsRunDir):
            claimed.append("NeedsRunDir")
            tracker.start(Path(tmp))
        from PIL import Image

        tracker.log_metrics(0, {"reward/r/mean": 0.5, "loss": -0.1})
        tracker.log_image(0, "group", Image.new("RGB", (8, 8)))
        tracker.close()
    return claimed


_CHECKS = {
    "schedule": check_schedule,
    "kernel": check_kernel,
    "chunker": check_chunker,
    "selector": check_selector,
    "advantage": check_advantage,
    "loss": check_loss,
    "likelihood": check_likelihood,
    "window": check_window,
    "reward": check_reward,
    "tracker": check_tracker,
}


def check_component(kind: str, component: Any, **context: Any) -> list[str]:
    """Check ``component`` of ``kind`` (``schedule``, ``kernel``, ``chunker``, ``selector``,
    ``advantage``, ``loss``, ``likelihood``, ``window``, ``reward``, ``tracker``) and every optional protocol it implements;
    returns the protocols checked."""
    if kind not in _CHECKS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {sorted(_CHECKS)} (models: flowrl.testing.conformance)")
    return _CHECKS[kind](component, **context)
