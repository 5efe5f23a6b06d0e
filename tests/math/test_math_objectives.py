"""The newer objectives' maths against a second route: hand arithmetic, float64 closed forms,
exact ODE solutions and the anchors' own schedules written out (never flowrl's own output).

GRPO-Guard (flowrl.objectives.guard), MixGRPO's windows and MixGRPO-Flash's solver and schedule
(flowrl.sampling.windows, flowrl.sampling.solvers), DiffusionNFT (flowrl.objectives.nft), GARDO and the diversity bonus
(flowrl.objectives.gardo)."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.objectives.gardo import (
    RiskCompensator,
    descending_ranks,
    diversity_multipliers,
    gated_weights,
    nearest_cosine_distance,
    reset_due,
    uncertainty,
    uncertainty_gate,
)
from flowrl.objectives.guard import gaussian_log_ratio, guard_bias, guard_log_ratio, inverse_step_weight, reweighted
from flowrl.objectives.nft import DECAY_PRESETS, nft_loss, old_policy_decay, optimality_probability, velocity_kl
from flowrl.sampling.schedules import shifted_sigmas
from flowrl.sampling.kernels import gaussian_log_prob
from flowrl.sampling.solvers import dpm_first_order_step, dpmpp_2m_step, flash_schedule
from flowrl.sampling.windows import mixgrpo_sde_window, random_sde_window_start, sliding_sde_window_start

# ------------------------------------------------------------------------------------ GRPO-Guard


def _guard_example():
    s, eps, d = 0.5, torch.tensor([[1.0, -1.0]]), torch.tensor([[0.1, 0.3]])
    old = torch.tensor([[0.2, -0.4]])
    return s, old + s * eps, old, old + d


def test_guard_hand_example():
    """s = 0.5, eps = [1, -1], d = [0.1, 0.3]: r = mean(eps d)/s - mean(d^2)/(2 s^2) = -0.2 - 0.1 = -0.3,
    zh = mean(eps d) = -0.1 (by hand)."""
    s, x, old, mu = _guard_example()
    assert float(gaussian_log_ratio(x, mu, old, s)) == pytest.approx(-0.3, abs=1e-6)
    assert float(guard_log_ratio(x, mu, old, s)) == pytest.approx(-0.1, abs=1e-6)
    assert float(guard_bias(mu, old, s)) == pytest.approx(0.1, abs=1e-6)
    # the raw log-ratio is the difference of the two Gaussian log-probs (flowrl.sampling.kernels), route 2
    r = gaussian_log_prob(x, mu, torch.tensor([s])) - gaussian_log_prob(x, old, torch.tensor([s]))
    assert float(r) == pytest.approx(-0.3, abs=1e-6)


def test_guard_step_loss_and_gradient_by_hand():
    """h = 0.25, A = 1, clip 0.2: rh = exp(-0.1) = 0.904837418, L = -rh / h = -3.619349672,
    dL/dd = (1/h)(-A) rh eps / D = [-1.809674836, +1.809674836] (hand derivation)."""
    s, x, old, _ = _guard_example()
    d = torch.tensor([[0.1, 0.3]], dtype=torch.float32, requires_grad=True)
    zh = reweighted(guard_log_ratio(x, old + d, old, s), 1.0 / 0.25)
    rho = torch.exp(zh)
    loss = torch.maximum(-1.0 * rho, -1.0 * rho.clamp(0.8, 1.2)).sum()
    assert float(rho.detach()) == pytest.approx(0.904837418, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(d.grad, torch.tensor([[-1.809674836, 1.809674836]]), rtol=0, atol=1e-5)
    # the weight changes the gradient, not the value: the loss value is -rh, as unweighted
    assert float(loss.detach()) == pytest.approx(-0.904837418, abs=1e-6)


def test_guard_identity_on_random_inputs():
    """s (r + mean(d^2) / (2 s^2)) == mean(eps d) for random d, eps, s (float64 route)."""
    g = torch.Generator().manual_seed(0)
    old = torch.randn(5, 4, 3, generator=g)
    eps = torch.randn(5, 4, 3, generator=g)
    d = 0.05 * torch.randn(5, 4, 3, generator=g)
    s = torch.rand(5, generator=g) * 0.5 + 0.05
    x = old + s[:, None, None] * eps
    r64 = ((eps * d).double().mean(dim=(1, 2)) / s.double() - (d.double() ** 2).mean(dim=(1, 2)) / (2 * s.double() ** 2))
    zh64 = s.double() * (r64 + (d.double() ** 2).mean(dim=(1, 2)) / (2 * s.double() ** 2))
    torch.testing.assert_close(guard_log_ratio(x, old + d, old, s).double(), zh64, rtol=0, atol=2e-6)
    torch.testing.assert_close(gaussian_log_ratio(x, old + d, old, s).double(), r64, rtol=0, atol=5e-5)


def test_guard_on_policy_is_exactly_zero():
    s, x, old, _ = _guard_example()
    assert float(guard_log_ratio(x, old.clone(), old, s)) == 0.0


def test_guard_statistics_match_the_derivation():
    """E[r] = -mean(d^2)/(2 s^2), E[zh] = 0, Var[zh] = mean(d^2)/D over the rollout noise
    (seeded Monte Carlo in float64 against the closed forms)."""
    g = torch.Generator().manual_seed(1)
    D, s, n = 64, 0.3, 40_000
    d = 0.05 * torch.randn(1, D, generator=g)
    old = torch.zeros(n, D)
    eps = torch.randn(n, D, generator=g)
    x = old + s * eps
    mu = old + d
    r = gaussian_log_ratio(x, mu, old, s).double()
    zh = guard_log_ratio(x, mu, old, s).double()
    md2 = float((d.double() ** 2).mean())
    se_r = float(r.std()) / math.sqrt(n)
    assert abs(float(r.mean()) + md2 / (2 * s * s)) < 3 * se_r
    assert abs(float(zh.mean())) < 3 * float(zh.std()) / math.sqrt(n)
    assert float(zh.var()) == pytest.approx(md2 / D, rel=0.03)


def test_inverse_step_weight():
    torch.testing.assert_close(inverse_step_weight(torch.tensor([0.8, 0.5]), torch.tensor([0.6, 0.25])),
                               torch.tensor([5.0, 4.0]))
    with pytest.raises(ValueError):
        inverse_step_weight(0.5, 0.5)


# ------------------------------------------------------------------------------------ MixGRPO windows


def _mixgrpo_state_machine(k: int, size: int, every: int, stride: int, max_stop: int) -> tuple[int, int]:
    """MixGRPO's progressive schedule stepped one iteration at a time (roll back on)."""
    cur, it = 0, 0
    for _ in range(k):
        it += 1
        if it >= every:
            it, cur = 0, cur + stride
            if cur > max_stop:
                cur, it = 0, 0
    return cur, min(cur + size, max_stop)


