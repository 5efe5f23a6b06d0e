"""Flow-DPPO's maths (flowrl/objectives/dppo.py) against values derived by hand and a float64
second route, and its unit objective inside the chunk update (the lean update's gradient equals
the full graph's at chunk level)."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.chunking import step_chunks
from flowrl.objectives.chunk_gradient import full_graph_backward, lean_chunk_backward
from flowrl.objectives.dppo import KLMaskedSurrogate, dppo_drop_mask, dppo_unit_loss, unit_kl
from flowrl.objectives.losses import kl_gaussian_exact
from flowrl.sampling.kernels import gaussian_log_prob
from flowrl.sampling.rollout import make_kernels, make_step_log_prob_fn, rollout
from flowrl.sampling.schedules import shifted_sigmas
from flowrl.sampling.kernels import FlowKernel
from flowrl.selection import select_uniform
from test_chunk_gradient import SHAPE, B, TinyVelocity  # the tiny velocity field of the chunk-update tests


def test_step_kl_is_the_exact_gaussian_kl():
    # D = 2, s = 0.5: d = (0.1, -0.3) -> mean(d^2) / (2 s^2) = (0.01 + 0.09) / 2 / 0.5 = 0.1
    mu, old = torch.tensor([[1.1, 0.7]]), torch.tensor([[1.0, 1.0]])
    assert kl_gaussian_exact(mu, old, 0.5).item() == pytest.approx(0.1, rel=1e-6)
    # second route, float64: KL = E_{x ~ N(old, s^2)} [log N(x | old, s^2) - log N(x | mu, s^2)] per
    # element by quadrature over x = old + s e (e on a fine grid), averaged over the 2 elements
    e = torch.linspace(-8, 8, 20001, dtype=torch.float64)
    w = torch.exp(-e**2 / 2) / math.sqrt(2 * math.pi) * (e[1] - e[0])
    s = 0.5
    total = 0.0
    for m, o in zip(mu[0].double(), old[0].double()):
        x = o + s * e
        total += float((w * (-(x - o) ** 2 / (2 * s * s) + (x - m) ** 2 / (2 * s * s))).sum())
    assert total / 2 == pytest.approx(0.1, rel=1e-6)


def test_unit_kl_by_hand():
    kl = torch.tensor([[1.0, 3.0, 5.0, 7.0]])
    assert unit_kl(kl, (1, 3)).tolist() == [[1.0, 5.0]]
    assert unit_kl(kl, step_chunks(4)).tolist() == [[1.0, 3.0, 5.0, 7.0]]
    assert unit_kl(kl, (4,)).tolist() == [[4.0]]
    with pytest.raises(ValueError):
        unit_kl(kl[0], (4,))


def test_drop_mask_and_loss_by_hand():
    # units: (z, A, kl) with delta = 1e-3
    z = torch.tensor([[0.1, 0.1, -0.1, -0.1, 0.1, -0.1, 0.1, 0.0]], requires_grad=True)
    A = torch.tensor([[1.0, -1.0, -1.0, 1.0, 1.0, -1.0, 0.0, 1.0]])
    kl = torch.tensor([[2e-3, 2e-3, 2e-3, 2e-3, 5e-4, 5e-4, 2e-3, 1e-3]])
    drop = dppo_drop_mask(z, A, kl, 1e-3)
    # dropped: outside (kl >= delta) and moving further with the advantage (rho > 1, A > 0) or
    # (rho < 1, A < 0); inside the region, corrective moves and A = 0 or rho = 1 are kept
    assert drop.tolist() == [[True, False, True, False, False, False, False, False]]
    loss = dppo_unit_loss(z, A, kl, 1e-3)
    rho = math.exp(0.1)
    want = [0.0, rho, 0.0, -1 / rho, -rho, 1 / rho, 0.0, -1.0]
    assert loss[0].tolist() == pytest.approx(want, rel=1e-6)
    (grad,) = torch.autograd.grad(loss.sum(), z)
    # d(-A rho)/dz = -A rho where kept, 0 where dropped (float64 second route)
    zz = z.detach().double()
    want_grad = torch.where(drop, torch.zeros_like(zz), -A.double() * torch.exp(zz))
    assert torch.allclose(grad.double(), want_grad, rtol=1e-6)


def test_drop_mask_rejects_bad_input():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="threshold"):
        dppo_drop_mask(z, torch.zeros(2), z, -1.0)
    with pytest.raises(ValueError, match="threshold"):
        KLMaskedSurrogate(float("nan"))
    with pytest.raises(ValueError, match="shape"):
        dppo_drop_mask(z, torch.zeros(2), torch.zeros(2, 2), 1e-3)


def test_surrogate_without_update_is_on_policy():
    obj = KLMaskedSurrogate(0.0)  # delta 0: every unit is outside once it has a KL
    z, A = torch.tensor([[0.2, -0.2]]), torch.tensor([1.0])
    # no KL source: on-policy (KL 0 >= 0 is "outside", so a unit moving with A is dropped)
    assert obj.clip_mask(z, A).tolist() == [[True, False]]
    obj.kl_of = lambda: torch.tensor([[0.0, 0.0]])
    assert obj(z, A)[0].tolist() == pytest.approx([0.0, -math.exp(-0.2)])


@pytest.mark.parametrize("sizes", [(2, 3, 3), step_chunks(8)])
def test_lean_update_equals_full_graph_with_the_kl_mask(sizes):
    """The KL-masked unit objective is elementwise in the units, so the memory-lean chunk update
    gives the full graph's gradient, at step and chunk level, with some units dropped."""
    model = TinyVelocity()
    noise = torch.randn(B, *SHAPE, generator=torch.Generator().manual_seed(1))
    gens = [torch.Generator().manual_seed(10 + b) for b in range(B)]
    tr = rollout(model.fn_for(torch.arange(B)), noise, shifted_sigmas(9, 3.0), make_kernels(9, FlowKernel(0.7)),
                 generators=gens)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    fn = make_step_log_prob_fn(model.fn_for, tr)
    old = tr.trainable_log_probs
    K = len(sizes)
    mask = select_uniform(B, K, 0.67, torch.Generator().manual_seed(3))
    A = torch.tensor([1.0, -1.0, 0.5, -2.0, 1.5, -0.3])
    kl = torch.rand(B, K, generator=torch.Generator().manual_seed(5))
    obj = KLMaskedSurrogate(0.5)
    obj.kl_of = lambda: kl
    loss_full, met_full = full_graph_backward(fn, old, A, sizes, mask, obj, normaliser=12)
    g_full = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    loss_lean, met_lean = lean_chunk_backward(fn, old, A, sizes, mask, obj, normaliser=12)
    g_lean = [p.grad.clone() for p in model.parameters()]
    assert torch.allclose(loss_lean, loss_full, rtol=1e-5, atol=1e-9)
    for a, b in zip(g_lean, g_full):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)
    assert met_lean["clip_fraction"] == met_full["clip_fraction"] and 0 < met_lean["clip_fraction"] < 1


def test_dppo_config_checks():
    from flowrl.config import from_dict
    from flowrl.errors import RecipeError
    from plugins.losses import DppoConfig, build_dppo

    assert DppoConfig().kl_threshold == 1e-5
    for key, bad in (("kl_threshold", -1e-6), ("beta", -0.1)):
        with pytest.raises(RecipeError, match=key):
            from_dict(DppoConfig, {key: bad}, where="[loss]")
    objective = build_dppo(DppoConfig(kl_threshold=2e-5))
    assert objective.keep_means and objective.objective.threshold == 2e-5 and objective.beta == 0.0
