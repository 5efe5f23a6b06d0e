"""Independent checks of the maths: every expected value comes from a SECOND route.

The maths tests beside the code (tests/sampling, tests/objectives, tests/math) check each
function against the formula it implements. Here the reference is computed another way:
torch.distributions, python's ``statistics``, closed forms written out term by term, finite
differences of a float64 re-implementation, a Monte-Carlo frequency, or a hand-written
step-level GRPO / GSPO loss on the embedded model. Nothing here calls the function under test
twice and compares it with itself. Algorithms.md sections cited as "s. N".
"""

from __future__ import annotations

import copy
import math
import statistics

import pytest
import torch

from flowrl.objectives.advantages import group_zscore
from flowrl.chunking import sequence_chunks, step_chunks
from flowrl.interfaces import select_embeddings
from flowrl.objectives.losses import ClippedObjective, kl_flow_grpo, kl_gaussian_exact, objective_loss
from flowrl.sampling.rollout import make_kernels, make_step_log_prob_fn, rollout, trainable_mask
from flowrl.sampling.schedules import flux_dynamic_sigmas, shifted_sigmas
from flowrl.sampling.kernels import CPSKernel, FlowKernel, dance_step, flow_diffusion, flow_step
from flowrl.selection import select_uniform, select_weighted, selection_count
from flowrl.objectives.chunk_gradient import lean_chunk_backward

LOG_2PI = math.log(2 * math.pi)


# ------------------------------------------------------------------ hand-written references
def flow_g(sigma: float, sigma_next: float, a: float) -> float:
    """s. 2, written out: g = a sqrt(sigma / (1 - sigma)); 1 - sigma_next at sigma = 1."""
    return a * math.sqrt(sigma / ((1.0 - sigma_next) if sigma >= 1.0 else (1.0 - sigma)))


def sde_mean_std_f64(v, x, sigma: float, sigma_next: float, g: float):
    """s. 2 in float64 term by term: mu = x + dt (v + g^2/(2 sigma) (x + (1 - sigma) v))."""
    v, x = v.double(), x.double()
    dt = sigma_next - sigma
    x1_hat = x + (1.0 - sigma) * v
    mu = x + dt * v + dt * (g * g / (2.0 * sigma)) * x1_hat
    return mu, g * math.sqrt(sigma - sigma_next)


def log_prob_f64(x_next, mu, s):
    """s. 3: mean over the D elements of a per-sample Gaussian log-density (float64)."""
    d = (x_next.double() - mu).flatten(1)
    return (-(d * d) / (2.0 * s * s) - math.log(s) - 0.5 * LOG_2PI).mean(1)


def clipped_f64(rho, a, eps):
    return torch.maximum(-a * rho, -a * rho.clamp(1.0 - eps, 1.0 + eps))


def eps_between(rho, adv) -> float:
    """A clip range that clips some units and not others, far from every boundary.

    A unit clips iff ``sign(A) (rho - 1) > eps`` (s. 5), so eps is put (geometrically) in the
    widest gap between the positive values of ``sign(A) (rho - 1)``: finite differences and
    float32 vs float64 then agree on which branch is active."""
    d = sorted(float(x) for x in (torch.sign(adv) * (rho - 1)).flatten() if x > 0)
    assert d, "no unit can clip"
    if len(d) == 1:
        return d[0] / 2
    j = max(range(len(d) - 1), key=lambda k: d[k + 1] / d[k])
    assert d[j + 1] > 1.2 * d[j], "no usable gap between clipped and unclipped units"
    return math.sqrt(d[j] * d[j + 1])


# ------------------------------------------------------------------ s. 1 schedules
def test_shifted_sigmas_closed_form_by_hand():
    for n in (1, 4, 16, 17):
        for s in (1.0, 3.0, 0.5, 7.0):
            want = []
            for i in range(n + 1):
                t = 1.0 - i / n
                want.append(s * t / (1.0 + (s - 1.0) * t))
            want[-1] = 0.0
            got = shifted_sigmas(n, s)
            assert got.dtype == torch.float32 and got[-1].item() == 0.0
            assert max(abs(g - w) for g, w in zip(got.tolist(), want)) < 1e-7, (n, s)
    # docs/api.md §1 reference values, N = 16, s = 3 (5 decimals)
    ref = [1.0, .97826, .95455, .92857, .9, .86842, .83333, .79412, .75, .7, .64286, .57692, .5,
           .40909, .3, .16667, 0.0]
    assert max(abs(g - r) for g, r in zip(shifted_sigmas(16, 3.0).tolist(), ref)) < 5e-6


