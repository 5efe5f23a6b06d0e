import random

import torch

from flowrl_plugins.embedded import dataset as D
from flowrl_plugins.embedded.verifier import verify


def _gt(n=2000, seed=0):
    return D.sample_batch(n, torch.Generator().manual_seed(seed))


def test_ground_truth_all_correct():
    x, p = _gt()
    r = verify(x, p)
    acc = r.all_correct.float().mean().item()
    assert acc >= 0.995, acc
    assert r.score.shape == (2000,) and r.score.dtype == torch.float32
    assert (r.score >= 0).all() and (r.score <= 1).all() and r.score.mean() > 0.95


def test_ground_truth_with_noise():
    x, p = _gt(500, 1)
    xn = (x + 0.3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(2))).clamp(0, 1)
    assert verify(xn, p).all_correct.float().mean() >= 0.98


def test_mismatched_prompts_near_chance():
    # Every mismatched prompt differs in >= 1 attribute, so chance all-correct is 0.
    x, p = _gt(2000, 3)
    rng = random.Random(0)
    ps = D.all_prompts()
    wrong = [rng.choice([q for q in ps if q != pp]) for pp in p]
    r = verify(x, wrong)
    acc = r.all_correct.float().mean().item()
    print(f"all-correct on mismatched prompts: {acc:.4f}")
    assert acc <= 0.01
    assert r.score.mean() < 0.5


def test_per_attribute_swaps():
    x, p = _gt(300, 4)
    attrs = [D.parse_prompt(q) for q in p]
    # wrong shape only
    wp = [D.make_prompt(a.fg, D.SHAPES[(a.shape_index + 1) % 3], a.bg) for a in attrs]
    r = verify(x, wp)
    assert r.bg_correct.all() and r.fg_correct.all() and r.shape_correct.float().mean() < 0.01
    # swapped colours
    wp = [D.make_prompt(a.bg, a.shape, a.fg) for a in attrs]
    r = verify(x, wp)
    assert not r.bg_correct.any() and not r.fg_correct.any()


def test_blank_image_has_no_object():
    x = torch.zeros(2, 3, 32, 32)
    r = verify(x, ["a red circle on a black background"] * 2)
    assert r.bg_correct.all() and not r.fg_correct.any() and not r.all_correct.any()
