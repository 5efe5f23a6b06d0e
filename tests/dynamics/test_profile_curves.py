"""Curves of `flowrl profile` (flowrl/dynamics/, docs/api.md §6) against independent
computations: numpy loops, a straight-line trajectory with a closed form, and hand statistics."""

import numpy as np
import pytest
import torch

from flowrl.dynamics.measure import (
    CURVES,
    curve_stats,
    measure_dynamics,
    profile_model,
    relative_change,
    reprofile,
    transition_curves,
)
from flowrl.dynamics.segment import segment
from flowrl.sampling.schedules import shifted_sigmas
from flowrl.sampling.kernels import FlowKernel, ODEKernel


def np_rel(a, b):
    return np.abs(b - a).sum() / np.abs(a).sum()


def test_relative_change_matches_numpy():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(3, 5, 4, 2, generator=g)
    out = relative_change(s)
    assert out.shape == (3, 4) and out.dtype == torch.float32
    a = s.numpy().astype(np.float64)
    for b in range(3):
        for i in range(4):
            assert out[b, i].item() == pytest.approx(np_rel(a[b, i], a[b, i + 1]), rel=1e-5)
    with pytest.raises(ValueError, match="all-zero"):
        relative_change(torch.zeros(1, 2, 3))


def test_transition_curves_match_numpy():
    g = torch.Generator().manual_seed(1)
    n = 5
    sig = shifted_sigmas(n, 3.0)
    x = torch.randn(2, n + 1, 6, generator=g)
    v = torch.randn(2, n + 1, 6, generator=g)
    out = transition_curves(x, v, sig)
    assert set(out) == set(CURVES)
    xs, vs, ss = x.double().numpy(), v.double().numpy(), sig.double().numpy()
    for b in range(2):
        for i in range(n):
            x0_i = xs[b, i] - ss[i] * vs[b, i]
            x0_n = xs[b, i + 1] - ss[i + 1] * vs[b, i + 1]
            l1 = np_rel(xs[b, i], xs[b, i + 1])
            assert out["l1rel"][b, i].item() == pytest.approx(l1, rel=1e-5)
            assert out["l1rel_norm"][b, i].item() == pytest.approx(l1 / (ss[i] - ss[i + 1]), rel=1e-5)
            assert out["x0_change"][b, i].item() == pytest.approx(np_rel(x0_i, x0_n), rel=1e-5)
            assert out["v_change"][b, i].item() == pytest.approx(np_rel(vs[b, i], vs[b, i + 1]), rel=1e-5)


def test_straight_line_closed_form():
    # x_sigma = (1 - sigma) x0 + sigma eps with x0 = 1, eps = 3 and the exact velocity v = eps - x0:
    # l1rel_i = 2 (sigma_i - sigma_{i+1}) / (1 + 2 sigma_i), x0_hat is constant, v is constant.
    n = 8
    sig = shifted_sigmas(n, 3.0).double()
    x = (1 + 2 * sig).reshape(1, -1, 1).expand(1, n + 1, 5)
    v = torch.full((1, n + 1, 5), 2.0, dtype=torch.float64)
    out = transition_curves(x, v, sig)
    expected = 2 * (sig[:-1] - sig[1:]) / (1 + 2 * sig[:-1])
    torch.testing.assert_close(out["l1rel"][0], expected.float(), rtol=1e-5, atol=0)
    torch.testing.assert_close(out["l1rel_norm"][0], (2 / (1 + 2 * sig[:-1])).float(), rtol=1e-5, atol=0)
    assert out["x0_change"].abs().max().item() < 1e-6
    assert out["v_change"].abs().max().item() == 0


