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

import tempfile
from pathlib import Path
from typing import Any

import torch

from flowrl.interfaces import (
    AdaptiveChunker,
    AdvantageEstimator,
    Chunker,
    ChunkSelector,
    CurveSource,
    CurveWeightedSelector,
    Kernel,
    KLRegularised,
    NeedsRunDir,
    PolicyLoss,
    ProfilingChunker,
    ReportsClipping,
    Schedule,
    Tracker,
    score,
)
from flowrl.schedules import validate_sigmas

__all__ = ["check_component", "KL_KINDS"]

#: The KL kinds the engine implements (:mod:`flowrl.train.reference`).
KL_KINDS = ("gaussian_exact", "flow_grpo", "old_policy_k3")


def _gens(n: int, seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def check_schedule(schedule, model=None, **_) -> list[str]:
    """``model``: the adapter a schedule may read (its own sigmas, its image sequence length)."""
    assert isinstance(schedule, Schedule), "a schedule has sigmas(num_steps, model)"
    for n in (1, 4, 17):
        sig = validate_sigmas(schedule.sigmas(n, model))  # decreasing, 1 to 0, float32
        assert sig.numel() == n + 1, f"sigmas({n}) must have {n + 1} entries, got {sig.numel()}"
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
    mask = selector.select(6, sizes, _gens(6))
    assert mask.dtype == torch.bool and tuple(mask.shape) == (6, len(sizes)), f"select returns bool [B, K], got {mask.shape}"
    assert bool(mask.any(dim=1).all()), "every sample selects at least one chunk"
    assert torch.equal(mask, selector.select(6, sizes, _gens(6))), "the same generators give the same selection"
    return claimed


def check_advantage(estimator, **_) -> list[str]:
    assert isinstance(estimator, AdvantageEstimator), "an estimator is called as (rewards, weights, group_ids)"
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    rewards = {"r": torch.tensor([0.1, 0.5, 0.9, 0.3, 0.3, 0.3])}
    adv = estimator(rewards, {"r": 1.0}, groups)
    assert adv.shape == (6,) and adv.dtype == torch.float32 and bool(torch.isfinite(adv).all())
    assert bool((adv[3:] == 0).all()), "a group whose rewards are all equal gets advantage 0"
    assert adv[2] > adv[1] > adv[0], "a higher reward in the group gets a higher advantage"
    return ["AdvantageEstimator"]


def check_loss(loss, **_) -> list[str]:
    assert isinstance(loss, PolicyLoss), "a loss has objective(log_ratio [B, K], advantages [B, K])"
    claimed = ["PolicyLoss"]
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


def check_reward(reward, images=None, prompts=None, metadata=None, **_) -> list[str]:
    """``metadata``: what the engine would pass (e.g. ``condition_images`` for editing rewards)."""
    g = torch.Generator().manual_seed(0)
    images = torch.rand(3, 3, 32, 32, generator=g) if images is None else images
    prompts = ["a red circle on a blue background"] * images.shape[0] if prompts is None else prompts
    out = score(reward, images, prompts, metadata)  # checks one score per image
    assert bool(torch.isfinite(out.scores).all()), f"scores must be finite, got {out.scores}"
    return ["Reward"]


def check_tracker(tracker, **_) -> list[str]:
    assert isinstance(tracker, Tracker), "a tracker has log_metrics, log_image and close"
    claimed = ["Tracker"]
    with tempfile.TemporaryDirectory() as tmp:
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
    "reward": check_reward,
    "tracker": check_tracker,
}


def check_component(kind: str, component: Any, **context: Any) -> list[str]:
    """Check ``component`` of ``kind`` (``schedule``, ``kernel``, ``chunker``, ``selector``,
    ``advantage``, ``loss``, ``reward``, ``tracker``) and every optional protocol it implements;
    returns the protocols checked."""
    if kind not in _CHECKS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {sorted(_CHECKS)} (models: flowrl.testing.conformance)")
    return _CHECKS[kind](component, **context)
