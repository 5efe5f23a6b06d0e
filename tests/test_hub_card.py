"""The model card names the run's algorithm and task from what its components say of themselves
(never "step-level GRPO" for a DiffusionNFT, DPO, AWM or SFT run, never text-to-image for a video
run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.hub import algorithm_of, model_card, task_of
from flowrl.plugins import get_registry
from flowrl.recipe import load_recipe, uses_units

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@pytest.mark.parametrize("recipe, algorithm, paper", [
    ("quickstart.toml", "on the final image's ELBO likelihood, with EPG's policy-gradient loss",
     "Rethinking the Design Space of RL for Diffusion Models"),
    ("quickstart_nft.toml", "DiffusionNFT", "DiffusionNFT"),
    ("quickstart_vgrpo.toml", "V-GRPO", "arXiv:2604.23380"),
    ("quickstart_fdfo.toml", "FDFO", "arXiv:2603.12893"),
    ("quickstart_awm.toml", "AWM (Advantage Weighted Matching)", "arXiv:2509.25050"),
    ("quickstart_dpo.toml", "online DPO", "arXiv:2311.12908"),
    ("quickstart_dgpo.toml", "DGPO", "arXiv:2510.08425"),
    ("offline_sft.toml", "supervised fine-tuning", ""),
    ("offline_dpo.toml", "offline Diffusion-DPO", "arXiv:2311.12908"),
    ("quickstart_step.toml", "step-level GRPO (DanceGRPO / Flow-GRPO)", "arXiv:2505.05470"),
    ("quickstart_gspo.toml", "GSPO-style sequence-level", "arXiv:2507.18071"),
    ("quickstart_guard.toml", "with GRPO-Guard's ratio correction", "arXiv:2510.22319"),
    ("quickstart_dppo.toml", "with Flow-DPPO's trust region", "arXiv:2606.11025"),
    ("quickstart_gardo.toml", "with GARDO's gated KL", "arXiv:2512.24138"),
    ("study_embedded.toml", "temporal-dynamics weight", "arXiv:2510.21583"),
])
def test_the_card_names_the_algorithm_the_components_run(recipe, algorithm, paper):
    name, cited = algorithm_of(load_recipe(RECIPES / recipe))
    assert algorithm in name and paper in cited
    if recipe.startswith(("quickstart.", "quickstart_awm", "quickstart_dpo", "quickstart_dgpo", "offline")):
        assert "GRPO" not in name  # an objective that owns its update is not the chunker's GRPO


@pytest.mark.parametrize("recipe, task", [
    ("quickstart.toml", "text-to-image"), ("quickstart_video.toml", "text-to-video"),
    ("wan21_1p3b_lora.toml", "text-to-video"), ("ltx_lora.toml", "text-to-video"),
    ("kontext_edit_lora.toml", "image-to-image"), ("qwen_image_edit_lora.toml", "image-to-image"),
    ("chunk_grpo_flux.toml", "text-to-image"),
])
def test_the_card_tags_the_models_task(recipe, task):
    resolved = load_recipe(RECIPES / recipe)
    assert task_of(resolved) == task
    info = {"format": "state_dict", "model": resolved.components["model"].use, "base": None, "finetune": "full",
            "iteration": 1}
    card = model_card("me/x", info, resolved, None, has_plot=False)
    assert f"pipeline_tag: {task}\n" in card and f"\n- {task}\n" in card


#: Every shipped recipe: the words its card must use for the algorithm, and its task. A recipe
#: added to recipes/ without a row here fails the test below, so each new one is read once.
STEP, CHUNK, FIXED, GSPO = "step-level GRPO", "Chunk-GRPO", "GRPO on fixed chunks", "GSPO-style sequence-level"
T2I, T2V, I2I = "text-to-image", "text-to-video", "image-to-image"
ELBO = "on the final image's ELBO likelihood"
EVERY_RECIPE = {
    "chunk_grpo_flux.toml": (CHUNK, T2I), "chunk_grpo_flux_lora.toml": (CHUNK, T2I),
    "chunk_grpo_flux_ws.toml": (f"{CHUNK}, with chunks sampled by their temporal-dynamics weight", T2I),
    "chunk_grpo_sd3.toml": (CHUNK, T2I), "compose_grpo.toml": (STEP, T2I), "compose_nft.toml": ("DiffusionNFT", T2I),
    "dance_grpo_flux.toml": (STEP, T2I), "fdfo_pickscore_sd3.toml": ("FDFO", T2I), "fixed_chunk_flux.toml": (FIXED, T2I),
    "flow_grpo_geneval_flux.toml": (STEP, T2I), "flow_grpo_geneval_sd3.toml": (STEP, T2I),
    "flow_grpo_ocr_flux.toml": (STEP, T2I), "flow_grpo_ocr_sd3.toml": (STEP, T2I),
    "flow_grpo_pickscore_flux.toml": (STEP, T2I), "flux_nf4_24gb.toml": (STEP, T2I),
    "flow_grpo_pickscore_sd3.toml": (STEP, T2I),
    "flux2_klein_lora.toml": (STEP, T2I), "flux2_klein_nf4_24gb.toml": (STEP, T2I), "gspo_flux.toml": (GSPO, T2I),
    "kontext_edit_lora.toml": (STEP, I2I), "lora_single_gpu_sd3.toml": (STEP, T2I), "ltx_lora.toml": (CHUNK, T2V),
    "offline_dpo.toml": ("offline Diffusion-DPO", T2I), "offline_dpo_sd3.toml": ("offline Diffusion-DPO", T2I),
    "offline_sft.toml": ("supervised fine-tuning", T2I),
    "pepg_geneval_sd3.toml": (f"{ELBO}, with PEPG", T2I), "quickstart.toml": (f"{ELBO}, with EPG", T2I),
    "quickstart_awm.toml": ("AWM", T2I), "quickstart_dgpo.toml": ("DGPO", T2I),
    "quickstart_diversity.toml": (f"{CHUNK}, with GARDO's diversity-aware advantage", T2I),
    "quickstart_dpo.toml": ("online DPO", T2I), "quickstart_dppo.toml": (f"{STEP} (DanceGRPO / Flow-GRPO), with Flow-DPPO", T2I),
    "quickstart_dynamics.toml": (f"{CHUNK} with chunks from the sampler's temporal dynamics", T2I),
    "quickstart_egrpo.toml": (f"{STEP} (DanceGRPO / Flow-GRPO), with E-GRPO", T2I),
    "quickstart_epg.toml": (f"{ELBO}, with EPG", T2I), "quickstart_fast.toml": ("with Flow-GRPO-Fast's", T2I),
    "quickstart_fdfo.toml": ("FDFO", T2I), "quickstart_fixed.toml": (FIXED, T2I),
    "quickstart_flash.toml": ("with Flash-GRPO's", T2I), "quickstart_gardo.toml": (f"{CHUNK}, with GARDO's gated KL", T2I),
    "quickstart_gspo.toml": (GSPO, T2I), "quickstart_guard.toml": (f"{CHUNK}, with GRPO-Guard", T2I),
    "quickstart_hacking.toml": (CHUNK, T2I), "quickstart_mixgrpo.toml": ("with MixGRPO's sliding SDE window", T2I),
    "quickstart_mixgrpo_flash.toml": ("with MixGRPO-Flash's", T2I), "quickstart_nft.toml": ("DiffusionNFT", T2I),
    "quickstart_par.toml": (f"{ELBO}, with PAR", T2I), "quickstart_pepg.toml": (f"{ELBO}, with PEPG", T2I),
    "quickstart_step.toml": (STEP, T2I), "quickstart_vgrpo.toml": ("V-GRPO", T2I), "quickstart_video.toml": (FIXED, T2V),
    "quickstart_video_nft.toml": ("DiffusionNFT", T2V), "qwen_image_edit_lora.toml": (STEP, I2I),
    "qwen_image_lora.toml": (STEP, T2I), "study_compose.toml": (CHUNK, T2I), "study_embedded.toml": (CHUNK, T2I),
    "study_latent.toml": (CHUNK, T2I), "vgrpo_geneval_sd3.toml": ("V-GRPO", T2I), "wan21_14b_lora.toml": (CHUNK, T2V),
    "wan21_14b_nf4_32gb.toml": (CHUNK, T2V), "wan21_1p3b_lora.toml": (CHUNK, T2V),
    "wan21_1p3b_videoalign.toml": (CHUNK, T2V), "wan22_5b_lora.toml": (CHUNK, T2V),
    "wan22_a14b_lora.toml": (CHUNK, T2V), "zimage_lora.toml": (STEP, T2I),
}


def test_the_table_lists_every_shipped_recipe():
    assert sorted(EVERY_RECIPE) == sorted(p.name for p in RECIPES.glob("*.toml"))


@pytest.mark.parametrize("recipe", sorted(EVERY_RECIPE))
def test_every_shipped_recipes_card_names_its_algorithm_task_rewards_and_components(recipe):
    words, task = EVERY_RECIPE[recipe]
    resolved = load_recipe(RECIPES / recipe)
    info = {"format": "state_dict", "model": resolved.components["model"].use, "base": None, "finetune": "full",
            "iteration": 1}
    card = model_card("me/x", info, resolved, None, has_plot=False)
    algorithm = card.split("using **", 1)[1].split("**", 1)[0]
    assert words in algorithm, algorithm
    assert f"pipeline_tag: {task}\n" in card
    assert ("\n- grpo\n" in card) == ("GRPO" in algorithm)  # no GRPO tag on an NFT, DPO or SFT run
    for reward in resolved.rewards:
        assert f"- `{reward.label}` (`{reward.use}`), weight {reward.weight:g}" in card
    training = card.split("## Training", 1)[1].split("- rewards:", 1)[0]
    assert f"loss `{resolved.components['loss'].use}`" in training
    # the chunk layout is named only where the objective lays units out
    assert ("chunker `" in training) == uses_units(resolved, get_registry())


@pytest.mark.parametrize("trained, files, loads", [
    ("both", ["pytorch_lora_weights.safetensors", "pytorch_lora_weights_transformer_2.safetensors"],
     ['pipe.load_lora_weights("me/x")',
      'pipe.load_lora_weights("me/x", weight_name="pytorch_lora_weights_transformer_2.safetensors", '
      'load_into_transformer_2=True)']),
    ("low", ["pytorch_lora_weights_transformer_2.safetensors"],
     ['pipe.load_lora_weights("me/x", weight_name="pytorch_lora_weights_transformer_2.safetensors", '
      'load_into_transformer_2=True)']),
    (None, None, ['pipe.load_lora_weights("me/x")']),  # an export from before the files were recorded
])
def test_the_card_loads_every_lora_file_the_export_wrote(trained, files, loads):
    """Wan 2.2 A14B exports a LoRA per trained expert; the card's snippet loads each into its
    transformer (it loaded only the default file, which an export of the low-noise expert lacks)."""
    from flowrl.hub import DEFAULT_LORA_FILE, SECOND_TRANSFORMER_LORA_FILE, how_to_load
    from flowrl_plugins.diffusers_models.wan_a14b import LORA_FILES

    assert LORA_FILES == {"transformer": DEFAULT_LORA_FILE, "transformer_2": SECOND_TRANSFORMER_LORA_FILE}
    info = {"format": "diffusers_lora", "base": "Wan-AI/Wan2.2-T2V-A14B-Diffusers"}
    if files is not None:
        info["weights"] = files
    lines = how_to_load(info, "me/x")
    assert lines[3] == 'pipe = DiffusionPipeline.from_pretrained("Wan-AI/Wan2.2-T2V-A14B-Diffusers")'
    assert lines[4:-1] == loads