def test_curve_stats_by_hand():
    g = torch.Generator().manual_seed(2)
    vals = torch.rand(3, 4, 5, generator=g) + 0.5  # [seeds, prompts, transitions]
    st = curve_stats(vals)
    a = vals.double().numpy()
    per_prompt = a.mean(axis=0)
    np.testing.assert_allclose(st.mean, a.mean(axis=(0, 1)), rtol=1e-12)
    np.testing.assert_allclose(st.prompt_std, per_prompt.std(axis=0, ddof=1), rtol=1e-12)
    np.testing.assert_allclose(st.prompt_cv, per_prompt.std(axis=0, ddof=1) / a.mean(axis=(0, 1)), rtol=1e-12)
    np.testing.assert_allclose(st.seed_std, a.std(axis=0, ddof=1).mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(st.seed_cv, (a.std(axis=0, ddof=1) / per_prompt).mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(st.d1, np.diff(a.mean(axis=(0, 1))), rtol=1e-12)
    np.testing.assert_allclose(st.d2, np.diff(a.mean(axis=(0, 1)), 2), rtol=1e-9)
    one = curve_stats(vals[:1, :1])
    assert one.prompt_std is None and one.seed_std is None and one.summary() == {"prompt_cv": None, "seed_cv": None}


def test_measure_dynamics_is_the_engine_rollout(tiny_model):
    n = 6
    sig = shifted_sigmas(n, 3.0)
    kernels = (FlowKernel(a=0.7),) * n
    prompts = ["a", "bb", "ccc"]
    out = measure_dynamics(tiny_model, sig, kernels, prompts, num_seeds=2, seed=5, batch_size=64)
    assert {k: tuple(v.shape) for k, v in out.items()} == {c: (2, 3, n) for c in CURVES}
    # N steps plus one velocity at sigma = 0 per batch
    assert [s for _, s in tiny_model.calls][-1] == 0.0 and len(tiny_model.calls) == n + 1
    # independent of the batch size, and deterministic for a seed
    again = measure_dynamics(tiny_model, sig, kernels, prompts, num_seeds=2, seed=5, batch_size=1)
    for c in CURVES:
        torch.testing.assert_close(out[c], again[c], rtol=1e-5, atol=1e-7)
    other = measure_dynamics(tiny_model, sig, kernels, prompts, num_seeds=2, seed=6)
    assert not torch.allclose(out["l1rel"], other["l1rel"])


def test_prompt_spread_measures_the_prompt_alone(tiny_model):
    # every prompt of a seed gets the same starting and SDE noise: a model that ignores the
    # prompt has exactly zero spread across prompts, but a spread across seeds
    tiny_model.prompt_strength = 0.0
    n = 5
    res = profile_model(tiny_model, shifted_sigmas(n, 3.0), (FlowKernel(a=0.7),) * n, ["p", "q", "r"],
                        num_seeds=2, num_chunks=2)
    assert max(res.curves["l1rel"].prompt_std) == 0.0
    assert min(res.curves["l1rel"].seed_std) > 0.0


def test_ode_sampler_profile_has_curves_but_no_proposals(tiny_model):
    n = 4
    res = profile_model(tiny_model, shifted_sigmas(n, 3.0), (ODEKernel(),) * n, ["p"], num_seeds=1)
    assert res.positions == [] and res.proposals == {}
    assert len(res.curves["l1rel"].mean) == n


def test_reprofile_returns_the_segmentation_of_the_current_policy(tiny_model):
    n = 9
    sig, kernels = shifted_sigmas(n, 3.0), (FlowKernel(a=0.7),) * n
    sizes, result = reprofile(tiny_model, sig, kernels, ["a", "b"], curve="x0_change", method="curvature",
                              num_chunks=3, min_size=2, seed=1)
    assert sizes == segment(result.trainable_curve("x0_change"), "curvature", 3, 2).sizes
    assert sum(sizes) == 8 and result.settings["num_seeds"] == 1
    assert reprofile(tiny_model, sig, kernels, ["a", "b"], num_chunks=3, seed=1)[0] == \
        reprofile(tiny_model, sig, kernels, ["a", "b"], num_chunks=3, seed=1)[0]
