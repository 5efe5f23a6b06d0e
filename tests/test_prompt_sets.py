"""The standard prompt sets shipped in recipes/prompts/benchmarks/: each loads with the
project's prompt loader with its expected count, is byte for byte the upstream file its README
names, and fits the reward that scores it; the Flow-GRPO recipes that use them validate and plan
within one 80 GB GPU at 8 processes and at 1; scripts/fetch_prompt_sets.py checks and converts
what it fetches (offline here: local inputs only)."""

from __future__ import annotations

import collections
import csv
import hashlib
import json
import re
from pathlib import Path

import pytest
from script_modules import script_module

from flowrl import geneval
from flowrl.plugins import get_registry
from flowrl.prompts import read_prompts
from flowrl.recipe import PromptsConfig

REPO = Path(__file__).resolve().parents[1]
SETS = REPO / "recipes" / "prompts" / "benchmarks"
FLOW_GRPO_RECIPES = sorted((REPO / "recipes").glob("flow_grpo_*.toml"))

#: file -> (prompts, git blob SHA-1 of the upstream file)
SHIPPED = {
    "geneval.jsonl": (553, "efc21c7e639cd45554a1e44fac87157211f16d51"),
    "ocr_test.txt": (1018, "8deb4f8d8f2e863f45353354243669b3c991a6a2"),
    "pickscore_test.txt": (2048, "45f05231b969fb5f74c8debd606b22cd3be27f8e"),
}
GENEVAL_TAGS = {"single_object": 80, "two_object": 99, "counting": 80, "colors": 94, "position": 100, "color_attr": 100}


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.fixture(scope="module")
def fetch():
    yield from script_module("fetch_prompt_sets")


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_each_set_loads_with_the_prompt_loader(name):
    count, _ = SHIPPED[name]
    prompts = read_prompts(str(SETS / name), None, name, PromptsConfig())
    assert len(prompts) == count
    assert len(set(map(str, prompts))) == count  # no prompt twice
    # what a recipe's evaluation draws from it: the whole set with num_eval = count
    assert all(isinstance(p, str) and p == p.strip() and p for p in prompts)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_each_set_is_the_upstream_file_its_readme_names(name):
    _, blob = SHIPPED[name]
    assert git_blob_sha1((SETS / name).read_bytes()) == blob
    readme = (SETS / "README.md").read_text(encoding="utf-8")
    row = next(line for line in readme.splitlines() if line.startswith(f"| `{name}` |"))
    assert blob in row and "MIT" in row


def test_the_readme_carries_both_licence_notices():
    readme = (SETS / "README.md").read_text(encoding="utf-8")
    for holder in ("Copyright (c) 2023 Dhruba Ghosh", "Copyright (c) 2025 Jie Liu"):
        assert readme.count(holder) >= 2, holder  # in the table and above its notice
    assert readme.count("Permission is hereby granted") == 2


def test_geneval_metadata_loads_with_geneval_six_categories():
    records = geneval.load_metadata(SETS / "geneval.jsonl")
    assert len(records) == 553
    assert dict(collections.Counter(r["tag"] for r in records)) == GENEVAL_TAGS
    assert set(GENEVAL_TAGS) == set(geneval.TAGS)
    # the prompt table and the reward's metadata are the same file, in the same order
    prompts = read_prompts(str(SETS / "geneval.jsonl"), None, "w", PromptsConfig())
    assert [str(p) for p in prompts] == [r["prompt"] for r in records]
    # GenEval's counting prompts exclude one more of the class (what its verdict checks)
    for r in records:
        if r["tag"] == "counting":
            (inc,), (exc,) = r["include"], r["exclude"]
            assert exc == {"class": inc["class"], "count": inc["count"] + 1}


