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


GARDO = REPO / "recipes" / "quickstart_gardo.toml"  # full fine-tuning: its reference is a frozen copy
SD3_LORA = REPO / "recipes" / "lora_single_gpu_sd3.toml"  # LoRA over SD3.5


@pytest.mark.parametrize("recipe, overrides", [
    (GARDO, ('train.finetune="lora"',)),
    (SD3_LORA, ('loss.use="gardo"', 'loss.auxiliary=["x"]')),
    (SD3_LORA, ('loss.use="gardo"', 'loss.auxiliary=["x"]', "loss.beta=0.01", 'loss.kl="gaussian_exact"')),
], ids=["embedded_full_made_lora", "sd3_lora", "sd3_lora_gaussian_exact"])
def test_an_objective_that_resets_its_reference_with_lora(validate, recipe, overrides):
    """GARDO's reference reset needs a frozen copy of the denoiser: its ``prepare`` refused LoRA
    only after the model loaded (the reference is then the base with the adapter off)."""
    code, err = validate(recipe, *overrides)
    one_error(code, err, "[train].finetune", "loss 'gardo' needs its KL reference as a frozen copy",
              "finetune = 'lora'", "use finetune = 'full'")


def test_the_refusal_follows_the_objectives_declaration_not_its_name(validate, monkeypatch):
    """Any objective that declares ``needs_reference_copy`` is refused with LoRA, and GARDO stops
    being refused once it no longer declares it: validation reads the declaration."""
    from flowrl.objectives.gardo import GatedKLPolicyGradient
    from flowrl_plugins.losses import ClippedSurrogate

    monkeypatch.setattr(GatedKLPolicyGradient, "needs_reference_copy", False)
    code, err = validate(GARDO, 'train.finetune="lora"')
    assert code == 0, err
    monkeypatch.setattr(ClippedSurrogate, "needs_reference_copy", True, raising=False)
    kl = ("loss.beta=0.04", 'loss.kl="flow_grpo"')
    code, err = validate(HACKING, 'train.finetune="lora"', *kl)  # the clipped loss, declared needy here
    one_error(code, err, "[train].finetune", "loss 'clipped' needs its KL reference as a frozen copy", "finetune = 'lora'")
    code, err = validate(HACKING)  # full fine-tuning, but beta = 0: no reference at all
    one_error(code, err, "[loss].beta", "loss 'clipped' needs its KL reference as a frozen copy", "no KL term")
    code, err = validate(HACKING, *kl)
    assert code == 0, err


def test_the_objective_that_resets_its_reference_with_full_fine_tuning_stays_valid(validate):
    code, err = validate(GARDO)
    assert code == 0, err


@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_the_rule_is_the_engines_reference_policy(finetune):
    """keeps_reference_copy (validation) says what ReferencePolicy (training) does on the
    embedded model: a frozen copy with full fine-tuning, none with LoRA. (The clipped loss with a
    KL term: a LoRA GARDO recipe no longer loads.)"""
    from flowrl.commands.base import load, registry
    from flowrl.objectives.kl import ReferencePolicy
    from flowrl.recipe import keeps_reference_copy
    from flowrl.train.finetune import prepare_trainable

    recipe = load(HACKING, [f'train.finetune="{finetune}"', "loss.beta=0.04", 'loss.kl="flow_grpo"'])
    choice = recipe.components["model"]
    model = registry().get("model", choice.use).build(choice.params)
    prepare_trainable(model, recipe.train)
    assert (ReferencePolicy(model).frozen is not None) == keeps_reference_copy(recipe) == (finetune == "full")
