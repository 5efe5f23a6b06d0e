"""Several [[rewards]] in one recipe: the run trains and metrics.jsonl logs each reward by label.

Uses the randomly initialised embedded model, 2 iterations, and three rewards of different
scales: area (in [0, 1]), brightness under the label "bright", and pickscore on the tiny CLIP
(cosine scale), so a model-backed reward runs inside the engine too.
"""

from __future__ import annotations

import math
import os

import pytest
from tiny_recipe import tiny_recipe


def recipe_text(mode: str, clip) -> str:
    """The tiny recipe with the three rewards, combined by ``mode``; pickscore on the CLIP at ``clip``."""
    return tiny_recipe(
        run={"name": "multi", "seed": 3}, schedule={"use": "shift", "shift": 3.0}, kernel={"use": "flow", "a": 0.7},
        selector={"use": "uniform", "fraction": 0.5}, advantage={"use": "group_zscore", "multi_reward": mode},
        loss={"use": "clipped"}, train={"micro_batch_size": 4, "lr": 1e-3}, checkpoint={"every": 2},
        rewards=[{"use": "area", "weight": 1.0}, {"use": "brightness", "name": "bright", "weight": 0.5},
                 {"use": "pickscore", "weight": 0.25, "model": str(clip), "processor": str(clip), "scale": "cosine"}])


@pytest.mark.parametrize("mode", ["normalise_then_weight", "weighted_sum"])
def test_multi_reward_recipe_trains_and_logs_each_reward(tmp_path, tiny_clip_dir, mode):
    from rich.console import Console

    from flowrl.recipe import load_recipe
    from flowrl.runlog import read_metrics
    from flowrl.train import train

    path = tmp_path / "multi.toml"
    path.write_text(recipe_text(mode, tiny_clip_dir))
    recipe = load_recipe(path, [f'run.output_dir="{tmp_path / "run"}"'])
    assert [(r.label, r.weight) for r in recipe.rewards] == [("area", 1.0), ("bright", 0.5), ("pickscore", 0.25)]
    run_dir = train(recipe, console=Console(file=open(os.devnull, "w"), width=200))
    records = [r for r in read_metrics(run_dir) if "reward/area/mean" in r]
    assert len(records) == 2
    for record in records:
        for label in ("area", "bright", "pickscore"):
            value = record[f"reward/{label}/mean"]
            assert math.isfinite(value), (label, record)
        assert 0.0 <= record["reward/area/mean"] <= 1.0
        assert 0.0 <= record["reward/bright/mean"] <= 1.0
        assert -1.0 <= record["reward/pickscore/mean"] <= 1.0
    # each reward has its own statistics, not a copy of another's
    assert len({records[0][f"reward/{label}/mean"] for label in ("area", "bright", "pickscore")}) == 3
