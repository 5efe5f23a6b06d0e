"""Rewards that score latents: each reward gets what it declares, and nothing is decoded for
rewards that all score latents (flowrl.interfaces.ScoresLatents)."""

from __future__ import annotations

import pytest
import torch

from flowrl.interfaces import scores_latents
from flowrl.rewards import FunctionReward, PerFrameReward, for_clips, needs_images
from flowrl.train.overlap import OverlappedScoring, RewardFailedError, score_part


def _latent_sum(latents, prompts):
    return latents.flatten(1).sum(1)


_latent_sum.scores_latents = True


def _image_mean(images, prompts):
    return images.mean((1, 2, 3))


LATENT = FunctionReward(_latent_sum, name="latent_sum")
IMAGE = FunctionReward(_image_mean, name="image_mean")


class NoDecode:
    """A model whose decode must not be called."""

    def decode(self, latents):
        raise AssertionError("decoded although every reward scores latents")


class HalfDecode:
    def decode(self, latents):
        return torch.full((len(latents), 3, 4, 4), 0.5)


def test_a_function_declares_that_it_scores_latents():
    assert scores_latents(LATENT) and not scores_latents(IMAGE)
    assert needs_images([("a", 1.0, IMAGE), ("b", 1.0, LATENT)]) and not needs_images([("b", 1.0, LATENT)])


def test_each_reward_gets_what_it_declares():
    latents, images = torch.randn(5, 6, 7), torch.rand(5, 3, 4, 4)
    scores, _ = score_part([("l", 1.0, LATENT), ("i", 1.0, IMAGE)], images, ["p"] * 5, latents=latents)
    torch.testing.assert_close(scores["l"], latents.flatten(1).sum(1))
    torch.testing.assert_close(scores["i"], images.mean((1, 2, 3)))


def test_a_missing_input_is_one_message_naming_the_reward():
    with pytest.raises(RewardFailedError, match="reward 'i' failed.*no images"):
        score_part([("i", 1.0, IMAGE)], None, ["p"], latents=torch.randn(1, 2))


def test_a_video_run_does_not_wrap_a_latent_reward_per_frame():
    assert for_clips(LATENT) is LATENT and isinstance(for_clips(IMAGE), PerFrameReward)


def test_overlapped_scoring_decodes_nothing_for_latent_rewards_and_scores_the_same():
    latents = torch.randn(6, 6, 7)
    with OverlappedScoring(NoDecode(), [("l", 1.0, LATENT)]) as scoring:
        scoring.submit(latents[:4], ["p"] * 4)
        scoring.submit(latents[4:], ["p"] * 2)
        images, scores, _ = scoring.gather()
    assert images is None
    torch.testing.assert_close(scores["l"], latents.flatten(1).sum(1))
    # beside an image reward, both get theirs
    with OverlappedScoring(HalfDecode(), [("l", 1.0, LATENT), ("i", 1.0, IMAGE)]) as scoring:
        scoring.submit(latents, ["p"] * 6)
        images, scores, _ = scoring.gather()
    assert images.shape == (6, 3, 4, 4) and bool((scores["i"] == 0.5).all())
    torch.testing.assert_close(scores["l"], latents.flatten(1).sum(1))


def test_a_reward_server_refuses_a_reward_that_scores_latents():
    from flowrl.commands.reward_server import build_reward
    from flowrl.errors import FlowrlError

    with pytest.raises(FlowrlError, match="scores a model's latents, and a reward server receives images"):
        build_reward("latent_verifier", [])
