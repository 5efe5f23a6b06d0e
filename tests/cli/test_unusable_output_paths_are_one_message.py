"""Output paths a command cannot use (a folder under /proc, a file where a folder is expected or a
folder where a file is, a parent that is a file), and inputs of the wrong kind (a binary prompt
file, a metrics file that is not one JSON object a line, a checkpoint without its weights, a GPU
this machine lacks): every command that writes or reads them says so in one message, exit status
2, before its work (no evaluation or sampling is spent first) and without writing anything. These
ended in tracebacks, some after the whole evaluation had run; one export silently mixed its files
with an earlier export's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny_recipe import CLI, tiny_recipe

from flowrl.errors import FlowrlError
from flowrl.files import ensure_writable, read_jsonl


def _one_message(result, *fragments: str) -> None:
    assert result.returncode == 2, (result.argv, result.stdout, result.stderr)
    assert result.stderr.startswith("error:") and "Traceback" not in result.stderr, result.stderr
    flat = " ".join(result.stderr.split())
    for fragment in fragments:
        assert fragment in flat, (fragment, flat)


@pytest.fixture(scope="module")
def run(tmp_path_factory, flowrl_cli):
    root = tmp_path_factory.mktemp("outputs")
    recipe = root / "tiny.toml"
    recipe.write_text(tiny_recipe(CLI))
    (done,) = flowrl_cli.in_process([["train", str(recipe), "-o", str(root / "run")]], cwd=root)
    assert done.returncode == 0, done.stderr
    (root / "a_file.png").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x01")
    return root


def test_ensure_writable_names_each_kind_of_unusable_path(tmp_path):
    a_file = tmp_path / "f.txt"
    a_file.write_text("x")
    cases = [(a_file, True, "is a file, not a directory"),
             (tmp_path, False, "is a directory; a file path is expected"),
             (a_file / "deeper" / "out.json", False, "f.txt is a file, not a directory"),
             (Path("/proc/flowrl-nowhere/out"), True, "cannot write /proc/flowrl-nowhere/out")]
    for path, directory, message in cases:
        with pytest.raises(FlowrlError, match=message.replace("(", r"\(")) as caught:
            ensure_writable(path, where="--output", directory=directory)
        assert caught.value.where == "--output"
    before = sorted(tmp_path.rglob("*"))
    assert ensure_writable(tmp_path / "new" / "deeper" / "out.json", where="-o", directory=False)
    assert sorted(tmp_path.rglob("*")) == before  # a usable path: nothing created, no probe left


def test_every_command_refuses_an_unusable_output_before_its_work(run, flowrl_cli):
    root = run
    runs = str(root / "run")
    nowhere, a_file = "/proc/flowrl-nowhere", str(root / "a_file.png")
    calls = {
        "eval_proc": ["eval", runs, "--num-prompts", "1", "-o", f"{nowhere}/x.json"],
        "eval_dir": ["eval", runs, "--num-prompts", "1", "-o", str(root)],
        "eval_images": ["eval", runs, "--num-prompts", "1", "-o", str(root / "e.json"), "--save-images", a_file],
        "sample_proc": ["sample", runs, "--num-prompts", "1", "-o", nowhere],
        "sample_file": ["sample", runs, "--num-prompts", "1", "-o", a_file],
        "export_proc": ["export", runs, "-o", nowhere],
        "export_under_file": ["export", runs, "-o", f"{a_file}/export"],
        "profile_file": ["profile", "--compare", runs, "-o", a_file],
        "plot_dir": ["plot", runs, "-o", str(root)],
        "plot_format": ["plot", runs, "-o", str(root / "curves.txt")],
        "compare_proc": ["compare", runs, runs, "-o", nowhere, "--no-figure"],
        "sweep_file": ["sweep", str(root / "tiny.toml"), "--seeds", "1", "-o", a_file],
        "selftest_file": ["selftest", "--device", "cpu", "--workdir", a_file],
    }
    before = sorted(p for p in root.rglob("*"))
    results = dict(zip(calls, flowrl_cli.in_process(list(calls.values()), cwd=root)))
    _one_message(results["eval_proc"], "--output: cannot write /proc/flowrl-nowhere/x.json")
    _one_message(results["eval_dir"], "is a directory; a file path is expected")
    _one_message(results["eval_images"], "--save-images:", "a_file.png is a file, not a directory")
    _one_message(results["sample_proc"], "--output: cannot write /proc/flowrl-nowhere")
    _one_message(results["sample_file"], "--output:", "is a file, not a directory")
    _one_message(results["export_proc"], "--output: cannot write /proc/flowrl-nowhere")
    _one_message(results["export_under_file"], "a_file.png is a file, not a directory")
    _one_message(results["profile_file"], "--output:", "is a file, not a directory")
    _one_message(results["plot_dir"], "is a directory; a file path is expected", "output.png")
    _one_message(results["plot_format"], ".txt is not a figure format matplotlib writes")
    _one_message(results["compare_proc"], "--output-dir: cannot write /proc/flowrl-nowhere")
    _one_message(results["sweep_file"], "--output-dir:", "is a file, not a directory")
    _one_message(results["selftest_file"], "--workdir:", "is a file, not a directory")
    assert sorted(p for p in root.rglob("*")) == before  # nothing written, no half-made folder


def test_an_export_folder_is_not_mixed_with_an_earlier_export(run, flowrl_cli):
    root = run
    out = root / "exported"
    export = ["export", str(root / "run"), "-o", str(out)]
    (first,) = flowrl_cli.in_process([export])
    assert first.returncode == 0, first.stderr
    (out / "README.md").write_text("an earlier export's model card")
    (again,) = flowrl_cli.in_process([export])
    _one_message(again, "already holds an export", "--overwrite")
    assert (out / "README.md").is_file()  # refused: nothing of it touched
    (replaced,) = flowrl_cli.in_process([[*export, "--overwrite"]])
    assert replaced.returncode == 0, replaced.stderr
    assert not (out / "README.md").exists() and (out / "flowrl_export.json").is_file()
    # --overwrite replaces an export and nothing else: a folder that also holds other files is refused
    (out / "my_notes.txt").write_text("not the export's")
    (mixed,) = flowrl_cli.in_process([[*export, "--overwrite"]])
    _one_message(mixed, "holds an earlier export and other files (my_notes.txt)")
    assert (out / "my_notes.txt").is_file() and (out / "flowrl_export.json").is_file()
    shutil.rmtree(out)


def test_inputs_of_the_wrong_kind_are_one_message(run, flowrl_cli, tmp_path):
    root = run
    broken = tmp_path / "broken_run"
    shutil.copytree(root / "run", broken)
    (checkpoint,) = [p for p in (broken / "checkpoints").iterdir() if p.is_dir()]
    (checkpoint / "model.safetensors").unlink()
    calls = [["eval", str(root / "run"), "--prompts", str(root / "a_file.png"), "-o", str(tmp_path / "e.json")],
             ["sample", str(broken), "--num-prompts", "1", "-o", str(tmp_path / "s")],
             ["eval", str(root / "run"), "--device", "cuda:7", "-o", str(tmp_path / "e.json")],
             ["sweep", "--resume", str(tmp_path / "listed")], ["sample", "--weights", str(tmp_path / "listed")],
             ["export", str(root / "a_file.png")]]
    (tmp_path / "listed").mkdir()
    for name in ("sweep.json", "flowrl_export.json"):  # flowrl's own files, holding a list
        (tmp_path / "listed" / name).write_text("[]")
    binary_prompts, no_weights, no_gpu, sweep_list, export_list, not_a_source = flowrl_cli.in_process(calls,
                                                                                                     cwd=tmp_path)
    _one_message(sweep_list, "is not a flowrl sweep manifest")
    _one_message(export_list, "holds a JSON list, not the object `flowrl export` writes")
    _one_message(not_a_source, "a_file.png: is a file but not a .toml recipe")
    _one_message(binary_prompts, "is not UTF-8 text")
    _one_message(no_weights, "model.safetensors is missing")
    if not torch.cuda.is_available():
        _one_message(no_gpu, "--device: device 'cuda:7' names a CUDA GPU")
    else:
        _one_message(no_gpu, "--device: device 'cuda:7': this machine has")


@pytest.mark.parametrize("text, message", [
    ("[1, 2]\n", "line 1 is a JSON list, not an object"),
    ('{"a": 1}\n{"b": 2\n{"c": 3}\n', "line 2 is not JSON"),
])
def test_a_metrics_file_that_is_not_one_object_a_line_is_one_message(tmp_path, text, message):
    path = tmp_path / "metrics.jsonl"
    path.write_text(text)
    with pytest.raises(FlowrlError, match=message):
        read_jsonl(path)
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    with pytest.raises(FlowrlError, match="is not UTF-8 text"):
        read_jsonl(path)


def test_a_record_still_being_written_is_left_out(tmp_path):
    """A live run's metrics read while it writes: the last line, without its newline, is not yet
    a record; a cut line inside the file is damage, and an error."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"iteration": 0}) + "\n" + '{"iteration": 1, "loss"')
    assert read_jsonl(path) == [{"iteration": 0}]


