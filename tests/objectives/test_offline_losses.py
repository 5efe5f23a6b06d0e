"""Offline SFT and DPO losses (flowrl.objectives.offline) against a second route in float64."""

import torch
import torch.nn.functional as F

from flowrl.objectives.offline import offline_dpo_loss, offline_points, sft_loss


class Linear:
    """A stand-in adapter: v = W x * sigma + b (per element), with a text row added."""

    def __init__(self, dim, dtype=torch.float32):
        g = torch.Generator().manual_seed(3)
        self.w = torch.randn(dim, dim, generator=g, dtype=dtype).requires_grad_(True)
        self.b = torch.randn(dim, generator=g, dtype=dtype).requires_grad_(True)

    def velocity(self, x, sigma, text):
        return (x @ self.w) * sigma.reshape(-1, 1, 1).to(x.dtype) + self.b + text["t"].to(x.dtype)


def test_points_are_shared_per_row_and_seeded():
    x0 = torch.zeros(2, 3, 4)
    sig = torch.linspace(1, 0, 6)
    a = offline_points(0, "t", 5, [7, 9], x0, sig, 3)
    b = offline_points(0, "t", 5, [7, 9], x0, sig, 3)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    s, e, idx = a
    assert s.shape == (6,) and e.shape == (6, 3, 4) and idx.tolist() == [0, 0, 0, 1, 1, 1]
    assert bool((s > 0).all()) and len(set(s[:3].tolist())) == 3  # no sigma 0, drawn without replacement
    c = offline_points(0, "t", 5, [9], x0[:1], sig, 3)  # a row's points do not depend on the others
    assert torch.equal(c[0], s[3:]) and torch.equal(c[1], e[3:])
    # a second pass over the iteration's rows ([train].updates_per_rollout = 2) draws new points;
    # the first pass's are the ones every earlier run drew
    assert all(torch.equal(u, v) for u, v in zip(offline_points(0, "t", 5, [7, 9], x0, sig, 3, epoch=0), a))
    again = offline_points(0, "t", 5, [7, 9], x0, sig, 3, epoch=1)
    assert not torch.equal(again[1], e) and torch.equal(again[2], idx)


def test_sft_loss_is_the_mean_flow_matching_error():
    m = Linear(4)
    x0 = torch.randn(2, 3, 4)
    s, e, idx = offline_points(1, "t", 0, [0, 1], x0, torch.linspace(1, 0, 5), 2)
    text = {"t": torch.randn(len(idx), 1, 4)}
    loss = sft_loss(m, x0, text, s, e, idx)
    xb = x0[idx]
    x = (1 - s.reshape(-1, 1, 1)) * xb + s.reshape(-1, 1, 1) * e
    want = ((m.velocity(x, s, text) - (e - xb)) ** 2).mean()
    assert torch.allclose(loss, want, atol=1e-6)


def test_dpo_loss_and_gradient_match_diffusion_dpo_in_float64():
    torch.manual_seed(0)
    m, ref = Linear(4), Linear(4)
    ref.w.data += 0.1
    w_lat, l_lat = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    s, e, idx = offline_points(2, "t", 0, [0, 1, 2], w_lat, torch.linspace(1, 0, 5), 2)
    text = {"t": torch.randn(len(idx), 1, 4)}
    beta = 7.0
    loss, metrics = offline_dpo_loss(m, lambda x, sg, t: ref.velocity(x, sg, t), w_lat, l_lat, text, s, e, idx, beta)
    loss.backward()
    # second route: the Diffusion-DPO loss written out in float64, differentiated as a whole
    w64, b64 = m.w.detach().double().requires_grad_(True), m.b.detach().double().requires_grad_(True)

    def err(wt, bt, lat):
        xb = lat.double()[idx]
        sd, ed = s.double().reshape(-1, 1, 1), e.double()
        x = (1 - sd) * xb + sd * ed
        v = (x @ wt) * sd + bt + text["t"].double()
        return ((v - (ed - xb)) ** 2).reshape(len(idx), -1).mean(1)

    rw, rb = ref.w.detach().double(), ref.b.detach().double()
    mm = (err(w64, b64, w_lat) - err(rw, rb, w_lat)) - (err(w64, b64, l_lat) - err(rw, rb, l_lat))
    want = F.softplus(0.5 * beta * mm).mean()
    want.backward()
    assert abs(float(loss.detach()) - float(want.detach())) < 1e-5
    assert abs(metrics["margin"] - float(mm.mean())) < 1e-5
    assert torch.allclose(m.w.grad.double(), w64.grad, rtol=1e-4, atol=1e-6)
    assert torch.allclose(m.b.grad.double(), b64.grad, rtol=1e-4, atol=1e-6)
