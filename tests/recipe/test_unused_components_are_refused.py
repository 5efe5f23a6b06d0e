"""A component the objective never consults is refused by name at validation: a chunker,
selector or ``chunk_weights`` chosen under an objective without units (DiffusionNFT, AWM, DPO,
any loss on the ELBO) was meant to change the run and would not. Their defaults pass, so a
resolved recipe, which writes every table out, still loads."""

from __future__ import annotations

import pytest
from tiny_recipe import tiny_recipe_data

from flowrl.errors import RecipeError
from flowrl.recipe import validate

NFT = {"loss": {"use": "nft", "timesteps": 2}, "window": {"use": "ode"}, "chunker": None}
ELBO = {"loss": {"use": "epg"}, "likelihood": {"use": "elbo", "timesteps": 2}, "chunker": None}


@pytest.mark.parametrize("objective, named", [(NFT, "loss 'nft'"), (ELBO, "loss 'epg' on [likelihood] 'elbo'")])
@pytest.mark.parametrize("table, choice", [("chunker", {"use": "fixed", "size": 2}),
                                           ("selector", {"use": "uniform", "fraction": 0.5})])
def test_a_chosen_chunk_layout_under_an_objective_without_units_is_refused(objective, named, table, choice):
    with pytest.raises(RecipeError) as err:
        validate(tiny_recipe_data(**{**objective, table: choice}))
    assert err.value.where.endswith(f"[{table}]")
    assert f"[{table}] use = '{choice['use']}' is not used: {named} trains without per-transition units" in err.value.message
    assert f"remove the [{table}] table" in err.value.hint


@pytest.mark.parametrize("objective", [NFT, ELBO])
def test_the_default_layout_written_out_passes(objective):
    recipe = validate(tiny_recipe_data(**{**objective, "chunker": {"use": "step", "size": None}, "selector": {"use": "all"}}))
    assert (recipe.components["chunker"].use, recipe.components["selector"].use) == ("step", "all")


def test_chunk_weights_under_an_objective_without_units_are_refused():
    data = tiny_recipe_data(**NFT, rewards=[{"use": "area", "chunk_weights": [1.0, 0.5]}])
    with pytest.raises(RecipeError) as err:
        validate(data)
    assert err.value.where.endswith("[[rewards]] #1 (area).chunk_weights")
    assert err.value.message.startswith("chunk_weights are not used: loss 'nft'")


def test_the_same_layout_is_accepted_where_the_objective_uses_it():
    recipe = validate(tiny_recipe_data(selector={"use": "uniform", "fraction": 0.5}))  # BASE: clipped, fixed chunks
    assert recipe.components["chunker"].use == "fixed" and recipe.components["selector"].use == "uniform"


def test_a_resolved_recipe_of_an_objective_without_units_loads_again():
    """A run directory's recipe.toml writes the default chunker and selector out in full."""
    first = validate(tiny_recipe_data(**NFT))
    again = validate(first.to_toml_dict(), source="recipe.toml")
    assert again.components["chunker"] == first.components["chunker"]
