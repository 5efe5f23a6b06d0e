"""Image rewards on a video model's clips: every frame scored with the clip's prompt, then one
number per clip by the entry's ``frames`` aggregation; images and clip rewards pass untouched."""

from __future__ import annotations

import pytest
import torch

from flowrl.interfaces import RewardOutput, ScoresClips
from flowrl.rewards import FunctionReward, PerFrameReward, for_clips, score


class Recording:
    """An image reward: the red channel's mean, with an extra; remembers what it was called with."""

    name = "redness"

    def __init__(self):
        self.calls = []

    def __call__(self, images, prompts, metadata=None):
        self.calls.append((tuple(images.shape), list(prompts), metadata))
        red = images[:, 0].mean(dim=(1, 2))
        return RewardOutput(scores=red, extras={"twice": 2 * red})


def clips_with_red(levels):
    """Clips [B, F, 3, 2, 2] whose frame f of clip b has red channel levels[b][f]."""
    t = torch.tensor(levels, dtype=torch.float32)
    out = torch.zeros(*t.shape, 3, 2, 2)
    out[:, :, 0] = t[:, :, None, None]
    return out


@pytest.mark.parametrize("how, expected", [("mean", [0.5, 0.25]), ("first", [0.0, 0.5]), ("last", [1.0, 0.25]),
                                           ("min", [0.0, 0.0])])
def test_each_frame_is_scored_and_aggregated(how, expected):
    inner = Recording()
    clips = clips_with_red([[0.0, 0.5, 1.0], [0.5, 0.0, 0.25]])
    out = score(PerFrameReward(inner, how), clips, ["p0", "p1"], {"conditions": ["c0", "c1"]})
    assert torch.allclose(out.scores, torch.tensor(expected))
    assert torch.allclose(out.extras["twice"], 2 * torch.tensor(expected))
    shape, prompts, meta = inner.calls[0]
    assert shape == (6, 3, 2, 2)  # clip-major frames
    assert prompts == ["p0"] * 3 + ["p1"] * 3 and meta == {"conditions": ["c0"] * 3 + ["c1"] * 3}


def test_images_reach_the_reward_unchanged():
    inner = Recording()
    images = torch.rand(3, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    direct = score(inner, images, ["a", "b", "c"])
    wrapped = score(for_clips(inner, "min"), images, ["a", "b", "c"])
    assert torch.equal(direct.scores, wrapped.scores) and torch.equal(direct.extras["twice"], wrapped.extras["twice"])
    assert inner.calls[0] == inner.calls[1]


def test_a_clip_reward_gets_whole_clips():
    def steadiness(images, prompts):
        return 1.0 - (images[:, 1:] - images[:, :-1]).abs().mean(dim=(1, 2, 3, 4))

    steadiness.scores_clips = True
    reward = FunctionReward(steadiness, name="steadiness")
    assert isinstance(reward, ScoresClips) and for_clips(reward, "first") is reward
    clips = clips_with_red([[0.0, 0.0], [0.0, 1.0]])
    assert torch.allclose(score(reward, clips, ["a", "b"]).scores, torch.tensor([1.0, 1.0 - 1.0 / 3]))
    plain = FunctionReward(lambda images, prompts: images.mean(dim=(1, 2, 3)), name="plain")
    assert not isinstance(plain, ScoresClips) and isinstance(for_clips(plain), PerFrameReward)
