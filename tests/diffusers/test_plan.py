"""``flowrl plan``: geometry and memory estimate without a GPU or weights, checked against real models."""

from __future__ import annotations

import pytest
import torch

from conftest import REPO

from flowrl.errors import FlowrlError

REPO_RECIPES = REPO / "recipes"

GB = 1024**3


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_plan_of_the_paper_recipe_needs_no_gpu_and_no_weights(cli):
    code, out, err = cli("plan", "recipes/chunk_grpo_flux.toml", "--num-processes", "8")
    assert code == 0, err
    text = _flat(out)
    assert "world size 8" in text and "24 per process" in text
    assert "11.901e9 params x 4 B / 8 shards" in text  # FLUX.1-dev's 12B transformer, fp32 master weights
    assert "fits in 80 GB" in text and "sharded over 8 of 8 processes" in text  # FSDP2 full fine-tuning
    code, out, _ = cli("plan", "recipes/chunk_grpo_flux.toml", "--num-processes", "8", "--set", "distributed.strategy=ddp")
    assert code == 0 and "does not fit in 80 GB" in _flat(out)  # replicated: weights + grads + AdamW on each GPU
    code, out, _ = cli("plan", "recipes/chunk_grpo_flux.toml", "--num-processes", "8", "--set", "train.finetune=lora",
                       "--set", "model.denoiser_dtype=auto")
    assert code == 0 and "fits in 80 GB" in _flat(out) and "(r = 64)" in _flat(out)


def test_plan_of_the_flagship_as_the_readme_runs_it_plans_its_8_processes_and_fits(cli):
    """Without --num-processes the plan is at the recipe's
    [distributed].num_processes, and the output says where the count came from."""
    code, out, err = cli("plan", "recipes/chunk_grpo_flux.toml")
    assert code == 0, err
    text = _flat(out)
    assert "(8 processes, from [distributed].num_processes in the recipe)" in text
    assert "world size 8" in text and "sharded over 8 of 8 processes" in text
    assert "fits in 80 GB" in text and "does not fit" not in text
    assert "this plan is for" not in text  # no note when planning at the recipe's own count


def test_num_processes_on_the_command_line_overrides_the_recipes_count(cli):
    code, out, err = cli("plan", "recipes/chunk_grpo_flux.toml", "--num-processes", "1")
    assert code == 0, err
    text = _flat(out)
    assert "(1 process, from --num-processes)" in text and "world size 1" in text
    assert "does not fit in 80 GB" in text  # 12B parameters of fp32 full fine-tuning on one GPU
    assert "the recipe is written for 8 processes ([distributed].num_processes); this plan is for 1" in text


def test_a_recipe_without_the_key_is_planned_at_one_process(cli):
    code, out, err = cli("plan", "recipes/lora_single_gpu_sd3.toml")
    assert code == 0, err
    assert "(1 process, from [distributed].num_processes in the recipe)" in _flat(out)


@pytest.mark.parametrize("argv, fragment", [
    (["--num-processes", "0"], "greater than or equal to 1"),
    (["--num-processes", "eight"], "valid integer"),
    (["--set", "distributed.num_processes=0"], "key 'num_processes' must be >= 1, got 0"),
    (["--set", 'distributed.num_processes="eight"'], "key 'num_processes' must be int, got 'eight'"),
])
def test_a_bad_process_count_is_one_clear_error(cli, argv, fragment):
    code, out, err = cli("plan", "recipes/chunk_grpo_flux.toml", *argv)
    assert code == 2 and "Traceback" not in err
    assert fragment in _flat(err)
    assert "peak ~" not in out


def test_the_flagship_lora_variant_fits_one_80gb_gpu(cli):
    code, out, err = cli("plan", "recipes/chunk_grpo_flux_lora.toml", "--num-processes", "1")
    assert code == 0, err
    assert "fits in 80 GB" in _flat(out) and "(r = 64)" in _flat(out)


