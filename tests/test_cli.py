"""The core CLI commands (validate, plugins, train's option parsing) and main()'s error handling.

Every recipe error must reach the user as one short message naming the file and the key, exit
status 2 and no traceback. The subprocess checks are batched into one interpreter (see
``run_cli_batch`` in conftest.py); one check runs the real console script.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import typer

from flowrl import cli
from flowrl.errors import RecipeError
from flowrl.recipe import apply_overrides, load_recipe

REPO = Path(__file__).resolve().parents[1]
FIX = "tests/fixtures/recipes"
QUICK = "recipes/quickstart_hacking.toml"

#: name -> (argv, the file or location the message must name, fragments the message must contain)
ERRORS = {
    "toml_syntax": (["validate", f"{FIX}/syntax_error.toml"], f"{FIX}/syntax_error.toml",
                    ["TOML syntax error", "line 4"]),
    "unknown_table": (["validate", f"{FIX}/unknown_table.toml"], f"{FIX}/unknown_table.toml",
                      ["unknown table [chunkr]", "did you mean 'chunker'?"]),
    "unknown_key": (["validate", f"{FIX}/unknown_key.toml"], f"{FIX}/unknown_key.toml",
                    ["[train]", "unknown key 'iteration'", "did you mean 'iterations'?"]),
    "unknown_component_key": (["validate", f"{FIX}/unknown_component_key.toml"], f"{FIX}/unknown_component_key.toml",
                              ["[chunker] (chunker 'explicit')", "unknown key 'size'", "did you mean 'sizes'?"]),
    "misspelt_component": (["validate", f"{FIX}/misspelt_component.toml"], f"{FIX}/misspelt_component.toml",
                           ["[chunker].use", "unknown chunker 'explict'", "did you mean 'explicit'?"]),
    "wrong_type": (["validate", f"{FIX}/wrong_type.toml"], f"{FIX}/wrong_type.toml",
                   ["[train]", "key 'lr' must be float, got 'fast'", "AdamW learning rate."]),
    "negative_count": (["validate", f"{FIX}/negative_count.toml"], f"{FIX}/negative_count.toml",
                       ["[train]", "key 'group_size' must be >= 2, got -4"]),
    "missing_use": (["validate", f"{FIX}/missing_use.toml"], f"{FIX}/missing_use.toml",
                    ["[chunker]", "required key 'use' is missing", "explicit"]),
    "chunk_sum": (["validate", f"{FIX}/bad_chunk_sum.toml"], f"{FIX}/bad_chunk_sum.toml",
                  ["[chunker]", "sum to 9", "must sum to the number of trainable transitions T = 16"]),
    "no_reward": (["validate", f"{FIX}/no_reward.toml"], f"{FIX}/no_reward.toml",
                  ["[[rewards]]", "no reward"]),
    "missing_file": (["validate", f"{FIX}/does_not_exist.toml"], f"{FIX}/does_not_exist.toml",
                     ["recipe file not found"]),
    "set_without_equals": (["validate", QUICK, "--set", "train.lr"], "--set",
                           ["override 'train.lr' must look like section.key=value"]),
    "set_without_key": (["validate", QUICK, "--set", "lr=3"], "--set", ["must name a section and a key"]),
    "set_into_a_value": (["validate", QUICK, "--set", "train.lr.x=1"], "--set",
                         ["'train.lr' is a value", "not a table"]),
    "set_bad_index": (["validate", QUICK, "--set", "rewards.7.weight=1"], "--set", ["no entry 7"]),
    "set_unknown_table": (["validate", QUICK, "--set", "trian.lr=1"], QUICK,
                          ["unknown table [trian]", "did you mean 'train'?"]),
    "set_unknown_key": (["validate", QUICK, "--set", "train.lrr=1"], QUICK,
                        ["[train]", "unknown key 'lrr'", "did you mean 'lr'?"]),
    "set_wrong_type": (["validate", QUICK, "--set", "train.lr=fast"], QUICK,
                       ["[train]", "key 'lr' must be float, got 'fast'"]),
    "set_out_of_range": (["validate", QUICK, "--set", "train.iterations=0"], QUICK,
                         ["[train]", "key 'iterations' must be >= 1, got 0"]),
    "set_bad_component": (["validate", QUICK, "--set", "chunker.use=fixd"], QUICK,
                          ["[chunker].use", "unknown chunker 'fixd'", "did you mean 'fixed'?"]),
    "set_breaks_chunk_sum": (["validate", QUICK, "--set", "sampler.steps=9"], QUICK,
                             ["[chunker]", "must sum to the number of trainable transitions T = 8"]),
    "validate_without_recipe": (["validate"], "validate", ["needs a RECIPE path"]),
    "train_bad_recipe": (["train", f"{FIX}/wrong_type.toml", "-o", "/tmp/flowrl-never-written"],
                         f"{FIX}/wrong_type.toml", ["key 'lr' must be float"]),
    "train_bad_set": (["train", QUICK, "--set", "train.iterations=-1"], QUICK,
                      ["key 'iterations' must be >= 1, got -1"]),
}

#: usage errors (click) must be short messages too
USAGE = {
    "unknown_option": ["validate", "--bogus", QUICK],
    "unknown_command": ["valdate", QUICK],
    "train_bad_int": ["train", QUICK, "--num-processes", "many"],
}

OK = {
    "quickstart": ["validate", QUICK],
    "minimal_defaults": ["validate", f"{FIX}/minimal.toml"],
    "switch_chunker": ["validate", QUICK, "--set", "sampler.steps=9", "--set", "chunker.use=sequence"],
    "switch_chunker_with_param": ["validate", QUICK, "--set", "chunker.use=fixed", "--set", "chunker.size=5"],
    "set_reward_label": ["validate", QUICK, "--set", "rewards.1.name=correct", "-s", "rewards.1.weight=0.5"],
    "explain_all": ["validate", "--explain"],
    "explain_recipe": ["validate", "--explain", QUICK],
    "plugins_table": ["plugins"],
    "plugins_json": ["plugins", "--json"],
}


@pytest.fixture(scope="module")
def results(flowrl_cli):
    calls = {**{k: v[0] for k, v in ERRORS.items()}, **USAGE, **OK,
             "debug": ["--debug", "validate", f"{FIX}/wrong_type.toml"]}
    return dict(zip(calls, flowrl_cli.batch(list(calls.values()))))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ERRORS))
def test_user_error_is_one_short_message_without_traceback(results, name):
    _, where, fragments = ERRORS[name]
    r = results[name]
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert r.stderr.lstrip().startswith("error:"), r.stderr
    assert sum(line.startswith("error:") for line in r.stderr.splitlines()) == 1
    assert len(r.stderr.strip().splitlines()) <= 4, r.stderr  # what/where on one line, one hint
    assert where in r.flat_err
    for fragment in fragments:
        assert fragment in r.flat_err, f"{fragment!r} not in {r.flat_err!r}"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(USAGE))
def test_usage_errors_have_no_traceback(results, name):
    r = results[name]
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert "Error" in r.stderr and "Usage" in r.stderr


@pytest.mark.slow
def test_debug_shows_the_traceback(results):
    r = results["debug"]
    assert r.returncode != 0
    assert "Traceback" in r.stderr and "RecipeError" in r.stderr and "key 'lr' must be float" in r.stderr


def test_real_console_script_prints_no_traceback(flowrl_cli):
    """The installed `flowrl` script itself (not only main() called from Python)."""
    proc = subprocess.run(
        [str(flowrl_cli.script), "validate", f"{FIX}/unknown_table.toml"],
        cwd=REPO, env=flowrl_cli.env(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "unknown table [chunkr]" in proc.stderr and f"{FIX}/unknown_table.toml" in proc.stderr


@pytest.mark.slow
def test_valid_recipes_and_set_overrides(results):
    for name in ("quickstart", "minimal_defaults", "switch_chunker", "switch_chunker_with_param", "set_reward_label"):
        assert results[name].returncode == 0, (name, results[name].stderr)
        assert "Traceback" not in results[name].stderr
    assert "chunker=explicit" in results["quickstart"].flat_out and "T=16" in results["quickstart"].flat_out
    # omitted tables come from the plugins' defaults
    assert "model=embedded" in results["minimal_defaults"].flat_out
    # switching chunker.use drops the explicit chunker's `sizes`; 9 steps give T = 8
    assert "chunker=sequence" in results["switch_chunker"].flat_out and "T=8" in results["switch_chunker"].flat_out
    assert "chunker=fixed" in results["switch_chunker_with_param"].flat_out
    assert "rewards=['area', 'correct']" in results["set_reward_label"].flat_out


def test_set_overrides_reach_the_recipe():
    recipe = load_recipe(
        REPO / QUICK,
        [
            "train.lr=1e-3",
            "run.name=renamed",  # a bare word is a string
            "train.adam_betas=[0.8, 0.95]",
            "log.progress=false",
            "rewards.0.weight=2.5",
            "chunker.use=fixed",
            "chunker.size=5",
            "schedule.shift=1.5",  # same component: its other keys stay
        ],
    )
    assert recipe.train.lr == 1e-3 and isinstance(recipe.train.lr, float)
    assert recipe.run.name == "renamed" and recipe.output_dir == Path("runs/renamed")
    assert recipe.train.adam_betas == [0.8, 0.95]
    assert recipe.log.progress is False
    assert recipe.rewards[0].weight == 2.5 and recipe.rewards[1].weight == 0.0
    assert recipe.components["chunker"].use == "fixed" and recipe.components["chunker"].params.size == 5
    assert recipe.components["schedule"].params.shift == 1.5
    assert recipe.components["kernel"].params.a == 0.7  # untouched keys keep the file's values
    # setting `use` to the name already there keeps the parameters
    recipe = load_recipe(REPO / QUICK, ["chunker.use=explicit"])
    assert recipe.components["chunker"].params.sizes == [2, 3, 4, 7]
    # a table the file omits is created
    assert load_recipe(REPO / f"{FIX}/minimal.toml", ["chunker.use=sequence"]).components["chunker"].use == "sequence"


def test_apply_overrides_does_not_crash_on_non_tables():
    with pytest.raises(RecipeError, match="'train.lr' is a value"):
        apply_overrides({"train": {"lr": 1.0}}, ["train.lr.x.y=1"])
    with pytest.raises(RecipeError, match="'train' is a value"):
        apply_overrides({"train": 3}, ["train.lr=1"])
    with pytest.raises(RecipeError, match="not a list index"):
        apply_overrides({"rewards": [{"use": "a"}]}, ["rewards.0=1"])


@pytest.mark.slow
def test_explain_prints_the_documentation_of_the_keys(results):
    r = results["explain_all"]
    assert r.returncode == 0, r.stderr
    out = r.flat_out
    assert '[chunker] use = "explicit"' in out
    assert "Chunk sizes in sampling order; must sum to the number of trainable transitions T" in out
    assert "AdamW learning rate." in out  # plain tables too
    assert '[[rewards]] use = "brightness"' in out
    r = results["explain_recipe"]
    assert r.returncode == 0, r.stderr
    out = r.flat_out
    # with a recipe: only the components it uses, then the usual "ok" line
    assert "Chunk sizes in sampling order" in out
    assert '[chunker] use = "fixed"' not in out
    assert "ok recipes/quickstart_hacking.toml" in out


@pytest.mark.slow
def test_plugins_command(results):
    table, js = results["plugins_table"], results["plugins_json"]
    assert table.returncode == 0 and js.returncode == 0, (table.stderr, js.stderr)
    listing = json.loads(js.stdout)
    names = [p["plugin"] for p in listing]
    assert {"chunkers", "embedded"} <= set(names)
    for p in listing:
        assert set(p) == {"plugin", "distribution", "version", "module", "components"}
        assert p["plugin"] in table.stdout
    assert "chunker:explicit" in table.flat_out


# ----------------------------------------------------------------------------- in-process main()


def test_train_option_parsing(monkeypatch, tmp_path):
    """train hands the engine the validated recipe with -o, --set, --resume and --dry-run applied."""
    import flowrl.train

    prev = tmp_path / "prev"  # --resume needs a run directory (one with the recipe training wrote)
    prev.mkdir()
    (prev / "recipe.toml").write_text((REPO / QUICK).read_text())

    seen = {}

    def fake_train(recipe, *, resume=None, dry_run=False, console=None, registry=None):
        seen.update(recipe=recipe, resume=resume, dry_run=dry_run)

    monkeypatch.setattr(flowrl.train, "train", fake_train)
    cli.main(["train", str(REPO / QUICK), "-o", "/tmp/flowrl-out dir", "--set", "train.iterations=3",
              "-s", "model.random_init=true", "--resume", str(prev), "--dry-run"])
    recipe = seen["recipe"]
    assert recipe.output_dir == Path("/tmp/flowrl-out dir")
    assert recipe.train.iterations == 3 and recipe.components["model"].params.random_init is True
    assert seen["resume"] == prev and seen["dry_run"] is True
    seen.clear()
    cli.main(["train", str(REPO / QUICK)])
    assert seen["recipe"].output_dir == Path("runs/quickstart_hacking") and seen["dry_run"] is False


@pytest.mark.parametrize("intended, env, warns", [
    (8, {}, True),                                       # one process, no launcher
    (8, {"WORLD_SIZE": "2", "RANK": "0"}, True),         # a launcher with fewer processes, the main one
    (8, {"WORLD_SIZE": "2", "RANK": "1"}, False),        # ... said once, by the main process only
    (8, {"WORLD_SIZE": "8", "RANK": "0"}, False),        # the intended count
    (2, {"WORLD_SIZE": "4", "RANK": "0"}, False),        # more processes only lower the memory
    (1, {}, False),                                      # the default: a one-process recipe
])
def test_train_warns_when_the_run_has_fewer_processes_than_the_recipe_states(monkeypatch, capsys, intended, env, warns):
    """[distributed].num_processes launches nothing (train keeps its one-process default), but a
    run with fewer processes holds more per process than `flowrl plan RECIPE` estimated."""
    import flowrl.train

    monkeypatch.setattr(flowrl.train, "train", lambda recipe, **kwargs: None)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cli.main(["train", str(REPO / QUICK), "--set", f"distributed.num_processes={intended}"])
    out = " ".join(capsys.readouterr().out.split())
    assert ("warning: the recipe is written for 8 processes ([distributed].num_processes) and this run has "
            f"{env.get('WORLD_SIZE', '1')}" in out) is warns, out
    assert ("warning" in out) is warns, out


def test_main_propagates_a_commands_exit_code(capsys):
    @cli.app.command(name="_exit_test", hidden=True)
    def _exit_test(code: int = 0) -> None:
        raise typer.Exit(code)

    try:
        with pytest.raises(SystemExit) as info:
            cli.main(["_exit_test", "--code", "3"])
        assert info.value.code == 3
        cli.main(["_exit_test"])  # exit code 0: returns normally
    finally:
        cli.app.registered_commands[:] = [
            c for c in cli.app.registered_commands if c.name != "_exit_test"
        ]
