"""Video clips where images flow: the frames axis, per-frame scoring, and clip files.

A video model's ``decode`` returns clips ``[B, F, 3, H, W]`` in [0, 1] where an image model's
returns images ``[B, 3, H, W]``; everything downstream tells them apart by the number of
dimensions (:func:`is_clip`), so an image run takes exactly the code path it always took.

- :func:`aggregate_frames`: one number per clip from per-frame numbers ``[B, F]`` (``mean``,
  ``first``, ``last``, ``min``): how an image reward scores a clip (:class:`flowrl.rewards.PerFrameReward`).
- :func:`filmstrip`: a clip as one image, its frames side by side, so every picture a run draws
  (grids, evolution strips) shows clips without a second drawing path.
- :func:`write_gif` (Pillow, always there) and :func:`write_mp4` (the ``video`` extra:
  ``imageio`` + ``imageio-ffmpeg``, imported only when an MP4 is written).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from .errors import FlowrlError

#: How per-frame scores become one score per clip.
FRAME_AGGREGATIONS = ("mean", "first", "last", "min")
#: Frames per second of the GIFs and MP4s flowrl writes (the embedded model's 4-frame clips then
#: last half a second; a viewer loops them).
DEFAULT_FPS = 8
MP4_EXTRA_HINT = "pip install 'flowrl-diffusion[video]' (imageio and imageio-ffmpeg)"


def is_clip(images: torch.Tensor) -> bool:
    """True for clips ``[B, F, 3, H, W]``, False for images ``[B, 3, H, W]``."""
    return images.ndim == 5


def aggregate_frames(values: torch.Tensor, how: str) -> torch.Tensor:
    """``values [B, F]`` -> ``[B]``: the mean over frames, the first or last frame's value, or the
    smallest (a clip is as good as its worst frame)."""
    if values.ndim != 2:
        raise ValueError(f"per-frame values must be [B, F], got shape {tuple(values.shape)}")
    if how == "mean":
        return values.mean(dim=1)
    if how == "first":
        return values[:, 0]
    if how == "last":
        return values[:, -1]
    if how == "min":
        return values.min(dim=1).values
    raise ValueError(f"unknown frame aggregation {how!r}: choose one of {', '.join(FRAME_AGGREGATIONS)}")


def filmstrip(images: torch.Tensor) -> torch.Tensor:
    """Clips ``[B, F, 3, H, W]`` -> ``[B, 3, H, F * W]`` (frames left to right); images are
    returned as they are (the same tensor)."""
    if not is_clip(images):
        return images
    b, f, c, h, w = images.shape
    return images.permute(0, 2, 3, 1, 4).reshape(b, c, h, f * w)


def frame(images: torch.Tensor, index: int) -> torch.Tensor:
    """Frame ``index`` of every clip, ``[B, 3, H, W]``."""
    return images[:, index]


def _rgb_frames(frames: Sequence) -> list:
    """PIL images or ``[3, H, W]`` tensors in [0, 1] -> PIL RGB images."""
    from PIL import Image

    out = []
    for f in frames:
        if isinstance(f, torch.Tensor):
            arr = (f.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
            out.append(Image.fromarray(arr))
        else:
            out.append(f.convert("RGB"))
    return out


def write_gif(frames: Sequence, path: Path, fps: int = DEFAULT_FPS) -> Path:
    """A looping GIF of ``frames`` (PIL images or ``[3, H, W]`` tensors in [0, 1])."""
    images = _rgb_frames(frames)
    path = Path(path)
    images[0].save(path, save_all=True, append_images=images[1:], duration=round(1000 / fps), loop=0,
                   optimize=False, disposal=1)
    return path


def mp4_available() -> bool:
    """Whether :func:`write_mp4` can run here (the ``video`` extra is installed)."""
    try:
        import imageio.v2  # noqa: F401
        import imageio_ffmpeg  # noqa: F401
    except ImportError:
        return False
    return True


class VideoExtraMissing(FlowrlError, ImportError):
    """Writing an MP4 needs the ``video`` extra."""


def write_mp4(frames: Sequence, path: Path, fps: int = DEFAULT_FPS, scale: int = 1) -> Path:
    """An H.264 MP4 of ``frames`` (PIL images or ``[3, H, W]`` tensors), each enlarged ``scale``
    times (nearest neighbour) and padded to even sides, which H.264's 4:2:0 needs."""
    try:
        import imageio.v2 as imageio
    except ImportError as e:
        raise VideoExtraMissing("writing an MP4 needs imageio and imageio-ffmpeg", hint=MP4_EXTRA_HINT) from e
    import numpy as np
    from PIL import Image

    images = _rgb_frames(frames)
    w, h = images[0].size
    w, h = w * scale, h * scale
    even = (w + w % 2, h + h % 2)
    arrays = []
    for im in images:
        im = im.resize((w, h), Image.NEAREST)
        if (w, h) != even:
            padded = Image.new("RGB", even, "white")
            padded.paste(im, (0, 0))
            im = padded
        arrays.append(np.asarray(im))
    try:
        with imageio.get_writer(str(path), fps=fps, codec="libx264", quality=8, macro_block_size=1,
                                ffmpeg_log_level="error") as writer:
            for a in arrays:
                writer.append_data(a)
    except ImportError as e:  # imageio without imageio-ffmpeg fails at the writer
        raise VideoExtraMissing("writing an MP4 needs imageio-ffmpeg", hint=MP4_EXTRA_HINT) from e
    return Path(path)
