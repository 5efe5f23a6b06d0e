"""Branch rollouts end to end on the embedded model (flowrl/sampling/branching.py): training runs,
the rollout runs fewer forwards than one full trajectory per sample, and the accounting says so."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import quiet_console

from flowrl.errors import RecipeError
from flowrl.recipe import load_recipe
from flowrl.runlog import read_metrics
from flowrl.sampling.branching import branch_forward_rows, node_blocks
from flowrl.train import train

REPO = Path(__file__).resolve().parents[2]
SMALL = ["train.prompts_per_iteration=2", "train.group_size=4", "train.micro_batch_size=4",
         "prompts.num_eval=0", "log.progress=false", "log.image_every=0", "model.random_init=true"]
BRANCH = ["sampler.branch_steps=[2, 6]", "sampler.branch_factors=[2, 2]"]


def test_branch_rollouts_train_two_iterations_with_fewer_rollout_forwards(tmp_path):
    recipe = load_recipe(REPO / "recipes" / "quickstart_hacking.toml",
                         [*SMALL, *BRANCH, "train.iterations=2", f"run.output_dir={str(tmp_path / 'run')!r}"])
    rows = read_metrics(train(recipe, console=quiet_console()))
    assert len(rows) == 2
    steps = recipe.sampler.steps
    run = 2 * branch_forward_rows(steps, 4, [2, 6], [2, 2])  # 2 groups of 4
    for row in rows:
        assert row["compute/rollout/forward"] == run < steps * 8
        assert row["compute/rollout/saved"] == steps * 8 - run
        assert row["compute/ratio"] == 1.0, row


def test_a_tree_advantage_trains_each_distinct_transition_once_and_prunes_leaves(tmp_path):
    """branch_advantage = 'tree': transition i of a group is trained once per node it leads into,
    and not at all where the group has one node (a transition every sample shares); with
    branch_keep = 2 only 2 of the 4 leaves are trained below the last split. The update's forwards
    are exactly those (the on-policy fast path: one forward and one backward each)."""
    step = ["chunker.use='step'", "selector.use='all'", "train.iterations=2"]
    recipe = load_recipe(REPO / "recipes" / "quickstart_hacking.toml",
                         [*SMALL, *BRANCH, *step, "sampler.branch_advantage='tree'", "sampler.branch_keep=2",
                          f"run.output_dir={str(tmp_path / 'tree')!r}"])
    rows = read_metrics(train(recipe, console=quiet_console()))
    blocks = node_blocks(recipe.sampler.steps, [2, 6], [2, 2])  # G = 4: one root per group
    trained = blocks[1:-1]  # the last transition is not trainable (the image is x0_hat)
    # per group: nothing where it has one node (advantage 0), each node once above the last
    # split, and 2 leaves below it
    distinct = 2 * sum(0 if b == 4 else (2 if b == 1 else 4 // b) for b in trained)
    assert distinct == 2 * (2 * 4 + 2 * 10) < 2 * 4 * len(trained)
    for row in rows:
        assert row["compute/update/forward"] == row["compute/update/backward"] == distinct, row
        assert row["compute/ratio"] == 1.0 and row["advantage/tree/std"] > 0
    with pytest.raises(RecipeError, match="needs step units"):
        load_recipe(REPO / "recipes" / "quickstart_hacking.toml", [*SMALL, *BRANCH, "sampler.branch_advantage='tree'"])
    with pytest.raises(RecipeError, match="needs branch rollouts"):
        load_recipe(REPO / "recipes" / "quickstart_hacking.toml", [*SMALL, *step, "sampler.branch_advantage='tree'"])
    with pytest.raises(RecipeError, match="set branch_advantage = 'tree' too"):
        load_recipe(REPO / "recipes" / "quickstart_hacking.toml", [*SMALL, *BRANCH, *step, "sampler.branch_keep=2"])


def test_depth_pruning_leaves_the_pruned_steps_untrained_and_slides_the_window(tmp_path):
    """branch_prune_steps = [12, 13, 14], sliding every iteration: the update skips those steps'
    transitions (4 leaves a group, 2 groups: 8 forwards a step fewer than the tree without
    pruning), and the window starts one step earlier at each iteration."""
    step = ["chunker.use='step'", "selector.use='all'", "train.iterations=2", "sampler.branch_advantage='tree'"]
    recipe = load_recipe(REPO / "recipes" / "quickstart_hacking.toml",
                         [*SMALL, *BRANCH, *step, "sampler.branch_prune_steps=[12, 13, 14]",
                          "sampler.branch_prune_slide=1", f"run.output_dir={str(tmp_path / 'pruned')!r}"])
    rows = read_metrics(train(recipe, console=quiet_console()))
    trained = node_blocks(recipe.sampler.steps, [2, 6], [2, 2])[1:-1]
    distinct = 2 * sum(0 if b == 4 else 4 // b for b in trained)  # the tree without pruning
    assert [r["branch/prune_start"] for r in rows] == [12, 11]
    for row in rows:
        assert row["compute/update/forward"] == row["compute/update/backward"] == distinct - 3 * 8, row
        assert row["compute/ratio"] == 1.0
    for extra, match in [(["sampler.branch_advantage='leaf'"], "set branch_advantage = 'tree'"),
                         (["sampler.branch_prune_steps=[5, 5]"], "strictly increasing"),
                         (["sampler.branch_prune_steps=[]"], "set branch_prune_steps too")]:
        with pytest.raises(RecipeError, match=match):
            load_recipe(REPO / "recipes" / "quickstart_hacking.toml",
                        [*SMALL, *BRANCH, *step, "sampler.branch_prune_steps=[12]", "sampler.branch_prune_slide=1",
                         *extra])


def test_branch_steps_from_a_dynamics_profile_are_filled_in_and_kept_in_the_run_recipe():
    from flowrl.dynamics.profile_file import read_profile, trainable_curve
    from flowrl.recipe import validate

    profile = REPO / "recipes" / "profiles" / "embedded_window16.json"
    sets = [f"sampler.branch_profile={str(profile)!r}", "sampler.branch_count=2", "chunker.use='step'",
            "selector.use='all'"]
    recipe = load_recipe(REPO / "recipes" / "study_embedded.toml", sets)
    curve = trainable_curve(read_profile(profile), "l1rel", 16)
    top = sorted(sorted(range(16), key=lambda t: -curve[t])[:2])  # the window starts at step 0: position = step
    assert recipe.sampler.branch_steps == top and recipe.sampler.branch_factors == [2, 2]
    # the run's resolved recipe names both, and validates to the same tree (a resume)
    again = validate(recipe.to_toml_dict(), source="recipe.toml")
    assert (again.sampler.branch_steps, again.sampler.branch_factors) == (top, [2, 2])
    with pytest.raises(RecipeError, match="not what branch_profile gives"):
        load_recipe(REPO / "recipes" / "study_embedded.toml", [*sets, "sampler.branch_steps=[5, 9]",
                                                                 "sampler.branch_factors=[2, 2]"])
    with pytest.raises(RecipeError, match="go together"):
        load_recipe(REPO / "recipes" / "study_embedded.toml", [f"sampler.branch_profile={str(profile)!r}"])
    with pytest.raises(RecipeError, match="exceeds the sampler's 16 trainable"):
        load_recipe(REPO / "recipes" / "study_embedded.toml", [*sets[:1], "sampler.branch_count=17", *sets[2:],
                                                                 "train.group_size=131072"])


@pytest.mark.parametrize("extra,match", [
    (["sampler.branch_factors=[2, 4]"], "must divide group_size"),
    (["sampler.batch_size=6"], "multiple of group_size"),
    (["sampler.branch_steps=[2, 99]"], "strictly increasing"),
])
def test_branch_recipes_are_checked_before_anything_loads(extra, match):
    with pytest.raises(RecipeError, match=match):
        load_recipe(REPO / "recipes" / "quickstart_hacking.toml", [*SMALL, *BRANCH, *extra])


def test_branch_rollouts_refuse_groups_split_across_processes():
    from types import SimpleNamespace

    from flowrl.geometry import resolve_geometry
    from flowrl.train.loop import refuse_split_trees

    recipe = load_recipe(REPO / "recipes" / "quickstart_hacking.toml",
                         [*SMALL, *BRANCH, "train.prompts_per_iteration=1", "train.micro_batch_size=2"])
    ctx = SimpleNamespace(world_size=2)
    with pytest.raises(RecipeError, match="whole groups on each process"):
        refuse_split_trees(recipe, resolve_geometry(recipe.train, 2, recipe.source), ctx)
    whole = resolve_geometry(recipe.train, 1, recipe.source)
    assert refuse_split_trees(recipe, whole, SimpleNamespace(world_size=1)) is whole


#: The tiny recipe (5 steps, T = 4, groups of 4) sampled as one tree per group, split at steps 1
#: and 2, with the tree advantage, width pruning to 2 leaves and a depth window from step 3 that
#: slides to step 2 after one iteration; step chunks, every chunk trained.
TREE = {"sampler": {"branch_steps": [1, 2], "branch_factors": [2, 2], "branch_advantage": "tree", "branch_keep": 2,
                    "branch_prune_steps": [3], "branch_prune_slide": 1},
        "chunker": {"use": "step", "size": None}, "selector": {"use": "all", "fraction": None}}


@pytest.mark.slow
def test_a_branch_run_resumes_exactly(tmp_path):
    """The tree's noise is keyed by (seed, iteration, global sample index) and the depth window
    by the iteration: nothing to checkpoint. Interrupted after iteration 1 (the window has moved)."""
    from engine_helpers import InterruptAt, assert_records_close, assert_weights_close, final_weights, load
    from tiny_recipe import ENGINE, tiny_recipe, write_recipe

    from flowrl.plugins import temporary_plugin

    (tmp_path / "ref").mkdir()
    recipe_path = write_recipe(tmp_path / "ref", tiny_recipe(ENGINE, TREE))
    ref_dir = train(load(recipe_path, f"run.output_dir={str(tmp_path / 'ref' / 'run')!r}"), console=quiet_console())
    run_dir = tmp_path / "run"
    with_tracker = write_recipe(tmp_path, tiny_recipe(ENGINE, TREE, trackers=[{"use": "interrupt_at"}]))
    with temporary_plugin(InterruptAt(1), name="interrupt-at-1"):
        with pytest.raises(KeyboardInterrupt):
            train(load(with_tracker, f"run.output_dir={str(run_dir)!r}"), console=quiet_console())
    train(load(recipe_path, f"run.output_dir={str(run_dir)!r}"), resume=run_dir, console=quiet_console())
    got, want = read_metrics(run_dir), read_metrics(ref_dir)
    assert [r["iteration"] for r in got] == [r["iteration"] for r in want] == [0, 1, 2, 3]
    assert all(r["compute/rollout/saved"] > 0 for r in got)
    for a, b in zip(got, want):
        assert_records_close(a, b)
    assert_weights_close(final_weights(run_dir), final_weights(ref_dir))


def test_branch_rollouts_refuse_a_window_plan_before_anything_loads():
    """Refused by validation (it was refused at the first rollout, after the model had loaded)."""
    with pytest.raises(RecipeError, match="'sliding' plans its own windows"):
        load_recipe(REPO / "recipes" / "quickstart_mixgrpo.toml", [*SMALL, *BRANCH, "train.iterations=1"])


def test_two_processes_draw_and_train_the_trees_of_one(tmp_path):
    """Branch rollouts with the tree advantage and both prunings: 2 processes, one group each,
    equal 1 process with both groups, with evaluation, grids and checkpoints on."""
    from engine_helpers import assert_same_run, two_processes_and_one
    from tiny_recipe import ENGINE, tiny_recipe, write_recipe

    recipe = write_recipe(tmp_path, tiny_recipe(ENGINE, TREE))
    # one optimizer step per pass: with more, each step's samples depend on the layout (loop.py)
    sets = ["train.iterations=2", "train.optimizer_steps_per_update=1", "log.eval_every=1", "prompts.num_eval=2",
            "log.image_every=1", "checkpoint.every=1"]
    two, one = two_processes_and_one(recipe, sets, tmp_path)
    rec1 = read_metrics(one)
    assert [r["branch/prune_start"] for r in rec1 if "lr" in r] == [3, 2]
    assert all(r["compute/rollout/saved"] > 0 for r in rec1 if "lr" in r)
    assert_same_run(two, one)
    assert list(two.rglob("*.png"))
