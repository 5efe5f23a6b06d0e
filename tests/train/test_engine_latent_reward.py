"""A run whose rewards all score latents never decodes in training: no ``decode`` phase,
``compute/decoded`` 0, the same scores with and without overlapped scoring, evaluation and the
group grid still drawn (decoded for the pictures only)."""

from __future__ import annotations

import pytest

from engine_helpers import load, quiet_console
from tiny_recipe import ENGINE, tiny_recipe, write_recipe

from flowrl.runlog import read_metrics
from flowrl.train import train

LATENT_RECIPE = tiny_recipe(ENGINE, rewards=[{"use": "latent_verifier"}])
SMALL = ["train.iterations=2", "train.updates_per_rollout=1", "train.optimizer_steps_per_update=1",
         "prompts.num_eval=2", "log.eval_every=1", "log.image_every=1"]


@pytest.mark.slow
def test_a_latent_reward_run_decodes_nothing_in_training(tmp_path):
    recipe_path = write_recipe(tmp_path, LATENT_RECIPE)
    plain = train(load(recipe_path, *SMALL, f"run.output_dir={str(tmp_path / 'plain')!r}"), console=quiet_console())
    overlapped = train(load(recipe_path, *SMALL, "sampler.overlap_rewards=true", "sampler.batch_size=4",
                            f"run.output_dir={str(tmp_path / 'overlap')!r}"), console=quiet_console())
    for run_dir in (plain, overlapped):
        rows = [r for r in read_metrics(run_dir) if not r.get("final")]
        assert len(rows) == 2
        for row in rows:
            assert "time/decode" not in row and row["compute/decoded"] == 0.0
            assert 0.0 <= row["reward/latent_verifier/mean"] <= 1.0 and "eval/latent_verifier/mean" in row
        assert (run_dir / "images" / "iter_000000.png").is_file()  # the group grid, decoded for the picture
    a, b = read_metrics(plain)[0], read_metrics(overlapped)[0]
    assert a["reward/latent_verifier/mean"] == b["reward/latent_verifier/mean"]


def test_an_image_reward_run_counts_its_decodes(tmp_path):
    recipe_path = write_recipe(tmp_path)  # the area reward scores images
    run_dir = train(load(recipe_path, "train.iterations=1", "train.updates_per_rollout=1",
                         "train.optimizer_steps_per_update=1", f"run.output_dir={str(tmp_path / 'run')!r}"),
                    console=quiet_console())
    row = read_metrics(run_dir)[0]
    assert row["compute/decoded"] == 8.0 and "time/decode" in row  # 2 prompts x 4 samples
