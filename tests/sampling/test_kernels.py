"""Step kernels and log-probs (docs/api.md §2, §3)."""

import math

import pytest
import torch

from flowrl.errors import RecipeError
from flowrl.plugins import get_registry
from flowrl.sampling.schedules import shifted_sigmas
from flowrl.sampling.kernels import (
    CPSKernel,
    DanceKernel,
    FlowKernel,
    ODEKernel,
    cps_step,
    dance_step,
    draw_noise,
    flow_step,
    gaussian_log_prob,
    ode_step,
)

# docs/api.md §2: N = 17, s = 3, a = 0.7 flow stds (3 decimals)
REF_STDS = [0.7, .722, .516, .425, .372, .335, .309, .288, .270, .255, .242, .229, .215, .200,
            .182, .158, .120]


def _xv(shape=(3, 4, 5, 5), seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def test_flow_stds_reference():
    sig = shifted_sigmas(17, 3.0)
    x, v = _xv((1, 2, 2))
    stds = [flow_step(v, x, sig[i].item(), sig[i + 1].item(), a=0.7).std.item() for i in range(17)]
    assert abs(stds[0] - 0.7) < 1e-6  # first step std is exactly a
    for got, ref in zip(stds, REF_STDS):
        assert abs(got - ref) < 5.1e-4, (got, ref)


def test_flow_std_first_step_by_hand():
    # sigma 1 -> 48/49: g = 0.7 sqrt(1 / (1/49)) = 4.9, std = 4.9 sqrt(1/49) = 0.7
    x, v = _xv((2, 3))
    out = flow_step(v, x, 1.0, 48 / 49, a=0.7)
    assert torch.allclose(out.std, torch.full((2,), 0.7), atol=1e-6)


def _dance_reference(x, v, sigma, sigma_next, eta):
    # DanceGRPO's score form, float64, written independently of the shared formula:
    # x0 = x - sigma v ; score = -(x - (1 - sigma) x0) / sigma^2 ;
    # mean = x + dt v - 0.5 eta^2 score dt ; std = eta sqrt(-dt)
    x, v = x.double(), v.double()
    dt = sigma_next - sigma
    x0 = x - sigma * v
    score = -(x - (1 - sigma) * x0) / sigma**2
    return x + dt * v - 0.5 * eta**2 * score * dt, eta * math.sqrt(-dt)


@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.95), (0.7, 0.6), (0.3, 0.0)])
def test_dance_matches_independent_formula_and_flow_with_g_eta(sigma, sigma_next):
    x, v = _xv()
    eta = 0.3
    out = dance_step(v, x, sigma, sigma_next, eta=eta)
    mean_ref, std_ref = _dance_reference(x, v, sigma, sigma_next, eta)
    assert torch.allclose(out.mean.double(), mean_ref, rtol=1e-6, atol=1e-6)
    assert abs(out.std[0].item() - std_ref) < 1e-6 * std_ref
    if sigma < 1:
        # flow kernel with a chosen so that g = a sqrt(sigma / (1 - sigma)) = eta
        a = eta * math.sqrt((1 - sigma) / sigma)
        fl = flow_step(v, x, sigma, sigma_next, a=a)
        assert torch.allclose(fl.mean, out.mean, rtol=1e-6, atol=1e-6)
        assert torch.allclose(fl.std, out.std, rtol=1e-6)


def test_noise_zero_is_euler():
    x, v = _xv()
    s, sn = 0.8, 0.55
    euler = x + (sn - s) * v  # by hand: x + dt v
    for out in (flow_step(v, x, s, sn, a=0.0), dance_step(v, x, s, sn, eta=0.0),
                cps_step(v, x, s, sn, a=0.0), ode_step(v, x, s, sn)):
        assert torch.allclose(out.next_sample, euler, atol=1e-6)
        assert torch.allclose(out.mean, euler, atol=1e-6)
        assert torch.all(out.log_prob == 0) and torch.all(out.std == 0)


def test_fresh_sample_mean_log_prob():
    # E[l] = -log s - 0.5 log(2 pi) - 0.5 = -log s - 1.4189, spread sqrt(0.5 / D)
    x, v = _xv((4, 4, 64, 64))
    D = 4 * 64 * 64
    out = flow_step(v, x, 0.7, 0.6, a=0.7, generator=torch.Generator().manual_seed(1))
    expected = -torch.log(out.std) - 1.4189385
    assert torch.all((out.log_prob - expected).abs() < 4 * math.sqrt(0.5 / D))


def test_scored_equals_sampled_log_prob_and_gradient():
    x, v = _xv()
    v = v.clone().requires_grad_(True)
    for kern in (FlowKernel(0.7), DanceKernel(0.3), CPSKernel(0.5)):
        out = kern.step(v, x, 0.6, 0.5, generator=torch.Generator().manual_seed(3))
        assert not out.next_sample.requires_grad
        again = kern.step(v, x, 0.6, 0.5, next_sample=out.next_sample)
        assert torch.equal(again.log_prob, out.log_prob)
        (gv,) = torch.autograd.grad(again.log_prob.sum(), v)
        assert gv.abs().sum() > 0  # the mean carries the gradient


