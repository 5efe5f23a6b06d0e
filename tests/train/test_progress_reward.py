"""The progress bar shows the reward training optimises, not a judge listed first to be logged."""

from __future__ import annotations

from types import SimpleNamespace

from flowrl.train.progress import shown_reward


def reward(label: str, weight: float) -> SimpleNamespace:
    return SimpleNamespace(label=label, weight=weight)


def test_the_bar_shows_the_first_weighted_reward():
    assert shown_reward([reward("clip", 0.0), reward("verifier", 1.0), reward("area", 0.5)]) == "verifier"


def test_the_bar_shows_the_first_reward_when_none_is_weighted():
    assert shown_reward([reward("clip", 0.0), reward("area", 0.0)]) == "clip"
