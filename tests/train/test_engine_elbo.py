"""The ELBO likelihood and FDFO through the engine, in the default lane (tiny, seconds): a run of
each trains with nothing computed beyond its minimum, the old policy's forward only where its
weights differ from the trained ones, and the model card names the algorithm from the components.
(2 processes equal 1 and exact resume: the slow lane, tests/train/test_engine_objectives_*.py.)"""

from __future__ import annotations

from engine_helpers import load, quiet_console
from tiny_recipe import tiny_recipe, write_recipe

from flowrl.hub import algorithm_of
from flowrl.runlog import read_metrics
from flowrl.train import train

ODE = {"window": {"use": "ode", "solver": "dpm2m"}, "advantage": {"use": "group_zscore"}, "chunker": None}  # no units: no chunk layout


def _run(tmp_path, **tables):
    recipe = write_recipe(tmp_path, tiny_recipe(**{**ODE, **tables}))
    resolved = load(recipe, f"run.output_dir={str(tmp_path / 'run')!r}")
    return resolved, [r for r in read_metrics(train(resolved, console=quiet_console())) if not r.get("final")]


def test_epg_on_the_elbo_trains_at_its_minimum(tmp_path):
    resolved, rows = _run(tmp_path, loss={"use": "epg"}, likelihood={"use": "elbo", "timesteps": 2},
                          train={"updates_per_rollout": 2})
    assert [r["compute/ratio"] for r in rows] == [1.0, 1.0]
    # iteration 0: the old policy is the trained one until the first optimizer step (pass 1 needs no
    # old forward, pass 2 one per point); iteration 1: decay type 1 keeps it apart from the start
    live = rows[0]["compute/update/forward"] // 2  # 2 passes, each point forward once
    assert rows[0]["compute/old/forward"] == live and rows[1]["compute/old/forward"] == 2 * (rows[1]["compute/update/forward"] // 2)
    assert rows[0]["elbo/log_ratio_abs_max"] > 0 and rows[1]["elbo/decay"] > rows[0]["elbo/decay"] > 0
    assert "on_policy/max_abs_log_ratio" not in rows[0]
    name, paper = algorithm_of(resolved)
    assert "ELBO" in name and "EPG" in name and "Rethinking" in paper


def test_fdfo_trains_on_pairs_at_its_minimum(tmp_path):
    resolved, rows = _run(tmp_path, window=None, loss={"use": "fdfo", "timesteps": 2},
                          advantage={"use": "group_centred"},
                          train={"group_size": 2, "prompts_per_iteration": 4, "same_noise_in_group": True})
    assert [r["compute/ratio"] for r in rows] == [1.0, 1.0]
    assert "compute/old/forward" not in rows[0]  # one optimizer step per rollout: v_ref is the forward's own
    assert rows[0]["fdfo/ratio_mean"] == 1.0 and rows[0]["fdfo/dR_abs"] > 0
    assert algorithm_of(resolved)[0].startswith("FDFO")


def test_the_clipped_ratio_runs_on_one_elbo_ratio_per_sample(tmp_path):
    """GSPO's sequence-level ratio on the ELBO: the clipped surrogate with units = "sample"."""
    _, rows = _run(tmp_path, loss={"use": "clipped", "eps_low": 0.2, "eps_high": 0.2},
                   likelihood={"use": "elbo", "timesteps": 2, "units": "sample", "decay_type": 0},
                   train={"iterations": 1})
    assert rows[0]["compute/ratio"] == 1.0 and rows[0]["elbo/ratio_mean"] == 1.0
    assert "compute/old/forward" not in rows[0] and rows[0]["elbo/decay"] == 0.0