def test_flux_dynamic_sigmas_by_hand():
    n, seq = 17, 64 * 64
    mu = 0.5 + (seq - 256) * (1.15 - 0.5) / (4096 - 256)
    want = [math.exp(mu) / (math.exp(mu) + (1.0 / (1 - i / n) - 1.0)) for i in range(n)] + [0.0]
    got = flux_dynamic_sigmas(n, seq).tolist()
    assert max(abs(g - w) for g, w in zip(got, want)) < 1e-6


# ------------------------------------------------------------------ s. 2, 3 kernels
@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.93), (0.6, 0.5), (0.2, 0.0)])
def test_flow_log_prob_against_multivariate_normal(sigma, sigma_next):
    D, B, a = 5, 3, 0.7
    gen = torch.Generator().manual_seed(1)
    x, v = torch.randn(B, D, generator=gen), torch.randn(B, D, generator=gen)
    g = flow_g(sigma, sigma_next, a)
    mu, s = sde_mean_std_f64(v, x, sigma, sigma_next, g)
    assert math.isfinite(s) and s > 0
    if sigma == 1.0:  # first step: no division by zero, std exactly a (s. 2)
        assert s == pytest.approx(a, rel=1e-12)
    x_next = (mu + s * torch.randn(B, D, generator=gen, dtype=torch.float64)).float()
    mvn = torch.distributions.MultivariateNormal(mu, covariance_matrix=s * s * torch.eye(D, dtype=torch.float64))
    ref_sum = mvn.log_prob(x_next.double())

    out_mean = flow_step(v, x, sigma, sigma_next, a=a, next_sample=x_next)
    out_sum = flow_step(v, x, sigma, sigma_next, a=a, next_sample=x_next, reduction="sum")
    assert torch.allclose(out_mean.mean.double(), mu, atol=1e-6)
    assert torch.allclose(out_mean.std.double(), torch.full((B,), s, dtype=torch.float64), rtol=1e-6)
    # mean reduction = true log-density / D (ratio to the power 1/D); sum = the true density
    assert torch.allclose(out_mean.log_prob.double(), ref_sum / D, rtol=1e-5, atol=1e-5)
    assert torch.allclose(out_sum.log_prob.double(), ref_sum, rtol=1e-5, atol=1e-5)


def test_flow_stds_n17_by_hand_and_reference_table():
    sig = [float(s) for s in shifted_sigmas(17, 3.0)]
    hand = [flow_g(sig[i], sig[i + 1], 0.7) * math.sqrt(sig[i] - sig[i + 1]) for i in range(17)]
    ref = [0.7, .722, .516, .425, .372, .335, .309, .288, .270, .255, .242, .229, .215, .200, .182,
           .158, .120]  # docs/api.md §2
    assert max(abs(h - r) for h, r in zip(hand, ref)) < 5.1e-4
    g = flow_diffusion(torch.tensor(sig[:-1]), torch.tensor(sig[1:]), 0.7)
    got = (g * torch.sqrt(torch.tensor(sig[:-1]) - torch.tensor(sig[1:]))).tolist()
    assert max(abs(x - h) for x, h in zip(got, hand)) < 1e-6


@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.9), (0.8, 0.7), (0.35, 0.1)])
def test_dance_equals_flow_with_g_eta(sigma, sigma_next):
    # choose the flow kernel's a so that its g(sigma) equals eta: the two kernels must then agree
    eta = 0.3
    denom = (1.0 - sigma_next) if sigma >= 1.0 else (1.0 - sigma)
    a = eta * math.sqrt(denom / sigma)
    gen = torch.Generator().manual_seed(2)
    x, v = torch.randn(4, 2, 3, generator=gen), torch.randn(4, 2, 3, generator=gen)
    x_next = torch.randn(4, 2, 3, generator=gen)
    d = dance_step(v, x, sigma, sigma_next, eta=eta, next_sample=x_next)
    f = flow_step(v, x, sigma, sigma_next, a=a, next_sample=x_next)
    assert torch.allclose(d.mean, f.mean, rtol=1e-6, atol=1e-6)
    assert torch.allclose(d.std, f.std, rtol=1e-6)
    assert torch.allclose(d.log_prob, f.log_prob, rtol=1e-6, atol=1e-6)
    assert d.std[0].item() == pytest.approx(eta * math.sqrt(sigma - sigma_next), rel=1e-6)


