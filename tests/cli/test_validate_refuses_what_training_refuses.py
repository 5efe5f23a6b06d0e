"""`flowrl validate` refuses what `flowrl train` would refuse only after the model loads (issue 28).

Each case used to validate cleanly and then stop a run after the model was built: ``[ema]
on_cpu`` with fsdp2 (:meth:`flowrl.train.ema.WeightEMA.attach`), ``[prompts] source = "model"``
with a model that ships no prompts (:func:`flowrl.prompts.read_prompts`), and a reward that reads
the embedded model's prompt grammar (``area``, ``verifier``) on prompts outside it (its first
call, in the first rollout). Like 8-bit AdamW with fsdp2, each is now one message at exit 2.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.toml"  # DiffusionNFT: no trajectory units, a CSV of grammar prompts
HACKING = REPO / "recipes" / "quickstart_hacking.toml"  # a clipped GRPO loss

SD3 = """
[run]
name = "sd3_checks"

[model]
use = "sd3"
path = "stabilityai/stable-diffusion-3.5-medium"

[train]
finetune = "lora"

[prompts]
source = "{source}"

[[rewards]]
use = "{reward}"
"""


def one_error(code: int, err: str, *fragments: str) -> None:
    flat = " ".join(err.split())
    assert code == 2, err
    assert err.startswith("error:") and err.count("\nerror:") == 0 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in flat, (fragment, flat)


def sd3_recipe(tmp_path: Path, source: str, reward: str) -> Path:
    path = tmp_path / "sd3.toml"
    path.write_text(SD3.format(source=source, reward=reward), encoding="utf-8")
    return path


@pytest.mark.parametrize("recipe", [QUICKSTART, HACKING])
def test_ema_on_cpu_with_fsdp2(validate, recipe):
    code, err = validate(recipe, 'distributed.strategy="fsdp2"', "ema.enabled=true", "ema.on_cpu=true")
    one_error(code, err, "[ema].on_cpu", "on_cpu = true is not supported with strategy = 'fsdp2'", "set on_cpu = false")


def test_ema_on_cpu_without_fsdp2_stays_valid(validate):
    code, err = validate(QUICKSTART, 'distributed.strategy="ddp"', "ema.enabled=true", "ema.on_cpu=true")
    assert code == 0, err


def test_a_model_without_prompts_of_its_own_and_source_model(validate, tmp_path):
    code, err = validate(sd3_recipe(tmp_path, "model", "brightness"))
    one_error(code, err, "[prompts].source", "model 'sd3' has no prompt source of its own", "give a prompt file")


@pytest.mark.parametrize("reward", ["area", "verifier"])
def test_a_grammar_reward_on_prompts_outside_the_grammar(validate, tmp_path, reward):
    (tmp_path / "photos.txt").write_text("a red circle on a white background\na photo of a cat\n", encoding="utf-8")
    code, err = validate(sd3_recipe(tmp_path, "photos.txt", reward))
    one_error(code, err, "[prompts].source", f"reward '{reward}' cannot score the prompt 'a photo of a cat'",
              "not a prompt of the grammar")


def test_a_grammar_reward_on_grammar_prompts_is_what_training_runs(validate, tmp_path):
    """The refusal follows what training refuses (the prompts), not the model's name."""
    (tmp_path / "shapes.txt").write_text("a red circle on a white background\n", encoding="utf-8")
    code, err = validate(sd3_recipe(tmp_path, "shapes.txt", "area"))
    assert code == 0, err


@pytest.mark.parametrize("recipe", [QUICKSTART, HACKING])
def test_the_quickstarts_grammar_prompts_stay_valid(validate, recipe):
    code, err = validate(recipe)
    assert code == 0, err
