"""The quickstart recipes train end to end on the shipped embedded model (shortened here).

The full 60-iteration quickstart (about 42 s on a 2-core CPU) is measured in README.md; this smoke test
runs every quickstart variant for one iteration with the real weights, so a broken recipe,
component or weight file fails the suite.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from flowrl.recipe import load_recipe
from flowrl.runlog import read_metrics
from flowrl.train import train

REPO = Path(__file__).resolve().parents[1]
# the image quickstarts (the video quickstarts' rewards differ: tests/test_quickstart_video.py)
QUICKSTARTS = sorted(p.name for p in (REPO / "recipes").glob("quickstart*.toml") if not p.name.startswith("quickstart_video"))


def test_there_are_quickstart_variants():
    assert {"quickstart.toml", "quickstart_step.toml", "quickstart_gspo.toml", "quickstart_fixed.toml",
            "quickstart_dynamics.toml"} <= set(QUICKSTARTS)


# the default quickstart in every run of the suite; its variants in the slow lane (``pytest -m slow``)
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "quickstart.toml" else pytest.mark.slow)
                                  for n in QUICKSTARTS])
def test_quickstart_variant_trains(name, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # (not needed for the paths: recipes name their files relative to the recipe)
    recipe = load_recipe(
        REPO / "recipes" / name,
        [f"run.output_dir={json.dumps(str(tmp_path / 'run'))}", "train.iterations=1", "train.prompts_per_iteration=2",
         "prompts.num_eval=2", "prompts.eval_seeds=1", f"train.group_size={2 if name == 'quickstart_fdfo.toml' else 4}",
         "train.micro_batch_size=4",
         "log.progress=false",
         "log.image_every=1"],
    )
    from rich.console import Console

    run_dir = train(recipe, console=Console(file=open(os.devnull, "w")))
    records = read_metrics(run_dir)
    first = records[0]
    loss = recipe.components["loss"].use
    likelihood = recipe.components["likelihood"].use
    if likelihood == "elbo" or loss == "fdfo":  # no trajectory log-probs: the estimator's own diagnostics
        assert "on_policy/max_abs_log_ratio" not in first
        if loss == "fdfo":  # one step, at the rollout's own velocities
            assert first["fdfo/ratio_mean"] == 1.0
        else:  # one step per rollout: the old policy is the trained one, no old forward
            assert first["elbo/ratio_mean"] == 1.0 and first["elbo/old_forward"] == 0.0
    elif loss in ("nft", "awm", "dpo", "dgpo"):  # likelihood-free: no trajectory log-probs, so no on-policy log-ratio
        assert "on_policy/max_abs_log_ratio" not in first
        if loss == "nft":  # its old policy starts as the policy
            assert first["nft/old_deviation"] == 0.0
        elif loss == "awm":  # one step per rollout, at the rollout's own weights
            assert first["awm/ratio_mean"] == 1.0
        elif loss == "dgpo":  # one step, on-policy: the anchors are the current errors (to rounding:
            # the measuring pass batches the points otherwise)
            assert first["dgpo/log_ratio_abs_max"] < 1e-5 and first["dgpo/clip_fraction"] == 0.0
        else:  # the first step is at the reference itself: no margin yet, to rounding
            assert abs(first["dpo/margin"]) < 1e-6
    else:
        assert first["on_policy/max_abs_log_ratio"] < 1e-6
    assert 0.0 <= first["reward/area/mean"] <= 1.0
    assert "eval/area/mean" in first and "eval/verifier/mean" in first
    assert (run_dir / "images" / "iter_000000.png").is_file()
    assert (run_dir / "checkpoints" / "latest.json").is_file()


def test_the_quickstart_stays_on_policy_and_spends_no_old_policy_forward(tmp_path):
    """The README's quickstart is EPG at decay 0: the rollouts come from the trained weights, so
    in every iteration (not only the first, as at the paper's decay type 1) the ratio is 1, the
    old policy's forward is skipped and the update costs one forward and backward per point."""
    recipe = load_recipe(
        REPO / "recipes" / "quickstart.toml",
        [f"run.output_dir={json.dumps(str(tmp_path / 'run'))}", "train.iterations=3", "train.prompts_per_iteration=2",
         "prompts.num_eval=2", "prompts.eval_seeds=1", "train.group_size=4", "train.micro_batch_size=4",
         "log.progress=false", "log.image_every=0"],
    )
    from rich.console import Console

    points = recipe.components["likelihood"].params.timesteps
    rows = [r for r in read_metrics(train(recipe, console=Console(file=open(os.devnull, "w")))) if "loss" in r]
    assert len(rows) == 3
    for r in rows:
        assert r["elbo/old_forward"] == 0.0 and r["elbo/ratio_mean"] == 1.0 and r["elbo/decay"] == 0.0
        assert r["compute/ratio"] == 1.0
        samples = recipe.train.prompts_per_iteration * recipe.train.group_size
        live = samples * (1 - r.get("groups/all_equal_fraction", 0.0))  # samples with an advantage: what EPG forwards
        assert r["compute/update/forward"] == r["compute/update/backward"] == live * points
