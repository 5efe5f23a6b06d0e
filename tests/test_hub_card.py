"""The model card names the run's algorithm and task from what its components say of themselves
(never "step-level GRPO" for a DiffusionNFT, DPO, AWM or SFT run, never text-to-image for a video
run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.hub import algorithm_of, model_card, task_of
from flowrl.recipe import load_recipe

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
