import torch

from flowrl_plugins.embedded import dataset as D


def test_grammar():
    ps = D.all_prompts()
    assert len(ps) == 90 and len(set(ps)) == 90
    for p in ps:
        a = D.parse_prompt(p)
        assert a.fg != a.bg
        assert D.make_prompt(a.fg, a.shape, a.bg) == p


def test_parse_rejects():
    import pytest

    for bad in ["a red circle on a red", "a purple circle on a red background", "hello"]:
        with pytest.raises(ValueError):
            D.parse_prompt(bad)


def test_deterministic_for_seed():
    x1, p1 = D.sample_batch(32, torch.Generator().manual_seed(123))
    x2, p2 = D.sample_batch(32, torch.Generator().manual_seed(123))
    x3, p3 = D.sample_batch(32, torch.Generator().manual_seed(124))
    assert p1 == p2 and torch.equal(x1, x2)
    assert p1 != p3 or not torch.equal(x1, x3)
    it1, it2 = iter(D.ShapesDataset(8, seed=5)), iter(D.ShapesDataset(8, seed=5))
    for _ in range(3):
        (a, pa), (b, pb) = next(it1), next(it2)
        assert pa == pb and torch.equal(a, b)


def test_render_values():
    p = "a red square on a blue background"
    img = D.render_prompt(p, torch.Generator().manual_seed(0))
    assert img.shape == (3, 32, 32) and img.dtype == torch.float32
    assert img.min() >= 0 and img.max() <= 1
    # border is background, centre is foreground (shapes are near-centred and large)
    assert torch.equal(img[:, 0, 0], torch.tensor([0.0, 0.0, 1.0]))
    assert torch.equal(img[:, 16, 16], torch.tensor([1.0, 0.0, 0.0]))
    # each pixel is exactly one of the two colours
    fg = (img == torch.tensor([1.0, 0, 0]).view(3, 1, 1)).all(0)
    bg = (img == torch.tensor([0, 0, 1.0]).view(3, 1, 1)).all(0)
    assert (fg ^ bg).all()