def test_plan_resolves_auto_as_a_run_does_and_refuses_none_with_several_processes(cli):
    """One rule (flowrl.distributed.choose_strategy) for a run and its plan; no launcher when
    planning, so "auto" plans ddp with several processes and none with one."""
    for n, expected in (("1", "none: weights"), ("2", "ddp: weights")):
        code, out, err = cli("plan", "recipes/quickstart_hacking.toml", "--num-processes", n, "--set", "distributed.strategy=auto")
        assert code == 0, err
        assert expected in _flat(out)
    code, out, err = cli("plan", "recipes/quickstart_hacking.toml", "--num-processes", "2", "--set", "distributed.strategy=none")
    assert code != 0 and "Traceback" not in err
    assert "strategy = 'none' runs one process, not 2" in _flat(err) and "plan one process" in _flat(err)


@pytest.mark.parametrize("name", ["dance_grpo_flux", "gspo_flux", "fixed_chunk_flux", "chunk_grpo_flux_ws", "chunk_grpo_flux_lora",
                                  "chunk_grpo_sd3", "lora_single_gpu_sd3"])
def test_plan_every_real_model_recipe(cli, name):
    code, out, err = cli("plan", f"recipes/{name}.toml")
    assert code == 0, err
    assert "peak ~" in out


def test_single_gpu_sd3_recipe_is_planned_to_fit_80gb(cli):
    code, out, _ = cli("plan", "recipes/lora_single_gpu_sd3.toml", "--gpu-memory", "80")
    assert code == 0 and "fits in 80 GB" in _flat(out)


def test_counts_match_the_loaded_tiny_pipeline(tiny_flux, tiny_overrides, flux_model):
    from flowrl.memory_plan import estimate
    from flowrl.plugins import get_registry
    from flowrl.recipe import load_recipe
    from flowrl.train.finetune import prepare_trainable

    recipe = load_recipe("recipes/chunk_grpo_flux.toml", [f"model.path={tiny_flux}", *tiny_overrides,
                         "rewards.0.use=brightness", "train.finetune=lora", "train.lora_rank=4"])
    _, mm, lines = estimate(recipe, get_registry(), 1)
    den = flux_model.denoiser
    assert mm.denoiser_params == sum(p.numel() for p in den.parameters()) + sum(b.numel() for b in den.buffers())
    pipe = flux_model.pipe
    for name in ("text_encoder", "text_encoder_2", "vae"):
        module = getattr(pipe, name)
        assert mm.frozen[name][0] == sum(p.numel() for p in module.parameters()) + sum(b.numel() for b in module.buffers())
    import copy

    model = copy.deepcopy(flux_model)
    params = prepare_trainable(model, recipe.train)
    lora = next(l for l in lines if l.item == "LoRA weights")
    assert lora.bytes == 4 * sum(p.numel() for p in params)
    assert mm.latent_elements == 64 * 16 and mm.tokens == 64 + 16


def test_update_activation_estimate_is_close_to_a_measurement(tiny_flux, tiny_overrides, flux_model):
    # The estimate uses constants measured on a one-block replica; compare it with the tensors
    # autograd really saves for one training forward of the whole tiny model (micro-batch 2).
    from flowrl.memory_plan import estimate
    from flowrl.plugins import get_registry
    from flowrl.recipe import load_recipe
    from flowrl_plugins.diffusers_models.memory.common import saved_elements

    recipe = load_recipe("recipes/chunk_grpo_flux.toml", [f"model.path={tiny_flux}", *tiny_overrides,
                         "rewards.0.use=brightness", "model.gradient_checkpointing=false", "train.micro_batch_size=2",
                         "train.group_size=2", "train.prompts_per_iteration=1", "train.optimizer_steps_per_update=1",
                         "distributed.strategy=none", "distributed.mixed_precision=no"])
    _, _, lines = estimate(recipe, get_registry(), 1)
    estimated = next(l for l in lines if l.item == "activations, forward with grad").bytes
    text = flux_model.encode_prompts(["a red cat", "a dog"])
    x = torch.randn(2, *flux_model.latent_shape)
    measured = 4 * saved_elements(flux_model.denoiser, lambda: flux_model.velocity(x, torch.tensor([0.5, 0.4]), text))
    flux_model.denoiser.requires_grad_(False)
    print(f"update activations: estimated {estimated} B, measured {measured} B")
    assert 0.7 < estimated / measured < 1.3, (estimated, measured)