# ------------------------------------------------------------------ s. 7 advantages
def test_group_zscore_against_statistics_module():
    gen = torch.Generator().manual_seed(3)
    groups = [0] * 4 + [1] * 3 + [2] + [3] * 3 + [4] * 30
    r = torch.randn(len(groups), generator=gen, dtype=torch.float64)
    r[8:11] = 0.25  # group 3: all equal -> 0
    r[11] = 40.0  # outlier in the group of 30: its z-score is above 5, so it is clipped
    gid = torch.tensor(groups)
    rows = r.tolist()
    by_group: dict[int, list[float]] = {}
    for g, x in zip(groups, rows):
        by_group.setdefault(g, []).append(x)

    def expect(sd_fn, eps, global_sd=None):
        out = []
        for g, x in zip(groups, rows):
            vals = by_group[g]
            if len(vals) == 1 or max(vals) == min(vals):
                out.append(0.0)
                continue
            sd = global_sd if global_sd is not None else sd_fn(vals)
            out.append(max(-5.0, min(5.0, (x - statistics.mean(vals)) / (sd + eps))))
        return torch.tensor(out, dtype=torch.float64)

    unb = group_zscore(r, gid)  # DanceGRPO / MixGRPO / GCPO default
    assert torch.allclose(unb.double(), expect(statistics.stdev, 1e-8), atol=1e-6)
    assert unb[11].item() == 5.0  # the clip was exercised
    bia = group_zscore(r, gid, std="biased", eps=1e-4)
    assert torch.allclose(bia.double(), expect(statistics.pstdev, 1e-4), atol=1e-6)
    glo = group_zscore(r, gid, std="biased", eps=1e-4, global_std=True)  # Flow-GRPO
    assert torch.allclose(glo.double(), expect(None, 1e-4, statistics.pstdev(rows)), atol=1e-6)
    assert torch.isfinite(unb).all() and torch.isfinite(glo).all()


# ------------------------------------------------------------------ s. 4, 6 selection
def test_weighted_selection_first_draw_frequencies():
    w = torch.tensor([0.5, 1.0, 2.0, 4.5])
    n = 40000
    mask = select_weighted(n, w, 1, torch.Generator().manual_seed(7))
    assert bool((mask.sum(1) == 1).all())
    freq = mask.double().mean(0)
    p = (w / w.sum()).double()
    sd = torch.sqrt(p * (1 - p) / n)
    assert bool(((freq - p).abs() < 4.5 * sd).all()), (freq, p)
    # zero-weight chunks are never drawn
    m0 = select_weighted(2000, torch.tensor([0.0, 1.0, 3.0]), 1, torch.Generator().manual_seed(8))
    assert not bool(m0[:, 0].any())


def test_selection_never_trains_nothing():
    # s. 4 pitfall: K = 1, fraction 0.5 trained nothing in an anchor
    assert selection_count(1, 0.5) == 1 and selection_count(4, 0.5) == 2 and selection_count(15, 0.6) == 9
    m = select_uniform(5, 1, 0.5, torch.Generator().manual_seed(0))
    assert bool(m.all())


