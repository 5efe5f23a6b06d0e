"""Three classes of bad input that ended in a traceback, each fed several instances: a run directory
the OS will not let us make or write, a recipe the TOML parser cannot read, and a batch too large
for memory. Each is now one message (what, where, how to fix), exit status 2."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tiny_recipe import ENGINE, tiny_recipe

REPO = Path(__file__).resolve().parents[2]


def _one_message(code: int, err: str) -> None:
    """Exit status 2, one message (one line starting with "error:"), no traceback."""
    assert code == 2, err
    assert err.startswith("error:") and err.count("\nerror:") == 0 and "Traceback" not in err, err


@pytest.fixture
def tiny(tmp_path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(tiny_recipe(ENGINE))
    return path


@pytest.fixture
def flowrl_train(flowrl_cli):
    """``flowrl_train(*args) -> (exit code, stderr)``: ``flowrl train ARGS`` in this process."""

    def run(*args: str) -> tuple[int, str]:
        (result,) = flowrl_cli.in_process([["train", *args]], cwd=Path.cwd())
        return result.returncode, result.stderr

    return run


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if a run gets as far as loading its model."""
    from flowrl.train import loop

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the run directory was checked")

    monkeypatch.setattr(loop.Session, "open", refuse)


# ------------------------------------------------------------------------------ the run directory

def _unmakeable_run_dirs(tmp_path: Path):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    cases = [
        (a_file / "run", "Not a directory"),                      # a parent that is a regular file
        (a_file / "deeper" / "run", "Not a directory"),            # ... further up
        (a_file, "it is a file, not a directory"),                 # the run directory itself is a file
        (Path("/proc/flowrl_no_such_dir/run"), "No such file or directory"),  # /proc: cannot be made
        (Path("/proc/self/flowrl_run"), "No such file or directory"),
        (Path("/dev/null/run"), "Not a directory"),
    ]
    if Path("/sys/kernel").is_dir():
        cases.append((Path("/sys/flowrl_run"), ""))  # sysfs: read-only for everyone (EPERM, EACCES or EROFS)
    if os.geteuid() != 0:  # root writes a read-only directory anyway
        read_only = tmp_path / "read_only"
        read_only.mkdir(mode=0o555)
        cases += [(read_only / "run", "Permission denied"), (read_only / "a" / "b" / "run", "Permission denied")]
    return cases


