"""Exact resume on the lane's device: the tiny recipe of the engine tests (tests/train/engine_helpers.py,
the embedded model randomly initialised, Chunk-GRPO with two passes of two optimizer steps per
rollout, a warm-up + cosine LR) for 3 iterations, in the lane's precision, killed when
iteration 1 is logged (a BaseException from a tracker: nothing in the loop checkpoints, as under
``kill -9``), resumed from its last periodic checkpoint, and compared with the uninterrupted run.

- Deterministic (``torch.use_deterministic_algorithms(True)``, ``CUBLAS_WORKSPACE_CONFIG=:4096:8``
  set by the lane's conftest before cuBLAS starts): every metrics row and every weight bit for bit.
- Torch's defaults (no determinism asked): equal within :data:`LOOSE` (the self-test's resume
  tolerance for bf16, flowrl/diagnostics/selftest.py), the tolerance the assertion message states.
  Same device, same kernels, same shapes: where CUDA's kernels are deterministic anyway (most
  forward matrix products) this too is bitwise; atomics in backward kernels are not.

Four runs of 3 iterations: 48 s for the file on the 2-core CPU; not yet timed on a GPU.
"""

from __future__ import annotations

import pytest
from engine_helpers import TINY_RECIPE, write_recipe
from gpu_lane import (
    Killed,
    Watch,
    deterministic,
    kill_after,
    read_rows,
    row_differences,
    train_run,
    weight_differences,
    weights,
    with_tracker,
)

from flowrl.plugins import temporary_plugin
from flowrl.train.checkpoint import latest_checkpoint

pytestmark = pytest.mark.gpu

SETS = ["train.iterations=3", "checkpoint.every=1"]
#: (metrics rtol, metrics atol, weights atol) without deterministic algorithms
LOOSE = (1e-3, 1e-4, 1e-4)


@pytest.fixture(scope="module")
def recipes(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    (root / "killed").mkdir()
    return write_recipe(root), write_recipe(root / "killed", with_tracker(TINY_RECIPE, "lane_kill"))


@pytest.fixture(scope="module")
def uninterrupted(lane, recipes, tmp_path_factory):
    """The uninterrupted run, once per setting: ``uninterrupted(exact) -> run directory``."""
    runs = {}

    def get(exact: bool):
        if exact not in runs:
            with deterministic(exact):
                runs[exact] = train_run(recipes[0], tmp_path_factory.mktemp("whole") / "run", *lane.placed(), *SETS)
        return runs[exact]

    return get


@pytest.mark.parametrize("exact", [True, False], ids=["deterministic", "torch_defaults"])
def test_killed_and_resumed_run_equals_the_uninterrupted_one(lane, recipes, uninterrupted, exact, tmp_path):
    whole = uninterrupted(exact)
    parts = tmp_path / "run"
    with deterministic(exact):
        with temporary_plugin(Watch("lane_kill", kill_after(1)), name="lane-kill"), pytest.raises(Killed):
            train_run(recipes[1], parts, *lane.placed(), *SETS)
        stopped = latest_checkpoint(parts)
        assert stopped is not None and stopped.name == "iter_000001", stopped  # iteration 0's checkpoint only
        train_run(recipes[0], parts, *lane.placed(), *SETS, resume=True)

    got, want = read_rows(parts), read_rows(whole)
    assert [r["iteration"] for r in got] == [0, 1, 2]
    if exact:
        wrong = row_differences(got, want) + weight_differences(weights(parts), weights(whole))
        assert not wrong, (f"{lane.precision} on {lane.device} with deterministic algorithms: the resumed run must "
                           f"repeat the uninterrupted one bit for bit; {len(wrong)} differ: " + "; ".join(wrong[:6]))
    else:
        rtol, atol, wtol = LOOSE
        wrong = row_differences(got, want, rtol, atol) + weight_differences(weights(parts), weights(whole), wtol)
        assert not wrong, (f"{lane.precision} on {lane.device} with torch's default (non-deterministic) kernels: "
                           f"the resumed run must equal the uninterrupted one within the documented tolerance "
                           f"(metrics rtol {rtol:g} atol {atol:g}, weights atol {wtol:g}); {len(wrong)} differ: "
                           + "; ".join(wrong[:6]))