@pytest.mark.parametrize("k, window", [(0, (0, 4)), (24, (0, 4)), (25, (1, 5)), (49, (1, 5)), (50, (2, 6)),
                                       (299, (11, 15)), (574, (22, 23)), (575, (23, 23)), (599, (23, 23)),
                                       (600, (0, 4))])
def test_mixgrpo_sde_window_table(k, window):
    """MixGRPO's script values (w 4, tau 25, stride 1, M = N - 2 = 23): the table of notes 3.2,
    also from the state machine."""
    assert mixgrpo_sde_window(k, size=4, every=25, stride=1, max_stop=23) == window
    assert _mixgrpo_state_machine(k, 4, 25, 1, 23) == window


def test_full_windows_and_frozen_windows():
    # flowrl keeps whole windows: start <= max_start; with M = 16, w = 4 -> max_start 12
    starts = [sliding_sde_window_start(k, every=2, stride=1, max_start=12) for k in range(30)]
    assert starts[:6] == [0, 0, 1, 1, 2, 2] and max(starts) == 12 and starts[26] == 0
    assert {sliding_sde_window_start(k, every=20, stride=0, max_start=19) for k in range(100)} == {0}  # Flash*
    # stride 2: starts 0, 2, 4 then roll back
    assert [sliding_sde_window_start(k, every=1, stride=2, max_start=5) for k in range(5)] == [0, 2, 4, 0, 2]


def test_random_sde_window_start_is_uniform_on_its_range():
    """(lo, hi) = (0, 5), size 3: start in {0, 1, 2}, each with probability 1/3 (chi-square, 3e4 draws)."""
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    for _ in range(30_000):
        counts[random_sde_window_start(g, 0, 5, 3)] += 1
    expected = 10_000
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 13.8  # 0.999 quantile of chi-square with 2 degrees of freedom
    with pytest.raises(ValueError):
        random_sde_window_start(g, 3, 5, 3)


# ------------------------------------------------------------------------------------ MixGRPO-Flash


