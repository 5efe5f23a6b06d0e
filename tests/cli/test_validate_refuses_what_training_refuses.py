"""`flowrl validate` refuses what `flowrl train` would refuse only after the model loads.

Each case used to validate cleanly and then stop a run after the model was built: ``[ema]
on_cpu`` with fsdp2 (:meth:`flowrl.train.ema.WeightEMA.attach`), ``[prompts] source = "model"``
with a model that ships no prompts (:func:`flowrl.prompts.read_prompts`), and a reward that reads
the embedded model's prompt grammar (``area``, ``verifier``) on prompts outside it (its first
call, in the first rollout). Like 8-bit AdamW with fsdp2, each is now one message at exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.toml"  # EPG on the ELBO: no trajectory units, a CSV of grammar prompts
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


def test_a_grammar_reward_on_grammar_prompts_is_what_training_runs(validate, tmp_path, monkeypatch):
    """The refusal follows what training refuses (the prompts), not the model's name. (SD3.5 on a
    machine without a GPU is refused for its RAM on a small machine: this one has a terabyte.)"""
    from flowrl.commands import machine

    monkeypatch.setattr(machine, "host_memory_bytes", lambda: 1024**4)
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


# ----------------------------------------------------------------------------- devices

STEP = REPO / "recipes" / "quickstart_step.toml"  # a clipped loss: [pipeline] staleness 1 trains with it
ROLLOUT_PROCESS = ("pipeline.staleness=1", 'pipeline.worker="process"')


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n)``: validation sees ``n`` CUDA devices on this machine (0: none, a CPU-only
    machine), whatever the machine running the test has; a GPU's memory reads as 80 GB. (Through
    flowrl.recipe.startable.cuda_device_count, the one place it asks PyTorch: a torch.cuda.is_available
    patched to True would break diffusers' imports.)"""
    from flowrl.commands import machine
    from flowrl.recipe import startable

    def see(n: int) -> None:
        monkeypatch.setattr(startable, "cuda_device_count", lambda: n)
        monkeypatch.setattr(machine, "visible_gpu_memory_gb", lambda: 80.0 if n else None)

    return see


@pytest.mark.parametrize("recipe, overrides, n, key, says, fix", [
    (STEP, (*ROLLOUT_PROCESS, "pipeline.device='cuda:1'"), 0, "[pipeline].device",
     "device = 'cuda:1' names a CUDA device, and this machine has none", "--set pipeline.device=cpu"),
    (STEP, (*ROLLOUT_PROCESS, "pipeline.device='cuda:1'"), 1, "[pipeline].device",
     "device = 'cuda:1' is cuda:1, and this machine has 1 CUDA device (cuda:0)", "--set pipeline.device=cuda:0"),
    (QUICKSTART, ("run.device=cuda",), 0, "[run].device", "device = 'cuda' names a CUDA device",
     "--set run.device=cpu"),
    (QUICKSTART, ("run.device='cuda:2'",), 2, "[run].device",
     "device = 'cuda:2' is cuda:2, and this machine has 2 CUDA devices (cuda:0 to cuda:1)", "--set run.device=cpu"),
    (QUICKSTART, ("rewards.1.device=cuda",), 0, "[[rewards]] #2 (embedded_clip).device",
     "device = 'cuda' names a CUDA device", "--set rewards.1.device=cpu"),
], ids=["rollout_process_no_gpu", "rollout_process_one_gpu", "run_no_gpu", "run_two_gpus", "reward_no_gpu"])
def test_a_cuda_device_the_machine_lacks(validate, gpus, recipe, overrides, n, key, says, fix):
    """`[pipeline] device = 'cuda:1'` once validated on a CPU-only machine, and training
    ended in "AssertionError: Torch not compiled with CUDA enabled" (a traceback) once the
    rollout process was placed; a reward's device only once the reward was built, after the
    model. Every device-valued key is checked against the machine, one message naming the key,
    the value, what the machine has and how to fix it."""
    gpus(n)
    code, err = validate(recipe, *overrides)
    one_error(code, err, key, says, fix)


