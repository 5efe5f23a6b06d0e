"""The video verifier: right on ground-truth clips, wrong on mismatched prompts, and each of its
terms reacts to what it checks (a clip played backwards has the wrong motion only)."""

import torch

from flowrl_plugins.embedded.video_dataset import all_prompts, parse_prompt, sample_batch
from flowrl_plugins.embedded.video_verifier import verify_clips


def test_ground_truth_clips_are_all_correct():
    clips, prompts = sample_batch(200, torch.Generator().manual_seed(0))
    v = verify_clips(clips, prompts)
    assert v.all_correct.all() and v.score.min() > 0.9
    noisy = (clips + 0.3 * torch.randn(clips.shape, generator=torch.Generator().manual_seed(1))).clamp(0, 1)
    assert verify_clips(noisy, prompts).all_correct.float().mean() >= 0.95


def test_mismatched_prompts_fail():
    clips, prompts = sample_batch(200, torch.Generator().manual_seed(2))
    pool = all_prompts()
    other = [pool[(pool.index(p) + 1 + i % 7) % len(pool)] for i, p in enumerate(prompts)]  # never the same prompt
    v = verify_clips(clips, other)
    assert not v.all_correct.any() and v.score.mean() < 0.8


def test_a_clip_played_backwards_has_only_the_motion_wrong():
    clips, prompts = sample_batch(50, torch.Generator().manual_seed(4))
    v = verify_clips(clips.flip(1), prompts)
    assert v.bg_correct.all() and v.fg_correct.all() and v.shape_correct.all()
    assert not v.motion_correct.any() and (v.motion_soft < 0.01).all()
    # the displacement is the motion from first frame to last, 6 px along the prompt's direction
    fwd = verify_clips(clips, prompts).displacement
    axis = torch.tensor([[-1.0, 0.0] if parse_prompt(p).direction == "left" else [1.0, 0.0]
                         if parse_prompt(p).direction == "right" else [0.0, -1.0]
                         if parse_prompt(p).direction == "up" else [0.0, 1.0] for p in prompts])
    assert ((fwd * axis).sum(1) > 4.0).all()


def test_a_still_clip_is_not_moving():
    clips, prompts = sample_batch(20, torch.Generator().manual_seed(5))
    still = clips[:, :1].expand_as(clips)
    v = verify_clips(still, prompts)
    assert v.displacement.abs().max() < 1e-4
    assert torch.allclose(v.motion_soft, torch.full((20,), 0.25), atol=1e-5)  # softmax of four zeros
