"""What a command would refuse is refused before it deletes or writes anything, and a file it
reads that is damaged or not its kind is one message (from a probe of the less-used paths):

- ``train --overwrite`` deleted the earlier run, then refused a missing prompt file;
- ``sample --overwrite`` deleted the earlier sample, then refused ``--hybrid-steps``, and emptied
  ``OUT/images`` of every PNG, the user's own too;
- a checkpoint whose ``state.json`` is cut short: a traceback in ``export`` after half the export
  was written (in ``eval`` after the whole evaluation);
- a ``--reference`` file without its ``regime``, a sweep manifest whose runs lack their keys:
  tracebacks in ``diagnose`` and ``compare``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tiny_recipe import CLI, tiny_recipe


def one_message(result, *fragments: str) -> str:
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    flat = " ".join(result.stderr.split())
    assert flat.startswith("error:") and flat.count(" error:") == 0, flat
    for fragment in fragments:
        assert fragment in flat, (fragment, flat)
    return flat


@pytest.fixture(scope="module")
def trained(tmp_path_factory, flowrl_cli):
    """A one-iteration run of the tiny CLI recipe and a sample of it."""
    root = tmp_path_factory.mktemp("refusals")
    recipe = root / "tiny.toml"
    recipe.write_text(tiny_recipe(CLI, prompts={"num_eval": 0, "eval_seeds": None}), encoding="utf-8")
    run_dir, sample = root / "run", root / "sample"
    results = flowrl_cli.in_process([["train", str(recipe), "-o", str(run_dir)],
                                     ["sample", str(run_dir), "--prompt", "a red circle", "--steps", "2",
                                      "-o", str(sample), "--device", "cpu"]], cwd=root)
    for r in results:
        assert r.returncode == 0, r.stderr
    return recipe, run_dir, sample


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_train_overwrite_refuses_a_missing_prompt_file_before_deleting_the_run(trained, tmp_path, flowrl_cli):
    recipe, run_dir, _ = trained
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    before = files_of(copy)
    (r,) = flowrl_cli.in_process([["train", str(recipe), "-o", str(copy), "--overwrite",
                                   "--set", f"prompts.source={str(tmp_path / 'nope.txt')!r}"]], cwd=tmp_path)
    one_message(r, "prompt file not found")
    assert files_of(copy) == before and "removed" not in r.stdout + r.stderr


def test_sample_overwrite_refuses_hybrid_steps_first_and_deletes_only_its_own_images(trained, tmp_path, flowrl_cli):
    _, run_dir, sample = trained
    out = tmp_path / "sample"
    shutil.copytree(sample, out)
    (out / "images" / "mine.png").write_bytes(b"the user's own file")
    before = files_of(out)
    argv = ["sample", str(run_dir), "--prompt", "a red circle", "--steps", "2", "-o", str(out), "--overwrite",
            "--device", "cpu"]
    (refused,) = flowrl_cli.in_process([[*argv, "--hybrid-steps", "5"]], cwd=tmp_path)
    one_message(refused, "--hybrid-steps 5 exceeds the 2 sampling steps")
    assert files_of(out) == before
    two = ["sample", str(run_dir), "--prompt", "a red circle", "--prompt", "a blue square", "--steps", "2",
           "-o", str(out), "--overwrite", "--device", "cpu"]
    (first,) = flowrl_cli.in_process([two], cwd=tmp_path)  # the earlier sample now draws 2 prompts
    assert first.returncode == 0 and (out / "images" / "00001_00.png").is_file(), first.stderr
    (replaced,) = flowrl_cli.in_process([argv], cwd=tmp_path)  # 1 prompt: its earlier second image goes
    assert replaced.returncode == 0, replaced.stderr
    assert not (out / "images" / "00001_00.png").exists() and (out / "images" / "00000_00.png").is_file()
    assert (out / "images" / "mine.png").read_bytes() == b"the user's own file"


def test_a_checkpoint_with_a_cut_state_json_is_one_message_before_anything_is_written(trained, tmp_path, flowrl_cli):
    _, run_dir, _ = trained
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    (state,) = (copy / "checkpoints").glob("iter_*/state.json")
    state.write_text(state.read_text()[:40])
    results = flowrl_cli.in_process([["export", str(copy), "-o", str(tmp_path / "export")],
                                     ["sample", str(copy), "--prompt", "a red circle", "--steps", "2",
                                      "-o", str(tmp_path / "sample"), "--device", "cpu"]], cwd=tmp_path)
    for r in results:
        one_message(r, "state.json", "does not parse")
    assert not (tmp_path / "export").exists() and not (tmp_path / "sample").exists()


def test_a_reference_without_its_regime_and_a_sweep_without_run_keys_are_one_message(trained, tmp_path, flowrl_cli):
    _, run_dir, _ = trained
    reference = tmp_path / "ref.json"
    reference.write_text(json.dumps({"format": 1, "metrics": {}}))
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep.json").write_text(json.dumps({"runs": [{"id": "a", "status": "done"}]}))
    listed = tmp_path / "listed"
    listed.mkdir()
    (listed / "sweep.json").write_text(json.dumps({"runs": ["a", "b"]}))
    results = flowrl_cli.in_process([["diagnose", str(run_dir), "--reference", str(reference)],
                                     ["compare", str(sweep)], ["compare", str(listed)]], cwd=tmp_path)
    one_message(results[0], "is not a reference file", "regime")
    one_message(results[1], "not a sweep manifest flowrl wrote", "runs[0] has no 'dir'")
    one_message(results[2], "runs[0] is a str, not a table")


def test_sweep_resume_of_a_manifest_missing_its_keys_is_one_message(tmp_path, flowrl_cli):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep.json").write_text(json.dumps({"version": 1, "spec": {"recipe": "r.toml"}, "runs": []}))
    (r,) = flowrl_cli.in_process([["sweep", "--resume", str(sweep)]], cwd=tmp_path)
    one_message(r, "not a sweep manifest flowrl wrote", "spec has no 'recipe_sha256'")


def test_an_image_too_large_to_decode_safely_is_one_message(tmp_path, flowrl_cli, monkeypatch):
    """PIL refuses an image past twice its pixel limit with DecompressionBombError, no OSError:
    ``reward score`` let it through as a traceback. (The limit lowered here, not the image raised.)"""
    from PIL import Image

    image = tmp_path / "big.png"
    Image.new("RGB", (64, 64)).save(image)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 64 x 64 = 4096 > 2 x 1000
    (r,) = flowrl_cli.in_process([["reward", "score", "area", "--images", str(image), "--prompt", "x"]], cwd=tmp_path)
    one_message(r, f"cannot read the image {image}", "decompression bomb")


def test_profile_compare_and_reward_score_refuse_before_their_work(trained, tmp_path, flowrl_cli, monkeypatch):
    """``profile --compare`` of a run without a checkpoint refused only after profiling the base
    model; ``reward score --json`` into a directory, only after scoring every image."""
    from PIL import Image

    from flowrl.commands import reward_score
    from flowrl.train import session

    recipe, _, _ = trained
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(recipe, bare / "recipe.toml")
    image = tmp_path / "a.png"
    Image.new("RGB", (8, 8)).save(image)
    work = AssertionError("the work started before the refusal")
    monkeypatch.setattr(session.Session, "open", lambda *a, **k: (_ for _ in ()).throw(work))
    monkeypatch.setattr(reward_score, "score_files", lambda *a, **k: (_ for _ in ()).throw(work))
    results = flowrl_cli.in_process([["profile", "--compare", str(bare)],
                                     ["reward", "score", "area", "--images", str(image), "--prompt", "x",
                                      "--json", str(tmp_path)]], cwd=tmp_path)
    one_message(results[0], f"{bare} has no checkpoint")
    one_message(results[1], "is a directory; a file path is expected")


def test_prompts_a_reward_cannot_score_are_refused_before_sampling(trained, tmp_path, flowrl_cli, monkeypatch):
    """``eval -p`` and ``sample --tables -p`` with a prompt outside the embedded grammar: a
    ValueError traceback from the reward, after every image was sampled (and, for sample, written)."""
    from flowrl.commands import inference

    _, run_dir, _ = trained
    monkeypatch.setattr(inference, "generate", lambda *a, **k: (_ for _ in ()).throw(AssertionError("sampled")))
    results = flowrl_cli.in_process([
        ["eval", str(run_dir), "-p", "a red circle", "--seeds", "1", "-o", str(tmp_path / "e.json"), "--device", "cpu"],
        ["sample", str(run_dir), "-p", "a red circle", "--tables", "--steps", "2", "-o", str(tmp_path / "s"),
         "--device", "cpu"]], cwd=tmp_path)
    for r in results:
        one_message(r, "cannot score the prompt 'a red circle'", "not a prompt of the grammar")
    assert not (tmp_path / "e.json").exists() and not (tmp_path / "s" / "samples.jsonl").exists()


def test_embed_refuses_its_prompt_files_and_output_before_loading_the_model(trained, tmp_path, flowrl_cli, monkeypatch):
    """An empty ``--prompts`` file and an ``-o`` under a regular file were refused only after the
    model loaded (seconds here, minutes for FLUX), the second as "File exists"."""
    from flowrl.train import session

    recipe, _, _ = trained
    monkeypatch.setattr(session.Session, "open", lambda *a, **k: pytest.fail("the model loaded first"))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    results = flowrl_cli.in_process([["embed", str(recipe), "-o", str(tmp_path / "emb"), "--prompts", str(empty)],
                                     ["embed", str(recipe), "-o", str(a_file / "sub")]], cwd=tmp_path)
    one_message(results[0], str(empty))
    one_message(results[1], "afile")
    assert "File exists" not in results[1].stderr and not (tmp_path / "emb").exists()


@pytest.mark.parametrize("value", ["inf", "1e308"])
def test_validate_bounds_the_gpu_memory_as_plan_does(trained, value, flowrl_cli):
    recipe, _, _ = trained
    (r,) = flowrl_cli.in_process([["validate", str(recipe), "--gpu-memory", value]])
    assert r.returncode == 2 and "--gpu-memory" in r.stderr and "Traceback" not in r.stderr, r.stderr