def test_bad_input_run_directory_os_errors_are_one_message_before_any_model_loads(tiny, tmp_path, flowrl_train,
                                                                                   no_model_load):
    cases = _unmakeable_run_dirs(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    for run_dir, reason in cases:
        for flags in (["-o", str(run_dir)], ["-o", str(run_dir), "--overwrite"]):
            code, err = flowrl_train(str(tiny), *flags)
            _one_message(code, err)
            err = " ".join(err.split())
            assert "--output-dir: cannot" in err and str(run_dir) in err and reason in err, (run_dir, err)
            assert "hint:" in err
    assert sorted(tmp_path.rglob("*")) == before  # nothing half-made on the way to a path that failed


def test_bad_input_run_directory_a_parent_that_fails_midway_leaves_none_made_behind(tiny, tmp_path, flowrl_train,
                                                                                      no_model_load, monkeypatch):
    """Missing parents are made one by one; when one fails (a full disk, an OS limit), those made
    before it are removed again."""
    import errno

    real_mkdir = Path.mkdir
    failures = {"full": (errno.ENOSPC, "No space left on device"), "quota": (errno.EDQUOT, "Disk quota exceeded"),
                "limit": (errno.EMLINK, "Too many links")}

    def mkdir(self, *args, **kwargs):
        if self.name in failures:
            raise OSError(*failures[self.name], str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    for name, (_, reason) in failures.items():
        run_dir = tmp_path / "made" / "also_made" / name / "run"
        code, err = flowrl_train(str(tiny), "-o", str(run_dir))
        _one_message(code, err)
        err = " ".join(err.split())
        assert f"cannot create the run directory {run_dir}: {reason} ({tmp_path / 'made' / 'also_made' / name})" in err
        assert not (tmp_path / "made").exists()


# ------------------------------------------------------------------------------ the recipe file

def _unreadable_recipes(tmp_path: Path):
    cases = {
        "invalid.toml": (b"[train\nlr = 1e-3\n", "TOML syntax error"),
        "unterminated.toml": (b'[run]\nname = "x\n', "TOML syntax error"),
        "deep_array.toml": (b"a = " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested too deeply"),
        "deep_table.toml": (b"a = " + b"{b = " * 3000 + b"1" + b"}" * 3000 + b"\n", "nested too deeply"),
        "latin1.toml": ('[run]\nname = "caf\u00e9"\n'.encode("latin-1"), "not a UTF-8 text file"),
        "binary.toml": (bytes(range(256)), "not a UTF-8 text file"),
    }
    paths = []
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        paths.append((tmp_path / name, message))
    (tmp_path / "a_directory.toml").mkdir()
    paths.append((tmp_path / "a_directory.toml", "is a directory, not a recipe file"))
    return paths


def test_bad_input_recipe_files_the_toml_parser_cannot_read_are_one_message_naming_the_file(tmp_path, validate,
                                                                                             flowrl_train):
    for path, message in _unreadable_recipes(tmp_path):
        code, err = validate(path)
        _one_message(code, err)
        err = " ".join(err.split())
        assert str(path) in err and message in err, (path, err)
        code, err = flowrl_train(str(path))
        _one_message(code, err)
        err = " ".join(err.split())
        assert str(path) in err and message in err, (path, err)


@pytest.mark.parametrize("value", ["[" * 5000 + "]" * 5000, "{a = " * 3000 + "1" + "}" * 3000])
def test_bad_input_a_set_value_nested_too_deeply_is_one_message(tiny, validate, value):
    code, err = validate(tiny, f"train.lr={value}")
    _one_message(code, err)
    err = " ".join(err.split())
    assert "--set" in err and "nested too deeply" in err and "train.lr" in err, err


# ------------------------------------------------------------------------------ memory

ALLOCATION_FAILURES = [
    RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: you tried to "
                 "allocate 1099511627776 bytes. Error code 12 (Cannot allocate memory)"),
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.11 GiB"),
    MemoryError(),
]


@pytest.mark.parametrize("phase", ["collect", "update"])
def test_bad_input_an_allocation_failure_names_the_recipe_keys_that_set_the_size(tiny, tmp_path, flowrl_train,
                                                                                  monkeypatch, phase):
    """Rollout (collect) or update cannot allocate: one message with the batch's keys and values."""
    from flowrl.train import loop

    for n, failure in enumerate(ALLOCATION_FAILURES):
        def fail(*args, **kwargs):
            raise failure

        if phase == "collect":
            monkeypatch.setattr(loop, "collect", fail)
        else:
            monkeypatch.setattr(loop.PolicyUpdate, "run", fail)
        code, err = flowrl_train(str(tiny), "-o", str(tmp_path / f"run{n}"))
        _one_message(code, err)
        err = " ".join(err.split())
        assert f"{tiny}: [train]: out of memory (" in err, err
        for key in ("[train].prompts_per_iteration = 2", "group_size = 4", "micro_batch_size = 2",
                    "[sampler].steps = 5"):
            assert key in err, (key, err)
        assert "hint: lower [train].micro_batch_size" in err and f"flowrl plan {tiny}" in err


def test_an_allocation_failure_shows_the_planned_peak_where_the_model_states_its_sizes():
    from flowrl.distributed import DistContext
    from flowrl.geometry import resolve_geometry
    from flowrl.plugins import get_registry
    from flowrl.recipe import load_recipe
    from flowrl.train.loop import out_of_memory

    recipe = load_recipe(REPO / "recipes" / "chunk_grpo_flux.toml", [])
    error = out_of_memory(recipe, resolve_geometry(recipe.train, 8, recipe.source), DistContext(world_size=8),
                          get_registry(), ALLOCATION_FAILURES[1])
    text = " ".join(error.format().split())
    assert "[model].height = " in text and "width = " in text
    assert "`flowrl plan` expects a peak of ~" in text and "GB per process" in text


def test_other_runtime_errors_are_not_taken_for_an_allocation_failure():
    from flowrl.train.loop import is_allocation_failure

    assert not is_allocation_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"))
    assert all(is_allocation_failure(e) for e in ALLOCATION_FAILURES)
