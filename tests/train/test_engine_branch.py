"""Branch rollouts end to end on the embedded model (flowrl/sampling/branching.py): training runs,
the rollout runs fewer forwards than one full trajectory per sample, and the accounting says so.
BranchGRPO is two components: the tree, ``[window] use = "branch"``, and the tree advantage,
``[advantage] use = "tree"``; recipes and run directories with the old ``[sampler].branch_*``
keys still load, read as the new keys (flowrl/recipe/legacy.py)."""

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
BRANCH = ["window.use='branch'", "window.steps=[2, 6]", "window.factors=[2, 2]"]
TREE_ADVANTAGE = "advantage.use='tree'"


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
    """[advantage] use = 'tree': transition i of a group is trained once per node it leads into,
    and not at all where the group has one node (a transition every sample shares); with
    keep = 2 only 2 of the 4 leaves are trained below the last split. The update's forwards
    are exactly those (the on-policy fast path: one forward and one backward each)."""
    step = ["chunker.use='step'", "selector.use='all'", "train.iterations=2"]
    recipe = load_recipe(REPO / "recipes" / "quickstart_hacking.toml",
                         [*SMALL, *BRANCH, *step, TREE_ADVANTAGE, "advantage.keep=2",
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
        load_recipe(REPO / "recipes" / "quickstart_hacking.toml", [*SMALL, *BRANCH, TREE_ADVANTAGE])
    with pytest.raises(RecipeError, match="\\[advantage\\]: advantage 'tree' gives each transition of a tree rollout its "
                                          "own advantage, and \\[window\\] 'fixed' samples no trees"):
        load_recipe(REPO / "recipes" / "quickstart_hacking.toml", [*SMALL, *step, TREE_ADVANTAGE])
    with pytest.raises(RecipeError, match="unknown key 'keep'"):  # width pruning is the tree advantage's key
        load_recipe(REPO / "recipes" / "quickstart_hacking.toml", [*SMALL, *BRANCH, *step, "advantage.keep=2"])


def test_depth_pruning_leaves_the_pruned_steps_untrained_and_slides_the_window(tmp_path):
    """prune_steps = [12, 13, 14], sliding every iteration: the update skips those steps'
    transitions (4 leaves a group, 2 groups: 8 forwards a step fewer than the tree without
    pruning), and the window starts one step earlier at each iteration."""
    step = ["chunker.use='step'", "selector.use='all'", "train.iterations=2", TREE_ADVANTAGE]
    recipe = load_recipe(REPO / "recipes" / "quickstart_hacking.toml",
                         [*SMALL, *BRANCH, *step, "advantage.prune_steps=[12, 13, 14]",
                          "advantage.prune_slide=1", f"run.output_dir={str(tmp_path / 'pruned')!r}"])
    rows = read_metrics(train(recipe, console=quiet_console()))
    trained = node_blocks(recipe.sampler.steps, [2, 6], [2, 2])[1:-1]
    distinct = 2 * sum(0 if b == 4 else 4 // b for b in trained)  # the tree without pruning
    assert [r["branch/prune_start"] for r in rows] == [12, 11]
    for row in rows:
        assert row["compute/update/forward"] == row["compute/update/backward"] == distinct - 3 * 8, row
        assert row["compute/ratio"] == 1.0
    for extra, match in [(["advantage.prune_steps=[5, 5]"], "strictly increasing"),
                         (["advantage.prune_steps=[17]"], r"strictly increasing steps in \[0, steps = 17\)"),
                         (["advantage.prune_steps=[]"], "set prune_steps too"),
                         (["advantage.prune_steps=[4]"], "so it would never move")]:
        with pytest.raises(RecipeError, match=match):
            load_recipe(REPO / "recipes" / "quickstart_hacking.toml",
                        [*SMALL, *BRANCH, *step, "advantage.prune_steps=[12]", "advantage.prune_slide=1", *extra])


def test_branch_steps_from_a_dynamics_profile_are_filled_in_and_kept_in_the_run_recipe():
    from flowrl.dynamics.profile_file import read_profile, trainable_curve
    from flowrl.recipe import validate

    profile = REPO / "recipes" / "profiles" / "embedded_window16.json"
    sets = ["window.use='branch'", f"window.profile={str(profile)!r}", "window.count=2", "chunker.use='step'",
            "selector.use='all'"]
    recipe = load_recipe(REPO / "recipes" / "study_embedded.toml", sets)
    curve = trainable_curve(read_profile(profile), "l1rel", 16)
    top = sorted(sorted(range(16), key=lambda t: -curve[t])[:2])  # the window starts at step 0: position = step
    params = recipe.components["window"].params
    assert params.steps == top and params.factors == [2, 2]
    # the run's resolved recipe names both, and validates to the same tree (a resume)
    again = validate(recipe.to_toml_dict(), source="recipe.toml")
    assert (again.components["window"].params.steps, again.components["window"].params.factors) == (top, [2, 2])
    with pytest.raises(RecipeError, match="not what the profile gives"):
        load_recipe(REPO / "recipes" / "study_embedded.toml", [*sets, "window.steps=[5, 9]", "window.factors=[2, 2]"])
    with pytest.raises(RecipeError, match="go together"):
        load_recipe(REPO / "recipes" / "study_embedded.toml", sets[:2])
    with pytest.raises(RecipeError, match="exceeds the sampler's 16 trainable"):
        load_recipe(REPO / "recipes" / "study_embedded.toml", [*sets[:2], "window.count=17", *sets[3:],
                                                                 "train.group_size=131072"])


@pytest.mark.parametrize("extra,match", [
    (["window.factors=[2, 4]"], "must divide group_size"),
    (["sampler.batch_size=6"], "multiple of group_size"),
    (["window.steps=[2, 99]"], "strictly increasing"),
    (["window.steps=[6, 2]"], "strictly increasing"),
    (["window.steps=[]", "window.factors=[]"], "never splits"),
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
    with pytest.raises(RecipeError, match="\\[window\\]: \\[window\\] 'branch' samples each group as a tree, which needs "
                                          "whole groups on each process"):
        refuse_split_trees(recipe, resolve_geometry(recipe.train, 2, recipe.source), ctx)
    whole = resolve_geometry(recipe.train, 1, recipe.source)
    assert refuse_split_trees(recipe, whole, SimpleNamespace(world_size=1)) is whole


#: The tiny recipe (5 steps, T = 4, groups of 4) sampled as one tree per group, split at steps 1
#: and 2, with the tree advantage, width pruning to 2 leaves and a depth window from step 3 that
#: slides to step 2 after one iteration; step chunks, every chunk trained.
TREE = {"window": {"use": "branch", "steps": [1, 2], "factors": [2, 2]},
        "advantage": {"use": "tree", "keep": 2, "prune_steps": [3], "prune_slide": 1},
        "chunker": {"use": "step", "size": None}, "selector": {"use": "all", "fraction": None}}


def in_old_keys(resolved: dict) -> dict:
    """A resolved recipe (a run directory's recipe.toml) as flowrl wrote it before BranchGRPO was
    components: the tree and the tree advantage as ``[sampler].branch_*`` (all nine, as the
    resolved recipe held every key), ``[window] use = "fixed"`` and ``[advantage] use = "group_zscore"``."""
    data = {name: dict(table) if isinstance(table, dict) else table for name, table in resolved.items()}
    window, advantage = data.pop("window"), data.pop("advantage")
    tree = advantage["use"] == "tree"
    data["sampler"].update(
        branch_steps=window.get("steps", []), branch_factors=window.get("factors", []),
        branch_profile=window.get("profile", ""), branch_count=window.get("count", 0),
        branch_advantage="tree" if tree else "leaf", branch_keep=advantage.pop("keep", 0),
        branch_prune_steps=advantage.pop("prune_steps", []), branch_prune_slide=advantage.pop("prune_slide", 0),
        branch_fusion=advantage.pop("fusion", "mean"))
    data["window"] = {"use": "fixed"}
    data["advantage"] = {**advantage, "use": "group_zscore"} if tree else advantage
    return data


@pytest.mark.slow
def test_a_branch_run_resumes_exactly(tmp_path):
    """The tree's noise is keyed by (seed, iteration, global sample index) and the depth window
    by the iteration: nothing to checkpoint. Interrupted after iteration 1 (the window has moved),
    and resumed from its run directory's recipe.toml as flowrl wrote it before the tree was
    components ([sampler].branch_*): a run of the old keys resumes."""
    from engine_helpers import InterruptAt, assert_records_close, assert_weights_close, final_weights, load
    from tiny_recipe import ENGINE, tiny_recipe, write_recipe

    from flowrl.plugins import temporary_plugin
    from flowrl.recipe import dump_toml, read_toml

    (tmp_path / "ref").mkdir()
    recipe_path = write_recipe(tmp_path / "ref", tiny_recipe(ENGINE, TREE))
    ref_dir = train(load(recipe_path, f"run.output_dir={str(tmp_path / 'ref' / 'run')!r}"), console=quiet_console())
    run_dir = tmp_path / "run"
    with_tracker = write_recipe(tmp_path, tiny_recipe(ENGINE, TREE, trackers=[{"use": "interrupt_at"}]))
    with temporary_plugin(InterruptAt(1), name="interrupt-at-1"):
        with pytest.raises(KeyboardInterrupt):
            train(load(with_tracker, f"run.output_dir={str(run_dir)!r}"), console=quiet_console())
    saved = run_dir / "recipe.toml"
    old = in_old_keys(read_toml(saved))
    old.pop("trackers")  # the interrupting tracker (trackers may change on resume)
    assert old["window"] == {"use": "fixed"} and old["sampler"]["branch_keep"] == 2
    saved.write_text(dump_toml(old))
    train(load(saved), resume=run_dir, console=quiet_console())  # `flowrl train RUN/recipe.toml --resume RUN`
    got, want = read_metrics(run_dir), read_metrics(ref_dir)
    assert [r["iteration"] for r in got] == [r["iteration"] for r in want] == [0, 1, 2, 3]
    assert all(r["compute/rollout/saved"] > 0 for r in got)
    for a, b in zip(got, want):
        assert_records_close(a, b)
    assert_weights_close(final_weights(run_dir), final_weights(ref_dir))


def test_old_branch_keys_of_a_recipe_and_of_set_overrides_read_as_the_new_ones(tmp_path, capsys):
    """A recipe with the old [sampler].branch_* keys (in the file or by --set) loads as the same
    recipe in the new keys, with one notice naming them; its resolved recipe has only the new."""
    from tiny_recipe import ENGINE, tiny_recipe_data

    from flowrl.recipe import dump_toml, validate

    new = tiny_recipe_data(ENGINE, TREE, advantage={"std": "biased", "clip": 1.0, "fusion": "probability"})
    old = in_old_keys(validate(tiny_recipe_data(ENGINE, TREE, advantage={
        "std": "biased", "clip": 1.0, "fusion": "probability"}), source="new.toml").to_toml_dict())
    assert old["sampler"]["branch_fusion"] == "probability" and old["advantage"]["std"] == "biased"
    (tmp_path / "new.toml").write_text(dump_toml(new))
    (tmp_path / "old.toml").write_text(dump_toml(old))
    capsys.readouterr()
    want = load_recipe(tmp_path / "new.toml").to_toml_dict()
    assert capsys.readouterr().err == ""
    got = load_recipe(tmp_path / "old.toml").to_toml_dict()
    assert got == want and not any(k.startswith("branch_") for k in got["sampler"])
    (notice,) = capsys.readouterr().err.splitlines()
    assert notice.startswith(f"warning: {tmp_path / 'old.toml'}: old [sampler] keys read as their new ones: ")
    for moved in ("branch_steps -> [window].steps", "branch_factors -> [window].factors",
                  "branch_advantage -> [advantage] use = 'tree'", "branch_keep -> [advantage].keep",
                  "branch_prune_steps -> [advantage].prune_steps", "branch_prune_slide -> [advantage].prune_slide",
                  "branch_fusion -> [advantage].fusion"):
        assert moved in notice, (moved, notice)
    # by --set, on a recipe without them; a profile given so resolves against the current directory
    plain = tmp_path / "plain.toml"
    plain.write_text(dump_toml(tiny_recipe_data(ENGINE, {k: v for k, v in TREE.items() if k in ("chunker", "selector")})))
    sets = ["sampler.branch_steps=[1, 2]", "sampler.branch_factors=[2, 2]", "sampler.branch_advantage='tree'",
            "sampler.branch_keep=2", "sampler.branch_prune_steps=[3]", "sampler.branch_prune_slide=1"]
    by_set = load_recipe(plain, sets).to_toml_dict()
    direct = load_recipe(plain, ["window.use='branch'", "window.steps=[1, 2]", "window.factors=[2, 2]",
                                 "advantage.use='tree'", "advantage.keep=2", "advantage.prune_steps=[3]",
                                 "advantage.prune_slide=1"]).to_toml_dict()
    assert by_set == direct and by_set["window"]["steps"] == [1, 2] and by_set["advantage"]["keep"] == 2
    assert f"warning: {plain}: old [sampler] keys read as their new ones: branch_steps -> [window].steps" in (
        capsys.readouterr().err)


def test_a_run_directory_of_the_old_keys_resumes_with_the_recipe_that_started_it():
    """A run's recipe.toml of before the move (every [sampler].branch_* key) validates to the recipe
    of the new keys, silently when it never branched, and the resume check finds no difference."""
    from tiny_recipe import ENGINE, tiny_recipe_data

    from flowrl.recipe import validate

    for tables in (TREE, {"window": {"use": "branch", "steps": [2], "factors": [4]}}, {}):
        recipe = validate(tiny_recipe_data(ENGINE, tables), source="recipe.toml")
        old = in_old_keys(recipe.to_toml_dict())
        assert {k for k in old["sampler"] if k.startswith("branch_")} == {
            "branch_steps", "branch_factors", "branch_profile", "branch_count", "branch_advantage", "branch_keep",
            "branch_prune_steps", "branch_prune_slide", "branch_fusion"}
        assert validate(old, source="run/recipe.toml").to_toml_dict() == recipe.to_toml_dict()


def test_the_resume_check_accepts_an_old_run_directory(tmp_path, capsys):
    from tiny_recipe import ENGINE, tiny_recipe_data

    from flowrl.plugins import get_registry
    from flowrl.recipe import dump_toml, validate
    from flowrl.train.run_dir import check_resumable_recipe

    recipe = validate(tiny_recipe_data(ENGINE, TREE), source="recipe.toml")
    (tmp_path / "recipe.toml").write_text(dump_toml(in_old_keys(recipe.to_toml_dict())))
    check_resumable_recipe(recipe, tmp_path, get_registry())  # no difference
    changed = validate(tiny_recipe_data(ENGINE, TREE, advantage={"keep": 1}), source="recipe.toml")
    with pytest.raises(Exception, match=r"\[advantage\].keep: 2 in the run, 1 now"):
        check_resumable_recipe(changed, tmp_path, get_registry())
    # a run that never branched: the nine keys at their defaults are dropped without a word
    plain = validate(tiny_recipe_data(ENGINE), source="recipe.toml")
    (tmp_path / "recipe.toml").write_text(dump_toml(in_old_keys(plain.to_toml_dict())))
    capsys.readouterr()
    check_resumable_recipe(plain, tmp_path, get_registry())
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("recipe, extra, where, match", [
    # a window that plans its own windows has no tree: it was refused with the branch keys, and is now
    ("quickstart_mixgrpo.toml", [], "[sampler].branch_steps",
     ("[sampler].branch_steps is now [window] use = 'branch' (steps), and this recipe's [window] is 'sliding', which "
      "plans its own windows")),
    ("quickstart_hacking.toml", ["advantage.use=diversity", "sampler.branch_advantage='tree'"],
     "[sampler].branch_advantage", "is now [advantage] use = 'tree', which computes its leaves' advantages"),
    ("quickstart_hacking.toml", ["sampler.branch_keep=2"], "[sampler].branch_keep",
     "[sampler].branch_keep prunes a tree advantage; it is now [advantage].keep of [advantage] use = 'tree'"),
])
def test_old_branch_keys_without_a_new_home_are_refused_naming_the_new_keys(recipe, extra, where, match):
    with pytest.raises(RecipeError) as exc:
        load_recipe(REPO / "recipes" / recipe, [*SMALL, "sampler.branch_steps=[2, 6]", "sampler.branch_factors=[2, 2]",
                                                 *extra])
    assert exc.value.where == f"{REPO / 'recipes' / recipe}: {where}" and match in exc.value.message, exc.value


def test_the_tree_advantage_and_the_tree_are_refused_alone_or_empty():
    """One message each: the tree advantage without a window that samples trees; a branch window
    that never splits."""
    step = ["chunker.use='step'", "selector.use='all'"]
    with pytest.raises(RecipeError, match="samples no trees") as exc:
        load_recipe(REPO / "recipes" / "quickstart_mixgrpo.toml", [*SMALL, TREE_ADVANTAGE])
    assert exc.value.where.endswith("[advantage]") and "[window] use = 'branch'" in exc.value.hint
    with pytest.raises(RecipeError, match="never splits") as exc:
        load_recipe(REPO / "recipes" / "quickstart_hacking.toml", [*SMALL, *step, "window.use='branch'"])
    assert exc.value.where.endswith("[window]")


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