# ------------------------------------------------------------------ s. 5 ratio gradients
def test_chunk_loss_gradient_against_float64_finite_differences():
    B, sizes = 3, (2, 3)
    gen = torch.Generator().manual_seed(4)
    old = torch.randn(B, 5, generator=gen) - 2.0
    new0 = old + 3e-4 * torch.randn(B, 5, generator=gen)
    mask = torch.tensor([[True, True], [False, True], [True, False]])
    A = torch.tensor([1.2, -0.7, 0.4])
    z = torch.stack([(new0 - old)[:, :2].mean(1), (new0 - old)[:, 2:].mean(1)], 1)
    eps = eps_between(torch.exp(z.double())[mask], A[:, None].expand(B, 2)[mask])

    def loss64(new):  # the chunk-level loss of s. 5, written out in float64
        total = 0.0
        for b in range(B):
            units = []
            for u, (lo, hi) in enumerate(((0, 2), (2, 5))):
                if mask[b, u]:
                    zu = (new[b, lo:hi] - old[b, lo:hi].double()).mean()
                    units.append(clipped_f64(torch.exp(zu), float(A[b]), eps))
            total = total + sum(units) / len(units)
        return total / B

    new = new0.clone().requires_grad_(True)
    loss, met = objective_loss(new, old, A, sizes, mask, ClippedObjective(eps, eps))
    loss.backward()
    assert 0 < met["clip_fraction"] < 1
    base = new0.double()
    assert loss.item() == pytest.approx(float(loss64(base)), rel=1e-6)
    h = 1e-7
    fd = torch.zeros(B, 5, dtype=torch.float64)
    for b in range(B):
        for t in range(5):
            e = torch.zeros_like(base)
            e[b, t] = h
            fd[b, t] = (loss64(base + e) - loss64(base - e)) / (2 * h)
    assert torch.allclose(new.grad.double(), fd, rtol=1e-5, atol=1e-9), (new.grad, fd)


def test_lean_chunk_parameter_gradient_against_float64_finite_differences():
    # whole chain: kernel mean, log-prob, chunk ratio, clip, one-step-at-a-time backward;
    # reference = central differences of the same loss written out in float64
    D, B, N = 3, 4, 6
    torch.manual_seed(0)
    W = torch.nn.Parameter(0.3 * torch.randn(D, D))
    c = torch.nn.Parameter(0.1 * torch.randn(D))

    def vel_for(idx):
        return lambda x, s: x @ W + c + 0.1 * s[:, None]

    sig = shifted_sigmas(N, 3.0)
    noise = torch.randn(B, D, generator=torch.Generator().manual_seed(5))
    tr = rollout(vel_for(torch.arange(B)), noise, sig, make_kernels(N, FlowKernel(0.7)),
                 generators=[torch.Generator().manual_seed(20 + b) for b in range(B)])
    with torch.no_grad():
        W.add_(0.01 * torch.randn(D, D, generator=torch.Generator().manual_seed(6)))
    pos = tr.trainable_indices.tolist()
    assert pos == [0, 1, 2, 3, 4]  # N = 6, last transition excluded (s. 4)
    sizes, old = (2, 3), tr.trainable_log_probs
    mask = torch.tensor([[True, True], [True, False], [False, True], [True, True]])
    A = torch.tensor([1.0, -0.5, 0.8, -1.3])
    sigf = sig.tolist()

    def loss64(W64, c64):
        total = 0.0
        for b in range(B):
            lps = []
            for i in pos:
                x, xn = tr.latents[b:b + 1, i].double(), tr.latents[b:b + 1, i + 1]
                v = x @ W64 + c64 + 0.1 * sigf[i]
                mu, s = sde_mean_std_f64(v, x, sigf[i], sigf[i + 1], flow_g(sigf[i], sigf[i + 1], 0.7))
                lps.append(log_prob_f64(xn, mu, s)[0])
            units = []
            for u, (lo, hi) in enumerate(((0, 2), (2, 5))):
                if mask[b, u]:
                    zu = sum(lps[t] - float(old[b, t]) for t in range(lo, hi)) / (hi - lo)
                    units.append(clipped_f64(torch.exp(zu), float(A[b]), eps))
            total = total + sum(units) / len(units)
        return total / B

    with torch.no_grad():
        W64, c64 = W.detach().double(), c.detach().double()
        new = torch.stack([make_step_log_prob_fn(vel_for, tr)(t, torch.arange(B), False) for t in range(5)], 1)
        z = torch.stack([(new - old)[:, :2].mean(1), (new - old)[:, 2:].mean(1)], 1)
    eps = eps_between(torch.exp(z.double())[mask], A[:, None].expand(B, 2)[mask])

    loss, met = lean_chunk_backward(make_step_log_prob_fn(vel_for, tr), old, A, sizes, mask,
                                    ClippedObjective(eps, eps))
    assert 0 < met["clip_fraction"] < 1
    assert loss.item() == pytest.approx(float(loss64(W64, c64)), rel=1e-4, abs=1e-7)
    h = 1e-6
    for param, p64, other in ((W, W64, "W"), (c, c64, "c")):
        fd = torch.zeros_like(p64)
        for k in range(p64.numel()):
            e = torch.zeros_like(p64).flatten()
            e[k] = h
            e = e.view_as(p64)
            if other == "W":
                fd.view(-1)[k] = (loss64(p64 + e, c64) - loss64(p64 - e, c64)) / (2 * h)
            else:
                fd.view(-1)[k] = (loss64(W64, p64 + e) - loss64(W64, p64 - e)) / (2 * h)
        scale = fd.abs().max()
        assert scale > 0
        assert torch.allclose(param.grad.double(), fd, rtol=1e-4, atol=1e-5 * scale), (other, param.grad, fd)