def test_unknown_hub_model_offline_is_a_clear_error(monkeypatch, tmp_path):
    import huggingface_hub.constants as hc

    from flowrl_plugins.diffusers_models.memory import pipeline_configs

    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(FlowrlError, match="cannot read the configs") as err:
        pipeline_configs("someone/some-flux-finetune")
    assert "built-in configs exist for" in err.value.hint


def test_plan_falls_back_to_measuring_small_models(cli):
    code, out, err = cli("plan", "recipes/quickstart_hacking.toml", "--set", "model.random_init=true")
    assert code == 0, err
    assert "measured by building the model" in _flat(out)


def test_a_pipelined_run_plans_its_rollout_copy_and_its_pending_rollout(cli):
    """[pipeline] staleness 1 keeps a second copy of the denoiser (with its LoRA) and the next
    iteration's trajectories beside this one's."""
    code, out, err = cli("plan", "recipes/chunk_grpo_flux_lora.toml", "--set", "pipeline.staleness=1")
    assert code == 0, err
    text = _flat(out)
    assert "rollout copy (pipeline) │ 22.84" in text and "pending rollout (pipeline) │ 1.67" in text
    code, out, _ = cli("plan", "recipes/chunk_grpo_flux_lora.toml")
    assert code == 0 and "(pipeline)" not in out
    # a rollout process on a GPU of its own holds the copy there, not on the learner's
    process = ("--set", "pipeline.staleness=1", "--set", "pipeline.worker='process'")
    code, out, err = cli("plan", "recipes/chunk_grpo_flux_lora.toml", *process, "--set", "pipeline.device='cuda:1'")
    assert code == 0, err
    text = _flat(out)
    assert "rollout copy" not in text and "pending rollout (pipeline) │ 1.67" in text
    # 'cuda:0' offset by the local rank is each learner's own GPU: the copy is planned there
    code, out, err = cli("plan", "recipes/chunk_grpo_flux_lora.toml", *process, "--set", "pipeline.device='cuda:0'")
    assert code == 0, err
    assert "rollout copy (pipeline) │ 22.84" in _flat(out)


def test_the_prompt_embedding_cache_is_planned_in_cpu_memory_at_most_the_cache_size(cli, tmp_path):
    """The plan once counted the prompt-embedding cache as GPU memory, one entry per prompt
    of the set (a 25,432-prompt set: over 100 GB, "does not fit"). The engine's cache
    (flowrl.train.session.PromptCache) lives in CPU memory and keeps CACHED_PROMPTS prompts; only
    the iteration's samples' embeddings go to the device. The plan now counts those, there."""
    from flowrl.commands.base import load, registry
    from flowrl.memory_plan import PROMPT_CACHE, TEXT_EMBEDDINGS, cpu_bytes, estimate, peak
    from flowrl.prompts import CACHED_PROMPTS
    from flowrl.train.session import PromptCache

    assert PromptCache(model=None).max_prompts == CACHED_PROMPTS  # the plan's bound is the engine's
    big = tmp_path / "prompts.txt"
    big.write_text("".join(f"a photo of object number {i}\n" for i in range(25_432)), encoding="utf-8")
    many = [f'prompts.source="{big}"', "train.iterations=100000"]  # every prompt of the set is visited

    def planned(*overrides: str) -> dict:
        geometry, mm, lines = estimate(load("recipes/lora_single_gpu_sd3.toml", list(overrides)), registry(), 1)
        items = {l.item: l for l in lines}
        return {"samples": geometry.samples_per_process, "per_prompt": mm.text_bytes_per_prompt,
                "cache": items[PROMPT_CACHE], "text": items[TEXT_EMBEDDINGS], "gpu": peak(lines)[0],
                "host": cpu_bytes(lines)}

    big_set, one_iteration = planned(*many), planned("train.iterations=1")
    cache, text = big_set["cache"], big_set["text"]
    assert cache.phase == "cpu" and cache.bytes == CACHED_PROMPTS * big_set["per_prompt"], cache
    assert text.phase == "persistent" and text.bytes == big_set["samples"] * big_set["per_prompt"], text
    # the GPU peak does not grow with the prompt set; the host memory grows by the cache alone, to its bound
    assert big_set["gpu"] == one_iteration["gpu"]
    assert big_set["host"] - one_iteration["host"] == cache.bytes - one_iteration["cache"].bytes > 0
    code, out, err = cli("plan", "recipes/lora_single_gpu_sd3.toml", *(a for o in many for a in ("--set", o)))
    assert code == 0, err
    flat = _flat(out)
    assert "fits in 80 GB" in flat and "does not fit" not in flat
    assert f"{CACHED_PROMPTS} prompts x" in flat and "25432 prompts" not in flat


