"""`flowrl eval --suite ocr|drawbench|geneval` for any model (flowrl/suites.py): each benchmark's
prompts, sampling settings, scorer and table, end to end on the embedded model with a few prompts
(`--limit`), for a registered model, a run and a checkpoint; and one clear message for a
missing prompt file, a missing extra, missing reward weights and an unknown suite.

The embedded model samples 32x32 images, so the numbers mean nothing: what is tested is what is
sampled, how it is scored and how it is tabulated."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest

from flowrl import suites

REPO = Path(__file__).resolve().parents[2]
#: a DrawBench-format table (scripts/fetch_prompt_sets.py writes prompt,split,category)
FAKE_DRAWBENCH = ("prompt,split,category\n"
                  "a red circle on a blue background,test,Colors\n"
                  "a green square on a white background,test,Counting\n"
                  "a blue triangle on a black background,test,Colors\n")


def _cli(flowrl_cli, argv, cwd=None) -> tuple[int, str, str]:
    (result,) = flowrl_cli.in_process([[str(a) for a in argv]], cwd=cwd or Path.cwd())
    return result.returncode, result.stdout, result.stderr


def _refused(code, err, *phrases) -> None:
    assert code != 0 and "Traceback" not in err, err
    flat = " ".join(err.split())
    for phrase in phrases:
        assert phrase in flat, err


@pytest.fixture
def no_fetched_drawbench(monkeypatch):
    """DrawBench looked for only where the current directory keeps it (data/prompts/drawbench.csv),
    not in this checkout's data/prompts/ too, which may hold a fetched copy."""
    import dataclasses

    only_here = dataclasses.replace(suites.SUITES["drawbench"], files=lambda: [suites.FETCHED / "drawbench.csv"])
    monkeypatch.setitem(suites.SUITES, "drawbench", only_here)


def few_steps(monkeypatch, name: str, steps: int = 3) -> None:
    """The suite sampled at ``steps`` (its own 40 cost minutes on a loaded 2-core machine)."""
    import dataclasses

    spec = suites.SUITES[name]
    monkeypatch.setitem(suites.SUITES, name, dataclasses.replace(spec, sampling=dataclasses.replace(spec.sampling,
                                                                                                  steps=steps)))


def test_the_registered_suites_state_their_benchmarks_settings():
    ocr, drawbench, geneval = (suites.SUITES[n] for n in ("ocr", "drawbench", "geneval"))
    for spec in (ocr, drawbench, geneval):  # Flow-GRPO's SD3.5-M evaluation
        assert (spec.sampling.steps, spec.sampling.height, spec.sampling.width, spec.sampling.guidance) == (40, 512, 512, 4.5)
        assert "flow_grpo" in spec.sampling.source
    assert (ocr.sampling.images_per_prompt, drawbench.sampling.images_per_prompt,
            geneval.sampling.images_per_prompt) == (1, 5, 4)
    assert (ocr.reward, drawbench.reward, geneval.reward) == ("ocr", "pickscore", "geneval")
    assert drawbench.choose_reward and not ocr.choose_reward and not geneval.choose_reward
    _, prompts, categories = ocr.load()
    assert len(prompts) == 1018 and set(categories) == {None}
    _, prompts, categories = geneval.load()
    assert len(prompts) == 553 and len(set(categories)) == 6


