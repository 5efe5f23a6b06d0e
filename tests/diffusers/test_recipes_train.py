"""Every real-model recipe trains 2 iterations end to end on the tiny offline pipelines.

Each recipe runs unchanged except for what cannot run on a CPU in a test: the tiny pipeline as
``model.path`` (32x32 images, fp32), a geometry of 1 prompt x 2 samples, and the offline
``brightness`` reward in place of HPSv3 / PickScore (16.5 GB / 4 GB of weights). Sampler,
schedule, kernel, chunker, selector, loss, fine-tuning mode, LoRA settings and gradient
checkpointing are the recipe's own.
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from flowrl.runlog import read_metrics
from flowrl.train.checkpoint import read_model_weights

RECIPES = {
    "chunk_grpo_flux": "flux",
    "chunk_grpo_flux_ws": "flux",
    "dance_grpo_flux": "flux",
    "gspo_flux": "flux",
    "fixed_chunk_flux": "flux",
    "chunk_grpo_sd3": "sd3",
    "lora_single_gpu_sd3": "sd3",
    "flow_grpo_ocr_sd3": "sd3",
    "flow_grpo_pickscore_flux": "flux",
}
#: what else a recipe needs here: the Flow-GRPO recipes evaluate their whole prompt set (1018, 2048)
#: at iteration 0 and at the end; here two prompts, with the recipe's own evaluation steps and EMA
EXTRA = {name: ["prompts.num_eval=2"] for name in RECIPES if name.startswith("flow_grpo_")}
GEOMETRY = ["train.iterations=2", "train.prompts_per_iteration=1", "train.group_size=2", "train.micro_batch_size=2",
            "train.optimizer_steps_per_update=1", "rewards.0.use=brightness", "log.progress=false",
            "log.image_every=1", "run.device=cpu"]


def _sets(items):
    out = []
    for item in items:
        out += ["--set", item]
    return out


@pytest.fixture(scope="module")
def flux_profile(tmp_path_factory, tiny_flux, tiny_overrides, cli):
    """A profile of the tiny FLUX sampler for the weighted selector (what `flowrl profile` writes)."""
    path = tmp_path_factory.mktemp("profile") / "flux.json"
    code, out, err = cli("profile", "recipes/chunk_grpo_flux.toml", *_sets([f"model.path={tiny_flux}", *tiny_overrides,
                         "rewards.0.use=brightness"]), "--num-prompts", "2", "--seeds", "1", "-o", path, "--no-plot",
                         "--device", "cpu")
    assert code == 0, err
    return path


@pytest.fixture(scope="module")
def cli(module_cli):
    """``cli(*argv)`` -> (code, stdout, stderr), module-scoped: the module-scoped profile fixture needs it."""
    return module_cli.run


@pytest.mark.parametrize("name", list(RECIPES))
def test_recipe_runs_two_iterations(name, request, tmp_path, tiny_overrides, cli):
    kind = RECIPES[name]
    path = request.getfixturevalue("tiny_flux" if kind == "flux" else "tiny_sd3")
    sets = [f"model.path={path}", *tiny_overrides, *GEOMETRY, *EXTRA.get(name, [])]
    if name == "chunk_grpo_flux_ws":
        sets.append(f"selector.profile={request.getfixturevalue('flux_profile')}")
    run = tmp_path / "run"
    code, out, err = cli("train", f"recipes/{name}.toml", *_sets(sets), "-o", run)
    assert code == 0, out + err
    records = read_metrics(run)
    evaluations = [r for r in records if "trained_units" not in r]  # a recipe that evaluates: its final one
    records = [r for r in records if "trained_units" in r]
    assert [r["iteration"] for r in records] == [0, 1]
    if name in EXTRA:
        assert records[0]["eval/brightness/mean"] >= 0 and evaluations[-1]["eval/brightness/mean"] >= 0
    for r in records:
        assert r["on_policy/max_abs_log_ratio"] <= 1e-6
        assert r["trained_units"] and all(units for units in r["trained_units"])
    assert (run / "images" / "iter_000001.png").is_file()
    # the FLUX full fine-tuning recipes shard with FSDP2: a torch.distributed.checkpoint directory
    state = read_model_weights(run / "checkpoints" / "iter_000002")
    recipe = (run / "recipe.toml").read_text()
    if 'finetune = "lora"' in recipe:
        assert state and all("lora_" in k for k in state)
        assert any("lora_B" in k and v.abs().max() > 0 for k, v in state.items()), "LoRA B never moved"
    else:
        sub = "transformer"
        base = load_file(str(path / sub / "diffusion_pytorch_model.safetensors"))
        assert set(state) == set(base)
        assert any((state[k] - base[k]).abs().max() > 0 for k in base), "no weight changed"