# ------------------------------------------------------------------ s. 8 KL
def test_kl_terms_against_torch_distributions_with_gradient():
    gen = torch.Generator().manual_seed(9)
    mu = torch.randn(2, 6, generator=gen).requires_grad_(True)
    mu_ref = torch.randn(2, 6, generator=gen)
    g, h = 0.8, 0.05
    s = g * math.sqrt(h)
    kl = kl_gaussian_exact(mu, mu_ref, s)
    ref = torch.distributions.kl_divergence(torch.distributions.Normal(mu, s),
                                            torch.distributions.Normal(mu_ref, s)).mean(1)
    assert torch.allclose(kl, ref, rtol=1e-5)
    (gk,) = torch.autograd.grad(kl.sum(), mu)  # the KL keeps its gradient (s. 8 pitfall)
    (gr,) = torch.autograd.grad(ref.sum(), mu)
    assert torch.allclose(gk, gr, rtol=1e-5) and gk.abs().max() > 0
    # Flow-GRPO's form divides by 2 g^2, not 2 s^2 = 2 g^2 h: it is the exact KL times h
    assert torch.allclose(kl_flow_grpo(mu, mu_ref, g), ref * h, rtol=1e-5)


# ------------------------------------------------------------------ s. 3, 4 rollouts
def test_bf16_model_float32_storage_keeps_on_policy_ratio_one():
    # s. 3 pitfall: a bf16 model is fine as long as the stored latents are the float32 values
    # that were scored; casting them to bf16 afterwards breaks the ratio.
    D, B, N = 8, 3, 5
    lin = torch.nn.Linear(D, D).to(torch.bfloat16)

    def vel_for(idx):
        return lambda x, s: lin(x.to(torch.bfloat16)) * (1 + s[:, None].to(torch.bfloat16))

    noise = torch.randn(B, D, generator=torch.Generator().manual_seed(10))
    tr = rollout(vel_for(torch.arange(B)), noise, shifted_sigmas(N, 3.0), FlowKernel(0.7),
                 generators=torch.Generator().manual_seed(11))
    assert tr.latents.dtype == torch.float32 and tr.log_probs.dtype == torch.float32
    fn = make_step_log_prob_fn(vel_for, tr)
    with torch.no_grad():
        new = torch.stack([fn(t, torch.arange(B), False) for t in range(tr.num_trainable)], 1)
    assert (new - tr.trainable_log_probs).abs().max().item() <= 1e-6
    cast = copy.copy(tr)
    cast.latents = tr.latents.to(torch.bfloat16).float()
    with torch.no_grad():
        bad = torch.stack([make_step_log_prob_fn(vel_for, cast)(t, torch.arange(B), False)
                           for t in range(tr.num_trainable)], 1)
    assert (bad - tr.trainable_log_probs).abs().max().item() > 1e-4


def test_last_step_and_image_latents_by_hand():
    # s. 4 off-by-one: the image is the LAST step's x0_hat, so the last transition is not trained
    D, B, N = 4, 2, 4
    Wt = torch.randn(D, D, generator=torch.Generator().manual_seed(12)) * 0.2

    def vel_for(idx):
        return lambda x, s: x @ Wt + s[:, None]

    sig = shifted_sigmas(N, 3.0)
    noise = torch.randn(B, D, generator=torch.Generator().manual_seed(13))
    tr = rollout(vel_for(None), noise, sig, FlowKernel(0.7), generators=torch.Generator().manual_seed(1))
    assert tr.trainable.tolist() == [True, True, True, False]
    x_last = tr.latents[:, N - 1]
    s_last = float(sig[N - 1])
    assert torch.allclose(tr.image_latents, x_last - s_last * (x_last @ Wt + s_last), atol=1e-6)
    fin = rollout(vel_for(None), noise, sig, FlowKernel(0.7), generators=torch.Generator().manual_seed(1),
                  image_from="final")
    assert fin.trainable.tolist() == [True] * 4 and torch.equal(fin.image_latents, fin.latents[:, N])
    # cps steps into sigma = 0 with std 0: deterministic, not trainable
    cps = make_kernels(N, CPSKernel(0.7))
    assert trainable_mask(cps, sig, "final").tolist() == [True, True, True, False]


