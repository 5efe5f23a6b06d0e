"""A damaged checkpoint (a truncated ``model.safetensors``, as a partial copy leaves) ends
``flowrl train --resume`` in one message, not a traceback: it names the damaged file,
the newest intact checkpoint and the command that resumes from it; that command works.

The run is the tiny CLI recipe: one iteration (whose end says "done: 1 iteration", in the singular),
then resumed to a second, so that it has two checkpoints.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest
from tiny_recipe import CLI, tiny_recipe

from flowrl.runlog import read_metrics


def flat(text: str) -> str:
    return " ".join(text.split())


def truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def train(flowrl_cli, *args: str) -> tuple[int, str, str]:
    """``flowrl train ARGS`` in this process, from the current directory: (exit code, stdout, stderr)."""
    (result,) = flowrl_cli.in_process([["train", *args]], cwd=Path.cwd())
    return result.returncode, result.stdout, result.stderr


@pytest.fixture(scope="module")
def trained(tmp_path_factory, flowrl_cli):
    """A run directory with checkpoints iter_000001 and iter_000002 (trained once for the module),
    and the stdout of its first, one-iteration, run."""
    root = tmp_path_factory.mktemp("damaged")
    recipe = root / "tiny.toml"
    recipe.write_text(tiny_recipe(CLI, run={"name": "damaged_checkpoint", "seed": 5},
                                  prompts={"num_eval": 0, "eval_seeds": None}), encoding="utf-8")
    run_dir = root / "run"
    code, first, err = train(flowrl_cli, str(recipe), "-o", str(run_dir))
    assert code == 0, err
    code, _, err = train(flowrl_cli, "--resume", str(run_dir), "--set", "train.iterations=2")
    assert code == 0, err
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir())
    assert names == ["iter_000001", "iter_000002"], names
    return run_dir, first


@pytest.fixture
def two_checkpoints(trained, tmp_path):
    """A copy of the trained run directory, for a test to damage."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(trained[0], run_dir)
    for lock in run_dir.glob(".lock*"):
        lock.unlink()
    return run_dir, trained[1]


def test_the_end_of_a_one_iteration_run_counts_in_the_singular(two_checkpoints):
    _, out = two_checkpoints
    assert "done: 1 iteration in" in flat(out) and "1 iterations" not in out, out


def test_a_truncated_model_file_is_one_message_naming_the_intact_checkpoint_and_the_command(two_checkpoints,
                                                                                            flowrl_cli):
    run_dir = two_checkpoints[0]
    damaged = run_dir / "checkpoints" / "iter_000002" / "model.safetensors"
    truncate(damaged)

    code, _, err = train(flowrl_cli, "--resume", str(run_dir), "--set", "train.iterations=3")
    assert code == 2, err
    assert "Traceback" not in err and err.startswith("error:") and err.count("\nerror:") == 0, err
    text = flat(err)
    assert str(damaged) in text and "truncated" in text, text
    intact = run_dir / "checkpoints" / "iter_000001"
    assert f"the previous checkpoint {intact} (1 iteration) is intact" in text, text

    # the command the hint gives, run as given, resumes from the intact checkpoint
    command = text.split("`")[-2]
    *shell, resume = command.split(" && ")
    subprocess.run(" && ".join(shell), shell=True, check=True)
    argv = shlex.split(resume)
    assert argv[:2] == ["flowrl", "train"] and "--resume" in argv, argv
    code, _, err = train(flowrl_cli, *argv[2:])
    assert code == 0, err
    from flowrl.train.checkpoint import checkpoint_iteration, latest_checkpoint, load_checkpoint

    latest = latest_checkpoint(run_dir)
    assert latest == run_dir / "checkpoints" / "iter_000002" and checkpoint_iteration(latest) == 2
    load_checkpoint(latest)  # written again, whole
    rows = read_metrics(run_dir)
    assert [r["iteration"] for r in rows if "iteration" in r] == [0, 1], rows
    assert (run_dir / "damaged_checkpoints" / "iter_000002" / "model.safetensors").is_file()  # kept, not deleted


def test_without_an_intact_checkpoint_the_message_says_so(two_checkpoints, flowrl_cli):
    run_dir = two_checkpoints[0]
    for name in ("iter_000001", "iter_000002"):
        truncate(run_dir / "checkpoints" / name / "rng.safetensors")
    code, _, err = train(flowrl_cli, "--resume", str(run_dir))
    assert code == 2 and "Traceback" not in err, err
    text = flat(err)
    assert "rng.safetensors is truncated" in text and "no intact checkpoint is left" in text, text
