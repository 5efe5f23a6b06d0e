"""The prompt-embedding store (flowrl/embeddings.py): written whole or not at all, read back bit
for bit, refused with one message when it was computed for another model configuration, is of
another format, is damaged, or lacks a prompt."""

from __future__ import annotations

import json

import pytest
import torch

from flowrl.embeddings import (
    NOT_ENCODING,
    EmbeddingStore,
    encoder_fingerprint,
    loading_text_encoders,
    without_text_encoders,
    write_store,
)
from flowrl.errors import FlowrlError

FINGERPRINT = encoder_fingerprint("flux", {"path": "black-forest-labs/FLUX.1-dev", "max_sequence_length": 512})


def _rows(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(f"prompt {i}", {"prompt_embeds": torch.randn(1, 7, 3, generator=g).to(torch.bfloat16),
                             "pooled": torch.randn(1, 4, generator=g)}) for i in range(n)]


def test_a_store_reads_back_every_prompt_bit_for_bit_across_shards(tmp_path):
    rows = _rows(5)
    assert write_store(tmp_path / "store", rows, FINGERPRINT, shard_bytes=64) == 5
    store = EmbeddingStore(tmp_path / "store", FINGERPRINT)
    assert store.shards > 1 and len(store) == 5 and "prompt 3" in store and "prompt 9" not in store
    for prompt, embeddings in rows:
        got = store.get(prompt)
        assert sorted(got) == sorted(embeddings)
        for key, value in embeddings.items():
            assert got[key].dtype == value.dtype and torch.equal(got[key], value)
    assert store.missing(["prompt 1", "new", "prompt 2", "new"]) == ["new"]


def test_a_failed_write_leaves_nothing_and_an_existing_directory_is_refused(tmp_path):
    def failing():
        yield from _rows(2)
        raise RuntimeError("encoder crashed")

    with pytest.raises(RuntimeError, match="encoder crashed"):
        write_store(tmp_path / "store", failing(), FINGERPRINT, shard_bytes=64)
    assert list(tmp_path.iterdir()) == []  # neither the store nor its temporary directory
    (tmp_path / "store").mkdir()
    with pytest.raises(FlowrlError, match="exists"):
        write_store(tmp_path / "store", _rows(1), FINGERPRINT)


def test_a_prompt_given_twice_or_with_other_keys_is_refused(tmp_path):
    rows = _rows(2)
    with pytest.raises(ValueError, match="given twice"):
        write_store(tmp_path / "a", [rows[0], rows[0]], FINGERPRINT)
    with pytest.raises(ValueError, match="has embeddings"):
        write_store(tmp_path / "b", [rows[0], ("other", {"prompt_embeds": rows[1][1]["prompt_embeds"]})], FINGERPRINT)


def test_another_model_configuration_is_one_message_naming_what_differs(tmp_path):
    write_store(tmp_path / "store", _rows(1), FINGERPRINT)
    other = encoder_fingerprint("flux", {"path": "black-forest-labs/FLUX.1-dev", "max_sequence_length": 256})
    with pytest.raises(FlowrlError) as exc:
        EmbeddingStore(tmp_path / "store", other, where="r.toml: [prompts].embeddings")
    assert "[model].max_sequence_length = 256 here, 512 in the store" in exc.value.message
    assert exc.value.where == "r.toml: [prompts].embeddings" and "flowrl embed" in exc.value.hint
    with pytest.raises(FlowrlError, match="model 'sd3' here, 'flux' in the store"):
        EmbeddingStore(tmp_path / "store", encoder_fingerprint("sd3", {}))


def test_settings_that_do_not_change_the_embeddings_do_not_count():
    base = {"path": "p", "max_sequence_length": 512}
    assert encoder_fingerprint("flux", {**base, "height": 1024, "gradient_checkpointing": True, "quantize": "nf4"}) == \
        encoder_fingerprint("flux", {**base, "height": 512})
    assert encoder_fingerprint("flux", {**base, "negative_prompt": "blurry"}) != encoder_fingerprint("flux", base)
    assert {"height", "width", "lora_preset", "offload_encoders"} <= NOT_ENCODING


def test_a_missing_damaged_or_foreign_store_is_one_message(tmp_path):
    with pytest.raises(FlowrlError, match="holds no prompt embeddings"):
        EmbeddingStore(tmp_path, FINGERPRINT)
    write_store(tmp_path / "store", _rows(2), FINGERPRINT)
    index = tmp_path / "store" / "index.json"
    data = json.loads(index.read_text())
    index.write_text(json.dumps({**data, "format": 99}))
    with pytest.raises(FlowrlError, match="format 99"):
        EmbeddingStore(tmp_path / "store", FINGERPRINT)
    index.write_text("{not json")
    with pytest.raises(FlowrlError, match="not a readable index"):
        EmbeddingStore(tmp_path / "store", FINGERPRINT)
    index.write_text(json.dumps(data))
    (tmp_path / "store" / "shard-00000.safetensors").write_bytes(b"damaged")
    with pytest.raises(FlowrlError, match="cannot read"):
        EmbeddingStore(tmp_path / "store", FINGERPRINT).get("prompt 0")


def test_a_prompt_not_in_the_store_is_one_message_with_the_fix(tmp_path):
    write_store(tmp_path / "store", _rows(1), FINGERPRINT)
    with pytest.raises(FlowrlError) as exc:
        EmbeddingStore(tmp_path / "store", FINGERPRINT).get("a cat")
    assert "'a cat' is not in the prompt embeddings" in exc.value.message and "flowrl embed" in exc.value.hint


def test_text_encoders_are_skipped_only_inside_the_context():
    assert loading_text_encoders()
    with without_text_encoders():
        assert not loading_text_encoders()
        with without_text_encoders(False):
            assert loading_text_encoders()
        assert not loading_text_encoders()
    assert loading_text_encoders()


def test_the_plan_keeps_an_embedded_models_text_encoder_which_it_still_loads(tmp_path):
    """Only adapters that load without their encoders (loads_without_text_encoders) lose them in the plan."""
    from flowrl.memory_plan import model_memory
    from flowrl.plugins import get_registry
    from flowrl.recipe import load_recipe

    from test_recipes import REPO

    registry = get_registry()
    plain = model_memory(load_recipe(REPO / "recipes" / "quickstart.toml", []), registry)
    stored = model_memory(load_recipe(REPO / "recipes" / "quickstart.toml", [f"prompts.embeddings={str(tmp_path)!r}"]),
                          registry)
    assert stored.frozen == plain.frozen and not any("embeddings" in n for n in stored.notes)
