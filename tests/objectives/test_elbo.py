"""The ELBO likelihood estimator (flowrl/objectives/elbo.py): each weighting against a float64
computation by hand, its gradient by a second route, the points it draws (stratified, shared by a
group), the old policy swapped by storage, and the objective's gradient on a tiny linear model
against the formula written out."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.objectives.elbo import ElboPolicyGradient, elbo_log_likelihood
from flowrl.objectives.forward_process import forward_process_points, stratified_pick
from flowrl.objectives.old_policy import OldPolicy, old_policy_decay
from flowrl.objectives.rethinking import EPGObjective, PARObjective, PEPGObjective
from flowrl.seeding import generator
from objective_helpers import Ctx as _Ctx, Linear as _Linear, Micro as _Micro, tiny_batch as _batch


def _point(n=3, shape=(2, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(n, *shape, generator=g)
    eps = torch.randn(n, *shape, generator=g)
    sigma = torch.tensor([0.2, 0.5, 0.9])[:n]
    s = sigma.reshape(-1, *([1] * len(shape)))
    x = (1 - s) * x0 + s * eps
    v = (eps - x0) + 0.3 * torch.randn(n, *shape, generator=g)
    return v, x, x0, eps, sigma


def test_adaptive_weighting_by_hand_in_float64():
    v, x, x0, eps, sigma = _point()
    got = elbo_log_likelihood(v, x, x0, eps, sigma, weighting="adaptive")
    for i in range(3):
        err = (x[i].double() - sigma[i].double() * v[i].double() - x0[i].double()).flatten().tolist()
        mse = sum(e * e for e in err) / len(err)
        w = max(sum(abs(e) for e in err) / len(err), 1e-5)
        assert got[i].item() == pytest.approx(-mse / w, rel=1e-6)


def test_adaptive_weight_has_a_floor():
    x0 = torch.zeros(1, 4)
    v = torch.zeros(1, 4)
    x = torch.full((1, 4), 1e-9)  # x0_hat - x0 = 1e-9 everywhere: the weight is floored at w_min
    got = elbo_log_likelihood(v, x, x0, torch.zeros(1, 4), 0.5, weighting="adaptive", weight_min=1e-5)
    assert got.item() == pytest.approx(-(1e-18) / 1e-5, rel=1e-4)


def test_sigma_weighting_is_sigma_squared_times_the_velocity_error_on_the_forward_process():
    v, x, x0, eps, sigma = _point()
    uniform = elbo_log_likelihood(v, x, x0, eps, sigma, weighting="uniform")
    by_sigma = elbo_log_likelihood(v, x, x0, eps, sigma, weighting="sigma")
    torch.testing.assert_close(by_sigma, sigma**2 * uniform, rtol=1e-5, atol=1e-7)
    exact = elbo_log_likelihood(v, x, x0, eps, sigma, weighting="exact")
    torch.testing.assert_close(exact, (1 - sigma) / (sigma + 1e-3) * uniform, rtol=1e-6, atol=1e-7)
    mse = ((v.double() - (eps.double() - x0.double())) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(uniform.double(), -mse, rtol=1e-6, atol=1e-9)


def test_adaptive_gradient_treats_the_weight_as_a_constant():
    v, x, x0, eps, sigma = _point()
    v = v.clone().requires_grad_(True)
    elbo_log_likelihood(v, x, x0, eps, sigma, weighting="adaptive").sum().backward()
    # second route: d/dv of -mean(e^2) / w with e = x - s v - x0 and w fixed is 2 s e / (N w)
    s = sigma.double().reshape(-1, 1, 1)
    e = x.double() - s * v.detach().double() - x0.double()
    w = e.abs().flatten(1).mean(1).reshape(-1, 1, 1)
    n = e[0].numel()
    torch.testing.assert_close(v.grad.double(), 2 * s * e / (n * w), rtol=1e-5, atol=1e-7)  # float32 rounding


def test_unknown_weighting_and_shape_mismatch_are_refused():
    v, x, x0, eps, sigma = _point()
    with pytest.raises(ValueError, match="weighting"):
        elbo_log_likelihood(v, x, x0, eps, sigma, weighting="nope")
    with pytest.raises(ValueError, match="one shape"):
        elbo_log_likelihood(v[:, :1], x, x0, eps, sigma)


def test_stratified_pick_draws_one_index_per_stratum():
    for n, K in [(9, 3), (10, 4), (7, 7), (16, 5)]:
        edges = [(k * n) // K for k in range(K + 1)]
        for seed in range(20):
            pick = stratified_pick(n, K, generator(seed, "strata"))
            assert len(pick) == K
            for k in range(K):
                assert edges[k] <= int(pick[k]) < edges[k + 1]
    assert stratified_pick(10, 4, generator(1, "s")).tolist() == stratified_pick(10, 4, generator(1, "s")).tolist()


def test_group_shared_points_noise_a_group_alike_and_groups_apart():
    batch = _batch()
    pts = forward_process_points(5, "elbo", batch, torch.arange(4), batch.trajectory.sigmas, 3, by_group=True,
                                 stratified=True)
    eps, sig = pts.eps.reshape(4, 3, -1), pts.sigma.reshape(4, 3)
    torch.testing.assert_close(eps[0], eps[1])
    torch.testing.assert_close(sig[2], sig[3])
    assert not torch.allclose(eps[0], eps[2])
    per_sample = forward_process_points(5, "elbo", batch, torch.arange(4), batch.trajectory.sigmas, 3)
    assert not torch.allclose(per_sample.eps.reshape(4, 3, -1)[0], per_sample.eps.reshape(4, 3, -1)[1])


def test_old_policy_swaps_storage_without_copying_and_restores_exactly():
    model = torch.nn.Linear(3, 3)
    params = list(model.parameters())
    old = OldPolicy(params, model)
    start = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    trained = [p.detach().clone() for p in params]
    ptrs = [p.data_ptr() for p in params]
    old_ptrs = [o.data_ptr() for o in old.values]
    with old.swapped_in():
        for p, s in zip(params, start):
            assert torch.equal(p, s)  # the old values
        assert [p.data_ptr() for p in params] == old_ptrs  # storage exchanged, nothing copied
    assert [p.data_ptr() for p in params] == ptrs
    for p, t in zip(params, trained):
        assert torch.equal(p, t)
    old.follow(0.25)
    for o, s, t in zip(old.values, start, trained):
        torch.testing.assert_close(o, 0.25 * s + 0.75 * t)
    with pytest.raises(RuntimeError):
        with old.swapped_in():
            raise RuntimeError("boom")
    assert [p.data_ptr() for p in params] == ptrs


def test_old_policy_decay_presets():
    assert old_policy_decay(0, 0, 0.001, 0.5) == 0.0
    assert old_policy_decay(100, 0, 0.001, 0.5) == pytest.approx(0.1)
    assert old_policy_decay(10_000, 0, 0.001, 0.5) == 0.5
    assert old_policy_decay(74, 75, 0.0075, 0.999) == 0.0


# ----------------------------------------------------------------------------- the objective


class _Loss:
    def __init__(self, objective, zero=False):
        self.objective, self.zero_without_advantage = objective, zero


def _elbo_by_hand(model, batch, rows, K, weighting="adaptive"):
    pts = forward_process_points(11, "elbo", batch, rows, batch.trajectory.sigmas, K)
    v = model.velocity(pts.x, pts.sigma, None)
    return elbo_log_likelihood(v, pts.x, pts.x0, pts.eps, pts.sigma, weighting=weighting).reshape(len(rows), K)


@pytest.mark.parametrize("objective,dz", [
    (EPGObjective(), lambda z, a: -torch.exp(z) * a),
    (PEPGObjective(), lambda z, a: -torch.exp(z) * (a - z)),
    (PARObjective(), lambda z, a: -torch.exp(z) * (a - z)),
])
def test_objective_gradient_is_the_formula_on_policy_and_off(objective, dz):
    batch = _batch()
    model = _Linear()
    K = 3
    elbo = ElboPolicyGradient(_Loss(objective), timesteps=K, decay_type=1)
    ctx = _Ctx(model)
    elbo.prepare(ctx)
    elbo.start_rollout(ctx, batch, (1,))
    rows = torch.arange(4)
    # on-policy: no old forward, z = 0, dL/dl = dz(0, A) / K per point, summed over samples / normaliser
    model.calls = 0
    elbo.backward(ctx, _Micro(batch, rows, 4.0))
    assert model.calls == 1
    got = [p.grad.clone() for p in ctx.params]
    for p in ctx.params:
        p.grad = None
    lp = _elbo_by_hand(model, batch, rows, K)
    a = batch.advantages.reshape(-1, 1).expand(4, K)
    (lp * dz(torch.zeros_like(lp), a) / K).sum().div(4.0).backward()
    for g, p in zip(got, ctx.params):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)
    # off-policy: the trained weights move; the old policy (decayed) scores z's denominator
    for p in ctx.params:
        p.grad = None
    with torch.no_grad():
        for p in ctx.params:
            p.mul_(1.05)
    ctx.steps = 1
    elbo.end_rollout(ctx, batch)  # decay 0.001 after one step: old = 0.001 old + 0.999 trained
    assert not elbo.trailing.same_as_current
    elbo.start_rollout(ctx, batch, (1,))
    with torch.no_grad():
        for p in ctx.params:
            p.add_(0.01)
    ctx.steps = 2
    model.calls = 0
    elbo.backward(ctx, _Micro(batch, rows, 4.0))
    assert model.calls == 2  # the old policy's forward, then the current one
    got = [p.grad.clone() for p in ctx.params]
    for p in ctx.params:
        p.grad = None
    with elbo.old.swapped_in(), torch.no_grad():
        old = _elbo_by_hand(model, batch, rows, K)
    lp = _elbo_by_hand(model, batch, rows, K)
    z = (lp - old).detach()
    assert z.abs().max() > 0
    (lp * dz(z, a) / K).sum().div(4.0).backward()
    for g, p in zip(got, ctx.params):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)


def test_sample_units_take_one_ratio_per_sample():
    batch = _batch()
    model = _Linear(1)
    K = 4
    seen = {}

    def record(z, a):
        seen["z"], seen["a"] = z.detach().clone(), a.clone()
        return -a * z

    elbo = ElboPolicyGradient(_Loss(record), timesteps=K, units="sample", decay_type=0)
    ctx = _Ctx(model)
    elbo.prepare(ctx)
    elbo.start_rollout(ctx, batch, (1,))
    elbo.backward(ctx, _Micro(batch, torch.arange(4), 4.0))
    assert seen["z"].shape == (4, 1) and seen["a"].shape == (4, 1)
    assert torch.equal(seen["a"].reshape(-1), batch.advantages)


def test_zero_advantage_samples_skip_their_forward_when_the_loss_allows():
    batch = _batch(advantages=[1.0, 0.0, 0.0, -1.0])
    model = _Linear(2)
    elbo = ElboPolicyGradient(_Loss(EPGObjective(), zero=True), timesteps=2, decay_type=0)
    ctx = _Ctx(model)
    elbo.prepare(ctx)
    elbo.start_rollout(ctx, batch, (1,))
    elbo.backward(ctx, _Micro(batch, torch.arange(4), 4.0))
    assert ctx.counter.minimum == {"update": 2 * 2}  # 2 live samples x 2 points
    empty = _batch(advantages=[0.0, 0.0, 0.0, 0.0])
    model.calls = 0
    res = elbo.backward(ctx, _Micro(empty, torch.arange(4), 4.0))
    assert model.calls == 0 and res.losses == (0.0,)
    # PEPG's gradient does not vanish with A off-policy: every sample is trained
    pepg = ElboPolicyGradient(_Loss(PEPGObjective()), timesteps=2, decay_type=0)
    ctx2 = _Ctx(_Linear(2))
    pepg.prepare(ctx2)
    pepg.start_rollout(ctx2, batch, (1,))
    pepg.backward(ctx2, _Micro(batch, torch.arange(4), 4.0))
    assert ctx2.counter.minimum == {"update": 4 * 2}


def test_decay_zero_keeps_the_old_forward_skipped_across_rollouts():
    batch = _batch()
    model = _Linear(3)
    elbo = ElboPolicyGradient(_Loss(EPGObjective()), timesteps=2, decay_type=0)
    ctx = _Ctx(model)
    elbo.prepare(ctx)
    for step in range(3):
        elbo.start_rollout(ctx, batch, (1,))
        model.calls = 0
        elbo.backward(ctx, _Micro(batch, torch.arange(4), 4.0))
        assert model.calls == 1
        ctx.steps = step + 1
        with torch.no_grad():
            for p in ctx.params:
                p.add_(0.01)
        assert elbo.end_rollout(ctx, batch) == {"elbo/decay": 0.0}
        for o, p in zip(elbo.old.values, ctx.params):
            assert torch.equal(o, p)
    # within a rollout, after an optimizer step, the old weights (the rollout's) score the ratio
    elbo.start_rollout(ctx, batch, (1,))
    ctx.steps += 1
    model.calls = 0
    elbo.backward(ctx, _Micro(batch, torch.arange(4), 4.0))
    assert model.calls == 2


def test_state_round_trip():
    model = _Linear(4)
    elbo = ElboPolicyGradient(_Loss(EPGObjective()), timesteps=2, decay_type=1)
    ctx = _Ctx(model)
    elbo.prepare(ctx)
    ctx.steps = 50
    with torch.no_grad():
        for p in ctx.params:
            p.add_(1.0)
    elbo.end_rollout(ctx, None)
    state, tensors = elbo.state_dict(), {k: v.clone() for k, v in elbo.tensors().items()}
    other = ElboPolicyGradient(_Loss(EPGObjective()), timesteps=2, decay_type=1)
    other.prepare(_Ctx(_Linear(4)))
    other.load_state(state, tensors)
    assert other.trailing.steps == 50 and other.trailing.same_as_current is False
    for a, b in zip(other.old.values, elbo.old.values):
        assert torch.equal(a, b)
    assert math.isclose(old_policy_decay(50, 0, 0.001, 0.5), 0.05)


def test_reference_kl_adds_the_velocity_kl_per_point():
    batch = _batch()
    model = _Linear(5)
    reference = _Linear(6)
    K = 2
    elbo = ElboPolicyGradient(_Loss(EPGObjective(), zero=True), timesteps=K, decay_type=0, beta_kl=0.5)
    ctx = _Ctx(model)
    ctx.kl = type("KL", (), {"reference": reference})()
    elbo.prepare(ctx)
    assert elbo.needs_reference()
    elbo.start_rollout(ctx, batch, (1,))
    res = elbo.backward(ctx, _Micro(batch, torch.arange(4), 4.0))
    assert ctx.counter.minimum == {"update": 4 * K, "reference": 4 * K}  # the KL keeps every sample
    got = [p.grad.clone() for p in ctx.params]
    for p in ctx.params:
        p.grad = None
    pts = forward_process_points(11, "elbo", batch, torch.arange(4), batch.trajectory.sigmas, K)
    v = model.velocity(pts.x, pts.sigma, None)
    lp = elbo_log_likelihood(v, pts.x, pts.x0, pts.eps, pts.sigma).reshape(4, K)
    v_ref = reference.velocity(pts.x, pts.sigma, None).detach()
    kl = ((v - v_ref) ** 2).flatten(1).mean(1).reshape(4, K)
    a = batch.advantages.reshape(-1, 1)
    ((-a * lp).mean(1) + 0.5 * kl.mean(1)).sum().div(4.0).backward()
    for g, p in zip(got, ctx.params):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)
    assert "elbo/kl_ref" in res.metrics


def _dppo_on_elbo(threshold, units="point", K=3):
    from flowrl.objectives.dppo import KLMaskedSurrogate

    return ElboPolicyGradient(_Loss(KLMaskedSurrogate(threshold), zero=True), timesteps=K, units=units, decay_type=0)


def test_flow_dppo_on_the_elbo_drops_by_hand_the_units_past_the_trust_region():
    """Flow-DPPO's trust region at the ELBO's points: on-policy nothing is dropped (the divergence
    is 0) and the gradient is -A rho's; after an optimizer step in the rollout each point's
    divergence is mean((v - v_old)^2), and a point at or past the threshold whose ratio moves on
    its advantage's side contributes nothing, value and gradient (mask and gradient by hand)."""
    batch = _batch()
    model = _Linear(7)
    K, rows = 3, torch.arange(4)
    a = batch.advantages.reshape(-1, 1).expand(4, K)
    elbo = _dppo_on_elbo(0.0)
    assert elbo.trust_region
    ctx = _Ctx(model)
    elbo.prepare(ctx)
    elbo.start_rollout(ctx, batch, (1,))
    res = elbo.backward(ctx, _Micro(batch, rows, 4.0))
    assert res.metrics["clip_fraction"] == 0.0 and res.metrics["dppo/kl_max"] == 0.0
    got = [p.grad.clone() for p in ctx.params]
    for p in ctx.params:
        p.grad = None
    (_elbo_by_hand(model, batch, rows, K) * -a / K).sum().div(4.0).backward()
    for g, p in zip(got, ctx.params):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)

    # an optimizer step inside the rollout: the old (rollout) weights now differ from the trained ones
    for p in ctx.params:
        p.grad = None
    with torch.no_grad():
        for i, p in enumerate(ctx.params):
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    ctx.steps = 1
    pts = forward_process_points(11, "elbo", batch, rows, batch.trajectory.sigmas, K)
    with elbo.old.swapped_in(), torch.no_grad():
        v_old = model.velocity(pts.x, pts.sigma, None)
        old = _elbo_by_hand(model, batch, rows, K)
    v_new = model.velocity(pts.x, pts.sigma, None).detach()
    divergence = ((v_new - v_old) ** 2).reshape(4 * K, -1).mean(dim=1).reshape(4, K).double()
    lp = _elbo_by_hand(model, batch, rows, K)
    z = (lp - old).detach()
    threshold = float(divergence.median())  # some points inside the region, some outside
    drop = (divergence >= threshold) & (((z > 0) & (a > 0)) | ((z < 0) & (a < 0)))
    assert 0 < int(drop.sum()) < drop.numel()
    elbo.unit_objective.threshold = threshold
    res = elbo.backward(ctx, _Micro(batch, rows, 4.0))
    assert math.isclose(res.metrics["clip_fraction"], float(drop.double().mean()), rel_tol=1e-6)
    assert math.isclose(res.metrics["dppo/kl_max"], float(divergence.max()), rel_tol=1e-4)
    assert math.isclose(res.metrics["dppo/kl_mean"], float(divergence.mean()), rel_tol=1e-4)
    got = [p.grad.clone() for p in ctx.params]
    for p in ctx.params:
        p.grad = None
    kept = (~drop).to(torch.float32)
    (lp * -a * torch.exp(z) * kept / K).sum().div(4.0).backward()
    for g, p in zip(got, ctx.params):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)
    assert elbo.unit_objective.kl_of is None  # nothing of this micro-batch is left behind


