"""`flowrl validate` reports a component's bad parameters as one message naming its table.

Each case used to reach a component's factory (or constructor) and end in a Python traceback or a
message without the recipe's table; the checks now live in the params dataclasses and every
component validation builds goes through :func:`flowrl.recipe.build_component`.
"""

from __future__ import annotations

from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "quickstart_hacking.toml"


def _with_table(tmp_path: Path, table: str, body: str) -> Path:
    """The quickstart recipe with ``[table]`` replaced by ``body`` (added when it has none)."""
    lines, out, skipping = RECIPE.read_text(encoding="utf-8").splitlines(), [], False
    for line in lines:
        if line.startswith("["):
            skipping = line.strip() == f"[{table}]"
        if not skipping:
            out.append(line)
    out += [f"[{table}]", body]
    path = tmp_path / "recipe.toml"
    path.write_text("\n".join(out) + "\n", encoding="utf-8")
    return path


PROFILE = str(REPO / "recipes" / "profiles" / "embedded.json")


@pytest.mark.parametrize("table, body, table_named, message", [
    ("loss", 'use = "gardo"', "[loss]", "gardo needs auxiliary"),
    ("loss", 'use = "gardo"\nauxiliary = []', "[loss]", "gardo needs auxiliary"),
    ("chunker", f'use = "dynamics"\nprofile = "{PROFILE}"\nmin_size = 3\nmax_size = 2', "[chunker]",
     "max_size (2) is smaller than min_size (3)"),
    ("window", 'use = "sliding"\nsize = 40', "[window]", "a window of 40 steps does not fit"),
    ("chunker", "use = \"explicit\"\nsizes = [1, 2]", "[chunker]", "sum"),
])
def test_bad_component_params_exit_2_with_one_message_naming_the_table(validate, tmp_path, table, body, table_named,
                                                                       message):
    code, err = validate(_with_table(tmp_path, table, body))
    flat = " ".join(err.split())
    assert code == 2, err
    assert err.startswith("error:") and err.count("\nerror:") == 0 and "Traceback" not in err, err
    assert table_named in flat and message in flat, err


def test_build_component_names_the_table_of_a_factory_error(tmp_path):
    """A check only the built component can make (a factory raising ValueError) is reported
    like a recipe error, with the recipe's table, not as a traceback."""
    from flowrl.errors import RecipeError
    from flowrl.plugins import get_registry
    from flowrl.recipe import build_component, load_recipe

    recipe = load_recipe(RECIPE)
    registry = get_registry()

    class Refusing:
        def get(self, kind, name, where=None):
            component = registry.get(kind, name)

            class Built:
                params = component.params

                @staticmethod
                def build(params):
                    raise ValueError(f"{kind} '{name}' refuses these parameters")

            return Built

    with pytest.raises(RecipeError) as caught:
        build_component(recipe, Refusing(), "chunker")
    text = str(caught.value)
    assert "[chunker] (chunker 'explicit')" in text and "refuses these parameters" in text
    with pytest.raises(RecipeError, match=r"\[\[rewards\]\] #2 \(verifier\)"):
        build_component(recipe, Refusing(), "rewards", 1)