def test_every_ocr_prompt_quotes_the_text_the_ocr_reward_reads():
    """The `ocr` reward reads the text between double quotes (ASCII or typographic) and refuses a
    prompt without it; `flowrl validate` runs its accepts_prompt over a recipe's prompt files."""
    accepts = get_registry().get("reward", "ocr").factory.accepts_prompt
    prompts = read_prompts(str(SETS / "ocr_test.txt"), None, "w", PromptsConfig())
    for p in prompts:
        accepts(p)  # raises ValueError for a prompt it cannot score
        assert p.count('"') == 2, p  # exactly one ASCII-quoted span, as Flow-GRPO's split('"')[1] reads
        assert re.search(r'"[^"]*\S[^"]*"', p), p


@pytest.mark.parametrize("path", FLOW_GRPO_RECIPES, ids=lambda p: p.name)
def test_flow_grpo_recipes_validate_and_fit_80_gb_at_8_and_1_processes(path, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from flowrl.commands.base import load, registry
    from flowrl.memory_plan import GB, estimate, peak
    from flowrl.recipe import check_startable

    # the geneval recipes leave the reward's local model directories to their user (required keys)
    local = [f"rewards.{i}.{key}={json.dumps(str(tmp_path))}" for i in (0, 1) for key in ("detector", "clip")]
    recipe = load(path, local if "geneval" in path.name else [])
    check_startable(recipe, registry())  # what `flowrl validate` checks before any model loads
    assert Path(recipe.prompts.source).is_relative_to(SETS)
    assert recipe.prompts.num_eval == SHIPPED[Path(recipe.prompts.source).name][0]  # the whole set
    assert recipe.distributed.num_processes == 8 and recipe.train.finetune == "lora"
    assert recipe.train.group_size == 24 and recipe.train.prompts_per_iteration == 48
    for processes in (8, 1):
        _, _, lines = estimate(recipe, registry(), processes, gpu_memory=80 * GB)
        assert peak(lines)[0] <= 80 * GB, (path.name, processes, peak(lines)[0] / GB)


@pytest.mark.parametrize("path", FLOW_GRPO_RECIPES, ids=lambda p: p.name)
def test_flow_grpo_recipes_say_where_their_training_prompts_come_from(path):
    """As shipped they train on the prompts they evaluate on; the header says so, and says how to
    train on Flow-GRPO's own training prompts (the fetch script's output, relative to the cwd)."""
    text = path.read_text(encoding="utf-8")
    assert "trains on the prompts it evaluates on" in text
    assert "python scripts/fetch_prompt_sets.py flow_grpo_" in text
    fetched = {m.group(1) for m in re.finditer(r'"data/prompts/([\w.]+)"', text)}
    assert fetched and fetched <= {"ocr_train.txt", "pickscore_train.txt", "geneval_train.jsonl", "geneval_all.jsonl"}


def test_geneval_recipes_name_the_shipped_metadata_for_both_reward_entries():
    for path in (REPO / "recipes").glob("flow_grpo_geneval_*.toml"):
        from flowrl.recipe import load_recipe

        recipe = load_recipe(path)
        assert [r.label for r in recipe.rewards] == ["geneval", "geneval_strict"]
        assert [r.weight for r in recipe.rewards] == [1.0, 0.0]
        assert {Path(r.params.metadata) for r in recipe.rewards} == {SETS / "geneval.jsonl"}
        assert recipe.prompts.eval_seeds == 4


# ----------------------------------------------------------------------------- the fetch script


def test_fetch_checks_git_blob_hashes(fetch, tmp_path):
    data = (SETS / "ocr_test.txt").read_bytes()
    fetch.check_blob(data, SHIPPED["ocr_test.txt"][1], "ocr")  # the same hash `git hash-object` gives
    with pytest.raises(fetch.FetchError, match="git blob hash"):
        fetch.check_blob(data + b"\n", SHIPPED["ocr_test.txt"][1], "ocr")
    # a file that is not the recorded upstream file is refused and nothing is written
    with pytest.raises(fetch.FetchError, match="not the file of yifan123/flow_grpo"):
        fetch.fetch_set("flow_grpo_ocr", tmp_path / "out", SETS / "ocr_test.txt")
    assert not (tmp_path / "out").exists()


def _drawbench_csv(rows) -> str:
    out = [["Prompts", "Category"], *rows]
    lines = []
    for row in out:
        lines.append(",".join('"' + c.replace('"', '""') + '"' for c in row))
    return "\n".join(lines) + "\n"


def test_drawbench_rows_are_checked_against_the_recorded_prompt_set(fetch):
    rows = [[f"prompt {i}.", cat] for i, cat in enumerate(
        c for c, n in fetch.DRAWBENCH_CATEGORIES.items() for _ in range(n))]
    assert len(rows) == 200
    with pytest.raises(fetch.FetchError, match="differ from Flow-GRPO's copy"):
        fetch.drawbench_rows(_drawbench_csv(rows))
    with pytest.raises(fetch.FetchError, match="199 rows"):
        fetch.drawbench_rows(_drawbench_csv(rows[:199]))
    with pytest.raises(fetch.FetchError, match="columns"):
        fetch.drawbench_rows("Prompt,Type\na,b\n")


def test_drawbench_conversion_strips_and_writes_a_loader_table(fetch, tmp_path, monkeypatch):
    """With the hash check satisfied by the rows themselves, the table written is prompt,split,category
    with categories stripped (the sheet writes 'Gary Marcus et al. ' with a trailing space)."""
    cats = [c for c, n in fetch.DRAWBENCH_CATEGORIES.items() for _ in range(n)]
    rows = [[f" prompt, {i} ", cat + (" " if cat.startswith("Gary") else "")] for i, cat in enumerate(cats)]
    monkeypatch.setattr(fetch, "DRAWBENCH_SHA256", fetch.prompts_sha256(r[0] for r in rows))
    table = fetch.drawbench_rows(_drawbench_csv(rows))
    fetch.write_table(tmp_path / "drawbench.csv", table)
    cfg = PromptsConfig(split_column="split")
    prompts = read_prompts(str(tmp_path / "drawbench.csv"), None, "w", cfg, role="eval")
    assert len(prompts) == 200 and prompts[0] == "prompt, 0"
    with (tmp_path / "drawbench.csv").open(encoding="utf-8", newline="") as f:
        counts = collections.Counter(r["category"] for r in csv.DictReader(f))
    assert dict(counts) == fetch.DRAWBENCH_CATEGORIES


def test_hpd_rows_take_the_style_as_category(fetch):
    files = {s: json.dumps([f"{s} one", f" {s} two "]).encode() for s in fetch.HPD_STYLES}
    rows = fetch.hpd_rows(files)
    assert len(rows) == 8 and rows[1] == {"prompt": "anime two", "split": "test", "category": "anime"}
    with pytest.raises(fetch.FetchError, match="photo.json"):
        fetch.hpd_rows({**files, "photo": b"{}"})


def test_geneval_training_metadata_is_merged_with_the_evaluation_set(fetch, tmp_path):
    train = [{"tag": "counting", "include": [{"class": "cup", "count": 3}], "exclude": [{"class": "cup", "count": 4}],
              "prompt": "a photo of three cups"},
             {"tag": "single_object", "include": [{"class": "bench", "count": 1}], "prompt": "a photo of a bench"}]
    data = "".join(json.dumps(r) + "\n" for r in train).encode()
    merged = fetch.geneval_all(data, (SETS / "geneval.jsonl").read_bytes())
    (tmp_path / "all.jsonl").write_bytes(merged)
    records = geneval.load_metadata(tmp_path / "all.jsonl")
    assert len(records) == 2 + 553 and records[0]["prompt"] == "a photo of three cups"
    clash = dict(train[1], include=[{"class": "bench", "count": 2}])
    with pytest.raises(fetch.FetchError, match="other requirements"):
        fetch.geneval_all(json.dumps(clash).encode(), (SETS / "geneval.jsonl").read_bytes())


def test_fetch_without_the_network_is_one_error_naming_the_fix(fetch, monkeypatch, capsys, tmp_path):
    def offline(url, what, timeout=0):
        raise fetch.FetchError(f"{what}: cannot download {url}: offline; give a local copy with --from")

    monkeypatch.setattr(fetch, "download", offline)
    assert fetch.main(["drawbench", "-o", str(tmp_path / "out")]) == 1
    assert "give a local copy with --from" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
