"""The video quickstarts train end to end on the shipped embedded video model (shortened here:
its 3-standard-error learning run is a measurement, docs/video.md): clips flow through the
rollout, the clip and per-frame rewards, the evaluation, the grids (PNG filmstrips, GIF, MP4)
and the checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from PIL import Image

from flowrl.recipe import load_recipe
from flowrl.runlog import read_metrics
from flowrl.train import train
from flowrl.video import mp4_available

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["quickstart_video.toml", "quickstart_video_nft.toml"])
def test_video_quickstart_trains(name, tmp_path):
    recipe = load_recipe(
        REPO / "recipes" / name,
        [f"run.output_dir={json.dumps(str(tmp_path / 'run'))}", "train.iterations=1", "train.prompts_per_iteration=2",
         "prompts.num_eval=2", "log.progress=false", "log.image_every=1", "log.eval_every=1"],
    )
    from rich.console import Console

    run_dir = train(recipe, console=Console(file=open(os.devnull, "w")))
    records = read_metrics(run_dir)
    first = records[0]
    if recipe.components["loss"].use != "nft":  # (NFT keeps no trajectory log-probs)
        assert first["on_policy/max_abs_log_ratio"] < 1e-6
    for label in ("video_verifier", "embedded_clip", "temporal_consistency"):
        assert 0.0 <= first[f"reward/{label}/mean"] <= 1.0 or label == "embedded_clip"
        assert f"eval/{label}/mean" in first and f"eval/{label}/sem" in first
    assert 0.0 <= first["eval/hf_share/mean"] <= 1.0
    eval_dir = run_dir / "images" / "eval"
    with Image.open(eval_dir / "iter_000000.gif") as gif:
        assert gif.n_frames == 4  # one grid per frame of the clips
    assert (eval_dir / "iter_000000.mp4").is_file() == mp4_available()
    with Image.open(eval_dir / "strips" / "iter_000000.png") as strip:
        assert strip.size == (2 * 4 * 16, 16)  # 2 prompts, each a filmstrip of 4 frames of 16 px
    assert (run_dir / "images" / "iter_000000.png").is_file()
    assert (run_dir / "checkpoints" / "latest.json").is_file()
