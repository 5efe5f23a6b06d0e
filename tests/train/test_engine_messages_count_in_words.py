"""The training loop's closing messages say a count of one in the singular ("done: 1
iteration", never "1 iterations"). The messages are printed by the loop's own functions, here onto a recording console;
tests/cli/test_resume_from_a_damaged_checkpoint.py checks the end of a real one-iteration run."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from rich.console import Console

from flowrl.train.loop import aborted, done, finish_interrupted, nothing_to_do

MAIN = SimpleNamespace(is_main=True)


def recording() -> Console:
    return Console(record=True, width=400, force_terminal=False)


def said(console: Console) -> str:
    return " ".join(console.export_text().split())


@pytest.mark.parametrize("n, words", [(1, "1 iteration in"), (3, "3 iterations in")])
def test_done_counts_the_iterations_in_words(tmp_path, n, words):
    console = recording()
    done(console, MAIN, tmp_path, n)
    assert f"done: {words}" in said(console)


def test_nothing_to_do_counts_in_words(tmp_path):
    console = recording()
    nothing_to_do(console, MAIN, tmp_path, 1)
    assert "has completed its 1 iteration and its final evaluation" in said(console)


def test_an_interrupt_and_an_abort_count_in_words(tmp_path):
    console = recording()
    saver = SimpleNamespace(ensure_current=lambda: None)
    finish_interrupted(console, MAIN, tmp_path, SimpleNamespace(iteration=1), saver,
                       SimpleNamespace(state_changed=False))
    assert "interrupted after 1 completed iteration;" in said(console)
    console = recording()  # stopped in the update of iteration 1: nothing written, resumes from the start
    finish_interrupted(console, MAIN, tmp_path, SimpleNamespace(iteration=1), saver,
                       SimpleNamespace(state_changed=True))
    text = said(console)
    assert "interrupted in the update of iteration 1" in text and "resumes from the start" in text

    ckpt = tmp_path / "checkpoints" / "iter_000001"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text(json.dumps({"iteration": 1}))
    (tmp_path / "checkpoints" / "latest.json").write_text(json.dumps({"name": "iter_000001"}))
    console = recording()
    aborted(console, MAIN, tmp_path)
    assert "its latest checkpoint (1 iteration)" in said(console)
