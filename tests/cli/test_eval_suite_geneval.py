"""`flowrl eval --suite geneval`: GenEval's table for a short run of recipes/compose_nft.toml and
for the registered model, with docs/compose.md's commands as written, and one clear message where
no suite exists."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from flowrl import geneval
from flowrl_plugins.embedded.compose.model import EmbeddedComposeModel

REPO = Path(__file__).resolve().parents[2]
#: the recipe, one short iteration of it
SHORT = ["train.iterations=1", "train.prompts_per_iteration=2", "train.group_size=2", "train.micro_batch_size=4",
         "sampler.steps=4", "log.eval_steps=0", "prompts.num_eval=2", "prompts.eval_seeds=1", "log.image_every=0",
         "log.progress=false", "checkpoint.every=1", "train.optimizer_steps_per_update=1"]


def doc_commands() -> list[list[str]]:
    """The `flowrl ...` command lines of docs/compose.md's code blocks."""
    text = (REPO / "docs" / "compose.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [line.split()[1:] for block in blocks for line in block.splitlines() if line.startswith("flowrl ")]


def _cli(flowrl_cli, argv) -> tuple[int, str, str]:
    """``flowrl ARGV`` in this process, from the current directory: (exit code, stdout, stderr)."""
    (result,) = flowrl_cli.in_process([argv], cwd=Path.cwd())
    return result.returncode, result.stdout, result.stderr


@pytest.fixture
def small_suite(monkeypatch):
    """The suite's design (every category, images per prompt, the scorer) on 12 images."""
    full = EmbeddedComposeModel.benchmark_suite

    def two_per_category(self, name):
        suite = full(self, name)
        keep = [i for i, c in enumerate(suite.categories) if c not in suite.categories[:i]][:6]
        suite.prompts[:] = [suite.prompts[i] for i in keep]
        suite.categories[:] = [suite.categories[i] for i in keep]
        suite.images_per_prompt[:] = [2] * len(keep)
        return suite

    monkeypatch.setattr(EmbeddedComposeModel, "benchmark_suite", two_per_category)


@pytest.fixture(scope="module")
def compose_run(tmp_path_factory):
    from rich.console import Console

    from flowrl.recipe import load_recipe
    from flowrl.train import train

    root = tmp_path_factory.mktemp("compose_suite")
    recipe = load_recipe(REPO / "recipes" / "compose_nft.toml", [*SHORT, f"run.output_dir={json.dumps(str(root / 'run'))}"])
    return train(recipe, console=Console(file=open(root / "console.txt", "w"), width=200))


def test_suite_of_a_run_writes_genevals_table_beside_its_checkpoint(compose_run, small_suite, flowrl_cli):
    code, out, err = _cli(flowrl_cli, ["eval", str(compose_run), "--suite", "geneval"])
    assert code == 0, err
    result = json.loads((compose_run / "checkpoints" / "iter_000001.geneval.json").read_text())
    assert set(result["categories"]) == set(geneval.TAGS)
    for row in [*result["categories"].values(), result["overall"]]:
        assert set(row) >= {"mean", "sem"} and 0.0 <= row["mean"] <= 1.0
    assert result["categories"]["counting"]["n"] == 2 and len(result["per_image"]) == 12
    means = [row["mean"] for row in result["categories"].values()]
    assert result["overall"]["mean"] == pytest.approx(sum(means) / 6)
    assert all(r["strict"] == (r["soft"] == 1.0) for r in result["per_image"])
    assert result["iteration"] == 1 and result["settings"]["steps"] == 16
    assert "overall" in out and "color_attr" in out


def test_docs_commands_run_as_written(small_suite, flowrl_cli, tmp_path, monkeypatch):
    commands = doc_commands()
    documented = ["eval", "--model", "embedded_compose", "--suite", "geneval", "--seed", "0", "-o", "geneval_base.json"]
    assert documented in commands
    monkeypatch.chdir(tmp_path)
    code, out, err = _cli(flowrl_cli, documented)
    assert code == 0, err
    result = json.loads((tmp_path / "geneval_base.json").read_text())
    assert result["overall"]["n"] == len(result["per_image"]) == 12 and result["checkpoint"] is None


def test_seeds_repeat_the_suite_from_new_noise_and_keep_the_first_pass(small_suite, flowrl_cli, tmp_path):
    argv = ["eval", "--model", "embedded_compose", "--suite", "geneval", "--seed", "3"]
    code, _, err = _cli(flowrl_cli, [*argv, "-o", str(tmp_path / "one.json")])
    assert code == 0, err
    code, _, err = _cli(flowrl_cli, [*argv, "--seeds", "2", "-o", str(tmp_path / "two.json")])
    assert code == 0, err
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert len(two["per_image"]) == 2 * len(one["per_image"]) == 24 and two["settings"]["repeats"] == 2
    assert two["per_image"][:12] == one["per_image"]  # the first pass is the suite's own images
    second = two["per_image"][12:]
    assert [(r["prompt"], r["seed_index"]) for r in second] == [(r["prompt"], r["seed_index"] + 2)
                                                               for r in one["per_image"]]  # new noise indices


def test_docs_training_commands_and_search_overrides_validate_as_written(flowrl_cli, monkeypatch):
    # the recipe trains for minutes: its documented command is dry-run; each row of the search
    # table names overrides of a shipped recipe, which must load as written
    from flowrl.recipe import load_recipe

    trains = [c for c in doc_commands() if c[0] == "train"]
    assert ["train", "recipes/compose_nft.toml"] in trains
    monkeypatch.chdir(REPO)
    for argv in trains:
        code, out, err = _cli(flowrl_cli, [*argv, "--dry-run"])
        assert code == 0, err
    text = (REPO / "docs" / "compose.md").read_text(encoding="utf-8")
    rows = [r for r in text.splitlines() if r.startswith("| ") and ("`train." in r or "`rewards." in r
                                                                     or "`loss." in r or "compose_grpo" in r)]
    assert len(rows) >= 8
    for row in rows:
        cell = row.split(" | ")[1]
        recipe = "recipes/compose_grpo.toml" if "compose_grpo" in cell else "recipes/compose_nft.toml"
        sets = [s for code in re.findall(r"`([^`]*)`", cell) for s in code.split() if "=" in s]
        load_recipe(REPO / recipe, sets)


def test_the_full_suite_and_its_refusals(tmp_path, flowrl_cli):
    from flowrl_plugins.embedded.compose.model import ComposeConfig

    suite = EmbeddedComposeModel(ComposeConfig(random_init=True)).benchmark_suite("geneval")
    per_category = {c: sum(n for n, cat in zip(suite.images_per_prompt, suite.categories) if cat == c)
                    for c in geneval.TAGS}
    assert per_category == {"single_object": 48, "two_object": 48, "counting": 48, "colors": 48, "position": 48,
                            "color_attr": 72}  # every held-out prompt, about 48 images a category
    assert EmbeddedComposeModel(ComposeConfig(random_init=True)).benchmark_suite("ocr") is None

    code, _, err = _cli(flowrl_cli,
                        ["eval", "--model", "embedded", "--suite", "geneval", "-o", str(tmp_path / "x.json")])
    assert code != 0 and "carries no 'geneval' suite" in err and "Traceback" not in err
    code, _, err = _cli(flowrl_cli, ["eval", "--model", "embedded_compose", "--suite", "geneval", "--reward", "area",
                                     "-o", str(tmp_path / "y.json")])
    assert code != 0 and "--reward cannot be combined" in err and "Traceback" not in err
    code, _, err = _cli(flowrl_cli, ["eval", "--model", "embedded_compose", "--suite", "geneval"])
    assert code != 0 and "-o" in err and "Traceback" not in err
    assert not (tmp_path / "x.json").exists() and not (tmp_path / "y.json").exists()
