"""Rollouts, trajectories and the trainable set (docs/api.md §1-§4)."""

import pytest
import torch

from flowrl.sampling.rollout import make_kernels, make_step_log_prob_fn, rollout, transition_log_prob
from flowrl.sampling.schedules import shifted_sigmas
from flowrl.sampling.kernels import CPSKernel, DanceKernel, FlowKernel, ODEKernel
from flowrl.sampling.trajectory import Trajectory

SHAPE = (2, 3, 3)


class TinyVelocity(torch.nn.Module):
    """Row-wise MLP velocity field conditioned on sigma and a per-sample embedding."""

    def __init__(self, d=18, e=4, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(d + 1 + e, 32), torch.nn.Tanh(), torch.nn.Linear(32, d))
        self.emb = torch.randn(16, e)

    def fn_for(self, batch_idx):
        emb = self.emb[batch_idx]

        def velocity(x, sigma):
            h = torch.cat([x.flatten(1), sigma[:, None], emb], dim=1)
            return self.net(h).view_as(x)

        return velocity


def _noise(b, seed=0):
    return torch.randn(b, *SHAPE, generator=torch.Generator().manual_seed(seed))


def test_noise_zero_rollout_is_euler_ode():
    model = TinyVelocity()
    vf = model.fn_for(torch.arange(3))
    sig = shifted_sigmas(8, 3.0)
    x0 = _noise(3)
    for kern in (FlowKernel(0.0), DanceKernel(0.0), CPSKernel(0.0), ODEKernel()):
        tr = rollout(vf, x0, sig, make_kernels(8, kern), image_from="final")
        x = x0.clone()
        with torch.no_grad():  # Euler by hand: x <- x + (sigma_{i+1} - sigma_i) v(x, sigma_i)
            for i in range(8):
                x = x + (sig[i + 1] - sig[i]) * vf(x, sig[i].expand(3))
        assert torch.allclose(tr.latents[:, -1], x, atol=1e-5)
        assert torch.allclose(tr.image_latents, x, atol=1e-5)
        assert torch.all(tr.log_probs == 0) and tr.num_trainable == 0


def test_on_policy_rescoring_ratio_is_one():
    model = TinyVelocity()
    idx = torch.arange(4)
    sig = shifted_sigmas(17, 3.0)
    gens = [torch.Generator().manual_seed(b) for b in range(4)]
    tr = rollout(model.fn_for(idx), _noise(4), sig, make_kernels(17, FlowKernel(0.7)), generators=gens)
    assert tr.latents.shape == (4, 18, *SHAPE) and tr.latents.dtype == torch.float32
    assert tr.log_probs.shape == (4, 17) and tr.log_probs.dtype == torch.float32
    for i in range(17):
        new = transition_log_prob(model.fn_for(idx), tr, i)
        assert torch.all((torch.exp(new - tr.log_probs[:, i]) - 1).abs() < 1e-6)
    # adapter over trainable positions, a sub-batch
    fn = make_step_log_prob_fn(model.fn_for, tr)
    sub = torch.tensor([1, 3])
    lp = fn(15, sub, True)
    assert lp.requires_grad and torch.allclose(lp, tr.log_probs[sub, 15], atol=1e-6)


def test_trainable_sets():
    model = TinyVelocity()
    vf = model.fn_for(torch.arange(2))
    sig = shifted_sigmas(17, 3.0)
    k = make_kernels(17, FlowKernel(0.7))
    # image from the last x0_hat: the last transition is excluded -> 16 = 2 + 3 + 4 + 7
    tr = rollout(vf, _noise(2), sig, k)
    assert tr.num_trainable == 16 and not tr.trainable[-1] and bool(tr.trainable[:-1].all())
    assert tr.trainable_indices.tolist() == list(range(16))
    assert rollout(vf, _noise(2), sig, k, image_from="final").num_trainable == 17
    # SDE window [3, 8): steps 3..7 only
    tw = rollout(vf, _noise(2), sig, make_kernels(17, FlowKernel(0.7), sde_window=(3, 8)))
    assert tw.trainable_indices.tolist() == [3, 4, 5, 6, 7]
    assert all(isinstance(tw.kernels[i], ODEKernel) for i in (0, 2, 8, 16))
    # a window touching the last step with x0_hat: last still excluded
    tl = rollout(vf, _noise(2), sig, make_kernels(17, FlowKernel(0.7), sde_window=(14, 17)))
    assert tl.trainable_indices.tolist() == [14, 15]
    # CPS into sigma 0 is deterministic, so not trainable even when decoding x_N
    tc = rollout(vf, _noise(2), sig, make_kernels(17, CPSKernel(0.5)), image_from="final")
    assert tc.num_trainable == 16 and not tc.trainable[-1]
    with pytest.raises(ValueError, match="window"):
        make_kernels(17, FlowKernel(0.7), sde_window=(5, 18))
    with pytest.raises(ValueError, match="one kernel per step"):
        rollout(vf, _noise(2), sig, k[:5])


def test_image_latents_is_last_x0_hat():
    model = TinyVelocity()
    vf = model.fn_for(torch.arange(2))
    sig = shifted_sigmas(6, 3.0)
    tr = rollout(vf, _noise(2), sig, FlowKernel(0.7), generators=torch.Generator().manual_seed(0))
    x = tr.latents[:, 5]
    with torch.no_grad():  # x0_hat = x_{N-1} - sigma_{N-1} v
        expected = x - sig[5] * vf(x, sig[5].expand(2))
    assert torch.allclose(tr.image_latents, expected, atol=1e-6)


def test_per_sample_generators_rollout_independent_of_batch():
    model = TinyVelocity()
    sig = shifted_sigmas(6, 3.0)
    noise = _noise(3)
    full = rollout(model.fn_for(torch.arange(3)), noise, sig, FlowKernel(0.7),
                   generators=[torch.Generator().manual_seed(10 + b) for b in range(3)])
    one = rollout(model.fn_for(torch.tensor([2])), noise[2:], sig, FlowKernel(0.7),
                  generators=[torch.Generator().manual_seed(12)])
    assert torch.allclose(full.latents[2:], one.latents, atol=1e-5)
    assert torch.allclose(full.log_probs[2:], one.log_probs, atol=1e-5)


def test_trajectory_select_to_transition_and_groups():
    model = TinyVelocity()
    sig = shifted_sigmas(5, 3.0)
    tr = rollout(model.fn_for(torch.arange(4)), _noise(4), sig, FlowKernel(0.7),
                 prompts=["a", "b", "a", "c"], generators=torch.Generator().manual_seed(0))
    assert tr.group_ids.tolist() == [0, 1, 0, 2]
    sub = tr.select([3, 0])
    assert sub.prompts == ["c", "a"] and sub.group_ids.tolist() == [2, 0]
    assert torch.equal(sub.latents[1], tr.latents[0]) and sub.batch_size == 2
    assert torch.equal(tr.select(torch.tensor([False, True, False, False])).latents[0], tr.latents[1])
    t2 = tr.transition(2)
    assert torch.equal(t2.sample, tr.latents[:, 2]) and torch.equal(t2.next_sample, tr.latents[:, 3])
    assert t2.sigma.item() == sig[2].item() and t2.trainable
    assert tr.to("cpu").latents.device.type == "cpu"
    assert tr.trainable_log_probs.shape == (4, 4)
    with pytest.raises(ValueError, match="transition index"):
        tr.transition(5)
    with pytest.raises(ValueError, match="log_probs"):
        Trajectory(tr.latents, tr.log_probs[:, :2], tr.sigmas, tr.trainable, tr.prompts,
                   tr.group_ids, tr.image_latents)
