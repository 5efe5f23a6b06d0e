"""The quickstart's metrics are bit-identical to the reference made before the loop redesign.

tests/fixtures/reference/quickstart_metrics.jsonl was written by flowrl at commit 06b93d1 (the
engine before flowrl/train/ existed) with::

    OMP_NUM_THREADS=1 flowrl train recipes/quickstart.toml -o DIR --set log.progress=false

Every row, key order and value must be the same today, except the wall-clock ``time/*`` fields.
This runs the whole quickstart (30 iterations, about 80 s on one CPU thread).
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from flowrl.recipe import load_recipe
from flowrl.train import train

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "tests" / "fixtures" / "reference" / "quickstart_metrics.jsonl"


def _rows(path: Path) -> list[str]:
    """Each row as canonical text without its timings (key order kept)."""
    rows = []
    for line in path.read_text().splitlines():
        record = {k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
        rows.append(json.dumps(record))
    return rows


def test_quickstart_metrics_equal_the_pre_redesign_reference(tmp_path):
    recipe = load_recipe(REPO / "recipes" / "quickstart.toml",
                         [f"run.output_dir={str(tmp_path / 'run')!r}", "log.progress=false"])
    run_dir = train(recipe, console=Console(quiet=True))
    got, want = _rows(run_dir / "metrics.jsonl"), _rows(REFERENCE)
    assert len(got) == len(want) == 31
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"row {i} differs:\n  got  {g[:300]}\n  want {w[:300]}"
