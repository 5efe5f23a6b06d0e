"""The run says a held-out evaluation's warning signs as they appear (flowrl/train/warning_signs.py):
each once, at the first evaluation that shows it, on resume against the first evaluation read
back from metrics.jsonl; the hacking lesson's recorded evaluations as the input."""

from __future__ import annotations

import shutil
from pathlib import Path

from flowrl.commands.base import load
from flowrl.files import read_jsonl
from flowrl.train.warning_signs import WarningSigns

RUN = Path(__file__).resolve().parents[1] / "fixtures" / "hacking_run"


def _said(run_dir, rows):
    lines = []
    signs = WarningSigns(run_dir, load(RUN / "recipe.toml"), lines.append)
    for row in rows:
        signs(row)
    return lines


def test_each_sign_is_said_once_at_the_first_evaluation_that_shows_it(tmp_path):
    """The hacking lesson evaluates every iteration: the checkerboard's high-frequency share has
    doubled by iteration 5, the verifier judge is down 2.7 SE by 7, and by 14 the area reward has
    risen too (the hacking signature, said once more); the end of the run (30) adds nothing."""
    rows = read_jsonl(RUN / "metrics.jsonl")
    lines = _said(tmp_path, rows)  # a new run: nothing written before
    assert [line.split(": ")[0:2] for line in lines] == [
        ["warning at iteration 5", "high-frequency share"],
        ["warning at iteration 7", "verifier (judge, not optimised)"],
        ["warning at iteration 14", "verifier (judge, not optimised)"]]
    assert lines[1].endswith(f"fell (every check: flowrl diagnose {tmp_path})")
    assert "fell while area rose: the reward-hacking signature" in lines[2]


def test_a_resumed_run_compares_with_the_first_evaluation_it_wrote(tmp_path):
    rows = read_jsonl(RUN / "metrics.jsonl")
    shutil.copy(RUN / "metrics.jsonl", tmp_path / "metrics.jsonl")  # as a resume finds it (later rows dropped)
    lines = _said(tmp_path, [r for r in rows if r.get("final")])  # the first evaluation after resuming
    assert len(lines) == 2 and all(line.startswith("warning at iteration 30:") for line in lines)
    assert "reward-hacking signature" in lines[0] or "reward-hacking signature" in lines[1]


def test_other_processes_say_nothing_and_read_nothing(tmp_path):
    signs = WarningSigns(tmp_path / "absent", load(RUN / "recipe.toml"), None)
    for row in read_jsonl(RUN / "metrics.jsonl"):
        signs(row)
    assert signs.first is None
