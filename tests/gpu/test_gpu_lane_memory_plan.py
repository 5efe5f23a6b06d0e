"""The memory plan (flowrl/memory_plan.py, what ``flowrl plan`` prints) against CUDA's allocator for
tiny runs: the tiny recipe of the engine tests in fp32 (the plan's own dtypes) for one iteration,
at 8 and at 16 samples per iteration, after a first run that warms cuBLAS's workspaces (kept by
the process, so they sit in the baseline the peaks are measured above).

The plan says it errs high, by up to 15% at full size (docs/benchmarks.md); at tiny sizes the
rollout's line is an upper bound too (a grad forward's saved tensors, flowrl/memory_plan.py
``measured_memory``). So:

- the plan's itemised peak (its lines, less the 1.5 GB it adds for the CUDA context and the
  allocator's slack, which ``max_memory_allocated`` does not see) is at least the measured peak
  (``torch.cuda.max_memory_allocated`` above what was allocated before the run) within 15%;
- what the plan adds from 8 to 16 samples (the rollout's activations, trajectories, text rows)
  bounds what the measured peak adds, within 15% (+1 MiB of allocator rounding), and the
  measured peak does grow.

The CPU variant skips the measurement (the CPU allocator keeps no peak) and checks the plan side.
Three one-iteration runs of the tiny recipe (skipped on the CPU); not yet timed on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import write_recipe
from gpu_lane import read_rows, train_run

from flowrl.memory_plan import CUDA_OVERHEAD, estimate, peak
from flowrl.plugins import get_registry
from flowrl.recipe import load_recipe

pytestmark = pytest.mark.gpu

MiB = 2**20
SETS = ["train.iterations=1", "train.prompts_per_iteration=2", "train.micro_batch_size=2"]
GROUPS = {"small": 4, "large": 8}  # 8 and 16 samples


def _sets(lane, group: int) -> list[str]:
    return [f"run.device={str(lane.device)!r}", "log.progress=false", *SETS, f"train.group_size={group}"]


def planned(recipe_path, lane, group: int) -> tuple[float, str]:
    """The plan's peak for one process (bytes, with the CUDA overhead) and its phase."""
    recipe = load_recipe(recipe_path, _sets(lane, group))
    _, _, lines = estimate(recipe, get_registry(), 1)
    return peak(lines)


def test_the_plan_grows_with_the_rollout_batch(lane, tmp_path):
    recipe = write_recipe(tmp_path)
    (small, phase), (large, _) = (planned(recipe, lane, g) for g in GROUPS.values())
    assert phase == "rollout" and CUDA_OVERHEAD < small < large
    assert 5 * MiB < large - small < 200 * MiB, (large - small) / MiB  # the embedded model's activations, in MiB


def _measured_peak(recipe, out, lane, group: int) -> int:
    import gc

    gc.collect()  # what earlier tests left is freed now, not during the run
    torch.cuda.synchronize(lane.device)
    base = torch.cuda.memory_allocated(lane.device)
    torch.cuda.reset_peak_memory_stats(lane.device)
    run_dir = train_run(recipe, out, *_sets(lane, group))
    torch.cuda.synchronize(lane.device)
    assert [r["iteration"] for r in read_rows(run_dir)] == [0]
    return torch.cuda.max_memory_allocated(lane.device) - base


def test_the_plan_bounds_and_follows_the_measured_peak(lane, tmp_path):
    lane.skip_on_cpu("the CPU allocator keeps no peak (torch.cuda.max_memory_allocated is CUDA's)")
    recipe = write_recipe(tmp_path)
    _measured_peak(recipe, tmp_path / "warm", lane, GROUPS["small"])  # cuBLAS workspaces, kernels loaded
    measured = {k: _measured_peak(recipe, tmp_path / k, lane, g) for k, g in GROUPS.items()}
    plan = {k: planned(recipe, lane, g)[0] for k, g in GROUPS.items()}
    itemised = {k: plan[k] - CUDA_OVERHEAD for k in GROUPS}
    grew, planned_growth = measured["large"] - measured["small"], plan["large"] - plan["small"]
    report = (f"measured peaks {measured['small'] / MiB:.2f} and {measured['large'] / MiB:.2f} MiB at 8 and 16 "
              "samples; "
              f"the plan's itemised peaks {itemised['small'] / MiB:.2f} and {itemised['large'] / MiB:.2f} MiB "
              f"(+{CUDA_OVERHEAD / MiB:.0f} MiB for the CUDA context and slack); growth measured {grew / MiB:.2f} MiB, "
              f"planned {planned_growth / MiB:.2f} MiB")
    for k in GROUPS:
        assert measured[k] <= 1.15 * itemised[k], f"{k}: the plan is low: " + report
    assert 0 < grew <= 1.15 * planned_growth + MiB, report