def test_an_os_error_on_a_named_path_no_command_checked_is_one_message(run, flowrl_cli, monkeypatch):
    """The class's safety net: a path the OS refuses where no command looked first (here the
    figure's writer, made to fail) is one message naming the path, not a traceback."""
    from flowrl import plotting

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/srv/shared/rewards.png")

    monkeypatch.setattr(plotting, "plot_run", refused)
    (result,) = flowrl_cli.in_process([["plot", str(run / "run")]])
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("error: /srv/shared/rewards.png: Permission denied"), result.stderr
    (debug,) = flowrl_cli.in_process([["plot", str(run / "run"), "--debug"]])
    assert "Traceback" in debug.stderr and "PermissionError" in debug.stderr


def test_doctor_fails_a_recipe_that_names_a_gpu_this_machine_lacks(run, flowrl_cli):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    (result,) = flowrl_cli.in_process([["doctor", str(run / "tiny.toml"), "--set", "run.device=cuda", "--json"]])
    report = json.loads(result.stdout[result.stdout.find("{"):])
    (devices,) = [c for c in report["checks"] if c["section"] == "recipe" and c["name"] == "devices"]
    assert result.returncode == 1 and devices["status"] == "fail" and "names a CUDA device" in devices["detail"]


def test_a_result_name_with_a_slash_and_an_empty_run_plot_are_one_message(run, flowrl_cli, tmp_path):
    (tmp_path / "empty_run").mkdir()
    (tmp_path / "empty_run" / "metrics.jsonl").write_text("")
    slash, empty = flowrl_cli.in_process([["eval", str(run / "run"), "--num-prompts", "1", "--name", "a/b"],
                                          ["plot", str(tmp_path / "empty_run")]])
    _one_message(slash, "--name 'a/b' is not a file name part")
    assert not list((run / "run" / "checkpoints").glob("*.a"))  # no folder made from the name
    _one_message(empty, "holds no record yet")
    assert not (tmp_path / "empty_run" / "rewards.png").exists()