def test_ocr_suite_samples_flow_grpos_test_prompts_and_scores_them_with_the_ocr_reward(flowrl_cli, tmp_path,
                                                                                        monkeypatch):
    pytest.importorskip("rapidocr_onnxruntime")
    few_steps(monkeypatch, "ocr")
    code, out, err = _cli(flowrl_cli, ["eval", "--model", "embedded", "--suite", "ocr", "--limit", "2",
                                       "-o", tmp_path / "ocr.json"])
    assert code == 0, err
    result = json.loads((tmp_path / "ocr.json").read_text())
    first = (REPO / "recipes/prompts/benchmarks/ocr_test.txt").read_text(encoding="utf-8").splitlines()[:2]
    assert [r["prompt"] for r in result["per_image"]] == first  # one image a prompt, in the file's order
    assert result["categories"] == {} and result["overall"]["n"] == 2
    scores = [r["score"] for r in result["per_image"]]
    assert all(0.0 <= s <= 1.0 for s in scores)
    assert result["overall"]["mean"] == pytest.approx(sum(scores) / 2)
    assert result["exact_match"]["mean"] == pytest.approx(sum(s == 1.0 for s in scores) / 2)
    settings = result["settings"]
    assert settings["steps"] == 3 and settings["limit"] == 2 and settings["reward"]["use"] == "ocr"  # the suite's steps
    assert settings["benchmark"] | {"source": None} == {"images_per_prompt": 1, "steps": 3, "height": 512,
                                                       "width": 512, "guidance": 4.5, "source": None}
    assert settings["model_sampling"] == {"height": 32, "width": 32, "guidance": None}
    flat = " ".join(out.split())
    assert "exact match" in flat and "overall" in flat
    assert "note: the benchmark samples at 512x512 with guidance 4.5, this model at 32x32 with no guidance" in flat


def test_drawbench_reads_the_fetched_table_and_tabulates_the_chosen_reward_per_category(flowrl_cli, tmp_path,
                                                                                        no_fetched_drawbench):
    fetched = tmp_path / "data" / "prompts" / "drawbench.csv"  # where scripts/fetch_prompt_sets.py writes
    fetched.parent.mkdir(parents=True)
    fetched.write_text(FAKE_DRAWBENCH, encoding="utf-8")
    code, out, err = _cli(flowrl_cli, ["eval", "--model", "embedded", "--suite", "drawbench", "--reward", "brightness",
                                       "--steps", "4", "-o", "db.json"], cwd=tmp_path)
    assert code == 0, err
    result = json.loads((tmp_path / "db.json").read_text())
    records = result["per_image"]
    assert len(records) == 15 and result["settings"]["benchmark"]["images_per_prompt"] == 5  # 3 prompts x 5
    assert list(result["categories"]) == ["Colors", "Counting"]
    for category, n in (("Colors", 10), ("Counting", 5)):
        values = [r["score"] for r in records if r["category"] == category]
        row = result["categories"][category]
        mean = sum(values) / n
        sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
        assert row["n"] == n and row["mean"] == pytest.approx(mean) and row["sem"] == pytest.approx(sd / math.sqrt(n))
    assert result["overall"]["n"] == 15
    assert result["overall"]["mean"] == pytest.approx(sum(r["score"] for r in records) / 15)  # over images
    assert result["settings"]["prompt_file"] == str(fetched.resolve())
    assert result["settings"]["reward"] == {"use": "brightness", "settings": {}} and result["settings"]["steps"] == 4
    assert "Counting" in out and "overall" in out


def test_a_suite_of_a_run_and_of_a_checkpoint_is_written_beside_the_checkpoint(flowrl_cli, tmp_path):
    import os

    from rich.console import Console
    from tiny_recipe import CLI, tiny_recipe

    from flowrl.recipe import load_recipe
    from flowrl.train import train

    (tmp_path / "recipe.toml").write_text(tiny_recipe(CLI, run={"name": "suites"}), encoding="utf-8")
    recipe = load_recipe(tmp_path / "recipe.toml", [f"run.output_dir={json.dumps(str(tmp_path / 'run'))}"])
    with open(os.devnull, "w") as quiet:
        run = train(recipe, console=Console(file=quiet, width=200))
    (tmp_path / "db.csv").write_text(FAKE_DRAWBENCH, encoding="utf-8")
    argv = ["eval", run, "--suite", "drawbench", "--suite-prompts", tmp_path / "db.csv", "--reward", "brightness",
            "--steps", "2", "--limit", "1"]
    code, _, err = _cli(flowrl_cli, argv)
    assert code == 0, err
    # not the default reward, a part of the suite: both in the name, beside the checkpoint
    result = json.loads((run / "checkpoints" / "iter_000001.drawbench-brightness-first1.json").read_text())
    assert result["iteration"] == 1 and result["overall"]["n"] == 5 and result["settings"]["model"] == "embedded"
    code, _, err = _cli(flowrl_cli, [*argv[:1], run / "checkpoints" / "iter_000001", *argv[2:], "--name", "db"])
    assert code == 0, err
    again = json.loads((run / "checkpoints" / "iter_000001.db.json").read_text())
    assert again["per_image"] == result["per_image"]  # the same checkpoint, the same noise