# ------------------------------------------------------------------ the embedded model
@pytest.fixture(scope="module")
def embedded():
    from flowrl_plugins.embedded.plugin import EmbeddedConfig, EmbeddedModel

    model = EmbeddedModel(EmbeddedConfig(random_init=True, seed=3))
    prompts = ["a red circle on a blue background"] * 2 + ["a green square on a white background"] * 2
    text = model.encode_prompts(prompts)
    B, N = len(prompts), 5

    def for_model(m):
        def velocity_fn_for(idx):
            sub = select_embeddings(text, idx)
            return lambda x, s: m.velocity(x, s, sub)
        return velocity_fn_for

    noise = torch.randn(B, *model.latent_shape, generator=torch.Generator().manual_seed(14))
    tr = rollout(for_model(model)(torch.arange(B)), noise, shifted_sigmas(N, 3.0),
                 make_kernels(N, FlowKernel(0.7)), prompts=prompts,
                 generators=[torch.Generator().manual_seed(30 + b) for b in range(B)])
    assert tr.num_trainable == N - 1

    off = copy.deepcopy(model)  # off-policy copy: every weight perturbed after the rollout
    off.denoiser.requires_grad_(True)
    with torch.no_grad():
        gp = torch.Generator().manual_seed(15)
        for p in off.denoiser.parameters():
            if p.numel() > 1:
                p.add_(2e-3 * p.std() * torch.randn(p.shape, generator=gp))
    return model, off, for_model, tr


def _hand_log_probs(off, for_model, tr):
    """[B, T] log-probs with gradient: the model's velocity, then s. 2-3 by hand in float64."""
    B = tr.batch_size
    fn = for_model(off)(torch.arange(B))
    sig = tr.sigmas.tolist()
    cols = []
    for i in tr.trainable_indices.tolist():
        x = tr.latents[:, i]
        v = fn(x, tr.sigmas[i].repeat(B))
        mu, s = sde_mean_std_f64(v, x, sig[i], sig[i + 1], flow_g(sig[i], sig[i + 1], 0.7))
        cols.append(log_prob_f64(tr.latents[:, i + 1], mu, s))
    return torch.stack(cols, 1)


def _grads(params):
    out = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]
    for p in params:
        p.grad = None
    return out


def _assert_grads_close(ga, gb):
    scale = max(float(g.abs().max()) for g in gb)
    assert scale > 0
    for a, b in zip(ga, gb):
        assert torch.allclose(a.double(), b.double(), rtol=2e-5, atol=2e-6 * scale), (a - b).abs().max()


def test_embedded_on_policy_ratio_is_one(embedded):
    model, _, for_model, tr = embedded
    fn = make_step_log_prob_fn(for_model(model), tr)
    B, T = tr.batch_size, tr.num_trainable
    with torch.no_grad():
        new = torch.stack([fn(t, torch.arange(B), False) for t in range(T)], 1)
    assert (new - tr.trainable_log_probs).abs().max().item() <= 1e-6
    # the unit ratios the update uses are 1 within 1e-6 as well (chunk and sequence)
    ratio = torch.exp((new - tr.trainable_log_probs).mean(1))
    assert (ratio - 1).abs().max().item() <= 1e-6
    # and the s. 3 sanity value: E[l] = -log s - 1.4189, spread sqrt(0.5 / D) per sample
    sig = tr.sigmas.tolist()
    i0 = tr.trainable_indices[0].item()
    s0 = flow_g(sig[i0], sig[i0 + 1], 0.7) * math.sqrt(sig[i0] - sig[i0 + 1])
    D = tr.latents[0, 0].numel()
    assert abs(new[:, 0].mean().item() - (-math.log(s0) - 0.5 * (1 + LOG_2PI))) < 4 * math.sqrt(0.5 / D)


