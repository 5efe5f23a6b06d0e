"""Plugin discovery and the component registry (flowrl/plugins.py, flowrl/hookspecs.py).

The first tests install a real third-party distribution with pip and run the real CLI against it
in a subprocess; the others register plugins in-process with ``temporary_plugin``.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from flowrl import hookimpl
from flowrl.config import param
from flowrl.errors import PluginError, RecipeError
from flowrl.rewards import score
from flowrl.plugins import KINDS, get_registry, temporary_plugin
from flowrl.recipe import validate

# ----------------------------------------------------------------------------- a real third party

MYPLUG = '''
"""A third-party flowrl plugin, as someone outside the project would write it."""
import dataclasses

from flowrl import hookimpl
from flowrl.config import param


def sharpness(images, prompts, *, gain: float = 2.0):
    """Gain times the mean absolute horizontal pixel difference."""
    return gain * (images[..., 1:] - images[..., :-1]).abs().mean(dim=(1, 2, 3))


@dataclasses.dataclass(frozen=True)
class HalvesConfig:
    first: int = param(1, "Transitions in the first of the two chunks.", min=1)


class HalvesChunker:
    """Two chunks: `first` transitions, then the rest."""

    Config = HalvesConfig

    def __init__(self, config):
        self.config = config

    def sizes(self, num_transitions):
        if not 0 < self.config.first < num_transitions:
            raise ValueError(f"first must be in [1, {num_transitions - 1}], got {self.config.first}")
        return (self.config.first, num_transitions - self.config.first)


@hookimpl
def register_rewards(register):
    register("sharpness", sharpness)


@hookimpl
def register_chunkers(register):
    register("halves", HalvesChunker)
'''

PYPROJECT = """
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "flowrl-myplug"
version = "1.2.3"

[project.entry-points.flowrl]
myplug = "myplug"

[tool.setuptools]
packages = ["myplug"]
"""

MYPLUG_RECIPE = """
[sampler]
steps = 9            # T = 8 trainable transitions

[chunker]
use = "halves"
first = 3