def _shift3(t):
    return 3 * t / (1 + 2 * t)


def test_flash_schedules_from_the_definition():
    """MixGRPO-Flash's compressed schedules (N = 25, shift 3), recomputed in float64 from the
    definition: window [0, 4) with ratio 0.4 and 0.2, window [6, 10) with 0.4 (notes 3.4)."""
    sig = shifted_sigmas(25, 3.0)
    a = flash_schedule(sig, 3, 0.4, _shift3)
    want = [1.0, .986301, .971831, .956522, .940298, .885246, .818182, .734694, .627907, .486486, .290323, 0.0]
    torch.testing.assert_close(a, torch.tensor(want), rtol=0, atol=2e-6)
    b = flash_schedule(sig, 3, 0.2, _shift3)
    torch.testing.assert_close(b, torch.tensor([1.0, .986301, .971831, .956522, .940298, .792453, .538462, 0.0]),
                               rtol=0, atol=2e-6)
    c = flash_schedule(sig, 9, 0.4, _shift3)
    assert c.numel() - 1 == 15
    torch.testing.assert_close(c[-6:], torch.tensor([.818182, .734694, .627907, .486486, .290323, 0.0]), rtol=0, atol=2e-6)
    torch.testing.assert_close(c[:11], sig[:11])
    # ratio 1 is no compression: the original schedule
    torch.testing.assert_close(flash_schedule(sig, 3, 1.0, _shift3), sig, rtol=0, atol=1e-6)


def test_flash_schedule_refuses_hazards():
    sig = shifted_sigmas(25, 3.0)
    with pytest.raises(ValueError, match="compression leaves"):
        flash_schedule(sig, 20, 0.2, _shift3)  # int(5 * 0.2) = 1 point: never reaches sigma 0
    with pytest.raises(ValueError, match="time warp"):
        flash_schedule(sig, 3, 0.4, lambda t: t)  # not the run's schedule


def _gaussian_data_solve(n: int, c: float, solver: str) -> float:
    """Data N(0, c^2) in 1-D: exact x0_hat(x, sigma) = alpha c^2 x / (alpha^2 c^2 + sigma^2)."""
    sig = [float(s) for s in shifted_sigmas(n, 3.0).double()]
    x = torch.tensor([[1.0]])
    prev, prev_s = None, None
    for i in range(n):
        s, sn = sig[i], sig[i + 1]
        alpha = 1 - s
        x0 = alpha * c * c * x / (alpha * alpha * c * c + s * s)
        x_new = dpmpp_2m_step(x, x0, s, sn, prev, prev_s) if solver == "2m" else dpm_first_order_step(x, x0, s, sn)
        prev, prev_s, x = x0, s, x_new
    return float(x)


def test_dpmpp_2m_against_the_exact_ode_solution():
    """Gaussian data N(0, c^2), c = 0.5, x(1) = 1: the exact flow ODE ends at x(0) = 0.5; float64
    reference values of the notes: 2M 0.40675945748 (N = 10), 0.48493616539 (N = 20); Euler
    0.36969200818, 0.43155608493. 2M converges faster than Euler."""
    assert _gaussian_data_solve(10, 0.5, "2m") == pytest.approx(0.40675945748, abs=2e-6)
    assert _gaussian_data_solve(20, 0.5, "2m") == pytest.approx(0.48493616539, abs=2e-6)
    assert _gaussian_data_solve(10, 0.5, "euler") == pytest.approx(0.36969200818, abs=2e-6)
    assert _gaussian_data_solve(20, 0.5, "euler") == pytest.approx(0.43155608493, abs=2e-6)
    errs = [abs(_gaussian_data_solve(n, 0.5, "2m") - 0.5) for n in (10, 20, 40)]
    assert errs[0] > errs[1] > errs[2]
    # point-mass data (c = 0) is exact for both
    assert _gaussian_data_solve(10, 0.0, "2m") == pytest.approx(0.0, abs=1e-7)


