"""The `dynamics` chunker (plugins/chunkers.py): reading a profile in a recipe, profiling at start,
re-profiling, and the committed quickstart_dynamics recipe and profile."""

from pathlib import Path

import pytest
import torch
from tiny_recipe import tiny_recipe_data

from flowrl.dynamics.measure import profile_model
from flowrl.dynamics.profile_file import read_l1rel, read_profile, trainable_curve, write_profile
from flowrl.dynamics.segment import segment
from flowrl.errors import FlowrlError, RecipeError
from flowrl.plugins import get_registry
from flowrl.recipe import load_recipe, validate
from flowrl.sampling.schedules import shifted_sigmas
from flowrl.sampling.kernels import FlowKernel

ROOT = Path(__file__).resolve().parents[2]
N = 9  # steps; image from x0_hat -> T = 8


def recipe_dict(chunker):
    """The tiny recipe's model with N steps in dynamics chunks (``chunker``), the rest at its defaults."""
    return tiny_recipe_data(run=None, train=None, log=None, sampler={"steps": N},
                            chunker={"use": "dynamics", "size": None, **chunker}, rewards=[{"use": "brightness"}])


@pytest.fixture
def profile_path(tmp_path, tiny_model):
    res = profile_model(tiny_model, shifted_sigmas(N, 3.0), (FlowKernel(a=0.7),) * N, ["a", "b", "c"], num_seeds=2)
    return write_profile(tmp_path / "profile.json", res)


def build_chunker(recipe):
    choice = recipe.components["chunker"]
    return get_registry().get("chunker", choice.use).build(choice.params)


@pytest.mark.parametrize("method", ["dp", "curvature", "derivative"])
def test_recipe_reads_the_profile(profile_path, method):
    recipe = validate(recipe_dict({"profile": str(profile_path), "method": method, "num_chunks": 3, "max_size": 4}))
    chunker = build_chunker(recipe)
    assert not chunker.needs_model
    y = trainable_curve(read_profile(profile_path), "l1rel", 8)
    assert chunker.sizes(8) == segment(y, method, 3, 1, 4).sizes
    assert len(chunker.sizes(8)) == 3 and max(chunker.sizes(8)) <= 4
    torch.testing.assert_close(chunker.l1rel(8), read_l1rel(profile_path, 8))


def test_recipe_errors(profile_path, tmp_path):
    # the profile describes T = 8; a 17-step recipe has T = 16
    data = recipe_dict({"profile": str(profile_path)})
    data["sampler"]["steps"] = 17
    with pytest.raises(FlowrlError, match="T = 8 .* this run has T = 16"):
        validate(data)
    with pytest.raises(FlowrlError, match="not found"):
        validate(recipe_dict({"profile": str(tmp_path / "missing.json")}))
    with pytest.raises(RecipeError, match=r"cannot be cut into num_chunks = 9"):
        validate(recipe_dict({"profile": str(profile_path), "num_chunks": 9}))
    with pytest.raises(RecipeError, match="max_size"):
        validate(recipe_dict({"profile": str(profile_path), "min_size": 3, "max_size": 2}))
    with pytest.raises(RecipeError, match="method"):
        validate(recipe_dict({"profile": str(profile_path), "method": "magic"}))


def test_profile_at_start(tiny_model):
    # no profile: validation skips the size check (even an impossible K), the engine profiles
    recipe = validate(recipe_dict({"num_chunks": 3, "num_prompts": 4, "seeds": 1}))
    chunker = build_chunker(recipe)
    assert chunker.needs_model
    with pytest.raises(FlowrlError, match="profile_at_start"):
        chunker.sizes(8)
    sigmas = shifted_sigmas(N, 3.0)
    kernels = (FlowKernel(a=0.7),) * N
    prompts = tiny_model.prompt_source()
    result = chunker.profile_at_start(tiny_model, sigmas, kernels, prompts, seed=3)
    assert len(result.settings["prompts"]) == 4 and result.settings["num_seeds"] == 1
    sizes = chunker.sizes(8)
    assert len(sizes) == 3 and sum(sizes) == 8
    assert chunker.l1rel(8).shape == (8,)
    # deterministic: a second chunker gets the same boundaries
    other = build_chunker(recipe)
    other.profile_at_start(tiny_model, sigmas, kernels, prompts, seed=3)
    assert other.sizes(8) == sizes

    # adaptive: re-profiling a changed policy returns (old, new) and moves sizes with it
    with torch.no_grad():
        tiny_model.denoiser.weight.mul_(3.0)
    old, new = chunker.reprofile(tiny_model, sigmas, kernels, prompts, seed=3)
    assert old == sizes and chunker.sizes(8) == new and sum(new) == 8
    chunker.set_sizes((4, 4))
    assert chunker.sizes(8) == (4, 4)
    with pytest.raises(ValueError, match="sum to T = 9"):
        chunker.sizes(9)


def test_quickstart_dynamics_recipe_and_committed_profile(monkeypatch):
    monkeypatch.chdir(ROOT)  # the recipe's profile path is relative to the repository root
    recipe = load_recipe(ROOT / "recipes" / "quickstart_dynamics.toml", ["model.random_init=true"])
    chunker = build_chunker(recipe)
    T = recipe.num_trainable
    sizes = chunker.sizes(T)
    assert T == 16 and sum(sizes) == 16 and len(sizes) == 4
    assert all(2 <= s <= 8 for s in sizes)
    data = read_profile(ROOT / "recipes" / "profiles" / "embedded.json")
    assert data["settings"]["steps"] == 17 and data["settings"]["kernel"] == {"use": "flow", "a": 0.7}
    assert data["settings"]["num_prompts"] == 32
    l1 = read_l1rel(ROOT / "recipes" / "profiles" / "embedded.json", 16)
    assert bool((l1 > 0).all())
