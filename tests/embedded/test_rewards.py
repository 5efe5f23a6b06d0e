import torch

from flowrl_plugins.embedded import dataset as D
from flowrl_plugins.embedded.rewards import REWARDS, brightness, foreground_area, verifier_score


def test_shapes_dtypes_ranges():
    x, p = D.sample_batch(16, torch.Generator().manual_seed(0))
    noisy = (x + 0.5 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1))).clamp(0, 1)
    for fn in REWARDS.values():
        for imgs in (x, noisy, torch.rand(16, 3, 32, 32)):
            r = fn(imgs, p)
            assert r.shape == (16,) and r.dtype == torch.float32
            assert (r >= 0).all() and (r <= 1).all()
    assert verifier_score(x, p).mean() > verifier_score(torch.rand(16, 3, 32, 32), p).mean()


def test_foreground_area_hand_built():
    # 32x32 white background; a 10x6 red block (60 px); a 4x4 "nearly blue" block (16 px);
    # plus 5 "nearly white" pixels (0.9 grey) that count as background.
    img = torch.ones(3, 32, 32)
    img[:, 3:13, 5:11] = torch.tensor([1.0, 0.0, 0.0]).view(3, 1, 1)
    img[:, 20:24, 20:24] = torch.tensor([0.1, 0.1, 0.8]).view(3, 1, 1)
    img[:, 30, 0:5] = 0.9
    expected = (60 + 16) / 1024
    got = foreground_area(img[None], ["a red circle on a white background"])
    assert abs(got.item() - expected) < 1e-6
    # with a black background prompt, everything except the true black pixels (none) is "foreground"
    got = foreground_area(img[None], ["a red circle on a black background"])
    assert abs(got.item() - 1.0) < 1e-6


def test_foreground_area_ground_truth_matches_mask():
    prompts = ["a green triangle on a yellow background", "a white circle on a black background"]
    g = torch.Generator().manual_seed(3)
    cx, cy, r = D.sample_geometry(2, g)
    sh = torch.tensor([2, 0])
    imgs = D.render(torch.tensor([1, 4]), sh, torch.tensor([3, 5]), cx, cy, r)
    mask = D.shape_masks(sh, cx, cy, r)
    assert torch.allclose(foreground_area(imgs, prompts), mask.mean((1, 2)))


def test_brightness():
    assert brightness(torch.ones(2, 3, 8, 8), ["a red circle on a white background"] * 2).tolist() == [1.0, 1.0]
