import pytest
"""The embedded video model: lossless clip latents with a frames axis, space-time RoPE ids, the
adapter conformance suite, and the shipped weights' quality bars."""

import torch

from flowrl.testing.conformance import CHECK_NAMES, check_adapter
from flowrl_plugins.embedded import video_network as VN
from flowrl_plugins.embedded.video_dataset import sample_batch
from flowrl_plugins.embedded.video_model import EmbeddedVideoConfig, EmbeddedVideoModel


def test_clip_latents_round_trip_and_keep_the_frames_axis():
    clips, _ = sample_batch(3, torch.Generator().manual_seed(0))
    lat = VN.encode_clips(clips)
    assert lat.shape == (3, 4, 16, 48)
    assert torch.equal(VN.decode_clips(lat), clips)
    # frame f of the latent is the image model's packed latent of frame f alone
    assert torch.equal(lat[:, 2], VN.pack(VN.encode_images(clips[:, 2])))


def test_rope_ids_count_frames_rows_and_columns():
    ids = VN.video_ids()
    assert ids.shape == (64, 3)
    assert ids[:16, 0].eq(0).all() and ids[48:, 0].eq(3).all()
    assert ids[17].tolist() == [1.0, 0.0, 1.0]  # frame 1, row 0, column 1 of the 4x4 token grid


def test_embedded_video_conforms():
    adapter = EmbeddedVideoModel(EmbeddedVideoConfig(random_init=True))
    report = check_adapter(adapter)  # raises with the full summary on any failure
    notes = {r.name: r.message for r in report.results}
    assert [r.name for r in report.results] == list(CHECK_NAMES)
    assert notes["decode"].startswith("clips (4, 3, 16, 16)")


def test_velocity_depends_on_other_frames():
    """Space-time attention: changing frame 3 of the input changes the velocity of frame 0."""
    adapter = EmbeddedVideoModel(EmbeddedVideoConfig(random_init=True, seed=1))
    text = adapter.encode_prompts(["a red circle moving left on a blue background"] * 2)
    x = torch.randn(2, *adapter.latent_shape, generator=torch.Generator().manual_seed(0))
    x[1, 3] += 1.0
    x[1, :3] = x[0, :3]
    with torch.no_grad():
        v = adapter.velocity(x, torch.tensor([0.7, 0.7]), text)
    assert v.shape == x.shape and (v[0, 0] - v[1, 0]).abs().max() > 1e-4


@pytest.mark.slow
def test_shipped_weights_load_and_meet_the_quality_bars():
    """Every third prompt x seed 0, 120 clips (the card's table has all 360: MODEL_CARD.md, 'The video model')."""
    torch.set_num_threads(1)
    from flowrl_plugins.embedded.video_dataset import all_prompts
    from flowrl_plugins.embedded.video_pretrain import evaluate_clips

    assert VN.WEIGHTS_PATH.exists() and VN.WEIGHTS_PATH.stat().st_size < 6_000_000
    r = evaluate_clips(VN.load_video_pretrained(), prompts=all_prompts()[::3])
    print(r)
    assert r["bg"] >= 0.95 and r["fg"] >= 0.80 and r["motion"] >= 0.70, r
