"""The evaluation's artefact measure: hand-derived values, a float64 second route, and the
hacking recipe's checkerboard (images of a real run) against the base model's images."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flowrl.artefacts import HF_CUTOFF, high_frequency_share

FIXTURES = Path(__file__).parent / "fixtures"


def test_constant_image_has_no_high_frequency_energy():
    assert high_frequency_share(torch.full((2, 3, 16, 16), 0.7)).tolist() == [0.0, 0.0]


def test_one_pixel_checkerboard_is_all_high_frequency():
    y, x = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    board = ((x + y) % 2).float().expand(1, 3, 16, 16)
    assert high_frequency_share(board).item() == pytest.approx(1.0, abs=1e-6)


def test_mixture_share_by_hand():
    # a cos(2 pi x / 8) has its energy N^4 / 2 at |f| = 0.125 (below the cutoff); b (-1)^(x+y) has
    # N^4 at |f| = 0.707: share = b^2 / (b^2 + a^2 / 2)
    n, a, b = 16, 0.8, 0.3
    y, x = torch.meshgrid(torch.arange(n).double(), torch.arange(n).double(), indexing="ij")
    img = a * torch.cos(2 * math.pi * x / 8) + b * (-1.0) ** (x + y)
    got = high_frequency_share(img.float().view(1, 1, n, n)).item()
    assert got == pytest.approx(b**2 / (b**2 + a**2 / 2), rel=1e-5)


def test_matches_an_explicit_float64_dft():
    g = torch.Generator().manual_seed(0)
    imgs = torch.rand(3, 2, 8, 12, generator=g, dtype=torch.float64)
    h, w = imgs.shape[-2:]
    ky, kx = torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64)
    dft_y = torch.exp(-2j * math.pi * torch.outer(ky, ky) / h)
    dft_x = torch.exp(-2j * math.pi * torch.outer(kx, kx) / w)
    centred = (imgs - imgs.mean((-2, -1), keepdim=True)).to(torch.complex128)
    power = (dft_y @ centred @ dft_x.T).abs() ** 2
    fy = torch.where(ky < h / 2, ky, ky - h) / h  # signed frequency of each bin
    fx = torch.where(kx < w / 2, kx, kx - w) / w
    high = (fy.view(-1, 1) ** 2 + fx.view(1, -1) ** 2).sqrt() > HF_CUTOFF
    want = (power * high).sum((1, 2, 3)) / power.sum((1, 2, 3))
    torch.testing.assert_close(high_frequency_share(imgs.float()).double(), want, rtol=1e-5, atol=1e-6)


def _tiles(name: str) -> torch.Tensor:
    grid = torch.from_numpy(np.array(Image.open(FIXTURES / name).convert("RGB"))).permute(2, 0, 1).float() / 255
    return torch.stack([grid[:, r : r + 32, c : c + 32] for r in range(0, 128, 32) for c in range(0, 128, 32)])


def test_flags_the_hacking_recipes_checkerboard():
    # the 16 evaluation images of recipes/quickstart_hacking.toml after its 30 iterations, and the
    # base model's from the same prompts and noise (flowrl eval RUN_DIR --save-images)
    base = high_frequency_share(_tiles("hacking_quickstart_base.png"))
    hacked = high_frequency_share(_tiles("hacking_quickstart_iter30.png"))
    assert base.mean() < 0.1
    assert hacked.min() > base.max()  # every hacked image is flagged above every base image
    assert hacked.mean() > 4 * base.mean()
