"""Branch (tree) rollouts: flowrl/sampling/branching.py."""

import pytest
import torch

from flowrl.sampling.branching import (
    branch_forward_rows,
    branch_rollout,
    check_branches,
    first_of_block,
    live_rows_per_step,
    node_blocks,
    prune_leaves,
    pruned_steps,
    steps_of_highest_dynamics,
    tree_advantages,
)
from flowrl.sampling.kernels import FlowKernel
from flowrl.sampling.rollout import make_kernels, rescore_transition, rollout
from flowrl.sampling.schedules import shifted_sigmas

SHAPE = (2, 3, 3)
G = 4


class GroupVelocity(torch.nn.Module):
    """Row-wise MLP velocity conditioned on sigma and the prompt (group) embedding; counts rows."""

    def __init__(self, d=18, e=4):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(d + 1 + e, 32), torch.nn.Tanh(), torch.nn.Linear(32, d))
        self.emb = torch.randn(8, e)
        self.rows = 0

    def fn_for(self, batch_idx, offset=0):
        emb = self.emb[(torch.as_tensor(batch_idx) + offset) // G]

        def velocity(x, sigma):
            self.rows += x.shape[0]
            return self.net(torch.cat([x.flatten(1), sigma[:, None], emb], dim=1)).view_as(x)

        return velocity


def _setup(b=2 * G, offset=0):
    sig = shifted_sigmas(6, 3.0)
    kernels = make_kernels(6, FlowKernel(0.7))
    noise = torch.randn(b + offset, *SHAPE, generator=torch.Generator().manual_seed(1))[offset:]
    gens = [torch.Generator().manual_seed(100 + offset + j) for j in range(b)]
    gids = [(offset + j) // G for j in range(b)]
    return sig, kernels, noise, gens, gids


def _branch(model, steps, factors, b=2 * G, offset=0, **kw):
    sig, kernels, noise, gens, gids = _setup(b, offset)
    return branch_rollout(lambda rows: model.fn_for(rows, offset), noise, sig, kernels, group_size=G,
                          branch_steps=steps, branch_factors=factors, generators=gens, group_ids=gids, **kw)


def test_factor_one_equals_the_plain_rollout_bit_for_bit():
    model = GroupVelocity()
    sig, kernels, noise, gens, gids = _setup()
    plain = rollout(model.fn_for(torch.arange(2 * G)), noise, sig, kernels, generators=gens, group_ids=gids,
                    keep_means=True)
    tree = _branch(model, [1, 3], [1, 1], keep_means=True)
    for field in ("latents", "log_probs", "image_latents", "means", "trainable", "group_ids"):
        assert torch.equal(getattr(plain, field), getattr(tree, field)), field


def test_two_level_branch_shares_prefixes_and_differs_after():
    model = GroupVelocity()
    tree = _branch(model, [1, 3], [2, 2], keep_means=True)  # 1 root per group; 2 live rows from step 1, 4 from 3
    lat, lp, mu = tree.latents, tree.log_probs, tree.means
    for g0 in (0, G):
        grp = lat[g0 : g0 + G]
        # x_0, x_1 shared by the whole group; the transition 1 -> 2 is the first that differs
        assert all(torch.equal(grp[0, :2], grp[j, :2]) for j in range(G))
        assert torch.equal(lp[g0, :1].expand(G, 1), lp[g0 : g0 + G, :1])
        # x_2, x_3 shared within each pair of siblings, different across pairs
        assert torch.equal(grp[0, 2:4], grp[1, 2:4]) and torch.equal(grp[2, 2:4], grp[3, 2:4])
        assert not torch.equal(grp[0, 2], grp[2, 2])
        # the proposal means follow their states: transition 1 from the shared x_1, 3 from each pair's x_3
        assert all(torch.equal(mu[g0, 1], mu[g0 + j, 1]) for j in range(G))
        assert torch.equal(mu[g0, 3], mu[g0 + 1, 3]) and not torch.equal(mu[g0, 3], mu[g0 + 2, 3])
        # after step 3 every sample is its own
        assert not torch.equal(grp[0, 4], grp[1, 4]) and not torch.equal(grp[2, 4], grp[3, 4])
        assert not torch.equal(tree.image_latents[g0], tree.image_latents[g0 + 1])
    assert not torch.equal(lat[0, 1], lat[G, 1])  # groups differ (their roots' noise and prompts)


def test_the_shared_prefix_is_computed_once():
    model = GroupVelocity()
    _branch(model, [1, 3], [2, 2])
    per_group = live_rows_per_step(6, G, [1, 3], [2, 2])
    assert per_group == [1, 1, 2, 2, 4, 4]
    assert model.rows == 2 * sum(per_group) == 2 * branch_forward_rows(6, G, [1, 3], [2, 2]) == 28  # 48 plain


def test_rescoring_a_tree_is_on_policy():
    model = GroupVelocity()
    tree = _branch(model, [1, 3], [2, 2])
    for i in range(6):
        lp = rescore_transition(model.fn_for(torch.arange(2 * G)), tree, i).log_prob
        assert torch.allclose(lp, tree.log_probs[:, i], atol=1e-5), i


def test_a_group_draws_the_same_tree_alone_or_beside_another():
    """Keyed by global sample index: the second group rolled out alone (another process) is the same."""
    model = GroupVelocity()
    both = _branch(model, [1, 3], [2, 2])
    alone = _branch(model, [1, 3], [2, 2], b=G, offset=G)
    assert torch.allclose(both.latents[G:], alone.latents, atol=1e-6)
    assert torch.allclose(both.log_probs[G:], alone.log_probs, atol=1e-6)


@pytest.mark.parametrize("steps,factors,match", [
    ([1, 3], [2], "one entry each"),
    ([3, 1], [2, 2], "strictly increasing"),
    ([6], [2], "strictly increasing"),
    ([1], [0], ">= 1"),
    ([1, 3], [2, 4], "must divide the group size"),
])
def test_bad_branches_are_refused_with_one_message(steps, factors, match):
    with pytest.raises(ValueError, match=match):
        check_branches(steps, factors, 6, G)


# ----------------------------------------------------------------------------- tree advantages


def test_node_blocks_and_the_distinct_transitions_of_a_tree():
    # 2 roots of 2, split in 2 at step 1: x_0 and x_1 shared by pairs, x_2 on each leaf
    assert node_blocks(3, [1], [2]) == [2, 2, 1, 1]
    assert node_blocks(4, [0, 2], [2, 2]) == [4, 2, 2, 1, 1]
    assert first_of_block(4, node_blocks(4, [0, 2], [2, 2])).int().tolist() == [
        [1, 1, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]]


def test_tree_advantage_by_hand():
    # G = 4, one root, split in 2 before transitions 1 and 2: nodes {4}, {4}, {2, 2}, {1, 1, 1, 1}
    blocks = node_blocks(3, [1, 2], [2, 2])
    assert blocks == [4, 4, 2, 1]
    got = tree_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0]), blocks)
    # transition 0 is shared by all: 0; transition 1: nodes 1.5 and 4.5, unbiased std 3 / sqrt(2)
    half = 1.5 / (3 / 2**0.5)
    # transition 2: the leaves, mean 3, unbiased std sqrt(14 / 3)
    s = (14 / 3) ** 0.5
    want = torch.tensor([[0, -half, -2 / s], [0, -half, -1 / s], [0, half, 0], [0, half, 3 / s]])
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-7)


