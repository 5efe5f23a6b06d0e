"""`flowrl validate` and `flowrl train` check a recipe on the device the run gets on this machine:
`[run] device = "auto"` takes the CPU where PyTorch sees no CUDA GPU, and a GPU
recipe (chunk_grpo_flux.toml) validated "ok" there while training went on to download the
weights without ever saying that there is no GPU. Now the CPU's RAM check (which fired only for
`device = "cpu"`) fires for `auto` on the CPU too, at validate and at train start; a GPU-sized
model that `auto` puts on the CPU is a warning at validate and one line at train start;
`--gpu-memory GB` checks the recipe for a machine with such GPUs instead.

The machine is set by each test (its GPUs, its RAM), whatever runs the tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
FLUX = RECIPES / "chunk_grpo_flux.toml"  # full fine-tuning of FLUX.1-dev, 8 processes
SD3_LORA = RECIPES / "lora_single_gpu_sd3.toml"  # SD3.5 medium, LoRA, one process
GB = 1024**3


@pytest.fixture
def machine(monkeypatch):
    """``machine(gpus, ram_gb)``: the machine validate and train see: ``gpus`` CUDA devices (of
    80 GB each) and ``ram_gb`` of RAM."""
    from flowrl.commands import machine as this
    from flowrl.recipe import startable

    def set_up(gpus: int, ram_gb: float) -> None:
        monkeypatch.setattr(startable, "cuda_device_count", lambda: gpus)
        monkeypatch.setattr(this, "visible_gpu_memory_gb", lambda: 80.0 if gpus else None)
        monkeypatch.setattr(this, "host_memory_bytes", lambda: int(ram_gb * GB))

    return set_up


@pytest.fixture
def flowrl(flowrl_cli):
    """``flowrl(*argv)`` -> the CliResult of one command line, in this process."""
    return lambda *argv: flowrl_cli.in_process([[str(a) for a in argv]], cwd=REPO)[0]


def one_error(result, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    err = result.stderr
    assert err.startswith("error:") and err.count("\nerror:") == 0 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in result.flat_err, (fragment, result.flat_err)


ON_THE_CPU = "([run].device = 'auto', and PyTorch sees no CUDA GPU here: the run trains on the CPU)"


def test_a_gpu_recipe_whose_weights_exceed_the_ram_is_refused_by_validate_and_train(machine, flowrl, tmp_path):
    machine(gpus=0, ram_gb=64)
    out = tmp_path / "run"
    for result in (flowrl("validate", FLUX), flowrl("train", FLUX, "-o", out)):
        one_error(result, "[run].device", "the model's weights, gradients and optimizer state alone need",
                  f"more than this machine's 64.0 GB of RAM {ON_THE_CPU}",
                  f"flowrl validate {FLUX} --gpu-memory 80")
    assert not out.exists()  # refused before anything loads: no weight download, no run directory


def test_gpu_memory_checks_the_recipe_for_a_machine_with_such_gpus_instead(machine, flowrl):
    """On a laptop, a cluster's recipe is checked for the cluster's GPUs: the plan's verdict
    against them, and not this machine's devices."""
    machine(gpus=0, ram_gb=64)
    result = flowrl("validate", FLUX, "--gpu-memory", "80")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    rollout_on_gpu_1 = ["--set", "pipeline.staleness=1", "--set", "pipeline.worker='process'",
                        "--set", "pipeline.device='cuda:1'"]
    result = flowrl("validate", RECIPES / "quickstart_step.toml", *rollout_on_gpu_1, "--gpu-memory", "80")
    assert result.returncode == 0, result.stderr
    one_error(flowrl("validate", RECIPES / "quickstart_step.toml", *rollout_on_gpu_1), "[pipeline].device")


def test_on_a_machine_with_a_gpu_the_recipe_is_planned_for_it(machine, flowrl):
    machine(gpus=1, ram_gb=64)
    result = flowrl("validate", FLUX)
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_a_gpu_model_that_auto_puts_on_the_cpu_is_a_warning_at_validate(machine, flowrl):
    machine(gpus=0, ram_gb=1024)
    result = flowrl("validate", SD3_LORA)
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith("warning:") and result.stderr.count("warning:") == 1, result.stderr
    assert ("PyTorch sees no CUDA GPU here, so [run].device = 'auto' trains model 'sd3' (2.5e9 parameters) on the CPU"
            in result.flat_err and f"flowrl validate {SD3_LORA} --gpu-memory 80" in result.flat_err), result.stderr
    result = flowrl("validate", SD3_LORA, "--set", "run.device=cpu")  # the CPU is meant: nothing to say
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_a_small_model_that_auto_puts_on_the_cpu_says_nothing(machine, flowrl):
    machine(gpus=0, ram_gb=1024)
    result = flowrl("validate", RECIPES / "quickstart.toml")
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_a_peak_beyond_the_ram_of_a_run_that_auto_puts_on_the_cpu_is_a_warning(machine, flowrl):
    from flowrl.commands.base import load
    from flowrl.commands.machine import plan
    from flowrl.memory_plan import CUDA_OVERHEAD

    recipe = RECIPES / "quickstart.toml"
    planned = plan(load(recipe, []), 1)
    in_all = planned.total - CUDA_OVERHEAD + planned.host
    machine(gpus=0, ram_gb=in_all * 0.999 / GB)
    result = flowrl("validate", recipe)
    assert result.returncode == 0 and result.stderr.startswith("warning:"), result.stderr
    assert f"peak of {in_all / GB:.1f} GB in all" in result.flat_err and ON_THE_CPU in result.flat_err


def test_a_rollout_far_beyond_the_ram_is_refused_by_validate_and_train_with_the_keys_to_lower(machine, flowrl,
                                                                                               tmp_path):
    # group_size=100000 once validated "ok" and the kernel killed the run (SIGKILL, no message)
    machine(gpus=0, ram_gb=24)
    huge = ["--set", "train.group_size=100000", "--set", "train.prompts_per_iteration=1"]
    out = tmp_path / "run"
    recipe = RECIPES / "quickstart.toml"
    for result in (flowrl("validate", recipe, *huge), flowrl("train", recipe, *huge, "-o", out)):
        one_error(result, "[train]", "more than 1.5 x this machine's 24.0 GB of RAM", "rollout phase",
                  "[sampler].batch_size (roll out in parts)")
    assert not out.exists()
    # rolled out in parts, the same run plans to fit (its trajectories alone: about 21 GB)
    result = flowrl("validate", recipe, *huge, "--set", "sampler.batch_size=64")
    assert result.returncode == 0, result.stderr


def test_train_says_in_one_line_that_a_gpu_model_trains_on_the_cpu(machine, flowrl, tmp_path):
    machine(gpus=0, ram_gb=1024)
    result = flowrl("train", SD3_LORA, "--dry-run", "-o", tmp_path / "run")
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stdout.splitlines() if "on the CPU" in line]
    assert len(said) == 1 and said[0].startswith("warning:"), result.stdout
    assert "[run].device = 'auto' trains model 'sd3' (2.5e9 parameters) on the CPU" in said[0]
    result = flowrl("train", SD3_LORA, "--dry-run", "-o", tmp_path / "run", "--set", "run.device=cpu")
    assert result.returncode == 0 and "on the CPU" not in result.stdout, result.stdout