def test_flow_dppo_on_sample_units_measures_a_samples_mean_divergence():
    batch = _batch()
    model = _Linear(8)
    elbo = _dppo_on_elbo(1e9, units="sample", K=2)  # a threshold nothing reaches: nothing dropped
    ctx = _Ctx(model)
    elbo.prepare(ctx)
    elbo.start_rollout(ctx, batch, (1,))
    with torch.no_grad():
        for p in ctx.params:
            p.add_(0.05)
    ctx.steps = 1
    res = elbo.backward(ctx, _Micro(batch, torch.arange(4), 4.0))
    assert res.metrics["clip_fraction"] == 0.0 and res.metrics["dppo/kl_max"] > 0


def test_the_elbo_serves_flow_dppo_and_still_refuses_grpo_guard():
    from flowrl_plugins.likelihoods import ElboConfig, ElboLikelihood
    from flowrl_plugins.losses import DppoConfig, GuardConfig, GuardSurrogate, build_dppo

    served = ElboLikelihood(ElboConfig(timesteps=2)).objective(build_dppo(DppoConfig(kl_threshold=1e-3)))
    assert isinstance(served, ElboPolicyGradient) and served.trust_region
    assert served.unit_objective.threshold == 1e-3 and served.skips_zero_advantage
    with pytest.raises(ValueError, match="per-step Gaussian means"):
        ElboLikelihood(ElboConfig(timesteps=2)).objective(GuardSurrogate(GuardConfig()))
    with pytest.raises(ValueError, match="trajectory KL"):
        ElboLikelihood(ElboConfig(timesteps=2)).objective(build_dppo(DppoConfig(beta=0.1)))
