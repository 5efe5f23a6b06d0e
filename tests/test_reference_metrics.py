"""The quickstart's metrics are bit-identical to the reference made before the loop redesign.

tests/fixtures/reference/quickstart_metrics.jsonl was written by flowrl at commit 06b93d1 (the
engine before flowrl/train/ existed) with::

    OMP_NUM_THREADS=1 flowrl train recipes/quickstart.toml -o DIR --set log.progress=false

Every row, key order and value must be the same today, except the wall-clock ``time/*`` fields and
the keys added since (``compute/*``, listed below). The recipe is pinned here
(``tests/fixtures/reference/quickstart.toml``, the quickstart of that commit, shipped today as
``recipes/quickstart_hacking.toml``), so changing the shipped quickstart does not move the reference. The redesign kept the algorithm's arithmetic
exactly; the fast path added later (issue 17: the first optimizer step after a rollout skips the
lean update's re-scoring forwards) computes the same gradient from the log-probs of its grad
forwards instead, which can differ in the last bits where rollout and re-scoring round differently.
So the bitwise comparison runs the exact lean path (``fast_path = false``, ``update_mode = "lean"``), and a second
test holds the default run to the reference within float tolerance. Each runs the whole quickstart
(30 iterations, about 80 s on one CPU thread).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.console import Console

from flowrl.recipe import load_recipe
from flowrl.train import train

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "tests" / "fixtures" / "reference" / "quickstart_metrics.jsonl"


#: Metric keys added after the reference was made, and by which change.
ADDED = ("compute/",  # compute accounting (issue 17)
         "diag/", "groups/",  # update diagnostics: log-ratio spread per step and unit, zero-advantage groups (issue 14)
         "eval/hf_share/")  # the evaluation's artefact measure (flowrl.artefacts)


def _records(path: Path) -> list[dict]:
    """Each row without its timings and without the keys added since the reference."""
    out = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        assert all(k in REFERENCE_KEYS or k.startswith(("time/", *ADDED)) for k in record), set(record) - REFERENCE_KEYS
        out.append({k: v for k, v in record.items() if not k.startswith(("time/", *ADDED))})
    return out


REFERENCE_KEYS = {k for line in REFERENCE.read_text().splitlines() for k in json.loads(line)}


def _quickstart(tmp_path, *overrides: str) -> list[dict]:
    recipe = load_recipe(REFERENCE.parent / "quickstart.toml",
                         [f"run.output_dir={str(tmp_path / 'run')!r}", "log.progress=false", *overrides])
    return _records(train(recipe, console=Console(quiet=True)) / "metrics.jsonl")


def test_quickstart_metrics_equal_the_pre_redesign_reference(tmp_path):
    got, want = _quickstart(tmp_path, "train.fast_path=false", "train.update_mode='lean'"), _records(REFERENCE)
    assert len(got) == len(want) == 31
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = json.dumps(g), json.dumps(w)  # key order and every bit of every value
        assert g == w, f"row {i} differs:\n  got  {g[:300]}\n  want {w[:300]}"


def test_quickstart_with_the_fast_path_stays_on_the_reference(tmp_path):
    """The default run (fast path) computes the same gradients from log-probs that differ from the
    lean path's in the last bits; training amplifies such differences from iteration to
    iteration (measured: first difference at iteration 10, advantages' extremes 2.5% apart by
    iteration 27). The learning curve is what must not move: every reward and evaluation mean
    within 1% of the reference at every iteration (a wrong coefficient moves it far more)."""
    got, want = _quickstart(tmp_path), _records(REFERENCE)
    assert len(got) == len(want) == 31
    for i, (g, w) in enumerate(zip(got, want)):
        assert list(g) == list(w), f"row {i}: keys differ"
        # every update of the quickstart is one on-policy step: the fast path re-scores nothing
        assert g.get("recompute_mismatch", 0.0) == 0.0, (i, g["recompute_mismatch"])
        for key, value in w.items():
            if key.endswith("/mean") and key.startswith(("reward/", "eval/")):
                assert math.isclose(g[key], value, rel_tol=1e-2), (i, key, g[key], value)
