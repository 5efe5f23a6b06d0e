"""What a new user meets on the command line: `flowrl eval`, help and --debug, resume and overwrite
messages, `validate --explain`, export and the hub export.

One tiny run of the embedded model (2 iterations, evaluated before every iteration and at the
end, a checkpoint per iteration) is trained once; every command line below runs against it in
one interpreter (``flowrl_cli.batch``).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from tiny_recipe import tiny_recipe

from flowrl import cli
from flowrl.recipe import dump_toml, load_recipe
from flowrl.runlog import read_metrics
from flowrl.train.run_dir import recipe_differences

REPO = Path(__file__).resolve().parents[1]
QUICK = REPO / "recipes" / "quickstart_hacking.toml"

# eval_steps: more than the rollouts' 5, so `flowrl eval` must reproduce the run's own
TINY = tiny_recipe(run={"name": "ux", "seed": 11}, model={"random_init": None},
                   prompts={"num_eval": 3, "eval_seeds": 2}, log={"eval_every": 1, "eval_steps": 9},
                   checkpoint={"every": 1, "keep_last": 3},
                   rewards=[{"use": "area"}, {"use": "verifier", "weight": 0.0}])


def quiet():
    import os

    from rich.console import Console

    return Console(file=open(os.devnull, "w"), width=200)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from flowrl.train import train

    root = tmp_path_factory.mktemp("ux")
    recipe = root / "tiny.toml"
    recipe.write_text(TINY)
    run_dir = train(load_recipe(recipe, [f"run.output_dir={json.dumps(str(root / 'run'))}"]), console=quiet())
    return root, recipe, run_dir


@pytest.fixture(scope="module")
def results(tiny_run, flowrl_cli):
    root, recipe, run = tiny_run
    not_a_run = root / "not_a_run"
    not_a_run.mkdir()
    (not_a_run / "notes.txt").write_text("hello")
    old_metrics = root / "old_metrics"
    old_metrics.mkdir()
    (old_metrics / "metrics.jsonl").write_text('{"iteration": 0, "reward/area/mean": 0.123}\n')
    overwritten = root / "overwritten"
    overwritten.mkdir()
    (overwritten / "metrics.jsonl").write_text('{"iteration": 0, "reward/area/mean": 0.123}\n')
    (overwritten / "mine.txt").write_text("not flowrl's")
    calls = {
        "eval_default": ["eval", str(run)],
        "eval_iter1": ["eval", str(run), "--checkpoint", str(run / "checkpoints" / "iter_000001"), "-o", str(root / "e1.json")],
        "eval_explicit": ["eval", str(run), "--num-prompts", "2", "-o", str(root / "explicit.json")],
        "eval_nothing": ["eval"],
        "eval_model_only": ["eval", "--model", "embedded"],
        "eval_recipe_no_o": ["eval", str(recipe)],
        "merge_full": ["export", str(run), "--merge"],
        "hub_dry_run": ["export", str(run), "-o", str(root / "hub"), "--push-to-hub", "me/tiny-rl", "--dry-run"],
        "private_alone": ["export", str(run), "--private"],
        "resume_missing": ["train", "--resume", str(root / "nope")],
        "resume_not_a_run": ["train", "--resume", str(not_a_run)],
        "resume_checkpoint": ["train", "--resume", str(run / "checkpoints" / "iter_000002")],
        "resume_changed": ["train", "--resume", str(run), "--set", "train.lr=0.5", "--set", "rewards.1.weight=0.25",
                           "--set", "train.iterations=3"],
        "resume_overwrite": ["train", "--resume", str(run), "--overwrite"],
        "old_metrics": ["train", str(recipe), "-o", str(old_metrics)],
        "old_checkpoints": ["train", str(recipe), "-o", str(run)],
        "overwrite": ["train", str(recipe), "-o", str(overwritten), "--overwrite", "--set", "train.iterations=1",
                      "--set", "prompts.num_eval=0"],
        "explain": ["validate", "--explain"],
        "markdown": ["validate", "--explain", "--markdown"],
        "version": ["--version"],
        "debug_after": ["validate", str(REPO / "tests/fixtures/recipes/wrong_type.toml"), "--debug"],
        "debug_after_ok": ["plugins", "--debug"],
        "serve_unknown": ["reward", "serve", "nosuch"],
        "help_root": ["--help"],
    }
    import typer.main

    from flowrl.commands.base import app

    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        calls[f"help_{name}"] = [name, "--help"]
        for sub in getattr(command, "commands", {}):
            calls[f"help_{name}_{sub}"] = [name, sub, "--help"]
    out = dict(zip(calls, flowrl_cli.batch(list(calls.values()), timeout=600)))
    out["paths"] = {"root": root, "run": run, "old_metrics": old_metrics, "overwritten": overwritten}
    return out


def one_error(r, *fragments):
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert sum(line.startswith("error:") for line in r.stderr.splitlines()) == 1, r.stderr
    for fragment in fragments:
        assert fragment in r.flat_err, f"{fragment!r} not in {r.flat_err!r}"


# ----------------------------------------------------------------------- finding 2: eval = the run's evaluation


@pytest.mark.slow
def test_eval_reproduces_the_runs_own_final_evaluation(results, tiny_run):
    _, _, run = tiny_run
    r = results["eval_default"]
    assert r.returncode == 0, r.stderr
    rows = read_metrics(run)
    final = [row for row in rows if row.get("final")]
    assert len(final) == 1 and final[0]["iteration"] == 2
    result = json.loads((run / "checkpoints" / "iter_000002.eval.json").read_text())
    assert result["iteration"] == 2 and result["settings"]["protocol"] == "run"
    assert result["settings"]["steps"] == 9  # [log].eval_steps, which the run's evaluation used
    assert result["settings"]["num_prompts"] == 3 and result["settings"]["seeds_per_prompt"] == 2
    for label in ("area", "verifier"):
        assert result["rewards"][label]["n"] == 6
        assert result["rewards"][label]["mean"] == pytest.approx(final[0][f"eval/{label}/mean"], rel=1e-6, abs=1e-7)
        assert result["rewards"][label]["sem"] == pytest.approx(final[0][f"eval/{label}/sem"], rel=1e-5, abs=1e-7)
    # the prompts are the run's seeded evaluation subset, not the first prompts of the pool
    prompts = [p["prompt"] for p in result["per_image"]]
    assert len(set(prompts)) == 3 and prompts[:3] == prompts[3:]


@pytest.mark.slow
def test_eval_at_an_earlier_checkpoint_equals_that_iterations_row(results, tiny_run):
    root, _, run = tiny_run
    assert results["eval_iter1"].returncode == 0, results["eval_iter1"].stderr
    result = json.loads((root / "e1.json").read_text())
    row = next(r for r in read_metrics(run) if r["iteration"] == 1 and not r.get("final"))
    assert result["iteration"] == 1
    assert result["rewards"]["area"]["mean"] == pytest.approx(row["eval/area/mean"], rel=1e-6, abs=1e-7)


@pytest.mark.slow
def test_eval_with_explicit_prompts_keeps_sampling_as_before(results, tiny_run):
    root, _, _ = tiny_run
    assert results["eval_explicit"].returncode == 0, results["eval_explicit"].stderr
    result = json.loads((root / "explicit.json").read_text())
    assert result["settings"]["protocol"] == "explicit"
    assert result["settings"]["num_prompts"] == 2 and result["settings"]["seeds_per_prompt"] == 1
    assert result["rewards"]["area"]["n"] == 2


# ----------------------------------------------------------------------- finding 16: eval's missing arguments at once


@pytest.mark.slow
def test_eval_reports_every_missing_argument_at_once(results):
    one_error(results["eval_nothing"], "eval is missing 1 argument(s)", "SOURCE or --model NAME")
    one_error(results["eval_model_only"], "eval is missing 2 argument(s)", "--reward NAME", "-o PATH")
    one_error(results["eval_recipe_no_o"], "eval is missing 1 argument(s)", "-o PATH", "pass -o")


# ----------------------------------------------------------------------- finding 16: export --merge, --version, help


@pytest.mark.slow
def test_export_merge_of_a_full_fine_tune_is_an_error(results):
    one_error(results["merge_full"], "--merge", "finetune = 'full'", "nothing to merge", "export without --merge")


@pytest.mark.slow
def test_version(results):
    from importlib import metadata

    r = results["version"]
    assert r.returncode == 0 and r.stdout.strip() == f"flowrl {metadata.version('flowrl-diffusion')}"


@pytest.mark.slow
def test_help_shows_no_value_type_after_plain_flags(results):
    helps = {k: v for k, v in results.items() if k.startswith("help_")}
    assert {"help_root", "help_train", "help_eval", "help_export", "help_reward_serve"} <= set(helps)
    for name, r in helps.items():
        assert r.returncode == 0, (name, r.stderr)
        assert "<bool>" not in r.stdout, f"{name}: {r.stdout}"
    assert "--dry-run" in results["help_train"].stdout and "--overwrite" in results["help_train"].stdout
    assert "<path>" in results["help_train"].stdout  # options that take a value still show its type
    assert "flowrl-diffusion[fleet]" in results["help_reward_serve"].flat_out  # not eaten as markup


@pytest.mark.slow
def test_reward_serve_names_the_argument(results):
    one_error(results["serve_unknown"], "flowrl reward serve NAME: unknown reward 'nosuch'")
    assert "serve.use" not in results["serve_unknown"].stderr


# ----------------------------------------------------------------------- finding 4: --debug anywhere


@pytest.mark.slow
def test_debug_after_the_subcommand(results):
    r = results["debug_after"]
    assert r.returncode != 0
    assert "NoSuchOption" not in r.stderr and "No such option" not in r.stderr
    assert "Traceback" in r.stderr and "RecipeError" in r.stderr
    assert results["debug_after_ok"].returncode == 0, results["debug_after_ok"].stderr


def test_hoist_debug_moves_only_the_flag_before_a_double_dash():
    assert cli.hoist_debug(["train", "x.toml", "--debug"]) == (["--debug", "train", "x.toml"], True)
    assert cli.hoist_debug(["plugins"]) == (["plugins"], False)
    assert cli.hoist_debug(["sample", "--", "--debug"]) == (["sample", "--", "--debug"], False)


# ----------------------------------------------------------------------- finding 9: --resume


@pytest.mark.slow
def test_resume_of_something_that_is_not_a_run_directory(results, tiny_run):
    one_error(results["resume_missing"], "cannot resume", "does not exist", "a run directory is what `flowrl train` writes")
    one_error(results["resume_not_a_run"], "is not a run directory (it has no recipe.toml)", "checkpoints/iter_NNNNNN/")
    one_error(results["resume_checkpoint"], "is a checkpoint directory, not a run directory", "pass the run directory")
    for key in ("resume_missing", "resume_not_a_run", "resume_checkpoint"):
        assert "recipe file not found" not in results[key].flat_err


@pytest.mark.slow
def test_resume_with_a_changed_recipe_names_keys_and_values(results):
    r = results["resume_changed"]
    one_error(r, "differs from the one that started", "2 key(s)", "[train].lr: 1e-05 in the run, 0.5 now",
              "[[rewards]] #2.weight: 0.0 in the run, 0.25 now")
    assert "[train].iterations" not in r.flat_err  # iterations may change


def test_recipe_differences_of_tables_and_arrays_of_tables():
    old = {"train": {"lr": 0.1, "group_size": 8}, "rewards": [{"use": "area", "weight": 1.0}]}
    new = {"train": {"lr": 0.1, "group_size": 4, "extra": True},
           "rewards": [{"use": "area", "weight": 1.0}, {"use": "verifier", "weight": 0.5}]}
    assert recipe_differences(old, new) == [
        ("[train].group_size", "8", "4"),
        ("[train].extra", "(absent)", "true"),
        ("[[rewards]] #2.use", "(absent)", '"verifier"'),
        ("[[rewards]] #2.weight", "(absent)", "0.5"),
    ]


# ----------------------------------------------------------------------- finding 14: --overwrite


@pytest.mark.slow
def test_training_over_old_metrics_is_refused(results):
    paths = results["paths"]
    one_error(results["old_metrics"], "already holds the metrics.jsonl of an earlier run", "--overwrite")
    assert (paths["old_metrics"] / "metrics.jsonl").read_text() == '{"iteration": 0, "reward/area/mean": 0.123}\n'
    one_error(results["old_checkpoints"], "already holds a run with checkpoints", "--resume", "--overwrite")
    one_error(results["resume_overwrite"], "--overwrite starts afresh and --resume continues")


@pytest.mark.slow
def test_overwrite_replaces_the_earlier_run_only(results):
    paths = results["paths"]
    r = results["overwrite"]
    assert r.returncode == 0, r.stderr
    assert "removed the earlier run's metrics.jsonl" in r.flat_out
    rows = read_metrics(paths["overwritten"])
    assert [row["iteration"] for row in rows] == [0] and rows[0]["reward/area/mean"] != 0.123
    assert (paths["overwritten"] / "mine.txt").read_text() == "not flowrl's"  # not a file flowrl writes


# ----------------------------------------------------------------------- finding 10: --explain


@pytest.mark.slow
def test_explain_documents_reward_entry_keys_and_does_not_wrap_keys_when_piped(results):
    r = results["explain"]
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "[[rewards]] (every entry)" in r.stdout
    for key in ("weight", "name", "chunk_weights", "prompts_per_iteration", "optimizer_steps_per_update",
                "on_policy_tolerance", "same_noise_in_group"):
        assert any(re.match(rf"│ {key}\s+│", line) for line in lines), f"key {key} is not on one line"
    assert results["markdown"].stdout == (REPO / "docs" / "reference.md").read_text(encoding="utf-8")


# ----------------------------------------------------------------------- hub export


@pytest.mark.slow
def test_hub_dry_run_writes_the_folder_with_a_model_card(results):
    r = results["hub_dry_run"]
    assert r.returncode == 0, r.stderr
    folder = results["paths"]["root"] / "hub"
    assert "would push" in r.flat_out and "me/tiny-rl" in r.flat_out
    card = (folder / "README.md").read_text()
    assert card.startswith("---\n") and "pipeline_tag: text-to-image" in card
    assert "GRPO on fixed chunks" in card and "arXiv:2510.21583" in card
    assert "| area |" in card and "iteration 0" in card and "iteration 2" in card
    assert "![reward curves](rewards.png)" in card and (folder / "rewards.png").is_file()
    assert (folder / "recipe.toml").is_file() and 'use = "area"' in card
    assert json.loads((folder / "flowrl_export.json").read_text())["iteration"] == 2
    one_error(results["private_alone"], "--private applies to --push-to-hub")


@pytest.mark.slow
def test_write_card_without_matplotlib(tmp_path, tiny_run, monkeypatch):
    """The card is written without the figure when matplotlib is missing."""
    import sys

    from flowrl.hub import write_card

    _, _, run = tiny_run
    (tmp_path / "flowrl_export.json").write_text(json.dumps({
        "format": "state_dict", "model": "embedded", "base": None, "finetune": "full", "iteration": 2}))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    written = write_card(tmp_path, "me/x", load_recipe(run / "recipe.toml"), run)
    assert written == ["recipe.toml", "README.md"] and not (tmp_path / "rewards.png").exists()
    assert "rewards.png" not in (tmp_path / "README.md").read_text()


@pytest.mark.slow
def test_changed_recipe_of_copy(tiny_run, tmp_path):
    """check_resumable_recipe compares resolved recipes: an identical copy of the run's recipe passes."""
    from flowrl.plugins import get_registry
    from flowrl.train.run_dir import check_resumable_recipe

    _, _, run = tiny_run
    copy = tmp_path / "run"
    copy.mkdir()
    shutil.copy(run / "recipe.toml", copy / "recipe.toml")
    recipe = load_recipe(copy / "recipe.toml", ["train.iterations=9", "log.every=2"])
    check_resumable_recipe(recipe, copy, get_registry())  # no error: only what may change changed
    (copy / "recipe.toml").write_text(dump_toml(load_recipe(copy / "recipe.toml", ["sampler.steps=9"]).to_toml_dict()))
    with pytest.raises(Exception, match=r"\[sampler\]\.steps: 9 in the run, 5 now"):
        check_resumable_recipe(recipe, copy, get_registry())


