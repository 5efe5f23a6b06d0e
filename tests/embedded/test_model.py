import pytest
import os
import time

import torch

from flowrl_plugins.embedded import network as N
from flowrl_plugins.embedded.dataset import all_prompts, sample_batch


def test_pack_roundtrip_and_lossless_vae():
    x, _ = sample_batch(4, torch.Generator().manual_seed(0))
    lat = N.encode_images(x)
    assert lat.shape == (4, 12, 16, 16)
    pk = N.pack(lat)
    assert pk.shape == (4, 64, 48)
    assert torch.equal(N.unpack(pk), lat)
    assert torch.allclose(N.decode(pk), x) and torch.allclose(N.decode(lat), x)


def test_tokenizer():
    tok = N.WordTokenizer()
    ids = tok(["a red circle on a blue background", "a zebra"])
    assert ids.shape == (2, 8)
    assert ids[1, 1] == tok.unk_id and ids[1, 2] == tok.pad_id


def test_load_offline_fast_and_shapes():
    os.environ["HF_HUB_OFFLINE"] = "1"
    from diffusers import FluxTransformer2DModel  # noqa: F401  (import cost is not load cost)

    assert N.WEIGHTS_PATH.exists() and N.WEIGHTS_PATH.stat().st_size < 10_500_000
    t = time.time()
    model = N.load_pretrained()
    dt = time.time() - t
    assert dt < 2.0, dt
    emb, pooled = model.encode_prompts(["a red circle on a blue background"] * 2)
    assert emb.shape == (2, 8, 64) and pooled.shape == (2, 64)
    with torch.no_grad():
        v = model.velocity(torch.randn(2, 64, 48), torch.tensor([1.0, 0.5]), emb, pooled)
    assert v.shape == (2, 64, 48) and torch.isfinite(v).all()


@pytest.mark.slow
def test_quality_bars_subset():
    """Every prompt x eval seed 0 (half the eval set; the full table is in MODEL_CARD.md)."""
    torch.set_num_threads(1)
    from flowrl_plugins.embedded.evaluate import evaluate

    r = evaluate(N.load_pretrained(), all_prompts(), seeds=(0,))
    print(r)
    assert r["bg"] >= 0.95 and r["fg"] >= 0.95 and r["all"] >= 0.70, r