def test_a_run_with_a_prompt_store_plans_no_text_encoder(tmp_path):
    """FLUX.1-dev's text encoders (T5-XXL and CLIP, 9.1 GB) leave the plan with [prompts] embeddings."""
    from flowrl.memory_plan import GB, estimate, host_lines, peak
    from flowrl.plugins import get_registry
    from flowrl.recipe import load_recipe

    recipe = REPO_RECIPES / "flow_grpo_pickscore_flux.toml"
    registry = get_registry()
    plans = {}
    for name, sets in (("encodes", []), ("store", [f"prompts.embeddings={str(tmp_path)!r}"])):
        r = load_recipe(recipe, sets)
        _, mm, lines = estimate(r, registry, world_size=1)
        plans[name] = (mm, lines, host_lines(r, mm, lines, 1))
    (mm, lines, host), (mm_s, lines_s, host_s) = plans["encodes"], plans["store"]
    encoders = sum(p * b for k, (p, b) in mm.frozen.items() if k not in mm.vae_names)
    assert encoders > 9 * GB and set(mm_s.frozen) == set(mm.vae_names) & set(mm.frozen)
    assert any(line.item == "text encoders (visiting)" for line in lines)
    assert not any(line.item == "text encoders (visiting)" for line in lines_s)
    held, held_s = (sum(line.bytes for line in h if line.phase == "held") for h in (host, host_s))
    assert held - held_s == pytest.approx(encoders)
    assert peak(lines_s)[0] <= peak(lines)[0] and "prompt embeddings" in mm_s.notes[-1]


def test_an_offline_runs_update_activations_count_every_point_it_forwards():
    """Offline DPO forwards 2 sides x [loss].timesteps points per table row in one forward, without
    CFG: the plan's update activations scale with both (they once counted one row a row)."""
    from flowrl.memory_plan import estimate, offline_points
    from flowrl.plugins import get_registry
    from flowrl.recipe import load_recipe

    registry = get_registry()

    def update(k):
        r = load_recipe(REPO_RECIPES / "offline_dpo_sd3.toml", [f"loss.timesteps={k}", "model.gradient_checkpointing=false"])
        _, _, lines = estimate(r, registry, world_size=1)
        return offline_points(r, registry), next(l.bytes for l in lines if l.item == "activations, forward with grad")

    (p1, a1), (p3, a3) = update(1), update(3)
    assert (p1, p3) == (2, 6) and a3 == pytest.approx(3 * a1)
    r = load_recipe(REPO_RECIPES / "offline_dpo_sd3.toml")
    items = {l.item for l in estimate(r, registry, world_size=1)[2]}
    assert {"table latents", "table latent cache"} <= items and "trajectories" not in items  # no rollout is stored
    quiet = estimate(load_recipe(REPO_RECIPES / "offline_dpo_sd3.toml", ["prompts.num_eval=0", "rewards.0.offload=false"]),
                     registry, world_size=1)[2]  # evaluating nothing, it samples, decodes and scores nothing
    assert all(l.bytes == 0 for l in quiet if l.phase in ("rollout", "decode"))
    assert not [l for l in quiet if l.item.startswith("reward '")]
    evaluating = estimate(load_recipe(REPO_RECIPES / "offline_dpo_sd3.toml", ["rewards.0.offload=false"]), registry,
                          world_size=1)[2]
    assert [l.phase for l in evaluating if l.item.startswith("reward '")] == ["persistent"]
    online = load_recipe(REPO_RECIPES / "lora_single_gpu_sd3.toml", ["model.gradient_checkpointing=false"])
    assert offline_points(online, registry) == 0
