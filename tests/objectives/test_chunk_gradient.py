"""Memory-lean exact chunk update (docs/api.md §5).

The reference is the full-graph backward of the same loss; both run on a real rollout of a
tiny MLP velocity field, with parameters perturbed after the rollout so that ratios differ
from 1 and some units are clipped.
"""

import pytest
import torch

from flowrl.chunking import relative_l1_change, sequence_chunks, step_chunks
from flowrl.objectives.losses import ClippedObjective, kl_old_policy_k3, unit_log_ratios
from flowrl.sampling.rollout import make_kernels, make_step_log_prob_fn, rollout
from flowrl.sampling.schedules import shifted_sigmas
from flowrl.sampling.kernels import FlowKernel
from flowrl.selection import chunk_weights_from_l1rel, select_uniform, select_weighted
from flowrl.objectives.chunk_gradient import full_graph_backward, lean_chunk_backward

B = 6
SHAPE = (2, 3, 3)


class TinyVelocity(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(18 + 1 + 4, 32), torch.nn.Tanh(), torch.nn.Linear(32, 18))
        self.emb = torch.randn(B, 4)

    def fn_for(self, batch_idx):
        emb = self.emb[batch_idx]

        def velocity(x, sigma):
            return self.net(torch.cat([x.flatten(1), sigma[:, None], emb], 1)).view_as(x)

        return velocity


@pytest.fixture(scope="module")
def setup():
    model = TinyVelocity()
    noise = torch.randn(B, *SHAPE, generator=torch.Generator().manual_seed(1))
    gens = [torch.Generator().manual_seed(10 + b) for b in range(B)]
    tr = rollout(model.fn_for(torch.arange(B)), noise, shifted_sigmas(17, 3.0),
                 make_kernels(17, FlowKernel(0.7)), generators=gens)
    assert tr.num_trainable == 16
    with torch.no_grad():  # move off-policy
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return model, tr


def _grads(model):
    out = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def _eps_for_clipping(fn, old, sizes):
    # choose eps at the median |rho - 1| so that a fair share of units clip
    with torch.no_grad():
        T = old.shape[1]
        new = torch.stack([fn(t, torch.arange(B), False) for t in range(T)], 1)
        z = unit_log_ratios(new, old, sizes)
    return float(torch.quantile(torch.expm1(z).abs().flatten(), 0.5))


