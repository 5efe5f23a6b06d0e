"""The objectives of docs/objectives.md run through the one engine: each recipe smoke-trains
(2 iterations, tiny geometry), the loop has no branch on an objective's name, a third-party
window planner plugs in through ``register_windows``, and the diagnostics are logged.

The learning bars (eval reward up >= 3 SE in 30 iterations) are measured by
benchmarks/objectives.py, not here.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from engine_helpers import load, quiet_console
from tiny_recipe import ENGINE, tiny_recipe, write_recipe

from flowrl import hookimpl
from flowrl.sampling.plans import RolloutPlan
from flowrl.plugins import temporary_plugin
from flowrl.runlog import read_metrics
from flowrl.train import train

REPO = Path(__file__).resolve().parents[2]
NEW = ["quickstart_guard", "quickstart_mixgrpo", "quickstart_mixgrpo_flash", "quickstart_fast", "quickstart_nft",
       "quickstart_gardo", "quickstart_diversity", "quickstart_awm", "quickstart_dppo", "quickstart_flash",
       "quickstart_egrpo", "quickstart_dpo", "quickstart_dgpo", "quickstart_epg", "quickstart_pepg", "quickstart_par",
       "quickstart_vgrpo", "quickstart_fdfo"]
SMALL = ["train.iterations=2", "train.prompts_per_iteration=2", "train.group_size=4", "train.micro_batch_size=4",
         "prompts.num_eval=2", "log.eval_every=1", "log.image_every=0", "log.progress=false", "sampler.steps=9"]


def _pairs(steps: int, shift: float):
    """(sigma, sigma_next) of the first steps - 1 transitions of the shifted linear schedule."""
    t = [1 - i / steps for i in range(steps + 1)]
    s = [shift * x / (1 + (shift - 1) * x) for x in t]
    return list(zip(s[:-2], s[1:-1]))


def _rows(run_dir):
    return [r for r in read_metrics(run_dir) if not r.get("final")]


@pytest.mark.slow
@pytest.mark.parametrize("name", NEW)
def test_recipe_smoke_trains(name, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    overrides = SMALL + [f"run.output_dir={tmp_path / name}"]
    if name in ("quickstart_guard", "quickstart"):
        overrides.append("chunker.sizes=[1, 2, 2, 3]")  # 8 trainable transitions at 9 steps
    if name == "quickstart_diversity":
        overrides.append("chunker.sizes=[1, 2, 2, 3]")
    if name == "quickstart_gardo":
        # two optimizer steps: the second sees a KL > 0 = kl_threshold, so the reference resets at iteration 1
        overrides += ["chunker.sizes=[1, 2, 2, 3]", "loss.kl_threshold=0", "train.optimizer_steps_per_update=2"]
    if name == "quickstart_fast":
        overrides.append("window.hi=6")
    if name.startswith("quickstart_mixgrpo"):
        overrides.append("window.every=1")
    if name in ("quickstart_flash", "quickstart_egrpo"):  # the study's regime: SDE in the first 16 of 32
        overrides.append("sampler.sde_window=[0, 8]")  # all 8 transitions at 9 steps
    if name == "quickstart_guard":
        overrides.append("train.micro_batch_size=4")
    if name == "quickstart_dppo":
        # 8 trainable transitions at 9 steps; threshold 1e-8: the second pass drops the units that move with A
        overrides += ["sampler.sde_window=[0, 8]", "loss.kl_threshold=1e-8"]
    if name in ("quickstart_dpo", "quickstart_dgpo"):  # a second, off-policy pass: the mates' anchors lag
        overrides.append("train.updates_per_rollout=2")
    if name in ("quickstart_epg", "quickstart_pepg", "quickstart_par", "quickstart_vgrpo"):
        overrides += ["train.updates_per_rollout=2", "likelihood.timesteps=3"]  # the old policy lags on pass 2
    if name == "quickstart_fdfo":  # pairs; a second pass needs the rollout weights' velocities
        overrides += ["train.group_size=2", "train.prompts_per_iteration=4", "train.updates_per_rollout=2",
                      "loss.timesteps=2"]
    run_dir = train(load(REPO / "recipes" / f"{name}.toml", *overrides), console=quiet_console())
    rows = _rows(run_dir)
    assert len(rows) == 2 and all("loss" in r and r["nonfinite_steps"] == 0 for r in rows)
    assert "groups/all_equal_fraction" in rows[0]
    if name == "quickstart_nft":
        assert rows[0]["nft/old_deviation"] >= 0 and "on_policy/max_abs_log_ratio" not in rows[0]
        assert rows[0]["trained_units"] == [[] for _ in range(8)]
    elif name == "quickstart_awm":
        assert rows[0]["awm/fm_loss"] > 0 and rows[0]["awm/ratio_mean"] == 1.0  # one on-policy step
        assert "on_policy/max_abs_log_ratio" not in rows[0] and rows[0]["trained_units"] == [[] for _ in range(8)]
        # 8 samples x 6 sigmas, each once forward and once backward
        assert rows[0]["compute/update/forward"] == rows[0]["compute/update/backward"] == 48
    elif name == "quickstart_dpo":
        # 2 groups, one pair each: 4 samples x 4 points, measured once without gradient (and by the
        # reference), then forward and backward in each of the 2 passes; the winners lead by the end
        assert rows[0]["dpo/pairs"] == 2 and "on_policy/max_abs_log_ratio" not in rows[0]
        assert rows[0]["compute/update/forward"] == 16 + 2 * 16 and rows[0]["compute/update/backward"] == 2 * 16
        # the minimum: the rollout (8 x 9), the reference and each pass's forward and backward; the
        # pre-pass's 16 policy forwards are the work above it
        assert rows[0]["compute/reference/forward"] == 16 and rows[0]["compute/minimum"] == 72 + 16 + 2 * (16 + 16)
        assert rows[0]["compute/ratio"] == pytest.approx((72 + 16 + 48 + 32) / (72 + 16 + 64))
        assert rows[0]["dpo/margin"] < 0 and 0 < rows[0]["dpo/loss"] < math.log(2)
    elif name == "quickstart_dgpo":
        # 8 samples x 4 points: the pre-pass (policy and reference), then 2 passes; sigmoid(S) near 1/2
        assert rows[0]["compute/update/forward"] == 32 + 2 * 32 and rows[0]["compute/update/backward"] == 2 * 32
        assert rows[0]["compute/reference/forward"] == 32 and "on_policy/max_abs_log_ratio" not in rows[0]
        assert rows[0]["compute/minimum"] == 72 + 32 + 2 * (32 + 32)
        assert 0.4 < rows[0]["dgpo/weight_mean"] < 0.6 and rows[0]["dgpo/log_ratio_abs_max"] > 0
    elif name in ("quickstart_epg", "quickstart_pepg", "quickstart_par", "quickstart_vgrpo", "quickstart_fdfo"):
        # nothing beyond the minimum: iteration 0's old policy is the trained one until its first step
        # (no old forward on pass 1, one on pass 2); iteration 1's differs from the start (decay type 1)
        assert all(r["compute/ratio"] == 1.0 for r in rows), [r["compute/ratio"] for r in rows]
        assert "on_policy/max_abs_log_ratio" not in rows[0] and rows[0]["trained_units"] == [[] for _ in range(8)]
        per_pass = 8 * (2 if name == "quickstart_fdfo" else 3)
        assert rows[0]["compute/update/forward"] <= 2 * per_pass and rows[0]["compute/old/forward"] <= per_pass
        if name != "quickstart_fdfo":
            assert rows[0]["elbo/log_ratio_abs_max"] > 0 and rows[1]["elbo/decay"] > 0
    else:
        assert rows[0]["on_policy/max_abs_log_ratio"] <= 1e-6
        assert len(rows[0]["diag/step_log_ratio_std"]) == (4 if "mixgrpo" in name else 2 if "fast" in name else 8)
    if name == "quickstart_dppo":  # the second pass is off-policy: some units leave the region and are dropped
        assert rows[0]["dppo/kl_max"] > 0 and 0 < rows[0]["clip_fraction"] < 1
    if name == "quickstart_gardo":
        assert rows[0]["gardo/reset"] is False and rows[1]["gardo/reset"] is True
        assert 0 < rows[0]["gardo/gate_fraction"] <= 0.25 and rows[0]["kl/flow_grpo"] > 0
    if name == "quickstart_flash":  # one transition per sample, the same in a group (2 groups of 4)
        units = rows[0]["trained_units"]
        assert all(len(u) == 1 and u[0] < 4 for u in units)  # span 0.5 of the 8 transitions
        assert units[:4] == [units[0]] * 4 and units[4:] == [units[4]] * 4
    if name == "quickstart_egrpo":  # the 4 of 8 transitions with the largest kernel std, for every sample
        std = [0.7 * math.sqrt(s / (1 - s if s < 1 else 1 - n)) * math.sqrt(s - n) for s, n in _pairs(9, 3.0)]
        top = sorted(sorted(range(8), key=lambda i: -std[i])[:4])
        assert rows[0]["trained_units"] == [top] * 8
    if name == "quickstart_guard":  # two optimizer steps: the second re-scores off-policy
        assert any(s and s > 0 for s in rows[1]["diag/step_log_ratio_std"])


@pytest.mark.slow
def test_flow_dppo_trains_on_the_elbo(tmp_path, monkeypatch):
    """Flow-DPPO on the final image's ELBO: pass 1 is on-policy (divergence 0, nothing dropped); on
    pass 2 the old (rollout) policy differs, and with the threshold at 0 every point moving on its
    advantage's side leaves the region, while the compute stays the ELBO's minimum."""
    monkeypatch.chdir(REPO)
    overrides = SMALL + [f"run.output_dir={tmp_path / 'run'}", "loss.use=dppo", "loss.kl_threshold=0",
                         "train.updates_per_rollout=2", "likelihood.timesteps=3"]
    rows = _rows(train(load(REPO / "recipes" / "quickstart.toml", *overrides), console=quiet_console()))
    assert len(rows) == 2 and all(r["nonfinite_steps"] == 0 for r in rows)
    assert all(r["compute/ratio"] == 1.0 for r in rows)
    assert rows[0]["dppo/kl_max"] > 0 and 0 < rows[0]["clip_fraction"] < 1


def test_engine_has_no_branch_on_an_objective_name():
    """The loop and the update never name an objective, window or estimator: they call the
    components' methods whatever the recipe names."""
    names = ["guard", "nft", "gardo", "mixgrpo", "flash", "fast", "sliding", "diversity", "clipped", "random", "awm",
             "dppo", "dpo", "dgpo", "entropy", "epg", "pepg", "par", "vgrpo", "fdfo", "elbo", "trajectory"]
    for rel in ("flowrl/train/loop.py", "flowrl/train/update.py", "flowrl/train/collect.py", "flowrl/train/replay.py"):
        code = "\n".join(line.split("#")[0] for line in (REPO / rel).read_text().splitlines())
        strings = re.findall(r"[\"']([a-z_]+)[\"']", code)
        assert not set(strings) & set(names), (rel, set(strings) & set(names))