[[rewards]]
use = "sharpness"
gain = 4.0
"""


def _install_myplug(root):
    """pip-install the third-party distribution into root/site (offline, no build isolation)."""
    src = root / "myplug_dist"
    (src / "myplug").mkdir(parents=True)
    (src / "pyproject.toml").write_text(PYPROJECT)
    (src / "myplug" / "__init__.py").write_text(MYPLUG)
    site = root / "site"
    pytest.importorskip("setuptools", reason="building the test distribution needs setuptools")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "-q", "--target", str(site), str(src)],
        check=True, capture_output=True, text=True, timeout=180,
    )
    assert (site / "myplug" / "__init__.py").is_file()
    return site


def _write_broken_dist(root):
    """A distribution whose plugin module fails to import, as a hand-made dist-info on a path."""
    site = root / "broken_site"
    info = site / "flowrl_broken-0.0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flowrl-broken\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text("[flowrl]\nbroken = flowrl_broken_plugin\n")
    (site / "flowrl_broken_plugin.py").write_text("import a_module_that_does_not_exist_xyz\n")
    return site


@pytest.fixture(scope="module")
def third_party(tmp_path_factory, flowrl_cli):
    """Install both distributions and run every CLI call the tests below look at, in one process."""
    root = tmp_path_factory.mktemp("third_party")
    good = _install_myplug(root)
    broken = _write_broken_dist(root)
    recipe = root / "myplug_recipe.toml"
    recipe.write_text(MYPLUG_RECIPE)
    off = {"FLOWRL_DISABLE_PLUGINS": "broken"}
    calls = {
        "plugins_broken": ["plugins"],
        "validate_broken": ["validate", str(recipe)],
        "plugins_json_flag": ["--disable-plugin", "broken", "plugins", "--json"],
        "validate_env": {"argv": ["validate", str(recipe)], "env": off},
        "explain_env": {"argv": ["validate", "--explain", str(recipe)], "env": off},
        "bad_param_env": {"argv": ["validate", str(recipe), "--set", "chunker.first=99"], "env": off},
        "switch_chunker_env": {"argv": ["validate", str(recipe), "--set", "chunker.use=step"], "env": off},
    }
    results = flowrl_cli.batch(list(calls.values()), pythonpath=[good, broken])
    return dict(zip(calls, results)), recipe


@pytest.mark.slow
def test_third_party_plugin_is_discovered_through_its_entry_point(third_party):
    results, _ = third_party
    r = results["plugins_json_flag"]
    assert r.returncode == 0, r.stderr
    listing = {p["plugin"]: p for p in json.loads(r.stdout)}
    assert "broken" not in listing
    mine = listing["myplug"]
    assert mine["distribution"] == "flowrl-myplug"
    assert mine["version"] == "1.2.3"
    assert mine["module"] == "myplug"
    assert set(mine["components"]) == {"reward:sharpness", "chunker:halves"}
    # help defaults to the first docstring line
    assert mine["components"]["chunker:halves"] == "Two chunks: `first` transitions, then the rest."
    # the built-ins are discovered through the same group, with flowrl's distribution (its PyPI name)
    assert listing["chunkers"]["distribution"] == "flowrl-diffusion"
    assert "chunker:explicit" in listing["chunkers"]["components"]


@pytest.mark.slow
def test_recipe_using_third_party_components_validates(third_party):
    results, recipe = third_party
    r = results["validate_env"]
    assert r.returncode == 0, r.stderr
    assert "chunker=halves" in r.flat_out and "rewards=['sharpness']" in r.flat_out
    assert "T=8" in r.flat_out
    # its params dataclass and its keyword-only reward argument are documented recipe keys
    r = results["explain_env"]
    assert r.returncode == 0, r.stderr
    assert "Transitions in the first of the two chunks." in r.flat_out
    assert "keyword argument of sharpness" in r.flat_out
    # a ValueError raised by the third-party chunker is a clean recipe error
    r = results["bad_param_env"]
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "first must be in [1, 7], got 99" in r.flat_err and str(recipe) in r.flat_err
    assert "[chunker]" in r.flat_err
    # switching chunker.use drops the old chunker's parameters (`first` is not a step key)
    r = results["switch_chunker_env"]
    assert r.returncode == 0, r.stderr
    assert "chunker=step" in r.flat_out


@pytest.mark.slow
def test_plugin_that_fails_to_import_names_itself_and_how_to_disable_it(third_party):
    results, _ = third_party
    for key in ("plugins_broken", "validate_broken"):
        r = results[key]
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr
        assert sum(line.startswith("error:") for line in r.stderr.splitlines()) == 1, r.stderr
        err = r.flat_err
        assert "plugin 'broken' from flowrl-broken failed to load" in err
        assert "ModuleNotFoundError" in err and "a_module_that_does_not_exist_xyz" in err
        assert "FLOWRL_DISABLE_PLUGINS=broken" in err
        assert "--disable-plugin broken" in err
    # ... and disabling it (flag or environment) makes the CLI work again
    assert results["plugins_json_flag"].returncode == 0
    assert results["validate_env"].returncode == 0


# ----------------------------------------------------------------------------- in-process plugins


def _reward_plugin(reward_name, *, replace=False):
    class Plugin:
        @hookimpl
        def register_rewards(self, register):
            register(reward_name, lambda images, prompts: images.mean(dim=(1, 2, 3)), replace=replace)

    return Plugin()


def test_duplicate_names_across_plugins_name_both():
    with pytest.raises(PluginError) as info:
        with temporary_plugin(_reward_plugin("dup"), "alpha"), temporary_plugin(_reward_plugin("dup"), "beta"):
            pass
    msg = str(info.value)
    assert "reward 'dup' is registered twice" in msg
    assert "'alpha'" in msg and "'beta'" in msg
    assert "replace=True" in msg and "FLOWRL_DISABLE_PLUGINS" in msg
    # the failed registry is not cached: the next lookup works and no longer has the test plugins
    assert "dup" not in get_registry().names("reward")

    # both claiming to be the override is still a conflict
    with pytest.raises(PluginError, match="registered twice"):
        with temporary_plugin(_reward_plugin("dup", replace=True), "alpha"), \
                temporary_plugin(_reward_plugin("dup", replace=True), "beta"):
            pass


@pytest.mark.parametrize("order", ["override_first", "override_last"])
def test_replace_true_overrides_regardless_of_order(order):
    plain, override = (_reward_plugin("dup"), "plain"), (_reward_plugin("dup", replace=True), "override")
    first, second = (override, plain) if order == "override_first" else (plain, override)
    with temporary_plugin(*first), temporary_plugin(*second) as registry:
        assert registry.get("reward", "dup").plugin == "override"


class _MyExplicit:
    """A replacement for the built-in explicit chunker."""

    @dataclasses.dataclass(frozen=True)
    class Config:
        sizes: list[int] = param([1], "Ignored.")

    def __init__(self, config):
        self.config = config

    def sizes(self, num_transitions):
        return (num_transitions,)


def test_overriding_a_builtin_component():
    builtin = get_registry().get("chunker", "explicit").plugin

    class Clash:
        @hookimpl
        def register_chunkers(self, register):
            register("explicit", _MyExplicit)

    with pytest.raises(PluginError) as info:
        with temporary_plugin(Clash(), "clash"):
            pass
    assert f"'{builtin}'" in str(info.value) and "'clash'" in str(info.value)

    class Override:
        @hookimpl
        def register_chunkers(self, register):
            register("explicit", _MyExplicit, replace=True)

    with temporary_plugin(Override(), "override") as registry:
        comp = registry.get("chunker", "explicit")
        assert comp.plugin == "override" and comp.help == "A replacement for the built-in explicit chunker."
        # [2, 3] sums to 5, not T = 16: the built-in would reject it; the override takes any sizes
        recipe = validate(
            {"sampler": {"steps": 17}, "chunker": {"use": "explicit", "sizes": [2, 3]},
             "rewards": [{"use": "brightness"}]},
            registry=registry,
        )
        assert isinstance(comp.build(recipe.components["chunker"].params), _MyExplicit)
    assert get_registry().get("chunker", "explicit").plugin == builtin


def test_default_component_from_a_non_trylast_plugin_wins():
    base = get_registry()
    builtin_default = base.default("chunker")
    assert builtin_default in base.names("chunker")
    other = next(n for n in base.names("chunker") if n != builtin_default)
    minimal = {"sampler": {"steps": 17}, "rewards": [{"use": "brightness"}]}

    class Abstains:
        @hookimpl
        def default_component(self, kind):
            return None

    with temporary_plugin(Abstains(), "abstains") as registry:
        assert registry.default("chunker") == builtin_default

    class Prefers:
        @hookimpl
        def default_component(self, kind):
            return other if kind == "chunker" else None

    with temporary_plugin(Prefers(), "prefers") as registry:
        assert registry.default("chunker") == other
        assert registry.default("selector") == base.default("selector")  # only its kind changes
        assert validate(minimal, registry=registry).components["chunker"].use == other
    assert validate(minimal).components["chunker"].use == builtin_default


def test_misspelt_hookimpl_is_rejected_with_the_closest_hook():
    class Misspelt:
        @hookimpl
        def register_reward(self, register):  # missing the final "s"
            register("x", lambda images, prompts: images.mean(dim=(1, 2, 3)))

    with pytest.raises(PluginError) as info:
        with temporary_plugin(Misspelt(), "misspelt"):
            pass
    msg = str(info.value)
    assert "plugin 'misspelt' implements unknown hook 'register_reward'" in msg
    assert "did you mean 'register_rewards'?" in msg
    assert "FLOWRL_DISABLE_PLUGINS=misspelt" in msg


@pytest.mark.parametrize("hook", ["register_rewards", "default_component"])
def test_hookimpl_with_a_wrong_argument_name_is_rejected(hook):
    def impl(self, reg):
        return None

    impl.__name__ = hook
    Plugin = type("Plugin", (), {hook: hookimpl(impl)})
    with pytest.raises(PluginError) as info:
        with temporary_plugin(Plugin(), "wrongarg"):
            pass
    msg = str(info.value)
    assert "plugin 'wrongarg' has an invalid hook implementation" in msg
    assert "reg" in msg and hook in msg


def test_every_registration_hook_fills_its_own_kind():
    made = {}

    def component(kind):
        cls = type(f"T{kind.title()}", (), {"__doc__": f"test {kind}"})
        made[kind] = cls
        return cls

    class Everything:
        @hookimpl
        def register_models(self, register):
            register("t_model", component("model"))

        @hookimpl
        def register_schedules(self, register):
            register("t_schedule", component("schedule"))

        @hookimpl
        def register_kernels(self, register):
            register("t_kernel", component("kernel"))

        @hookimpl
        def register_chunkers(self, register):
            register("t_chunker", component("chunker"))

        @hookimpl
        def register_selectors(self, register):
            register("t_selector", component("selector"))

        @hookimpl
        def register_advantages(self, register):
            register("t_advantage", component("advantage"))

        @hookimpl
        def register_losses(self, register):
            register("t_loss", component("loss"))

        @hookimpl
        def register_likelihoods(self, register):
            register("t_likelihood", component("likelihood"))

        @hookimpl
        def register_windows(self, register):
            register("t_window", component("window"))

        @hookimpl
        def register_rewards(self, register):
            register("t_reward", component("reward"))

        @hookimpl
        def register_trackers(self, register):
            register("t_tracker", component("tracker"))

    with temporary_plugin(Everything(), "everything") as registry:
        assert set(made) == set(KINDS)
        for kind in KINDS:
            comp = registry.get(kind, f"t_{kind}")
            assert comp.kind == kind and comp.plugin == "everything" and comp.help == f"test {kind}"
            assert isinstance(comp.build(), made[kind])  # no params: built with no argument
            others = [k for k in KINDS if k != kind]
            assert all(f"t_{kind}" not in registry.names(k) for k in others)
        assert registry.plugins["everything"].distribution == "(registered in-process)"
        assert {c.name for c in registry.by_plugin()["everything"]} == {f"t_{k}" for k in KINDS}


def test_invalid_registrations_are_plugin_errors():
    class NotDataclass:
        pass

    class BadParams:
        @hookimpl
        def register_losses(self, register):
            register("bad", object, params=NotDataclass)

    with pytest.raises(PluginError, match="params of loss 'bad' must be a dataclass"):
        with temporary_plugin(BadParams(), "badparams"):
            pass

    class BadName:
        @hookimpl
        def register_losses(self, register):
            register("", object)

    with pytest.raises(PluginError, match="plugin 'badname' registered a loss with an invalid name"):
        with temporary_plugin(BadName(), "badname"):
            pass


def test_unknown_component_suggests_the_closest():
    with pytest.raises(RecipeError) as info:
        get_registry().get("chunker", "explict", where="x.toml: [chunker].use")
    assert "did you mean 'explicit'?" in str(info.value) and "x.toml: [chunker].use" in str(info.value)
    with pytest.raises(RecipeError, match="did you mean 'epg'"):  # too short for a close match: the case differs
        get_registry().get("loss", "EPG", where="x.toml: [loss].use")


# ----------------------------------------------------------------------------- plain-function rewards


def contrast(images, prompts, *, scale: float = 2.0, center=0.5):
    """Scaled mean distance of the pixels from a centre value."""
    return scale * (images - center).abs().mean(dim=(1, 2, 3))


def test_plain_function_reward_end_to_end():
    class Plugin:
        @hookimpl
        def register_rewards(self, register):
            register("contrast", contrast)

    images = torch.rand(5, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    prompts = [f"prompt {i}" for i in range(5)]

    def expected(scale, center):  # computed independently, in float64
        x = images.double()
        return (scale * (x - center).abs().flatten(1).mean(1)).float()

    with temporary_plugin(Plugin(), "contrast_plugin") as registry:
        comp = registry.get("reward", "contrast")
        assert comp.help == "Scaled mean distance of the pixels from a centre value."
        # keyword-only defaults became documented recipe params, with their types
        fields = {f.name: f for f in dataclasses.fields(comp.params)}
        assert set(fields) == {"scale", "center"}
        assert fields["scale"].default == 2.0 and fields["center"].default == 0.5
        assert fields["scale"].metadata["help"]

        out = score(comp.build(), images, prompts)  # default params
        assert out.scores.shape == (5,) and out.scores.dtype == torch.float32
        torch.testing.assert_close(out.scores, expected(2.0, 0.5), rtol=1e-5, atol=1e-6)

        data = {"rewards": [{"use": "contrast", "scale": 3, "center": 0.25, "weight": 0.5}]}
        recipe = validate(data, registry=registry)
        choice = recipe.rewards[0]
        assert choice.weight == 0.5 and choice.params.scale == 3.0 and choice.params.center == 0.25
        reward = comp.build(choice.params)
        scores = reward(images, prompts).scores
        assert scores.shape == (5,) and scores.dtype == torch.float32
        torch.testing.assert_close(scores, expected(3.0, 0.25), rtol=1e-5, atol=1e-6)

        # the params are validated like every other recipe key
        with pytest.raises(RecipeError, match="did you mean 'scale'"):
            validate({"rewards": [{"use": "contrast", "scal": 3.0}]}, registry=registry)
        with pytest.raises(RecipeError, match="key 'scale' must be float"):
            validate({"rewards": [{"use": "contrast", "scale": "big"}]}, registry=registry)


def test_plain_function_without_keywords_takes_no_params():
    def ones(images, prompts):
        return torch.ones(len(prompts))

    class Plugin:
        @hookimpl
        def register_rewards(self, register):
            register("ones", ones, help="Always one.")

    with temporary_plugin(Plugin(), "ones_plugin") as registry:
        comp = registry.get("reward", "ones")
        assert comp.params is None and comp.help == "Always one."
        assert score(comp.build(), torch.zeros(3, 3, 4, 4), ["a"] * 3).scores.tolist() == [1.0, 1.0, 1.0]
        with pytest.raises(RecipeError, match="takes no parameters"):
            validate({"rewards": [{"use": "ones", "gain": 1.0}]}, registry=registry)
        # weight and name belong to the [[rewards]] entry, not to the reward's parameters
        choice = validate({"rewards": [{"use": "ones", "weight": 2, "name": "o"}]}, registry=registry).rewards[0]
        assert choice.label == "o" and choice.weight == 2.0


def test_a_registration_hook_that_raises_is_reported_by_plugin_name():
    from flowrl import hookimpl
    from flowrl.errors import PluginError
    from flowrl.plugins import temporary_plugin

    class Buggy:
        @hookimpl
        def register_rewards(self, register):
            raise KeyError("oops")

    with pytest.raises(PluginError, match="plugin 'buggy' failed in register_rewards: KeyError"):
        with temporary_plugin(Buggy(), name="buggy"):
            pass


def test_factory_rule_params_or_no_arguments():
    """hookspecs' one rule: factory(params) with a params dataclass, factory() without."""
    calls = []

    @dataclasses.dataclass(frozen=True)
    class Params:
        size: int = param(3, "a size")

    def with_params(p):
        calls.append(("with", p))
        return "built-with"

    def without():
        calls.append(("without",))
        return "built-without"

    class Plugin:
        @hookimpl
        def register_chunkers(self, register):
            register("with_params", with_params, params=Params)
            register("without_params", without)

    with temporary_plugin(Plugin()) as registry:
        assert registry.get("chunker", "with_params").build(Params(size=5)) == "built-with"
        assert registry.get("chunker", "with_params").build() == "built-with"  # the defaults
        assert registry.get("chunker", "without_params").build() == "built-without"
    assert calls == [("with", Params(size=5)), ("with", Params()), ("without",)]