def _float64_tree(leaf, blocks, fusion, lp):
    """A second route: explicit nodes per depth, recursion over children, float64 throughout."""
    g, n = len(leaf), len(blocks) - 1

    def value(depth, first):  # the node of `depth` (state x_depth) whose block starts at sample `first`
        b = blocks[depth]
        if depth == n:
            return float(leaf[first])
        child = blocks[depth + 1]
        kids = [first + c * child for c in range(b // child)]
        vals = [value(depth + 1, k) for k in kids]
        if fusion == "mean" or len(kids) == 1:
            return sum(vals) / len(vals) if fusion == "mean" else vals[0]
        w = torch.softmax(torch.tensor([float(lp[k, depth]) for k in kids], dtype=torch.float64), 0)
        return float(sum(wi * v for wi, v in zip(w, vals)))

    out = torch.zeros(g, n, dtype=torch.float64)
    for i in range(n):
        b = blocks[i + 1]
        nodes = torch.tensor([value(i + 1, f) for f in range(0, g, b)], dtype=torch.float64)
        if len(nodes) > 1 and nodes.std() > 1e-6:
            out[:, i] = ((nodes - nodes.mean()) / nodes.std()).repeat_interleave(b)
    return out


@pytest.mark.parametrize("fusion", ["mean", "probability"])
def test_tree_advantage_equals_a_float64_recursion_and_ignores_affine_maps_of_the_leaves(fusion):
    gen = torch.Generator().manual_seed(3)
    blocks = node_blocks(6, [0, 2, 4], [2, 2, 2])  # G = 8 from one root
    leaf = torch.randn(8, generator=gen)
    lp = torch.randn(8, 6, generator=gen)
    got = tree_advantages(leaf, blocks, fusion=fusion, log_probs=lp)
    torch.testing.assert_close(got, _float64_tree(leaf, blocks, fusion, lp).float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tree_advantages(3.0 * leaf - 7.0, blocks, fusion=fusion, log_probs=lp), got,
                               rtol=1e-5, atol=1e-6)


def test_probability_fusion_with_equal_log_probs_is_the_mean():
    blocks = node_blocks(5, [1, 3], [2, 2])
    leaf = torch.tensor([0.3, -1.0, 2.0, 0.5])
    torch.testing.assert_close(tree_advantages(leaf, blocks, fusion="probability", log_probs=torch.zeros(4, 5)),
                               tree_advantages(leaf, blocks))


def test_probability_fusion_leans_to_the_likelier_child():
    blocks = node_blocks(3, [0, 1], [3, 2])  # one root, 3 nodes of 2 leaves after transition 0
    assert blocks == [6, 2, 1, 1]
    leaf = torch.tensor([10.0, 0.0, 4.0, 4.0, 5.0, 5.0])
    lp = torch.zeros(6, 3)
    lp[0, 1], lp[1, 1] = 4.0, -4.0  # the leaf with reward 10 is far likelier than its sibling
    mean = tree_advantages(leaf, blocks)
    prob = tree_advantages(leaf, blocks, fusion="probability", log_probs=lp)
    assert mean[0, 0] == mean[4, 0]  # nodes worth 5 and 5 by the mean
    assert prob[0, 0] > prob[4, 0] > prob[2, 0]  # about 10, 5 and 4 by probability
    assert torch.equal(mean[:, 1:], prob[:, 1:])  # below the last split nothing fuses


def test_tree_advantage_refuses_bad_blocks():
    with pytest.raises(ValueError, match="non-increasing divisors"):
        tree_advantages(torch.zeros(4), [4, 3, 1])
    with pytest.raises(ValueError, match="needs the rollout's log-probs"):
        tree_advantages(torch.zeros(4), [4, 2, 1], fusion="probability")


def test_width_pruning_trains_the_tails_of_the_strongest_leaves_only():
    blocks = node_blocks(3, [1, 2], [2, 2])  # tails: transition 2 (below the last split)
    tree = tree_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0]), blocks)
    pruned = prune_leaves(tree, blocks, keep=2)
    # |leaf advantages| at transition 2: 0.93, 0.46, 0, 1.39 -> samples 3 and 0 keep theirs
    assert torch.equal(pruned[:, :2], tree[:, :2])  # above the last split nothing changes
    assert pruned[:, 2].tolist() == [tree[0, 2].item(), 0.0, 0.0, tree[3, 2].item()]
    assert torch.equal(prune_leaves(tree, blocks, keep=0), tree) and torch.equal(prune_leaves(tree, blocks, keep=4), tree)


