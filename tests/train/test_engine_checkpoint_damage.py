"""A checkpoint file that cannot be read whole (a partial copy, an interrupted transfer)
is found cheaply, from headers and sizes (:func:`flowrl.train.checkpoint.checkpoint_damage`), and
reading it is one message naming the file and the run's newest intact checkpoint, never
safetensors' own error. Checkpoints here are written with :func:`save_checkpoint` from a few
small tensors: no model is built."""

from __future__ import annotations

import pytest
import torch

from flowrl.errors import FlowrlError
from flowrl.train.checkpoint import (
    checkpoint_damage,
    intact_checkpoints,
    load_checkpoint,
    newest_intact_checkpoint,
    read_model_weights,
    save_checkpoint,
)


def write_run(run_dir, iterations=(1, 2, 3)):
    """A run directory with one small checkpoint per iteration; returns their paths."""
    out = []
    for i in iterations:
        weight = torch.nn.Parameter(torch.full((64, 8), float(i)))
        opt = torch.optim.AdamW([weight])
        weight.grad = torch.ones_like(weight)
        opt.step()
        out.append(save_checkpoint(run_dir / "checkpoints", f"iter_{i:06d}", model={"w": weight.detach()},
                                   optimizer=opt.state_dict(), state={"iteration": i}, recipe_toml="[run]\n",
                                   keep_last=len(iterations)))
    return out


def truncate(file, keep: float = 0.5):
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


def test_an_intact_checkpoint_has_no_damage(tmp_path):
    for ckpt in write_run(tmp_path):
        assert checkpoint_damage(ckpt) is None
    assert [p.name for p in intact_checkpoints(tmp_path)] == ["iter_000003", "iter_000002", "iter_000001"]


@pytest.mark.parametrize("name, damage, said", [
    ("model.safetensors", lambda f: truncate(f), "is truncated"),
    ("model.safetensors", lambda f: truncate(f, keep=0.0001), "is truncated"),        # the header cut short
    ("model.safetensors", lambda f: f.write_bytes(b""), "is truncated"),               # an empty file
    ("optimizer.safetensors", lambda f: f.write_bytes(f.read_bytes() + b"\0" * 16), "is longer than its header"),
    ("optimizer.json", lambda f: truncate(f), "does not parse"),
    ("state.json", lambda f: f.write_text('{"iteration": 3', encoding="utf-8"), "does not parse"),
    ("recipe.toml", lambda f: f.write_bytes(b"[run\xff"), "does not parse"),
])
def test_a_damaged_file_is_found_and_named(tmp_path, name, damage, said):
    ckpt = write_run(tmp_path)[-1]
    damage(ckpt / name)
    file, why = checkpoint_damage(ckpt)
    assert file == ckpt / name and said in why, why


def test_the_newest_intact_checkpoint_and_the_damaged_ones_after_it(tmp_path):
    one, two, three = write_run(tmp_path)
    truncate(three / "model.safetensors")
    truncate(two / "rng.safetensors")
    intact, in_the_way = newest_intact_checkpoint(tmp_path, three)
    assert intact == one and in_the_way == [two, three]
    truncate(one / "model.safetensors")
    assert newest_intact_checkpoint(tmp_path, three)[0] is None


def test_reading_a_damaged_file_is_one_message_naming_it_and_the_intact_checkpoint(tmp_path):
    """What `flowrl sample`, `eval` and `export` read (the weights), and a resume's other files."""
    one, two, three = write_run(tmp_path)
    truncate(three / "model.safetensors")
    with pytest.raises(FlowrlError) as exc:
        read_model_weights(three)
    text = exc.value.format()
    assert str(three / "model.safetensors") in text and "truncated" in text and str(two) in text, text
    truncate(two / "optimizer.safetensors")
    with pytest.raises(FlowrlError) as exc:
        load_checkpoint(two)
    text = exc.value.format()
    assert str(two / "optimizer.safetensors") in text and str(one) in text, text


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sharded_checkpoint_shorter_than_its_metadata_is_damaged(tmp_path):
    import torch.distributed.checkpoint as dcp

    ckpt = write_run(tmp_path, iterations=(1,))[0]
    shards = ckpt / "sharded"
    dcp.save({"model": {"w": torch.ones(256, 16)}}, checkpoint_id=str(shards), no_dist=True)
    assert checkpoint_damage(ckpt) is None
    (data,) = [f for f in shards.iterdir() if f.suffix == ".distcp"]
    truncate(data)
    file, why = checkpoint_damage(ckpt)
    assert file == data and "is truncated" in why and ".metadata" in why, why
    (shards / ".metadata").write_bytes(b"\x80")
    file, why = checkpoint_damage(ckpt)
    assert file == shards / ".metadata" and "cannot be read" in why, why


def test_the_check_reads_headers_not_tensors(tmp_path, monkeypatch):
    """Cheap: no tensor is loaded to find the damage."""
    from flowrl.train import checkpoint

    ckpt = write_run(tmp_path, iterations=(1,))[0]
    monkeypatch.setattr(checkpoint, "load_file", lambda *a, **k: pytest.fail("loaded tensors"))
    assert checkpoint_damage(ckpt) is None