class _MiddleWindow:
    """A third party's planner: every sample's window at steps [1, 3)."""

    def num_trainable(self, context):
        return 2

    def plan(self, iteration, keys, context):
        return RolloutPlan(context.sigmas, torch.tensor([[1, 3]] * len(keys)), "euler")


class _Plugin:
    @hookimpl
    def register_windows(self, register):
        register("middle", _MiddleWindow)


def test_a_window_plugin_plugs_in(tmp_path):
    text = tiny_recipe(ENGINE, window={"use": "middle"}, chunker={"use": "step", "size": None})
    with temporary_plugin(_Plugin(), "middle_window") as registry:
        recipe = load(write_recipe(tmp_path, text), "train.iterations=1", f"run.output_dir={tmp_path / 'run'}")
        assert recipe.num_trainable == 2
        run_dir = train(recipe, console=quiet_console(), registry=registry)
    row = _rows(run_dir)[0]
    assert row["chunk_sizes"] == [1, 1] and row["on_policy/max_abs_log_ratio"] <= 1e-6
    assert len(row["diag/step_log_ratio_std"]) == 2


def _docs_objective_example() -> type:
    """The objective of docs/objectives.md, "Writing an objective", as written there."""
    text = (REPO / "docs" / "objectives.md").read_text(encoding="utf-8")
    section = text.split("## Writing an objective", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "docs/objectives.md", "exec"), namespace)
    return namespace["AdvantageWeightedRegression"]


def test_the_documented_objective_trains_through_the_context_alone(tmp_path):
    """A third party's objective, written against the documented protocol (backward(ctx, micro)
    with an UpdateContext, never the update), registers as a [loss] and trains: its loss and
    metric are logged and a gradient reaches the model."""
    example = _docs_objective_example()

    class _Losses:
        @hookimpl
        def register_losses(self, register):
            register("awr", example)

    # the whole trajectory, no chunks: an ODE window instead of the chunker and the selector
    text = tiny_recipe(ENGINE, loss={"use": "awr", "eps_low": None, "eps_high": None}, chunker=None, selector=None,
                       window={"use": "ode"})
    with temporary_plugin(_Losses(), "awr_objective") as registry:
        recipe = load(write_recipe(tmp_path, text), "train.iterations=2", f"run.output_dir={tmp_path / 'run'}",
                      "log.progress=false")
        run_dir = train(recipe, console=quiet_console(), registry=registry)
    rows = _rows(run_dir)
    assert len(rows) == 2
    for row in rows:
        assert row["awr/loss"] == row["awr/loss"] and row["grad_norm"] > 0  # finite, and a gradient flowed