def test_depth_pruning_slides_one_step_earlier_per_interval_and_stops_at_the_last_split():
    # by hand: window [13, 14, 15], one step earlier every 2 iterations, never before step 10
    assert [pruned_steps([13, 14, 15], 2, it, 10) for it in (0, 1, 2, 3, 4, 6, 100)] == [
        [13, 14, 15], [13, 14, 15], [12, 13, 14], [12, 13, 14], [11, 12, 13], [10, 11, 12], [10, 11, 12]]
    assert pruned_steps([13, 14], 0, 50, 10) == [13, 14]  # slide 0: fixed
    assert pruned_steps([4, 9], 1, 7, 6) == [4, 9]  # starts above the last split: stays
    assert pruned_steps([], 1, 7, 6) == []


def test_branch_steps_go_where_the_dynamics_are_highest():
    positions = [4, 5, 6, 7, 8]  # the trainable transitions' steps (an SDE window from step 4)
    curve = [0.2, 0.9, 0.1, 0.9, 0.5]
    assert steps_of_highest_dynamics(curve, positions, 2) == [5, 7]
    assert steps_of_highest_dynamics(curve, positions, 3) == [5, 7, 8]
    assert steps_of_highest_dynamics([1.0, 1.0, 1.0], [0, 1, 2], 1) == [0]  # ties: the earlier
    with pytest.raises(ValueError, match="one curve value per position"):
        steps_of_highest_dynamics(curve, positions, 6)