@pytest.mark.parametrize("selector", ["uniform", "weighted"])
@pytest.mark.parametrize("sizes", [(2, 3, 4, 7), step_chunks(16), sequence_chunks(16)])
def test_lean_equals_full_graph(setup, sizes, selector):
    model, tr = setup
    fn = make_step_log_prob_fn(model.fn_for, tr)
    old = tr.trainable_log_probs
    K = len(sizes)
    if selector == "uniform" or K == 1:
        mask = select_uniform(B, K, 0.5, torch.Generator().manual_seed(3))
    else:
        w = chunk_weights_from_l1rel(relative_l1_change(tr.latents)[tr.trainable_indices], sizes)
        mask = select_weighted(B, w, max(1, K // 2), torch.Generator().manual_seed(4))
    A = torch.tensor([1.0, -1.0, 0.5, -2.0, 1.5, -0.3])
    eps = _eps_for_clipping(fn, old, sizes)
    obj = ClippedObjective(eps, eps)

    loss_full, met_full = full_graph_backward(fn, old, A, sizes, mask, obj, normaliser=12)
    g_full = _grads(model)
    loss_lean, met_lean = lean_chunk_backward(fn, old, A, sizes, mask, obj, normaliser=12)
    g_lean = _grads(model)

    assert torch.allclose(loss_lean, loss_full, rtol=1e-5, atol=1e-9)
    for gl, gf in zip(g_lean, g_full):
        assert torch.allclose(gl, gf, rtol=1e-4, atol=1e-7), (gl - gf).abs().max()
    assert met_lean["num_units"] == met_full["num_units"] == int(mask.sum())
    assert met_lean["clip_fraction"] == met_full["clip_fraction"]
    if K > 1:
        assert 0 < met_lean["clip_fraction"] < 1
    assert met_lean["recompute_mismatch"] < 1e-6


def test_lean_generic_objective_with_k3(setup):
    model, tr = setup
    fn = make_step_log_prob_fn(model.fn_for, tr)
    old = tr.trainable_log_probs
    sizes = (2, 3, 4, 7)
    mask = select_uniform(B, 4, 0.5, torch.Generator().manual_seed(5))
    A = torch.linspace(-1, 1, B)
    clip = ClippedObjective(1e-3, 1e-3)

    def obj(z, a):
        return clip(z, a) + 0.1 * kl_old_policy_k3(z)

    full_graph_backward(fn, old, A, sizes, mask, obj)
    g_full = _grads(model)
    lean_chunk_backward(fn, old, A, sizes, mask, obj)
    g_lean = _grads(model)
    for gl, gf in zip(g_lean, g_full):
        assert torch.allclose(gl, gf, rtol=1e-4, atol=1e-7)


def test_lean_rejects_bad_input(setup):
    model, tr = setup
    fn = make_step_log_prob_fn(model.fn_for, tr)
    old = tr.trainable_log_probs
    with pytest.raises(ValueError, match="sum to"):
        lean_chunk_backward(fn, old, torch.ones(B), (2, 3), torch.ones(B, 2, dtype=torch.bool),
                            ClippedObjective())
    with pytest.raises(ValueError, match="without gradient"):
        lean_chunk_backward(lambda t, i, g: old[i, t].detach(), old, torch.ones(B), (16,),
                            torch.ones(B, 1, dtype=torch.bool), ClippedObjective())


# ---------------------------------------------------------------------------------- fast path and
# chunk graph: same gradients as the full graph, on- and off-policy


@pytest.fixture(scope="module")
def on_policy():
    """A rollout and the very weights that sampled it: every ratio is 1."""
    model = TinyVelocity()
    noise = torch.randn(B, *SHAPE, generator=torch.Generator().manual_seed(1))
    gens = [torch.Generator().manual_seed(10 + b) for b in range(B)]
    tr = rollout(model.fn_for(torch.arange(B)), noise, shifted_sigmas(17, 3.0),
                 make_kernels(17, FlowKernel(0.7)), generators=gens)
    return model, tr


def _kl_extra(model, tr, mask, sizes, beta):
    """forward_with_extra: the step log-prob and a per-sample extra term (beta * k3 of the step
    log-ratio, averaged over each sample's trained transitions) from ONE forward."""
    from flowrl.chunking import chunk_index
    from flowrl.sampling.rollout import rescore_transition

    trans = mask[:, chunk_index(sizes)]
    per_sample = trans.sum(1).clamp(min=1).float()
    positions = tr.trainable_indices.tolist()
    old = tr.trainable_log_probs

    def forward(t, idx):
        out = rescore_transition(model.fn_for(idx), tr, positions[t], idx)
        k3 = kl_old_policy_k3(out.log_prob - old[idx, t])
        return out.log_prob, beta * k3 * trans[idx, t] / per_sample[idx]

    def full_extra():  # the same term summed by hand over every selected transition, one graph
        total = 0.0
        for t in range(len(positions)):
            idx = torch.nonzero(trans[:, t]).flatten()
            if idx.numel():
                total = total + forward(t, idx)[1].sum()
        return total

    return forward, full_extra


@pytest.mark.parametrize("sizes", [(2, 3, 4, 7), step_chunks(16), sequence_chunks(16)])
@pytest.mark.parametrize("with_kl", [False, True])
def test_fast_path_equals_full_graph_on_policy(on_policy, sizes, with_kl):
    from flowrl.objectives.chunk_gradient import on_policy_chunk_backward

    model, tr = on_policy
    fn = make_step_log_prob_fn(model.fn_for, tr)
    old, K = tr.trainable_log_probs, len(sizes)
    mask = select_uniform(B, K, 0.5, torch.Generator().manual_seed(3))
    A = torch.tensor([1.0, -1.0, 0.0, -2.0, 1.5, -0.3])  # one zero advantage: never forwarded
    obj = ClippedObjective(1e-4, 1e-4)
    forward, full_extra = _kl_extra(model, tr, mask, sizes, 0.3) if with_kl else (None, None)

    full_graph_backward(fn, old, A, sizes, mask, obj, normaliser=12)
    if with_kl:
        full_extra().backward()
    g_full = _grads(model)
    calls = []
    counted = lambda t, i, g: calls.append((t, i.numel(), g)) or fn(t, i, g)  # noqa: E731
    loss, met = on_policy_chunk_backward(counted, old, A, sizes, mask, obj, normaliser=12, forward_with_extra=forward)
    g_fast = _grads(model)
    for a, b in zip(g_fast, g_full):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-8), (a - b).abs().max()
    assert met["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and met["num_units"] == int(mask.sum())
    if not with_kl:
        # every call has grad, and no selected transition is forwarded twice
        assert all(g for *_, g in calls) and len({t for t, *_ in calls}) == len(calls)


@pytest.mark.parametrize("sizes", [(2, 3, 4, 7), step_chunks(16), sequence_chunks(16)])
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("selected", ["half", "all"])  # "all": every row selects each unit (no index tensor)
def test_chunk_graph_equals_full_graph_off_policy(setup, sizes, batched, selected):
    from flowrl.sampling.rollout import rescore_transition
    from flowrl.objectives.chunk_gradient import chunk_graph_backward

    model, tr = setup  # weights moved after the rollout
    fn = make_step_log_prob_fn(model.fn_for, tr)
    old, K = tr.trainable_log_probs, len(sizes)
    mask = select_uniform(B, K, 0.5, torch.Generator().manual_seed(3))
    if selected == "all":
        mask = torch.ones(B, K, dtype=torch.bool)
    A = torch.tensor([1.0, -1.0, 0.5, -2.0, 1.5, -0.3])
    eps = _eps_for_clipping(fn, old, sizes)
    obj = ClippedObjective(eps, eps)
    positions = tr.trainable_indices.tolist()
    calls = []

    def many(ts, idx):  # a stand-in for a batched scorer: same numbers, stacked [len(ts), n]
        calls.append(idx)
        idx = torch.arange(B) if idx is None else idx  # None: every row
        return torch.stack([rescore_transition(model.fn_for(idx), tr, positions[t], idx).log_prob for t in ts])

    loss_full, met_full = full_graph_backward(fn, old, A, sizes, mask, obj, normaliser=12)
    g_full = _grads(model)
    loss, met = chunk_graph_backward(fn, old, A, sizes, mask, obj, normaliser=12, many=many if batched else None)
    g_graph = _grads(model)
    if batched:  # a unit every row selects is scored without an index tensor, others for their rows
        expected = [None if mask[:, u].all() else torch.nonzero(mask[:, u]).flatten().tolist()
                    for u in range(K) if mask[:, u].any()]
        assert [None if i is None else i.tolist() for i in calls] == expected
    assert torch.allclose(loss, loss_full, rtol=1e-5, atol=1e-9)
    assert met["clip_fraction"] == met_full["clip_fraction"]
    for a, b in zip(g_graph, g_full):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7), (a - b).abs().max()


@pytest.mark.parametrize("sizes", [(2, 3, 4, 7), sequence_chunks(16)])
@pytest.mark.parametrize("group", [2, 3, 16])
def test_the_fast_path_in_groups_of_steps_equals_one_step_at_a_time(on_policy, sizes, group):
    """``[train].update_group``: up to ``group`` steps of a unit in one batched forward and one
    backward give the per-step fast path's gradient and loss (float32 rounding), with one
    forward per group: ceil(|u| / group) calls per selected unit, each covering its steps once."""
    from flowrl.objectives.chunk_gradient import on_policy_chunk_backward
    from flowrl.sampling.rollout import rescore_transition

    model, tr = on_policy
    fn = make_step_log_prob_fn(model.fn_for, tr)
    old, K = tr.trainable_log_probs, len(sizes)
    mask = select_uniform(B, K, 0.5, torch.Generator().manual_seed(3))
    A = torch.tensor([1.0, -1.0, 0.0, -2.0, 1.5, -0.3])
    obj = ClippedObjective(1e-4, 1e-4)
    positions, calls = tr.trainable_indices.tolist(), []

    def many(ts, idx):  # a batched scorer: one call, [len(ts), n]
        calls.append(list(ts))
        return torch.stack([rescore_transition(model.fn_for(idx), tr, positions[t], idx).log_prob for t in ts])

    loss_one, met_one = on_policy_chunk_backward(fn, old, A, sizes, mask, obj, normaliser=12)
    g_one = _grads(model)
    loss, met = on_policy_chunk_backward(fn, old, A, sizes, mask, obj, normaliser=12, many=many, group=group)
    g_grouped = _grads(model)
    for a, b in zip(g_grouped, g_one):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-8), (a - b).abs().max()
    assert torch.allclose(loss, loss_one, rtol=1e-6) and met["num_units"] == met_one["num_units"]
    live = [u for u in range(K) if bool((mask[:, u] & (A != 0)).any())]
    assert len(calls) == sum(-(-sizes[u] // group) for u in live) and max(map(len, calls)) <= group
    starts = [sum(sizes[:u]) for u in range(K)]
    covered = sorted(t for ts in calls for t in ts)
    assert covered == sorted(t for u in live for t in range(starts[u], starts[u] + sizes[u]))
    with pytest.raises(ValueError, match="group must be >= 1"):
        on_policy_chunk_backward(fn, old, A, sizes, mask, obj, many=many, group=0)


def test_fast_path_is_the_lean_update_bit_for_bit_on_policy(on_policy):
    """On a deterministic device the fast path skips the no-grad forwards and nothing else."""
    from flowrl.objectives.chunk_gradient import on_policy_chunk_backward

    model, tr = on_policy
    fn = make_step_log_prob_fn(model.fn_for, tr)
    old, sizes = tr.trainable_log_probs, (2, 3, 4, 7)
    mask = select_uniform(B, 4, 0.5, torch.Generator().manual_seed(7))
    A = torch.tensor([1.0, -1.0, 0.5, -2.0, 1.5, -0.3])
    obj = ClippedObjective(5e-3, 5e-3)
    loss_lean, met_lean = lean_chunk_backward(fn, old, A, sizes, mask, obj, normaliser=12)
    g_lean = _grads(model)
    loss_fast, met_fast = on_policy_chunk_backward(fn, old, A, sizes, mask, obj, normaliser=12)
    g_fast = _grads(model)
    assert torch.equal(loss_lean, loss_fast) and met_lean == met_fast
    assert all(torch.equal(a, b) for a, b in zip(g_lean, g_fast))


class AlwaysBusyElsewhere:
    """A lockstep agreement in which another process always has work: every skip is refused."""

    def any(self, flag: bool) -> bool:
        return True


@pytest.mark.parametrize("path", ["lean", "fast", "chunk_graph"])
def test_lockstep_makes_the_same_calls_whatever_the_rows_and_keeps_the_gradient(setup, on_policy, path):
    """Under FSDP2 every process must make the same forwards and backwards. With an agreement
    that refuses every skip, the sequence of calls (position, grad) is the same for a micro-batch
    that selected nothing, one that selected everything and one in between, and the gradients
    and metrics equal those without lockstep (stand-in rows have weight 0)."""
    from flowrl.objectives.chunk_gradient import chunk_graph_backward, on_policy_chunk_backward

    model, tr = on_policy if path == "fast" else setup
    fn = make_step_log_prob_fn(model.fn_for, tr)
    old, sizes = tr.trainable_log_probs, (2, 3, 4, 7)
    A = torch.tensor([1.0, -1.0, 0.0, -2.0, 1.5, -0.3])
    obj = ClippedObjective(0.05, 0.05)
    backward = {"lean": lean_chunk_backward, "fast": on_policy_chunk_backward, "chunk_graph": chunk_graph_backward}[path]
    sequences = []
    masks = [torch.zeros(B, 4, dtype=torch.bool), select_uniform(B, 4, 0.5, torch.Generator().manual_seed(3)),
             torch.ones(B, 4, dtype=torch.bool)]
    masks[0][:, 0] = True  # every sample trains one unit (the contract); units 1-3 have no rows here
    for mask in masks:
        plain_loss, plain_met = backward(fn, old, A, sizes, mask, obj, normaliser=12)
        g_plain = _grads(model)
        calls = []
        counted = lambda t, i, g: calls.append((t, g)) or fn(t, i, g)  # noqa: E731
        loss, met = backward(counted, old, A, sizes, mask, obj, normaliser=12, lockstep=AlwaysBusyElsewhere())
        g_lock = _grads(model)
        for a, b in zip(g_lock, g_plain):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-9), (a - b).abs().max()
        assert torch.allclose(loss, plain_loss) and met == pytest.approx(plain_met)
        sequences.append(calls)
    assert sequences[0] == sequences[1] == sequences[2] and len(sequences[0]) >= 16