def build_tiny_owlv2(directory: Path) -> Path:
    """A random OWLv2 with its processor saved like a hub checkpoint (the geneval reward tests' own)."""
    import torch
    from transformers import CLIPTokenizer, Owlv2Config, Owlv2ForObjectDetection, Owlv2ImageProcessor, Owlv2Processor

    from flowrl.testing.tiny_models import write_clip_tokenizer

    vocab = write_clip_tokenizer(directory / "tok")
    tok = CLIPTokenizer(str(directory / "tok" / "vocab.json"), str(directory / "tok" / "merges.txt"))
    tok.model_max_length = 64
    text = {"vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "max_position_embeddings": 64, "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
              "image_size": 64, "patch_size": 16}
    torch.manual_seed(0)
    Owlv2ForObjectDetection(Owlv2Config(text_config=text, vision_config=vision, projection_dim=32)).save_pretrained(directory)
    Owlv2Processor(image_processor=Owlv2ImageProcessor(size={"height": 64, "width": 64}),
                   tokenizer=tok).save_pretrained(directory)
    return directory


def test_geneval_for_any_model_is_genevals_table_from_the_geneval_reward(flowrl_cli, tmp_path):
    pytest.importorskip("transformers")
    from flowrl.compat import ensure_torchvision_importable
    from flowrl.testing.tiny_models import build_tiny_clip

    ensure_torchvision_importable()
    owl = build_tiny_owlv2(tmp_path / "owl")
    clip = build_tiny_clip(tmp_path / "clip", image_size=32, seed=0)
    code, out, err = _cli(flowrl_cli, ["eval", "--model", "embedded", "--suite", "geneval", "--limit", "2",
                                       "--steps", "2", "--reward-set", f"detector={json.dumps(str(owl))}",
                                       "--reward-set", f"clip={json.dumps(str(clip))}", "-o", tmp_path / "g.json"])
    assert code == 0, err
    result = json.loads((tmp_path / "g.json").read_text())
    assert len(result["per_image"]) == 8  # GenEval's four images a prompt
    assert {r["seed_index"] for r in result["per_image"]} == {0, 1, 2, 3}
    assert list(result["categories"]) == ["single_object"] and result["overall"]["n"] == 8
    assert all(r["strict"] == (r["soft"] == 1.0) for r in result["per_image"])
    assert result["settings"]["reward"]["settings"]["mode"] == "strict"
    assert result["settings"]["reward"]["settings"]["metadata"].endswith("geneval.jsonl")
    assert "single_object" in out and "mean of the categories" in out