# ----------------------------------------------------------------------------- as components


def test_the_branch_window_is_a_window_planner_that_samples_trees():
    from flowrl.plugins import get_registry
    from flowrl.interfaces import SamplesTrees
    from flowrl.sampling.branching import BranchConfig, Tree
    from flowrl.testing.components import check_component

    window = get_registry().get("window", "branch").build(BranchConfig(steps=[1, 3], factors=[2, 2]))
    assert isinstance(window, SamplesTrees) and check_component("window", window) == ["WindowPlanner", "SamplesTrees"]
    tree = window.tree()
    assert tree == Tree((1, 3), (2, 2)) and tree.last_step == 3
    assert tree.forward_rows(6, G) == branch_forward_rows(6, G, [1, 3], [2, 2])
    assert tree.blocks(6) == node_blocks(6, [1, 3], [2, 2])
    fixed = get_registry().get("window", "fixed").build()
    assert not isinstance(fixed, SamplesTrees)
    for kwargs, match in [({"steps": [1, 3], "factors": [2]}, "one entry each"),
                          ({"steps": [3, 1], "factors": [2, 2]}, "strictly increasing"),
                          ({"count": 2}, "go together")]:
        with pytest.raises(ValueError, match=match):
            BranchConfig(**kwargs)


def test_the_tree_advantage_is_the_group_zscore_per_sample_and_the_tree_per_transition():
    from flowrl.plugins import get_registry
    from flowrl.interfaces import AdvantagesOnTrees
    from flowrl.sampling.branching import Tree, tree_unit_advantages
    from flowrl.testing.components import check_component

    registry = get_registry()
    comp = registry.get("advantage", "tree")
    estimator = comp.build(comp.params(std="biased", clip=1.0, keep=2, prune_steps=[4], prune_slide=1))
    assert isinstance(estimator, AdvantagesOnTrees) and check_component("advantage", estimator) == ["AdvantageEstimator", "AdvantagesOnTrees"]
    assert not isinstance(registry.get("advantage", "group_zscore").build(None), AdvantagesOnTrees)
    zscore = registry.get("advantage", "group_zscore")
    same = zscore.build(zscore.params(std="biased", clip=1.0))
    rewards, groups = {"r": torch.rand(2 * G, generator=torch.Generator().manual_seed(5))}, torch.arange(2 * G) // G
    leaf = estimator(rewards, {"r": 1.0}, groups)
    assert torch.equal(leaf, same(rewards, {"r": 1.0}, groups))
    # per transition: the tree of the rollout, depth pruning slid by the iteration, width pruning
    traj = _branch(GroupVelocity(), [1, 3], [2, 2])
    tree = Tree((1, 3), (2, 2))
    for iteration, pruned in ((0, [4]), (1, [3]), (5, [3])):  # slides from step 4 to the last split, 3
        got = estimator.on_tree(leaf, traj, tree, G, iteration)
        want = tree_unit_advantages(leaf, traj, tree, G, fusion="mean", keep=2, pruned=pruned)
        assert torch.equal(got.advantages, want[0]) and torch.equal(got.trained, want[1])
        assert got.metrics == {"branch/prune_start": pruned[0]}
        positions = torch.nonzero(traj.trainable).flatten().tolist()
        assert not got.trained[:, positions.index(pruned[0])].any()
        assert bool((got.advantages[~got.trained] == 0).all())
    # its own checks against the tree and the sampler
    for params, match in [({"keep": G}, "keeps every leaf of a group of 4"),
                          ({"prune_steps": [6]}, r"in \[0, steps = 6\)"),
                          ({"prune_steps": [2, 4], "prune_slide": 1}, "would never move"),
                          ({"prune_steps": [0, 1, 2, 3, 4]}, "prunes every trainable transition")]:
        with pytest.raises(ValueError, match=match):
            comp.build(comp.params(**params)).check_tree(tree, [0, 1, 2, 3, 4], 6, G)
    comp.build(comp.params(keep=2, prune_steps=[4, 5], prune_slide=1)).check_tree(tree, [0, 1, 2, 3, 4], 6, G)
