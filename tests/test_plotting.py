"""`flowrl plot`'s panels carry information for the run's objective (flowrl/plotting.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from flowrl.plotting import run_figure  # noqa: E402


def _grpo(iterations: int, spread: float) -> list[dict]:
    return [{"iteration": i, "reward/area/mean": 0.5 + 0.01 * i, "reward/area/std": 0.1,
             "diag/log_ratio_mean": 0.0, "diag/log_ratio_std": spread, "clip_fraction": 0.0,
             "approx_kl_old": spread**2, "diag/step_log_ratio_std": [spread] * 4,
             "diag/unit_log_ratio_std": [spread] * 2, "groups/all_equal_fraction": 0.0} for i in range(iterations)]


def _titles(fig) -> list[str]:
    return [ax.get_title() for ax in fig.axes if ax.get_title()]


def test_an_on_policy_run_draws_no_panels_of_rounding_noise():
    fig = run_figure(_grpo(5, 3e-8), "on_policy")
    try:
        assert not any("log-ratio" in t for t in _titles(fig)), _titles(fig)
        assert "not drawn" in fig._suptitle.get_text()
    finally:
        plt.close(fig)


def test_an_off_policy_run_draws_its_ratio_diagnostics():
    fig = run_figure(_grpo(5, 2e-3), "off_policy")
    try:
        titles = _titles(fig)
        assert "step log-ratio log pi_theta - log pi_old" in titles and "unit (chunk) log-ratio std" in titles
        assert "not drawn" not in fig._suptitle.get_text()
    finally:
        plt.close(fig)


@pytest.mark.parametrize("keys, name", [
    ({"nft/positive": 0.02, "nft/negative": 0.03, "nft/old_deviation": 1e-4, "nft/decay": 0.5}, "nft"),
    ({"gardo/gate_fraction": 0.7, "gardo/q": 0.2, "kl/gaussian_exact": 1e-3}, "gardo, kl"),
])
def test_the_objectives_own_metrics_get_a_panel_and_iterations_are_integers(keys, name):
    rows = [{"iteration": i, "reward/verifier/mean": 0.8, "reward/verifier/std": 0.1, **keys,
             **({"eval/verifier/mean": 0.8, "eval/verifier/sem": 0.01} if i % 2 == 0 else {})} for i in range(4)]
    fig = run_figure(rows, "objective")
    try:
        (panel,) = [ax for ax in fig.axes if ax.get_title() == f"objective: {name}"]
        assert sorted(line.get_label() for line in panel.get_lines()) == sorted(keys)
        for ax in fig.axes:
            if ax.get_xlabel() == "iteration":
                locator = ax.xaxis.get_major_locator()
                assert isinstance(locator, MaxNLocator) and locator._integer
    finally:
        plt.close(fig)


def test_rewards_of_different_scales_get_panels_of_their_own():
    rows = [{"iteration": i, "reward/pickscore/mean": 21.0 + 0.1 * i, "reward/pickscore/std": 0.5,
             "reward/brightness/mean": 0.4 + 0.01 * i, "reward/brightness/std": 0.05,
             "reward/area/mean": 0.3, "reward/area/std": 0.05,
             "eval/pickscore/mean": 21.0 + 0.1 * i, "eval/pickscore/sem": 0.1,
             "eval/brightness/mean": 0.4, "eval/brightness/sem": 0.01} for i in range(4)]
    fig = run_figure(rows, "scales")
    try:
        lines = {ax.get_title(): sorted(line.get_label() for line in ax.get_lines()) for ax in fig.axes if ax.get_title()}
        assert lines == {
            "training reward (rollout mean ± std)\narea, brightness": ["area", "brightness"],
            "training reward (rollout mean ± std)\npickscore": ["pickscore"],
            "evaluation reward (fixed prompts and seeds, ODE) ± sem\nbrightness": ["brightness"],
            "evaluation reward (fixed prompts and seeds, ODE) ± sem\npickscore": ["pickscore"],
        }, lines
    finally:
        plt.close(fig)


def test_rewards_of_one_scale_share_a_panel_whose_title_names_none():
    rows = [{"iteration": i, "reward/verifier/mean": 0.8, "reward/area/mean": 0.2, "reward/zero/mean": 0.0}
            for i in range(3)]
    fig = run_figure(rows, "one scale")
    try:
        (panel,) = [ax for ax in fig.axes if ax.get_title().startswith("training reward")]
        assert panel.get_title() == "training reward (rollout mean ± std)"
        assert sorted(line.get_label() for line in panel.get_lines()) == ["area", "verifier", "zero"]
    finally:
        plt.close(fig)


def test_scale_groups_split_where_magnitudes_differ_tenfold():
    from flowrl.plotting import scale_groups

    rows = [{"a": 0.0, "b": 0.05, "c": 0.4, "d": 0.6, "e": 3.9, "f": 22.0, "g": -30.0}]
    # b (0.05) starts a group that reaches 0.5: c joins, d (0.6) does not; e (3.9) joins d's; f (22) starts anew
    assert scale_groups(rows, list("abcdefg")) == [["a", "b", "c"], ["d", "e"], ["f", "g"]]


def test_an_offline_run_draws_no_empty_training_reward_panel():
    rows = [{"iteration": i, "sft/fm_loss": 0.5 - 0.01 * i,
             **({"eval/verifier/mean": 0.8 + 0.01 * i, "eval/verifier/sem": 0.01} if i % 2 == 0 else {})}
            for i in range(4)]
    fig = run_figure(rows, "offline")
    try:
        titles = _titles(fig)
        assert not any(t.startswith("training reward") for t in titles), titles
        assert any(t.startswith("evaluation reward") for t in titles) and "objective: sft" in titles
    finally:
        plt.close(fig)


def test_a_metrics_file_with_a_null_or_no_iteration_is_drawn_or_refused_in_one_message(tmp_path, flowrl_cli):
    """A null value is no point (``float(None)`` was a traceback); a row without an integer
    iteration is one message naming it (a KeyError was)."""
    import json

    run = tmp_path / "run"
    run.mkdir()
    rows = _grpo(3, 0.01)
    rows[1]["reward/area/mean"] = None
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "metrics.jsonl").write_text(json.dumps({"reward/area/mean": 0.5}) + "\n")
    drawn, refused = flowrl_cli.in_process([["plot", str(run)], ["plot", str(broken)]], cwd=tmp_path)
    assert drawn.returncode == 0 and (run / "rewards.png").is_file(), drawn.stderr
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert "row 1 has no integer 'iteration' (None)" in refused.flat_err