def test_per_sample_generators_independent_of_batch():
    x, v = _xv((3, 2, 4, 4))
    gens = [torch.Generator().manual_seed(100 + b) for b in range(3)]
    full = flow_step(v, x, 0.9, 0.8, a=0.7, generator=gens)
    alone = flow_step(v[1:2], x[1:2], 0.9, 0.8, a=0.7, generator=[torch.Generator().manual_seed(101)])
    assert torch.allclose(full.next_sample[1:2], alone.next_sample, atol=1e-7)
    # and the noise is exactly torch.randn(shape[1:]) from that generator
    n = draw_noise((2, 3), [torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)], "cpu")
    assert torch.equal(n[1], torch.randn(3, generator=torch.Generator().manual_seed(6)))
    with pytest.raises(ValueError, match="one per sample"):
        flow_step(v, x, 0.9, 0.8, a=0.7, generator=gens[:2])


def test_float32_with_bf16_inputs_and_tensor_sigmas():
    x, v = _xv(dtype=torch.bfloat16)
    sig = torch.tensor([0.9, 0.8, 0.7], dtype=torch.bfloat16)
    out = flow_step(v, x, sig, sig - 0.125, a=0.7, generator=torch.Generator().manual_seed(0))
    for t in (out.next_sample, out.log_prob, out.mean, out.std):
        assert t.dtype == torch.float32
    # per-sample sigmas equal separate scalar calls
    single = flow_step(v[2:], x[2:], float(sig[2]), float(sig[2] - 0.125), a=0.7)
    assert torch.allclose(single.mean, out.mean[2:], atol=1e-6)


def test_gaussian_log_prob_against_torch_normal():
    x, m = _xv((3, 2, 5))
    std = torch.tensor([0.3, 1.2, 0.05])
    ref = torch.distributions.Normal(m.double(), std.double().view(3, 1, 1)).log_prob(x.double())
    ours = gaussian_log_prob(x, m, std)
    assert torch.allclose(ours.double(), ref.mean(dim=(1, 2)), atol=1e-5, rtol=1e-6)
    ours_sum = gaussian_log_prob(x, m, std, reduction="sum")
    assert torch.allclose(ours_sum.double(), ref.sum(dim=(1, 2)), rtol=1e-5)
    assert torch.allclose(gaussian_log_prob(x, m, 0.5).double(),
                          torch.distributions.Normal(m.double(), 0.5).log_prob(x.double()).mean((1, 2)),
                          atol=1e-5)
    with pytest.raises(ValueError, match="reduction"):
        gaussian_log_prob(x, m, std, reduction="max")
    with pytest.raises(ValueError, match="> 0"):
        gaussian_log_prob(x, m, 0.0)


def test_cps_formula_and_anchor_variant():
    x, v = _xv((2, 3, 4))
    a, s, sn = 0.5, 0.6, 0.45
    # by hand: std = sn sin(a pi/2); mean = (1 - sn) x0 + sqrt(sn^2 - std^2) x1
    std = sn * math.sin(a * math.pi / 2)
    x0, x1 = x.double() - s * v.double(), x.double() + (1 - s) * v.double()
    mean = (1 - sn) * x0 + math.sqrt(sn**2 - std**2) * x1
    out = cps_step(v, x, s, sn, a=a, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(out.mean.double(), mean, atol=1e-6)
    assert torch.allclose(out.std.double(), torch.full((2,), std, dtype=torch.float64), atol=1e-7)
    anchor = cps_step(v, x, s, sn, a=a, next_sample=out.next_sample, log_prob="anchor")
    assert torch.allclose(anchor.log_prob.double(),
                          -((out.next_sample.double() - mean) ** 2).mean(dim=(1, 2)), atol=1e-6)
    # into sigma 0 the CPS step is deterministic: mean = x0_hat, log-prob 0
    last = cps_step(v, x, 0.2, 0.0, a=a, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(last.next_sample, x - 0.2 * v, atol=1e-6)
    assert torch.all(last.log_prob == 0)
    assert not CPSKernel(a).stochastic_at(0.2, 0.0) and CPSKernel(a).stochastic_at(0.3, 0.2)


def test_kernel_objects_and_errors():
    x, v = _xv((2, 3))
    assert FlowKernel(0.7).is_stochastic and not FlowKernel(0.0).is_stochastic
    assert not ODEKernel().is_stochastic and DanceKernel().eta == 0.3
    g = torch.Generator().manual_seed(0)
    k = FlowKernel(0.9).step(v, x, 0.5, 0.4, generator=g)
    f = flow_step(v, x, 0.5, 0.4, a=0.9, generator=torch.Generator().manual_seed(0))
    assert torch.equal(k.next_sample, f.next_sample)
    # the built-in plugin registers each kernel class as its own params: params ARE the kernel
    kernels = get_registry().components["kernel"]
    assert kernels["dance"].build(DanceKernel(0.5)) == DanceKernel(0.5)
    assert kernels["flow"].build() == FlowKernel(0.7)
    assert isinstance(kernels["ode"].build(), ODEKernel)
    with pytest.raises(RecipeError, match="unknown kernel"):
        get_registry().get("kernel", "sde")
    with pytest.raises(ValueError, match=">= 0"):
        FlowKernel(-1.0)
    with pytest.raises(ValueError, match="sigma_next must be < sigma"):
        flow_step(v, x, 0.4, 0.5, a=0.7)
    with pytest.raises(ValueError, match=r"\[B\]"):
        flow_step(v, x, torch.tensor([0.5, 0.4, 0.3]), 0.1, a=0.7)
    with pytest.raises(ValueError, match="shape"):
        flow_step(v, x, 0.5, 0.4, a=0.7, next_sample=x[:1])