def test_refusals_are_one_message_each(flowrl_cli, tmp_path, monkeypatch, no_fetched_drawbench):
    out = tmp_path / "x.json"
    model = ["eval", "--model", "embedded"]
    # DrawBench not fetched: the message names the fetch command and the option
    code, _, err = _cli(flowrl_cli, [*model, "--suite", "drawbench", "-o", out], cwd=tmp_path)
    _refused(code, err, "python scripts/fetch_prompt_sets.py drawbench", "--suite-prompts",
             str(Path("data") / "prompts" / "drawbench.csv"))
    code, _, err = _cli(flowrl_cli, [*model, "--suite", "drawbench", "--suite-prompts", tmp_path / "nope.csv", "-o", out])
    _refused(code, err, "prompt file not found")
    # an unknown suite, for a model that carries none and for one that carries suites
    code, _, err = _cli(flowrl_cli, [*model, "--suite", "drawbnech", "-o", out])
    _refused(code, err, "unknown suite 'drawbnech'", "did you mean 'drawbench'?", "geneval", "ocr")
    code, _, err = _cli(flowrl_cli, ["eval", "--model", "embedded_compose", "--suite", "nope", "-o", out])
    _refused(code, err, "unknown suite 'nope'", "model 'embedded_compose' carries none by that name")
    # the suite's scorer is fixed (ocr), or takes one reward (drawbench); reward settings are checked
    code, _, err = _cli(flowrl_cli, [*model, "--suite", "ocr", "--reward", "area", "-o", out])
    _refused(code, err, "--reward cannot be combined")
    (tmp_path / "db.csv").write_text(FAKE_DRAWBENCH, encoding="utf-8")
    db = ["--suite", "drawbench", "--suite-prompts", tmp_path / "db.csv"]
    code, _, err = _cli(flowrl_cli, [*model, *db, "--reward", "area", "--reward", "brightness", "-o", out])
    _refused(code, err, "scored by one reward")
    code, _, err = _cli(flowrl_cli, [*model, *db, "--reward", "embedded_clip", "--reward-set", "colour=1", "-o", out])
    _refused(code, err, "unknown key 'colour'")
    # suite options without a suite
    code, _, err = _cli(flowrl_cli, [*model, "--reward", "area", "--limit", "2", "-o", out])
    _refused(code, err, "--limit only applies with --suite")
    # geneval on a model that carries no GenEval: the reward's weights are the user's
    code, _, err = _cli(flowrl_cli, [*model, "--suite", "geneval", "-o", out])
    _refused(code, err, "carries no 'geneval' suite", "--reward-set detector=DIR", "--reward-set clip=DIR")
    # the ocr extra missing (hidden as a missing package is): one message naming the extra
    monkeypatch.setitem(sys.modules, "rapidocr_onnxruntime", None)
    code, _, err = _cli(flowrl_cli, [*model, "--suite", "ocr", "-o", out])
    _refused(code, err, "'rapidocr_onnxruntime', which is not installed", 'pip install "flowrl-diffusion[ocr]"')
    assert not out.exists()


def doc_suite_commands() -> list[list[str]]:
    """The command lines of the code blocks of docs/models.md's section "Benchmark suites"."""
    text = (REPO / "docs" / "models.md").read_text(encoding="utf-8")
    section = text.split("### Benchmark suites", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.DOTALL)
    return [line.split() for block in blocks for line in block.splitlines() if line.strip()]


def test_docs_suite_commands_name_real_options_and_the_smoke_run_runs_as_written(flowrl_cli, tmp_path, monkeypatch):
    import typer

    from flowrl import cli  # noqa: F401  (registers every command)
    from flowrl.commands.base import app

    commands = doc_suite_commands()
    assert ["python", "scripts/fetch_prompt_sets.py", "drawbench"] in commands
    evals = [c[2:] for c in commands if c[:2] == ["flowrl", "eval"]]
    assert len(evals) == len(commands) - 1 >= 5
    options = {o for p in typer.main.get_command(app).commands["eval"].params for o in p.opts}
    for argv in evals:
        assert {t for t in argv if t.startswith("-")} <= options, argv
        assert argv[argv.index("--suite") + 1] in suites.SUITES, argv
    assert {a[a.index("--suite") + 1] for a in evals} == set(suites.SUITES)
    # the real models' runs cannot run here; the smoke run of the embedded model does, as written
    smoke = [a for a in evals if "embedded" in a]
    assert smoke == [["--model", "embedded", "--suite", "ocr", "--limit", "2", "-o", "ocr_smoke.json"]]
    pytest.importorskip("rapidocr_onnxruntime")
    few_steps(monkeypatch, "ocr")
    code, _, err = _cli(flowrl_cli, ["eval", *smoke[0]], cwd=tmp_path)
    assert code == 0, err
    assert json.loads((tmp_path / "ocr_smoke.json").read_text())["overall"]["n"] == 2
