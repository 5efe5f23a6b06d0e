"""The engine's self-checks and visibility: on-policy ratio, non-finite rewards, layout-free
reproducibility, plots."""

from __future__ import annotations

import io

import pytest
import torch
from engine_helpers import assert_records_close, load, quiet_console
from rich.console import Console

from flowrl import hookimpl
from flowrl.errors import FlowrlError
from flowrl.plugins import temporary_plugin
from flowrl.runlog import read_metrics
from flowrl.train import train


def test_first_update_is_on_policy(reference_run):
    _, _, records = reference_run
    for r in records:
        # per-step max |log pi_new - log pi_old| over every re-scored transition of the first step
        assert 0.0 <= r["on_policy/max_abs_log_ratio"] < 1e-6
    # later passes over the same rollout are off-policy: the check is not trivially zero
    assert any(abs(r["ratio_max"] - 1) > 1e-4 or abs(r["ratio_min"] - 1) > 1e-4 for r in records)


class BatchDependentModel:
    """The embedded model with a velocity that depends on the batch size: the kind of adapter
    bug (precision, batch-dependent code path) the on-policy check exists to catch."""

    @hookimpl
    def register_models(self, register):
        from flowrl_plugins.embedded.plugin import EmbeddedModel

        class Model(EmbeddedModel):
            def velocity(self, latents, sigma, text):
                return super().velocity(latents, sigma, text) + 1e-3 * latents.shape[0]

        register("batch_dependent", Model)


def test_on_policy_check_catches_a_batch_dependent_model(tmp_path, reference_run):
    recipe_path, _, _ = reference_run
    with temporary_plugin(BatchDependentModel(), name="batch-dependent"):
        recipe = load(recipe_path, f"run.output_dir={str(tmp_path / 'run')!r}",
                      "model.use=batch_dependent", "model.random_init=true")
        with pytest.raises(FlowrlError, match="on-policy check failed"):
            train(recipe, console=quiet_console())


class NaNReward:
    @hookimpl
    def register_rewards(self, register):
        register("nan_reward", lambda images, prompts: torch.full((len(prompts),), float("nan")))


def test_nan_reward_skips_updates_then_stops(tmp_path, reference_run):
    recipe_path, _, _ = reference_run
    run_dir = tmp_path / "run"
    out = io.StringIO()
    with temporary_plugin(NaNReward(), name="nan-reward"):
        recipe = load(recipe_path, f"run.output_dir={str(run_dir)!r}", "rewards.0.use=nan_reward",
                      "train.max_nonfinite_steps=2", "train.iterations=6")
        with pytest.raises(FlowrlError, match="3 updates skipped") as exc:
            train(recipe, console=Console(file=out, width=200))
    assert "max_nonfinite_steps" in str(exc.value)
    assert out.getvalue().count("non-finite reward; update skipped") == 3
    records = read_metrics(run_dir)
    assert [r["nonfinite_steps"] for r in records] == [1, 2, 3]
    assert all(r["skipped_nonfinite"] and "loss" not in r and "grad_norm" not in r for r in records)


def test_rollout_does_not_depend_on_micro_batch_size(tmp_path, reference_run):
    """Same seed, another update layout (micro-batch 4 without accumulation instead of 2 x 2):
    the same samples, rewards, advantages, trained chunks and (within float rounding) updates."""
    recipe_path, _, ref = reference_run
    run_dir = tmp_path / "run"
    train(load(recipe_path, f"run.output_dir={str(run_dir)!r}", "train.micro_batch_size=4", "log.image_every=2"),
          console=quiet_console())
    # every image_every = 2 iterations, and the last one (3) always
    assert sorted(p.name for p in (run_dir / "images").iterdir()) == ["iter_000000.png", "iter_000002.png", "iter_000003.png"]
    records = read_metrics(run_dir)
    assert records[0]["reward/area/mean"] == ref[0]["reward/area/mean"]  # before any update: bit-equal
    for got, want in zip(records, ref):
        assert_records_close(got, want, rtol=1e-4, atol=1e-5)


def test_plot_writes_a_png(tmp_path, reference_run):
    from flowrl.cli import main

    _, ref_dir, _ = reference_run
    png = tmp_path / "curves.png"
    main(["plot", str(ref_dir), "-o", str(png)])
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_metrics_record_every_health_signal(reference_run):
    _, ref_dir, records = reference_run
    needed = [
        "reward/area/mean", "reward/area/std", "advantage/mean", "advantage/std", "ratio_mean", "ratio_min",
        "ratio_max", "clip_fraction", "grad_norm", "loss", "lr", "nonfinite_steps", "on_policy/max_abs_log_ratio",
        "time/encode", "time/rollout", "time/decode", "time/reward", "time/update",
    ]
    for r in records:
        assert all(k in r for k in needed), [k for k in needed if k not in r]
        # which chunks each of the 8 samples trained (half of the 2 chunks each)
        assert len(r["trained_units"]) == 8 and all(len(u) == 1 for u in r["trained_units"])
        assert r["num_units"] == 2 * 8  # two passes over 8 samples, one unit each
    # every = 2: checkpoints after iterations 1 and 3, each one's seconds in the next row written
    # (metrics.jsonl is only appended to); no row follows the last one
    assert ["time/checkpoint" in r for r in records] == [False, False, True, False]
    assert records[0]["lr"] < records[1]["lr"]  # warm-up, then cosine decay
    assert records[3]["lr"] < records[2]["lr"]