def test_embedded_chunk_size_one_is_step_level_grpo(embedded):
    _, off, for_model, tr = embedded
    B, T = tr.batch_size, tr.num_trainable
    old = tr.trainable_log_probs
    A = torch.tensor([1.0, -1.0, 0.6, -0.4])
    mask = select_uniform(B, T, 0.5, [torch.Generator().manual_seed(40 + b) for b in range(B)])
    params = list(off.denoiser.parameters())

    # hand route: step-level GRPO (s. 5, DanceGRPO form), one graph, float64 kernel maths
    lp = _hand_log_probs(off, for_model, tr)
    rho = torch.exp(lp - old.double())
    eps = eps_between(rho.detach()[mask], A[:, None].expand(B, T)[mask])
    per_step = clipped_f64(rho, A.double()[:, None], eps)
    hand = sum(per_step[b][mask[b]].mean() for b in range(B)) / B
    hand.backward()
    g_hand = _grads(params)

    loss, met = lean_chunk_backward(make_step_log_prob_fn(for_model(off), tr), old, A,
                                    step_chunks(T), mask, ClippedObjective(eps, eps))
    g_lean = _grads(params)
    assert 0 < met["clip_fraction"] < 1
    assert loss.item() == pytest.approx(hand.item(), rel=1e-5)
    _assert_grads_close(g_lean, g_hand)


def test_embedded_one_chunk_is_gspo(embedded):
    _, off, for_model, tr = embedded
    B, T = tr.batch_size, tr.num_trainable
    old = tr.trainable_log_probs
    A = torch.tensor([0.9, -1.1, -0.5, 1.4])
    params = list(off.denoiser.parameters())

    # hand route: GSPO sequence ratio rho_b = exp(mean_t (l - l_old)), one unit per sample
    lp = _hand_log_probs(off, for_model, tr)
    rho = torch.exp((lp - old.double()).mean(1))
    eps = eps_between(rho.detach(), A)
    hand = clipped_f64(rho, A.double(), eps).mean()
    hand.backward()
    g_hand = _grads(params)

    mask = torch.ones(B, 1, dtype=torch.bool)
    loss, met = lean_chunk_backward(make_step_log_prob_fn(for_model(off), tr), old, A,
                                    sequence_chunks(T), mask, ClippedObjective(eps, eps))
    g_lean = _grads(params)
    assert 0 < met["clip_fraction"] < 1
    assert loss.item() == pytest.approx(hand.item(), rel=1e-5)
    _assert_grads_close(g_lean, g_hand)


# ------------------------------------------------------------------ s. 5 lean update: cost
def test_lean_update_forward_counts_and_zero_coefficient_samples():
    # Counted by hand: a unit of size k costs k - 1 no-grad forwards and k forwards with grad
    # (size 1 = exactly a step-level update); samples whose coefficient is 0 (advantage 0) are
    # not recomputed. The gradient is compared with the loss written out by hand (autograd).
    D, B, N = 3, 4, 6
    torch.manual_seed(1)
    W = torch.nn.Parameter(0.3 * torch.randn(D, D))
    calls = []

    def vel_for(idx):
        return lambda x, s: x @ W + 0.1 * s[:, None]

    tr = rollout(vel_for(None), torch.randn(B, D, generator=torch.Generator().manual_seed(2)),
                 shifted_sigmas(N, 3.0), FlowKernel(0.7), generators=torch.Generator().manual_seed(3))
    with torch.no_grad():
        W.add_(0.02)
    inner = make_step_log_prob_fn(vel_for, tr)

    def fn(t, idx, grad):
        calls.append((t, idx.tolist(), grad))
        return inner(t, idx, grad)

    old = tr.trainable_log_probs
    A = torch.tensor([1.0, 0.0, -0.5, 2.0])  # sample 1: zero advantage
    mask = torch.tensor([[True, True], [True, True], [False, True], [True, False]])
    lean_chunk_backward(fn, old, A, (1, 4), mask, ClippedObjective(0.5, 0.5))
    g_lean = W.grad.clone()
    W.grad = None
    # unit 0 (size 1): one forward with grad for samples 0, 1, 3; unit 1 (size 4): three no-grad
    # forwards and one with grad for samples 0, 1, 2, then three recomputations for 0 and 2 only
    assert calls == [(0, [0, 1, 3], True)] + [(t, [0, 1, 2], False) for t in (1, 2, 3)] + \
        [(4, [0, 1, 2], True)] + [(t, [0, 2], True) for t in (1, 2, 3)]

    lp = torch.stack([inner(t, torch.arange(B), True) for t in range(5)], 1)
    z = torch.stack([lp[:, 0] - old[:, 0], (lp[:, 1:] - old[:, 1:]).mean(1)], 1)
    per = -A[:, None] * torch.exp(z)  # eps = 1: nothing clips
    hand = sum(per[b][mask[b]].mean() for b in range(B)) / B
    hand.backward()
    assert torch.allclose(g_lean, W.grad, rtol=1e-5, atol=1e-7)


