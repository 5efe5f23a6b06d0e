"""The shipped compositional model: loads offline from at most 10 MB, passes the adapter
conformance suite on the embedded model's code path, and samples images its detector reads."""

from __future__ import annotations

import os
import time

import torch

from flowrl.testing.conformance import CHECK_NAMES, check_adapter
from flowrl_plugins.embedded.compose import network as N
from flowrl_plugins.embedded.compose.model import ComposeConfig, EmbeddedComposeModel


def test_shipped_weights_load_offline_and_small():
    os.environ["HF_HUB_OFFLINE"] = "1"
    from diffusers import FluxTransformer2DModel  # noqa: F401  (import cost is not load cost)

    assert N.WEIGHTS_PATH.stat().st_size <= 10_000_000
    start = time.time()
    model = N.load_compose_pretrained()
    assert time.time() - start < 2.0
    emb, pooled = model.encode_prompts(["a red circle and a blue square", "four crosses"])
    assert emb.shape == (2, 8, 64) and pooled.shape == (2, 64)
    assert model.tokenizer(["a red circle and a blue square"])[0].tolist().count(model.tokenizer.unk_id) == 0


def test_adapter_conforms():
    report = check_adapter(EmbeddedComposeModel(ComposeConfig()))
    assert [r.name for r in report.results] == list(CHECK_NAMES)


def test_text_encoder_without_blocks_keeps_the_embedded_models_parameters():
    from flowrl_plugins.embedded.network import TextEncoder

    plain = TextEncoder(10, 8, 16)
    assert sorted(plain.state_dict()) == ["pool.bias", "pool.weight", "pos", "tok.weight"]


def test_text_blocks_make_a_words_embedding_depend_on_its_neighbours():
    """With self-attention blocks the noun carries its colour ("red circle" vs "blue circle"), which
    token and position embeddings alone cannot; and the inference and training paths agree."""
    from flowrl_plugins.embedded.network import TextEncoder

    torch.manual_seed(0)
    enc = TextEncoder(10, 8, 16, layers=2, heads=4)
    red, blue = torch.tensor([[2, 3, 4, 0, 0, 0, 0, 0]]), torch.tensor([[2, 5, 4, 0, 0, 0, 0, 0]])
    assert not torch.allclose(enc(red)[0][0, 2], enc(blue)[0][0, 2])
    plain = TextEncoder(10, 8, 16)
    assert torch.equal(plain(red)[0][0, 2], plain(blue)[0][0, 2])
    enc.train()
    trained = enc(red)[0]
    with torch.no_grad():
        assert torch.equal(enc.eval()(red)[0], trained)