@pytest.mark.parametrize("recipe, overrides, n", [
    (STEP, (*ROLLOUT_PROCESS, "pipeline.device='cuda:1'"), 2),
    (QUICKSTART, ("run.device=cuda", "rewards.1.device='cuda:0'"), 1),
    (QUICKSTART, ("run.device=cpu", "rewards.1.device=cpu"), 0),
    (QUICKSTART, ("run.device=auto",), 0),
], ids=["rollout_process_two_gpus", "run_and_reward_one_gpu", "cpu_no_gpu", "auto_no_gpu"])
def test_a_device_the_machine_has_stays_valid(validate, gpus, recipe, overrides, n):
    gpus(n)
    code, err = validate(recipe, *overrides)
    assert code == 0, err


def test_the_rollout_process_device_is_offset_by_the_local_rank(gpus):
    """Under a launcher `[pipeline] device = 'cuda:N'` is cuda:(N + local rank) (learners on
    GPUs 0..P-1 draw on P..2P-1): the check counts the offset, as the rollout process does."""
    from flowrl.commands.base import load
    from flowrl.errors import RecipeError
    from flowrl.recipe import check_devices
    from flowrl.train.rollout_worker import rollout_device

    gpus(2)
    recipe = load(STEP, [*ROLLOUT_PROCESS, "pipeline.device='cuda:1'"])
    check_devices(recipe, local_rank=0)
    assert str(rollout_device("cuda:1", None, 1)) == "cuda:2"
    with pytest.raises(RecipeError, match=r"is cuda:2 \(offset by this process's local rank 1\), and this machine "
                                          r"has 2 CUDA devices"):
        check_devices(recipe, local_rank=1)


def test_a_malformed_run_device_is_refused_at_validation(validate):
    """`[run] device = 'gpu'` validated and was refused only when the run started."""
    code, err = validate(QUICKSTART, "run.device=gpu")
    one_error(code, err, "[run]", "device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'gpu'")


def test_train_refuses_a_cuda_device_the_machine_lacks_before_anything_is_built(flowrl_cli, gpus, tmp_path):
    """`flowrl train` with the rollout process on 'cuda:1' of a CPU-only machine
    is the same one message, exit 2, no traceback, and nothing written."""
    gpus(0)
    out = tmp_path / "run"
    argv = ["train", str(STEP), "-o", str(out)] + [a for o in (*ROLLOUT_PROCESS, "pipeline.device='cuda:1'")
                                                     for a in ("--set", o)]
    (result,) = flowrl_cli.in_process([argv], cwd=REPO)
    one_error(result.returncode, result.stderr, "[pipeline].device", "names a CUDA device, and this machine has none")
    assert not out.exists()


# ----------------------------------------------------------------------------- required keys

GENEVAL = REPO / "recipes" / "flow_grpo_geneval_sd3.toml"  # `detector` and `clip` left to the user


def test_an_empty_required_reward_key(validate, gpus):
    """The `geneval` reward's `detector` (an OWLv2 directory it never downloads) was accepted empty
    by validation; training failed only once the reward was built, after the base model loaded."""
    gpus(1)
    code, err = validate(GENEVAL)
    one_error(code, err, "[[rewards]] #1 (geneval).detector", "key 'detector' is required, and it is empty",
              "OWLv2", "--set rewards.0.detector=VALUE")
    code, err = validate(GENEVAL, f"rewards.0.detector={json.dumps(str(REPO))}",
                         f"rewards.1.detector={json.dumps(str(REPO))}", 'rewards.1.metadata=""')
    one_error(code, err, "[[rewards]] #2 (geneval).metadata", "key 'metadata' is required, and it is empty")
    code, err = validate(GENEVAL, *(f"rewards.{i}.detector={json.dumps(str(REPO))}" for i in (0, 1)))
    assert code == 0, err  # set (to an existing directory: the path check is the next one)