def test_lean_update_rejects_objective_that_couples_units():
    D, B, N = 2, 2, 4
    W = torch.nn.Parameter(torch.eye(D))
    tr = rollout(lambda x, s: x @ W, torch.randn(B, D, generator=torch.Generator().manual_seed(4)),
                 shifted_sigmas(N, 3.0), FlowKernel(0.7), generators=torch.Generator().manual_seed(5))
    with torch.no_grad():
        W.add_(0.05)
    fn = make_step_log_prob_fn(lambda idx: (lambda x, s: x @ W), tr)

    def coupled(z, a):  # each unit's loss depends on the mean ratio of all units
        return -a * torch.exp(z) * torch.exp(z.mean(1, keepdim=True))

    with pytest.raises(ValueError, match="not elementwise in the units"):
        lean_chunk_backward(fn, tr.trainable_log_probs, torch.ones(B), (1, 2),
                            torch.ones(B, 2, dtype=torch.bool), coupled)


class _SavedBytes:
    """Peak bytes of tensors saved for backward and alive at once (saved_tensors_hooks)."""

    def __init__(self):
        self.current = self.peak = 0

    def _free(self, n):
        self.current -= n

    def pack(self, t):
        import weakref

        class Box:
            pass

        box, n = Box(), t.numel() * t.element_size()
        box.t = t
        self.current += n
        self.peak = max(self.peak, self.current)
        weakref.finalize(box, self._free, n)
        return box

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda box: box.t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def test_lean_update_keeps_one_step_graph_alive():
    # the full graph holds every selected step; the lean update never more than one, also when
    # a whole unit is skipped (zero advantage) between two trained ones
    D, B, N = 256, 6, 8  # wide enough that the [B, K] loss graph (a few hundred bytes) is noise
    net = torch.nn.Sequential(torch.nn.Linear(D + 1, 512), torch.nn.Tanh(), torch.nn.Linear(512, D))

    def vel_for(idx):
        return lambda x, s: net(torch.cat([x, s[:, None]], 1))

    tr = rollout(vel_for(None), torch.randn(B, D, generator=torch.Generator().manual_seed(6)),
                 shifted_sigmas(N, 3.0), FlowKernel(0.7), generators=torch.Generator().manual_seed(7))
    fn = make_step_log_prob_fn(vel_for, tr)
    old, T = tr.trainable_log_probs, tr.num_trainable
    with _SavedBytes() as one:
        fn(0, torch.arange(B), True)
    sizes = (3, 2, 2)
    mask = torch.ones(B, 3, dtype=torch.bool)
    A = torch.tensor([1.0, -1.0, 0.5, 0.0, 2.0, -0.3])
    obj = ClippedObjective(0.5, 0.5)
    with _SavedBytes() as lean:
        lean_chunk_backward(fn, old, A, sizes, mask, obj)
    with _SavedBytes() as lean_skip:  # unit 1 has zero advantage for every sample: skipped
        lean_chunk_backward(fn, old, torch.stack([A, 0 * A, A], 1), sizes, mask, obj)
    from flowrl.objectives.chunk_gradient import full_graph_backward

    with _SavedBytes() as full:
        full_graph_backward(fn, old, A, sizes, mask, obj)
    assert one.peak > 0 and T == 7
    assert lean.peak <= 1.05 * one.peak and lean_skip.peak <= 1.05 * one.peak
    assert full.peak >= 0.95 * T * one.peak