class StandInHub:
    """A local stand-in for the three endpoints of the Hugging Face hub API that an upload uses
    (create a repository, validate the card's YAML, pre-upload, commit); files arrive inline
    ("regular" upload mode) and are kept in ``files``."""

    def __init__(self):
        import base64
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        hub = self
        self.files: dict[str, bytes] = {}
        self.requests: list[tuple[str, str, dict]] = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                path = self.path.split("?")[0]
                hub.requests.append((self.command, path, {k.lower(): v for k, v in self.headers.items()}))
                base = f"http://127.0.0.1:{self.server.server_port}"
                if path == "/api/repos/create":
                    d = json.loads(body)
                    hub.created = d
                    return self.reply(200, {"url": f"{base}/{d['organization']}/{d['name']}"})
                if path == "/api/validate-yaml":
                    return self.reply(200, {"errors": [], "warnings": []})
                if "/preupload/" in path:
                    files = json.loads(body)["files"]
                    return self.reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                                      for f in files]})
                if "/commit/" in path:
                    for line in body.decode().splitlines():
                        entry = json.loads(line)
                        if entry["key"] == "file":
                            hub.files[entry["value"]["path"]] = base64.b64decode(entry["value"]["content"])
                    hub.commit_header = json.loads(body.decode().splitlines()[0])["value"]
                    return self.reply(200, {"commitUrl": f"{base}/me/tiny-rl/commit/{'1' * 40}", "commitOid": "1" * 40})
                return self.reply(404, {"error": f"the stand-in hub does not serve {path}"})

            do_GET = do_PUT = do_POST

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.slow
def test_push_to_hub_uploads_the_export_through_huggingface_hub(tiny_run, flowrl_cli):
    """The real upload path (huggingface_hub's HfApi: create_repo, upload_folder) against a local
    stand-in of the hub API, from the real console script."""
    import subprocess

    root, _, run = tiny_run
    hub = StandInHub()
    try:
        env = flowrl_cli.env(HF_ENDPOINT=hub.url, HF_TOKEN="hf_stand_in_token", HF_HUB_DISABLE_PROGRESS_BARS="1")
        env.pop("HF_HUB_OFFLINE", None)  # the tiny-pipeline tests set it for the session; this upload is local
        proc = subprocess.run(
            [str(flowrl_cli.script), "export", str(run), "-o", str(root / "pushed"), "--push-to-hub", "me/tiny-rl",
             "--private"], env=env, capture_output=True, text=True, timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        assert {k: hub.created[k] for k in ("name", "organization", "visibility")} == {
            "name": "tiny-rl", "organization": "me", "visibility": "private"}
        assert any(h.get("authorization") == "Bearer hf_stand_in_token" for _, _, h in hub.requests)
        assert "iteration 2" in hub.commit_header["summary"]
        local = {p.relative_to(root / "pushed").as_posix(): p.read_bytes() for p in (root / "pushed").rglob("*") if p.is_file()}
        assert set(hub.files) == set(local) and all(hub.files[k] == v for k, v in local.items())
        assert {"README.md", "recipe.toml", "rewards.png", "flowrl_export.json"} <= set(hub.files)
        assert any(name.endswith(".safetensors") for name in hub.files)  # the weights themselves
        assert "pushed to me/tiny-rl" in " ".join(proc.stdout.split())
        # a hub that refuses (here: an unknown endpoint) is one clear error, the folder stays on disk
        env["HF_ENDPOINT"] = hub.url + "/nowhere"
        proc = subprocess.run(
            [str(flowrl_cli.script), "export", str(run), "-o", str(root / "pushed2"), "--push-to-hub", "me/tiny-rl"],
            env=env, capture_output=True, text=True, timeout=300,
        )
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert "pushing" in proc.stderr and "failed" in proc.stderr and (root / "pushed2" / "README.md").is_file()
    finally:
        hub.close()
