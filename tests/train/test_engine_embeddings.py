"""A run that reads its prompt embeddings from a store (`flowrl embed`, `[prompts] embeddings`)
equals the run that encodes them, metrics and weights, with the dynamics chunker profiling at
start, evaluation, images and checkpoints on; a store that lacks a prompt the run uses, or was
computed for another model configuration, is refused before the first iteration."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import comparable, load, quiet_console
from tiny_recipe import ENGINE, tiny_recipe, write_recipe

from flowrl.errors import FlowrlError
from flowrl.runlog import read_metrics
from flowrl.train import train
from flowrl.train.checkpoint import latest_checkpoint, load_checkpoint, read_model_weights

#: dynamics chunks profiled at start (the profile encodes its prompts too), an evaluation of 2
#: prompts x 2 seeds every iteration, image grids and checkpoints
RECIPE = {"chunker": {"use": "dynamics", "size": None, "profile": "", "num_chunks": 2, "num_prompts": 2, "seeds": 1},
          "prompts": {"num_eval": 2, "eval_seeds": 2},
          "log": {"eval_every": 1, "image_every": 1}, "checkpoint": {"every": 2}, "train": {"iterations": 2}}


@pytest.fixture(scope="module")
def stored(tmp_path_factory, flowrl_cli):
    """The tiny recipe and the store `flowrl embed` wrote for it."""
    root = tmp_path_factory.mktemp("embeddings")
    path = write_recipe(root, tiny_recipe(ENGINE, RECIPE))
    (r,) = flowrl_cli.in_process([["embed", str(path), "-o", str(root / "store")]], cwd=root)
    assert r.returncode == 0, r.stderr
    assert "prompt embeddings" in r.stdout and "--set prompts.embeddings=" in r.stdout
    return path, root / "store"


def test_a_run_from_the_store_equals_the_run_that_encodes(stored, tmp_path):
    path, store = stored
    encoded = train(load(path, f"run.output_dir={str(tmp_path / 'encoded')!r}"), console=quiet_console())
    read = train(load(path, f"run.output_dir={str(tmp_path / 'read')!r}", f"prompts.embeddings={str(store)!r}"),
                 console=quiet_console())
    a, b = read_metrics(encoded), read_metrics(read)
    assert len(a) == 3 and [comparable(r) for r in a] == [comparable(r) for r in b]
    assert any("eval/area/mean" in r for r in a) and (read / "images" / "eval" / "iter_000002.png").is_file()
    got, want = (load_checkpoint(latest_checkpoint(d))["model"] for d in (read, encoded))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_a_store_without_a_prompt_the_run_uses_is_refused_before_training(stored, tmp_path, flowrl_cli):
    path, _ = stored
    other = tmp_path / "prompts.txt"
    other.write_text("a red circle on a blue background\n")
    (r,) = flowrl_cli.in_process([["embed", str(path), "-o", str(tmp_path / "small"), "--set",
                                   f"prompts.source={str(other)!r}"]], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    with pytest.raises(FlowrlError, match="of the run's prompts are not in the prompt embeddings"):
        train(load(path, f"run.output_dir={str(tmp_path / 'run')!r}", f"prompts.embeddings={str(tmp_path / 'small')!r}"),
              console=quiet_console())
    assert not (tmp_path / "run").exists()  # refused before the run directory was made


def test_a_store_for_another_model_configuration_is_refused_by_validate(stored, validate):
    path, store = stored
    code, err = validate(path, f"prompts.embeddings={str(store)!r}", "model.seed=3")
    assert code == 2 and "[prompts].embeddings" in err and "[model].seed = 3 here, 0 in the store" in err, err
    code, err = validate(path, f"prompts.embeddings={str(store)!r}")
    assert code == 0, err


@pytest.mark.parametrize("where, says", [("exists", "exists"),
                                         ("/proc/flowrl_store", "cannot write /proc/flowrl_store")])
def test_embed_into_an_existing_or_unwritable_directory_is_one_message(stored, tmp_path, flowrl_cli, where, says):
    path, _ = stored
    if where == "exists":
        (tmp_path / "exists").mkdir()
        (tmp_path / "exists" / "keep.txt").write_text("mine")
    out = tmp_path / where if where == "exists" else where
    (r,) = flowrl_cli.in_process([["embed", str(path), "-o", str(out)]], cwd=tmp_path)
    assert r.returncode == 2 and says in r.stderr and "hint:" in r.stderr and "Traceback" not in r.stderr, r.stderr
    if where == "exists":
        assert (tmp_path / "exists" / "keep.txt").read_text() == "mine"


def test_a_run_started_encoding_resumes_from_the_store_exactly(stored, tmp_path):
    """Where the embeddings come from may change on resume: the store holds what encoding gives."""
    from engine_helpers import InterruptAt

    from flowrl.plugins import temporary_plugin

    path, store = stored
    sets = ["train.iterations=3", "checkpoint.every=1"]
    whole = train(load(path, *sets, f"run.output_dir={str(tmp_path / 'whole')!r}"), console=quiet_console())
    (tmp_path / "t").mkdir()
    tracked = write_recipe(tmp_path / "t", tiny_recipe(ENGINE, RECIPE, trackers=[{"use": "interrupt_at"}]))
    parts = tmp_path / "parts"
    with temporary_plugin(InterruptAt(1), name="interrupt-at-1"):
        with pytest.raises(KeyboardInterrupt):
            train(load(tracked, *sets, f"run.output_dir={str(parts)!r}"), console=quiet_console())
    train(load(path, *sets, f"run.output_dir={str(parts)!r}", f"prompts.embeddings={str(store)!r}"), resume=parts,
          console=quiet_console())
    assert [comparable(r) for r in read_metrics(parts)] == [comparable(r) for r in read_metrics(whole)]
    got, want = (load_checkpoint(latest_checkpoint(d))["model"] for d in (parts, whole))
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_reading_the_store_equal_two_that_encode(stored, tmp_path, strategy):
    """Each process reads the store (the dynamics profile too, every process taking the same
    branch), with evaluation, images and checkpoints on: the same metrics and weights as the two
    processes that encode."""
    from engine_helpers import run_cli

    path, store = stored
    runs = {}
    for name, extra in (("encoded", []), ("read", [f"prompts.embeddings={str(store)!r}"])):
        args = [a for s in (f"distributed.strategy='{strategy}'", *extra) for a in ("--set", s)]
        proc = run_cli(["train", str(path), *args, "-o", str(tmp_path / name), "--num-processes", "2"], timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        runs[name] = tmp_path / name
    a, b = read_metrics(runs["encoded"]), read_metrics(runs["read"])
    assert len(a) == 3 and [r["world_size"] for r in a[:-1]] == [2, 2]
    assert [comparable(r) for r in a] == [comparable(r) for r in b]
    assert (runs["read"] / "images" / "eval" / "iter_000002.png").is_file()
    got, want = (read_model_weights(latest_checkpoint(d)) for d in (runs["read"], runs["encoded"]))  # DCP under fsdp2
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)

