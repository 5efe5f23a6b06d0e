"""flowrl.video: the frames axis, per-frame aggregation, filmstrips, GIF and MP4 files."""

import sys

import pytest
import torch

from flowrl.artefacts import high_frequency_share
from flowrl.video import (
    FRAME_AGGREGATIONS, VideoExtraMissing, aggregate_frames, filmstrip, is_clip, mp4_available, write_gif, write_mp4,
)


def test_aggregations_by_hand():
    v = torch.tensor([[0.5, 0.25, 1.0], [0.0, 0.75, 0.5]])
    assert torch.equal(aggregate_frames(v, "mean"), torch.tensor([1.75 / 3, 1.25 / 3]))
    assert torch.equal(aggregate_frames(v, "first"), torch.tensor([0.5, 0.0]))
    assert torch.equal(aggregate_frames(v, "last"), torch.tensor([1.0, 0.5]))
    assert torch.equal(aggregate_frames(v, "min"), torch.tensor([0.25, 0.0]))
    assert FRAME_AGGREGATIONS == ("mean", "first", "last", "min")
    with pytest.raises(ValueError, match="unknown frame aggregation 'max'"):
        aggregate_frames(v, "max")
    with pytest.raises(ValueError, match=r"\[B, F\]"):
        aggregate_frames(v[0], "mean")


def test_filmstrip_puts_frames_left_to_right_and_leaves_images_alone():
    clips = torch.rand(2, 3, 3, 4, 5)
    strip = filmstrip(clips)
    assert strip.shape == (2, 3, 4, 15)
    for f in range(3):
        assert torch.equal(strip[:, :, :, 5 * f: 5 * (f + 1)], clips[:, f])
    images = torch.rand(2, 3, 4, 5)
    assert filmstrip(images) is images and not is_clip(images) and is_clip(clips)


def test_high_frequency_share_of_a_clip_is_the_mean_of_its_frames():
    clips = torch.rand(2, 3, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    per_frame = torch.stack([high_frequency_share(clips[:, f]) for f in range(3)], dim=1)
    assert torch.allclose(high_frequency_share(clips), per_frame.mean(1))


def test_gif_has_every_frame(tmp_path):
    from PIL import Image

    frames = [torch.full((3, 6, 8), v) for v in (0.0, 0.5, 1.0)]
    path = write_gif(frames, tmp_path / "clip.gif")
    with Image.open(path) as im:
        assert im.n_frames == 3 and im.size == (8, 6)
        im.seek(2)
        assert im.convert("RGB").getpixel((0, 0)) == (255, 255, 255)


@pytest.mark.skipif(not mp4_available(), reason="the video extra (imageio, imageio-ffmpeg) is not installed")
def test_mp4_has_every_frame_at_even_size(tmp_path):
    import imageio.v2 as imageio

    frames = [torch.full((3, 5, 7), v) for v in (0.0, 1.0, 0.0, 1.0)]
    path = write_mp4(frames, tmp_path / "clip.mp4", scale=3)
    reader = imageio.get_reader(str(path))
    read = [reader.get_data(i) for i in range(reader.count_frames())]  # (iterating it runs out of memory)
    assert len(read) == 4 and read[0].shape == (16, 22, 3)  # 15 x 21 padded to even sides
    assert read[0][:15, :21].mean() < 30 and read[1][:15, :21].mean() > 225


def test_mp4_without_the_extra_says_which_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "imageio", None)
    monkeypatch.setitem(sys.modules, "imageio.v2", None)
    with pytest.raises(VideoExtraMissing, match="imageio") as err:
        write_mp4([torch.zeros(3, 4, 4)], tmp_path / "x.mp4")
    assert "flowrl-diffusion[video]" in str(err.value)
    assert not mp4_available()