def test_a_sweep_of_more_runs_than_its_limit_is_refused_at_once(run, flowrl_cli):
    from flowrl.sweeps import MAX_RUNS

    seeds, grid = flowrl_cli.in_process([["sweep", str(run / "tiny.toml"), "--seeds", "1000000", "--dry-run"],
                                         ["sweep", str(run / "tiny.toml"), "--grid", "train.lr=" + ",".join(
                                             f"{k}e-5" for k in range(1, 102)), "--seeds", "100", "--dry-run"]])
    _one_message(seeds, f"defines 1,000,000 runs, more than {MAX_RUNS:,}")
    _one_message(grid, f"defines 10,100 runs, more than {MAX_RUNS:,}")


def test_an_export_that_fails_leaves_no_folder_and_keeps_an_earlier_export(run, flowrl_cli, tmp_path):
    """--ema of a run without EMA fails after the output was checked: no empty folder is left,
    and with --overwrite the earlier export in the folder is still whole."""
    runs = str(run / "run")
    fresh, kept = tmp_path / "fresh", tmp_path / "kept"
    first, failed_fresh, failed_over = flowrl_cli.in_process([
        ["export", runs, "-o", str(kept)], ["export", runs, "--ema", "-o", str(fresh)],
        ["export", runs, "--ema", "-o", str(kept), "--overwrite"]])
    assert first.returncode == 0, first.stderr
    _one_message(failed_fresh, "--ema")
    assert not fresh.exists()
    _one_message(failed_over, "--ema")
    assert (kept / "flowrl_export.json").is_file()


@pytest.mark.parametrize("name", ["bad name!!", "no-owner", "me/", "a/b/c", "me/" + "x" * 97, "me/a--b", "me/x..y",
                                  "me/name.", "me-/x"])
def test_a_hub_repository_name_the_hub_refuses_is_refused_before_the_export(run, flowrl_cli, tmp_path, name):
    (result,) = flowrl_cli.in_process([["export", str(run / "run"), "-o", str(tmp_path / "hub"), "--push-to-hub",
                                        name, "--dry-run"]])
    _one_message(result, "is not a hub repository name")
    assert not (tmp_path / "hub").exists()