def test_train_refuses_an_empty_required_key_before_the_model_loads(flowrl_cli, monkeypatch, tmp_path):
    from flowrl.commands import machine

    monkeypatch.setattr(machine, "host_memory_bytes", lambda: 2**50)  # RAM is not what this test is about
    out = tmp_path / "run"
    (result,) = flowrl_cli.in_process([["train", str(GENEVAL), "-o", str(out), "--set", "run.device=cpu"]], cwd=REPO)
    one_error(result.returncode, result.stderr, "[[rewards]] #1 (geneval).detector", "is required, and it is empty")
    assert not out.exists()


@pytest.mark.parametrize("table, cls, key, where, flag", [
    ("model", None, "weights", "[model].weights", "--set model.weights=VALUE"),
    ("rewards", "embedded_clip", "model", "[[rewards]] #2 (embedded_clip).model", "--set rewards.1.model=VALUE"),
    ("prompts", None, "eval_source", "[prompts].eval_source", "--set prompts.eval_source=VALUE"),
], ids=["model", "reward", "plain_table"])
def test_any_key_declared_required_is_checked_for_every_kind_of_table(validate, monkeypatch, table, cls, key, where,
                                                                      flag):
    """The check reads the declaration (`param(..., required=True)`), not a reward's name: a key
    of the model, of a reward or of a plain table, declared required here, is refused empty."""
    import dataclasses
    import types

    from flowrl.commands.base import registry
    from flowrl.recipe import PromptsConfig

    owner = {"model": lambda: registry().get("model", "embedded").params,
             "rewards": lambda: registry().get("reward", cls).params, "prompts": lambda: PromptsConfig}[table]()
    field = next(f for f in dataclasses.fields(owner) if f.name == key)
    code, err = validate(QUICKSTART)
    assert code == 0, err  # empty, and not required
    monkeypatch.setattr(field, "metadata", types.MappingProxyType({**field.metadata, "required": True}))
    code, err = validate(QUICKSTART)
    one_error(code, err, where, f"key '{key}' is required, and it is empty", flag)


# ----------------------------------------------------------------------------- [log].kl_every


@pytest.mark.parametrize("recipe, overrides, fragments", [
    (QUICKSTART, (), ("loss 'epg' is not a ratio-based policy gradient", "trains on an ELBO", "remove kl_every")),
    (HACKING, ('loss.use="nft"',), ("loss 'nft' is not a ratio-based policy gradient", "nft's or awm's beta_kl")),
    (HACKING, ('loss.kl="old_policy_k3"',), ("measures against the rollout policy", "approx_kl_old",
                                            "set [loss].kl = 'gaussian_exact' or 'flow_grpo'")),
], ids=["epg_on_the_elbo", "nft", "old_policy_k3"])
def test_kl_every_where_there_is_no_reference_kl_to_measure(validate, recipe, overrides, fragments):
    """[log].kl_every would do nothing here: one message, not a run that silently logs no KL."""
    code, err = validate(recipe, "log.kl_every=5", *overrides)
    one_error(code, err, "[log].kl_every", *fragments)


@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_kl_every_keeps_the_reference_the_engine_measures_against(validate, finetune):
    """With beta = 0, [log].kl_every gives the run the reference the engine measures against
    (KLSettings.of), and the memory plan's rule (keeps_reference_copy) says the same: a frozen
    copy with full fine-tuning, the adapter off with LoRA."""
    from flowrl.commands.base import load, registry
    from flowrl.objectives.kl import KLSettings
    from flowrl.recipe import build_loss, keeps_reference_copy
    from flowrl.train.finetune import prepare_trainable

    sets = [f'train.finetune="{finetune}"', "log.kl_every=5"]
    code, err = validate(HACKING, *sets)
    assert code == 0, err
    recipe = load(HACKING, sets)
    choice = recipe.components["model"]
    model = registry().get("model", choice.use).build(choice.params)
    prepare_trainable(model, recipe.train)
    kl = KLSettings.of(build_loss(recipe, registry()), model, recipe.log.kl_every)
    assert kl.beta == 0 and kl.reference is not None and kl.monitors(10) and not kl.monitors(11)
    assert (kl.reference.frozen is not None) == keeps_reference_copy(recipe) == (finetune == "full")
    assert not keeps_reference_copy(load(HACKING, [f'train.finetune="{finetune}"']))