def test_first_order_step_is_euler():
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        x, v = torch.randn(2, 6, generator=g), torch.randn(2, 6, generator=g)
        s = float(torch.rand(1, generator=g)) * 0.9 + 0.05
        sn = s * float(torch.rand(1, generator=g))
        euler = x + (sn - s) * v
        torch.testing.assert_close(dpm_first_order_step(x, x - s * v, s, sn), euler, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------ DiffusionNFT


def _nft_example(v, beta):
    x0 = torch.tensor([[1.0, -1.0]])
    eps = torch.tensor([[0.5, 0.5]])
    x = 0.5 * x0 + 0.5 * eps
    v = torch.tensor([v], requires_grad=True)
    v_old = torch.tensor([[-0.3, 1.2]])
    return v, v_old, x, x0


def test_nft_hand_example():
    """sigma 0.5, x0 = [1, -1], eps = [0.5, 0.5], v = [-0.4, 1.0], v_old = [-0.3, 1.2], C = 5,
    A = 2.5 (r = 0.75), beta = 1: L+ = 0.2166667, L- = 0.125, loss 0.96875, dloss/dv =
    [-0.3125, -2.8125] (hand arithmetic); beta = 0.1: L+ = 0.1357843, loss 6.6544118,
    grad [0.8613445, -1.6386555]."""
    r = optimality_probability(torch.tensor([2.5]))
    assert float(r) == 0.75
    v, v_old, x, x0 = _nft_example([-0.4, 1.0], 1.0)
    loss, parts = nft_loss(v, v_old, x, x0, 0.5, r, beta=1.0)
    assert float(parts["positive"]) == pytest.approx(0.2166667, abs=1e-6)
    assert float(parts["negative"]) == pytest.approx(0.125, abs=1e-6)
    assert float(loss) == pytest.approx(0.96875, abs=1e-6)
    loss.sum().backward()
    torch.testing.assert_close(v.grad, torch.tensor([[-0.3125, -2.8125]]), rtol=0, atol=1e-5)
    v, v_old, x, x0 = _nft_example([-0.4, 1.0], 0.1)
    loss, parts = nft_loss(v, v_old, x, x0, 0.5, r, beta=0.1)
    assert float(parts["positive"]) == pytest.approx(0.1357843, abs=1e-6)
    assert float(loss) == pytest.approx(6.6544118, abs=1e-5)
    loss.sum().backward()
    torch.testing.assert_close(v.grad, torch.tensor([[0.8613445, -1.6386555]]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("beta", [1.0, 0.1, 0.01])
def test_nft_gradient_at_the_old_policy_does_not_depend_on_beta(beta):
    """At v = v_old: value (C / beta) L(v_old) (0.65, 6.5, 65) and gradient
    C (2r - 1) 2 sigma^2 (v_old - v*) / (D w) = [1.0, -1.5] for A = 2.5, its negative for -2.5."""
    for adv, grad in ((2.5, [1.0, -1.5]), (-2.5, [-1.0, 1.5]), (0.0, [0.0, 0.0])):
        v, v_old, x, x0 = _nft_example([-0.3, 1.2], beta)
        loss, _ = nft_loss(v, v_old, x, x0, 0.5, optimality_probability(torch.tensor([adv])), beta=beta)
        assert float(loss) == pytest.approx(0.65 / beta, rel=1e-5)
        loss.sum().backward()
        torch.testing.assert_close(v.grad, torch.tensor([grad]), rtol=0, atol=1e-5)


def test_nft_optimality_probability_and_decay():
    r = optimality_probability(torch.tensor([-7.0, -5.0, 0.0, 2.5, 5.0, 9.0]))
    assert r.tolist() == [0.0, 0.0, 0.5, 0.75, 1.0, 1.0]
    t1, t2 = DECAY_PRESETS[1], DECAY_PRESETS[2]
    assert [old_policy_decay(s, *t1) for s in (0, 100, 600, 10_000)] == pytest.approx([0.0, 0.1, 0.5, 0.5])
    assert [old_policy_decay(s, *t2) for s in (74, 75, 175, 300)] == pytest.approx([0.0, 0.0, 0.75, 0.999])
    assert old_policy_decay(50, *DECAY_PRESETS[0]) == 0.0  # type 0: copy
    d = old_policy_decay(100, *t1)
    assert 1.0 * d + 3.0 * (1 - d) == pytest.approx(2.8)


def test_velocity_kl():
    assert velocity_kl(torch.tensor([[1.0, 3.0]]), torch.tensor([[0.0, 1.0]])).tolist() == [2.5]


# ------------------------------------------------------------------------------------ GARDO


def test_uncertainty_gate_example():
    """main [0.9, 0.5, 0.7, 0.2, 0.4], aux = [0.1, 0.8, 0.6, 0.3, 0.9] (twice): ranks main
    [1, 3, 2, 5, 4], aux [5, 2, 3, 4, 1]; u = [-4, 1, -1, 1, 3]; P = [1, 1, 3]; numpy-linear
    percentile 90 of P = 1 + 0.8 (3 - 1) = 2.6 (position 0.9 x 2 = 1.8); gate = only sample 5."""
    main = torch.tensor([0.9, 0.5, 0.7, 0.2, 0.4])
    aux = torch.tensor([0.1, 0.8, 0.6, 0.3, 0.9])
    assert descending_ranks(main).tolist() == [1, 3, 2, 5, 4]
    u = uncertainty(main, [aux, aux])
    assert u.tolist() == [-4.0, 1.0, -1.0, 1.0, 3.0]
    gate, positive = uncertainty_gate(u, 0.1)
    assert sorted(positive.tolist()) == [1.0, 1.0, 3.0]
    assert float(torch.quantile(positive, 0.9)) == pytest.approx(2.6)
    assert gate.tolist() == [False, False, False, False, True]
    assert uncertainty(main, [aux], sign="proxy_high").tolist() == [4.0, -1.0, 1.0, -1.0, -3.0]


def test_risk_compensator_sequence():
    """means [1.0, 2.0, 1.5, 0.5]: q = 0.1 (no history), 0.11 (new max), 0.11 (inside), 0.099 (new min);
    clipped to 0.2 after enough increases and to 0.02 after enough decreases (hand arithmetic)."""
    rc = RiskCompensator()
    assert [rc.update(m) for m in (1.0, 2.0, 1.5, 0.5)] == pytest.approx([0.1, 0.11, 0.11, 0.099])
    up = RiskCompensator()
    qs = [up.update(float(m)) for m in range(1, 30)]
    assert qs[-1] == 0.2 and max(qs) == 0.2
    down = RiskCompensator()
    qs = [down.update(-float(m)) for m in range(40)]
    assert qs[-1] == 0.02
    again = RiskCompensator()
    again.load_state_dict(rc.state_dict())
    assert again.update(3.0) == rc.update(3.0)


@pytest.mark.parametrize("e, last, flag, due", [(16, 0, False, True), (15, 0, False, False), (3, 0, True, True),
                                               (0, 0, True, False)])
def test_reset_rule_truth_table(e, last, flag, due):
    assert reset_due(e, last, flag, 15) is due


def test_gated_kl_normalisation():
    """KL per sample [1, 2, 3, 4], gate [F, T, F, T]: the gated term is the mean over the gated
    samples, 3.0 (not 1.5)."""
    w = gated_weights(torch.tensor([False, True, False, True]))
    assert float((w * torch.tensor([1.0, 2.0, 3.0, 4.0])).mean()) == 3.0
    assert gated_weights(torch.zeros(3, dtype=torch.bool)).tolist() == [0.0, 0.0, 0.0]


def test_diversity_example():
    """r = [1, 2, 3, 4], features (1,0), (1,0), (0,1), (-1,0): d = [0, 0, 1, 1], mean 0.5,
    A = r - mean = [-1.5, -0.5, 0.5, 1.5] -> [-1.5, -0.5, 1.0, 3.0] (GARDO's example, by hand)."""
    f = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    g = torch.zeros(4, dtype=torch.long)
    assert nearest_cosine_distance(f, g).tolist() == [0.0, 0.0, 1.0, 1.0]
    a = torch.tensor([-1.5, -0.5, 0.5, 1.5])
    assert (a.double() * diversity_multipliers(f, g, a)).tolist() == [-1.5, -0.5, 1.0, 3.0]


def test_diversity_edge_cases_and_invariances():
    f = torch.tensor([[1.0, 2.0], [1.0, 2.0], [2.0, 4.0]])
    g = torch.tensor([0, 0, 0])
    assert diversity_multipliers(f, g, torch.tensor([1.0, 0.0, -1.0])).tolist() == [1.0, 1.0, 1.0]  # identical: mean d 0
    alone = diversity_multipliers(torch.eye(3), torch.tensor([0, 1, 1]), torch.tensor([0.0, 1.0, -1.0]))
    assert alone.tolist() == [1.0, 1.0, 1.0]
    h = torch.Generator().manual_seed(0)
    feats = torch.randn(6, 5, generator=h)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    d = nearest_cosine_distance(feats, groups)
    torch.testing.assert_close(nearest_cosine_distance(3.5 * feats, groups), d)  # scale invariant
    perm = torch.tensor([2, 0, 1, 5, 3, 4])
    torch.testing.assert_close(nearest_cosine_distance(feats[perm], groups), d[perm])  # permutation
