"""Overlapped rewards (``[sampler].overlap_rewards``): each rollout sub-batch is decoded
and scored while the next one samples. Rewards come out in the same order and bit for bit equal
to scoring after the rollout; a reward that raises stops the iteration naming the reward."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from engine_helpers import final_weights, load, quiet_console
from tiny_recipe import write_recipe

from flowrl import hookimpl
from flowrl.errors import FlowrlError, RecipeError
from flowrl.plugins import temporary_plugin
from flowrl.runlog import read_metrics
from flowrl.train import train
from flowrl.train.overlap import OverlappedScoring, RewardFailedError, score_part


@pytest.fixture(scope="module")
def embedded():
    from flowrl_plugins.embedded.dataset import all_prompts
    from flowrl_plugins.embedded.plugin import EmbeddedConfig, EmbeddedModel
    from flowrl_plugins.embedded.rewards import REWARDS

    model = EmbeddedModel(EmbeddedConfig())
    latents = torch.randn(12, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    prompts = list(all_prompts())[:12]
    rewards = [(name, 1.0, lambda images, prompts, metadata=None, fn=fn: fn(images, prompts))
               for name, fn in REWARDS.items()]
    return model, latents, prompts, rewards


def test_overlapped_scores_equal_scoring_after_the_rollout_bit_for_bit(embedded):
    model, latents, prompts, rewards = embedded
    images = model.decode(latents)
    want, want_extras = score_part(rewards, images, prompts)
    with OverlappedScoring(model, rewards) as scoring:
        for lo in range(0, 12, 5):  # uneven sub-batches: 5, 5, 2
            scoring.submit(latents[lo : lo + 5], prompts[lo : lo + 5])
        got_images, got, got_extras = scoring.gather()
    assert torch.equal(got_images, images)
    assert list(got) == list(want) and got_extras == want_extras == {}
    for label in want:
        assert torch.equal(got[label], want[label]), label


def test_order_is_kept_when_an_early_sub_batch_is_slow(embedded):
    """Scores land at their sub-batch's rows whatever the timing; calls never overlap."""
    model, latents, prompts, _ = embedded
    calls, active = [], []

    def slow_first(images, prompts, metadata=None):
        active.append(1)
        assert len(active) == 1, "a reward was called twice at once"
        calls.append((threading.current_thread().name, len(prompts)))
        time.sleep(0.2 if len(calls) == 1 else 0.0)
        active.pop()
        return images.mean((1, 2, 3))

    with OverlappedScoring(model, [("slow", 1.0, slow_first)]) as scoring:
        for lo in range(0, 12, 4):
            scoring.submit(latents[lo : lo + 4], prompts[lo : lo + 4])
        images, got, _ = scoring.gather()
    assert torch.equal(got["slow"], images.mean((1, 2, 3)))
    assert [n for _, n in calls] == [4, 4, 4]
    assert all(name.startswith("flowrl-rewards") for name, _ in calls)  # off the sampling thread


def test_a_raising_reward_is_named_and_fails_early(embedded):
    model, latents, prompts, _ = embedded

    def broken(images, prompts, metadata=None):
        raise ValueError("the model exploded")

    with OverlappedScoring(model, [("area", 1.0, lambda i, p, m=None: i.mean((1, 2, 3))), ("broken", 1.0, broken)],
                           iteration=3) as scoring:
        scoring.submit(latents[:4], prompts[:4])
        deadline = time.time() + 30
        with pytest.raises(RewardFailedError) as exc:
            while time.time() < deadline:  # the next submit (after the next sub-batch) raises it
                scoring.submit(latents[4:8], prompts[4:8])
                time.sleep(0.01)
    text = str(exc.value)
    assert "reward 'broken' failed: ValueError: the model exploded" in text
    assert "samples 0-3 of this process, iteration 3" in text
    assert isinstance(exc.value.__cause__, ValueError)


class Rewards:
    """A reward that raises, and a deterministic batch-independent one."""

    @hookimpl
    def register_rewards(self, register):
        def boom(images, prompts):
            raise RuntimeError("out of tokens")

        register("boom", boom)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_raising_reward_stops_training_with_its_name(tmp_path, overlap):
    recipe_path = write_recipe(tmp_path)
    with temporary_plugin(Rewards(), name="boom-rewards"):
        recipe = load(recipe_path, f"run.output_dir={str(tmp_path / 'run')!r}", "rewards.0.use=boom",
                      "rewards.0.name='my_boom'", "sampler.batch_size=3", f"sampler.overlap_rewards={str(overlap).lower()}")
        with pytest.raises(RewardFailedError, match="reward 'my_boom' failed: RuntimeError: out of tokens"):
            train(recipe, console=quiet_console())


@pytest.mark.slow
def test_training_with_overlap_is_bit_identical(tmp_path):
    """Two iterations with and without overlap: every metric (rewards, advantages, loss, ratios)
    and the trained weights are equal bit for bit."""
    recipe_path = write_recipe(tmp_path)
    runs = {}
    for overlap in (False, True):
        run_dir = tmp_path / f"run_{overlap}"
        recipe = load(recipe_path, f"run.output_dir={str(run_dir)!r}", "train.iterations=2", "sampler.batch_size=3",
                      f"sampler.overlap_rewards={str(overlap).lower()}")
        train(recipe, console=quiet_console())
        runs[overlap] = (read_metrics(run_dir), final_weights(run_dir))
    (rows_a, w_a), (rows_b, w_b) = runs[False], runs[True]
    for a, b in zip(rows_a, rows_b, strict=True):
        keys = {k for k in a if not k.startswith(("time/", "speed/"))}
        assert keys == {k for k in b if not k.startswith(("time/", "speed/"))}
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    assert "time/decode" in rows_a[0] and "time/decode" not in rows_b[0]  # decoded inside the rollout
    assert w_a.keys() == w_b.keys() and all(torch.equal(w_a[k], w_b[k]) for k in w_a)


def test_overlap_needs_sub_batches(tmp_path):
    recipe_path = write_recipe(tmp_path)
    with pytest.raises(RecipeError, match=r"\[sampler\].*overlap_rewards = true needs batch_size > 0") as exc:
        load(recipe_path, "sampler.overlap_rewards=true")
    assert isinstance(exc.value, FlowrlError)
