"""Weights are written with the permissions of the run's other files.

safetensors (0.8 and later) writes through a temporary file created with mode 0600 and renames it
into place, ignoring the umask: checkpoints and exports were readable by their owner only, while
the recipe, metrics and state beside them follow the umask (a second user serving the weights, or
a container running as another user, could not read them). Run under umask 027 here, so that both
the group bit that must appear and the world bits that must not are checked.
"""

from __future__ import annotations

import os
import stat

import pytest
from engine_helpers import load, quiet_console
from tiny_recipe import ENGINE, tiny_recipe, write_recipe

from flowrl.train import train


@pytest.fixture
def umask_027():
    previous = os.umask(0o027)
    try:
        yield 0o640
    finally:
        os.umask(previous)


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_checkpoint_and_export_weights_follow_the_umask(tmp_path, umask_027):
    from flowrl.commands.export import export_run

    recipe = tiny_recipe(ENGINE, train={"iterations": 1})
    run = train(load(write_recipe(tmp_path, recipe), f"run.output_dir={str(tmp_path / 'run')!r}"),
                console=quiet_console())
    kept = tmp_path / "kept.safetensors"  # someone else's file in the export directory keeps its mode
    out = tmp_path / "export"
    out.mkdir()
    kept.write_bytes(b"")
    os.chmod(kept, 0o600)
    os.replace(kept, out / "kept.safetensors")
    export_run(run, out)

    weights = sorted(run.rglob("*.safetensors")) + sorted(p for p in out.rglob("*.safetensors") if p.name != "kept.safetensors")
    assert any(p.name == "model.safetensors" for p in weights) and any(p.is_relative_to(out) for p in weights)
    ordinary = mode(run / "recipe.toml")
    assert ordinary == umask_027
    assert {str(p.relative_to(tmp_path)): oct(mode(p)) for p in weights} == {
        str(p.relative_to(tmp_path)): oct(ordinary) for p in weights}
    assert mode(out / "kept.safetensors") == 0o600
