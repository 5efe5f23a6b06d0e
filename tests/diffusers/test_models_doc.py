"""The adapter walk-through in docs/models.md runs as written: its toy adapter passes the
conformance suite (with its declared reversed time) and its registration snippet builds it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def _walkthrough_blocks() -> list[str]:
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## Writing an adapter (walk-through)"):]
    section = section.split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_walkthrough_adapter_passes_the_conformance_suite(capsys):
    blocks = _walkthrough_blocks()
    assert len(blocks) == 2
    namespace: dict = {}
    exec(compile(blocks[0], f"{DOC}:walk-through", "exec"), namespace)
    report = namespace["report"]
    assert report.passed
    notes = {r.name: r.message for r in report.results}
    assert "timestep_from_sigma(sigma): sigma 1 -> 0, 0.25 -> 0.75" in notes["sigma_direction"]
    assert notes["lora_noop"].startswith("4 LoRA tensors")
    assert "FAIL" not in capsys.readouterr().out

    exec(compile(blocks[1], f"{DOC}:walk-through registration", "exec"), namespace)
    registered = {}
    namespace["register_models"](lambda name, factory, params: registered.update({name: (factory, params)}))
    factory, params = registered["toy"]
    assert type(factory(params())).__name__ == "ToyAdapter"


def test_walkthrough_catches_the_toy_without_its_declaration():
    # The same toy without timestep_from_sigma declared feeds 1 - sigma: the suite must refuse it.
    from flowrl.testing.conformance import run_check

    namespace: dict = {}
    exec(compile(_walkthrough_blocks()[0], f"{DOC}:walk-through", "exec"), namespace)
    toy = namespace["ToyAdapter"]()

    class Undeclared:
        def __init__(self, inner):
            self.inner, self.denoiser, self.latent_shape = inner, inner.denoiser, inner.latent_shape

        def __getattr__(self, name):
            if name == "timestep_from_sigma":
                raise AttributeError(name)
            return getattr(self.inner, name)

    with pytest.raises(AssertionError, match="does not grow with sigma"):
        run_check(Undeclared(toy), "sigma_direction")
