"""`flowrl validate` says what `flowrl plan` already knows about memory (the two
once disagreed): a peak beyond one GPU's memory (--gpu-memory, else the GPU validate sees, else
the plan's 80 GB) is a warning that names the planned peak, the memory and the `--set` keys that
make it fit; a recipe for the CPU whose exactly known weights and optimizer state exceed this
machine's RAM is an error. Figures are compared with the plan's own, not written here, so that
a change of the plan (its lines, its constants) changes both alike.

The machine is set by each test (`auto` takes the CPU where PyTorch sees no GPU, and validation
checks the recipe there): ``run_validate`` is a machine with one GPU whose memory
validate cannot read; tests of a machine without a GPU are in
test_validate_checks_the_machine_the_run_gets.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"


@pytest.fixture
def run_validate(flowrl_cli, monkeypatch):
    """``run_validate(recipe, *args) -> (exit code, stderr)`` on a machine with one GPU whose
    memory validate cannot read (the plan's 80 GB is assumed)."""
    from flowrl.commands import machine
    from flowrl.recipe import startable

    monkeypatch.setattr(startable, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(machine, "visible_gpu_memory_gb", lambda: None)

    def run(recipe, *args: str) -> tuple[int, str]:
        (result,) = flowrl_cli.in_process([["validate", str(recipe), *args]], cwd=Path.cwd())
        return result.returncode, result.flat_err

    return run


def planned(recipe: Path, *overrides: str) -> tuple[float, float, float]:
    """(GPU peak, bytes kept in CPU memory, CUDA overhead) the plan gives the recipe at its process count."""
    from flowrl.commands.base import load, registry
    from flowrl.memory_plan import CUDA_OVERHEAD, cpu_bytes, estimate, peak

    resolved = load(recipe, list(overrides))
    _, _, lines = estimate(resolved, registry(), resolved.distributed.num_processes)
    return peak(lines)[0], cpu_bytes(lines), CUDA_OVERHEAD


def sets(recipe: Path, args: tuple[str, ...]) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == "--set"]


@pytest.mark.parametrize("recipe, args, gpu", [
    (RECIPES / "chunk_grpo_flux.toml", ("--set", "distributed.num_processes=1"), 80),  # 8 GPUs' recipe on one
    (RECIPES / "lora_single_gpu_sd3.toml", ("--gpu-memory", "12"), 12),
    (RECIPES / "chunk_grpo_sd3.toml", ("--gpu-memory", "20"), 20),
    (RECIPES / "qwen_image_lora.toml", ("--gpu-memory", "40"), 40),
], ids=["flux_on_one_gpu", "sd3_lora_12gb", "sd3_8_gpus_20gb", "qwen_image_40gb"])
def test_a_peak_beyond_the_gpu_is_a_warning_naming_the_peak_the_memory_and_the_fix(run_validate, recipe, args, gpu):
    from flowrl.commands.base import load, registry  # noqa: F401 - the registry of this process
    from flowrl.memory_plan import GB

    overrides = sets(recipe, args)
    total, _, _ = planned(recipe, *overrides)
    assert total > gpu * GB, "the case must not fit"
    code, err = run_validate(recipe, *args)
    assert code == 0, err  # a warning: the GPU the run gets may differ from the one assumed
    assert err.startswith("warning:") and "Traceback" not in err, err
    assert f"estimates a peak of {total / GB:.1f} GB per process" in err and f"more than the {gpu:g} GB of one GPU" in err
    assert f"flowrl plan {recipe} --gpu-memory {gpu:g}" in err, err
    # every key it names makes the plan fit (alone, or all together where it says so)
    named = re.findall(r"--set '?([^ ']+)'?", err.split("more than", 1)[1].split("(`flowrl plan", 1)[0])
    together = "together make it fit" in err
    if together:
        assert planned(recipe, *overrides, *named)[0] <= gpu * GB
    for fix in named if not together else ():
        assert planned(recipe, *overrides, fix)[0] <= gpu * GB, fix


@pytest.mark.parametrize("recipe, args", [
    (RECIPES / "quickstart.toml", ()),
    (RECIPES / "lora_single_gpu_sd3.toml", ()),
    (RECIPES / "chunk_grpo_flux.toml", ()),                      # at its own 8 processes
    (RECIPES / "flux2_klein_nf4_24gb.toml", ("--gpu-memory", "24")),
])
def test_a_recipe_the_plan_fits_gets_no_warning(run_validate, recipe, args):
    code, err = run_validate(recipe, *args)
    assert code == 0 and err == "", err


@pytest.mark.parametrize("recipe, overrides", [
    (RECIPES / "chunk_grpo_flux.toml", ('run.device="cpu"',)),
    (RECIPES / "lora_single_gpu_sd3.toml", ('run.device="cpu"',)),
    (RECIPES / "quickstart.toml", ('run.device="cpu"', "distributed.num_processes=2")),
])
def test_a_cpu_recipe_whose_weights_alone_exceed_the_ram_is_an_error(run_validate, monkeypatch, recipe, overrides):
    from flowrl.commands import machine

    monkeypatch.setattr(machine, "host_memory_bytes", lambda: 1024**2)  # a 1 MB machine
    args = [a for o in overrides for a in ("--set", o)]
    code, err = run_validate(recipe, *args)
    assert code == 2 and err.startswith("error:") and "Traceback" not in err, err
    assert "[run].device" in err and "optimizer state alone need" in err and "more than this machine's 0.0 GB of RAM" in err


def test_a_cpu_recipe_whose_estimated_peak_exceeds_the_ram_is_a_warning(run_validate, monkeypatch):
    """Between the exactly known part and the estimate's peak: a warning, not an error."""
    from flowrl.commands import machine
    from flowrl.memory_plan import GB

    recipe = RECIPES / "quickstart.toml"
    total, host, overhead = planned(recipe)
    ram = (total - overhead + host) * 0.999
    monkeypatch.setattr(machine, "host_memory_bytes", lambda: int(ram))
    code, err = run_validate(recipe, "--set", 'run.device="cpu"')
    assert code == 0 and err.startswith("warning:"), err
    assert f"peak of {(total - overhead + host) / GB:.1f} GB in all" in err and "RAM ([run].device = 'cpu')" in err
    monkeypatch.setattr(machine, "host_memory_bytes", lambda: int(ram / 0.999 * 1.01))
    code, err = run_validate(recipe, "--set", 'run.device="cpu"')
    assert code == 0 and err == "", err
