"""docs/embedded.md, "Using it": the example runs as written, with the shapes its comments give."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_using_it_example_runs_and_its_shapes_are_the_commented_ones():
    section = (REPO / "docs" / "embedded.md").read_text(encoding="utf-8").split("## Using it", 1)[1]
    (code,) = re.findall(r"```python\n(.*?)```", section.split("\n## ", 1)[0], re.S)
    namespace: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "docs/embedded.md", "exec"), namespace)
    assert tuple(namespace["emb"].shape) == (4, 8, 64) and tuple(namespace["pooled"].shape) == (4, 64)
    assert tuple(namespace["x"].shape) == (4, 64, 48) and tuple(namespace["v"].shape) == (4, 64, 48)
    images = namespace["images"]
    assert tuple(images.shape) == (4, 3, 32, 32) and 0 <= float(images.min()) and float(images.max()) <= 1
    assert printed.getvalue().strip()
