"""The compositional grammar: GenEval's six categories, GenEval-format metadata, a held-out split
of combinations never trained on."""

from __future__ import annotations

import collections
import csv
from pathlib import Path

import pytest

from flowrl import geneval
from flowrl_plugins.embedded.compose import grammar


def test_every_category_has_its_prompts_and_split_sizes():
    count = collections.Counter((grammar.metadata(p)["tag"], grammar.split(p)) for p in grammar.all_prompts())
    assert count == {("single_object", "train"): 4, ("two_object", "train"): 8, ("two_object", "eval"): 4,
                     ("counting", "train"): 12, ("counting", "eval"): 4, ("colors", "train"): 18,
                     ("colors", "eval"): 6, ("position", "train"): 36, ("position", "eval"): 12,
                     ("color_attr", "train"): 288, ("color_attr", "eval"): 72}


def test_held_out_prompts_are_never_training_prompts_except_single_objects():
    train, held_out = set(grammar.all_prompts("train")), set(grammar.all_prompts("eval"))
    shared = train & held_out
    assert shared == {"a circle", "a square", "a triangle", "a cross"}
    assert len(train) + len(held_out) - len(shared) == len(grammar.all_prompts()) == 464


def test_the_shipped_prompt_table_is_the_grammar_with_its_splits(tmp_path):
    """recipes/prompts/compose.csv is write_csv's output: the held-out rows are the grammar's
    'eval' prompts, the single objects sit in both splits."""
    shipped = Path(__file__).resolve().parents[2] / "recipes" / "prompts" / "compose.csv"
    grammar.write_csv(tmp_path / "compose.csv")
    assert (tmp_path / "compose.csv").read_text() == shipped.read_text()
    rows = list(csv.DictReader(shipped.open()))
    assert {r["prompt"] for r in rows if r["split"] == "test"} == set(grammar.all_prompts("eval"))
    assert {r["prompt"] for r in rows if r["split"] == "train"} == set(grammar.all_prompts("train"))


def test_metadata_is_in_genevals_format_and_satisfied_by_its_own_objects():
    for prompt in grammar.all_prompts():
        meta = grammar.metadata(prompt)
        assert meta["prompt"] == prompt and meta["tag"] in geneval.TAGS
        # one perfect detection per required object, laid out left to right, satisfies it
        dets, x = [], 0.0
        for req in meta["include"]:
            for _ in range(req["count"]):
                dets.append(geneval.Detection(req["class"], (x, 0, x + 4, 4), 1.0, req.get("color")))
                x += 8
        if meta["tag"] == "position":  # place the subject as the relation says
            rel = meta["include"][1]["position"][0]
            dx, dy = {"left of": (-8, 0), "right of": (8, 0), "above": (0, -8), "below": (0, 8)}[rel]
            dets[1] = geneval.Detection(dets[1].label, (dx, dy, dx + 4, dy + 4), 1.0)
            dets[0] = geneval.Detection(dets[0].label, (0, 0, 4, 4), 1.0)
        assert geneval.score_prompt(dets, meta).strict, (prompt, dets)


def test_examples_read_as_geneval_writes_them():
    assert grammar.metadata("a circle left of a square")["include"] == [
        {"class": "square", "count": 1}, {"class": "circle", "count": 1, "position": ["left of", 0]}]
    assert grammar.metadata("three crosses") == {"tag": "counting", "prompt": "three crosses",
                                                  "include": [{"class": "cross", "count": 3}],
                                                  "exclude": [{"class": "cross", "count": 4}]}
    assert grammar.metadata("  A Red Triangle and a blue square ")["include"][0] == {
        "class": "triangle", "count": 1, "color": "red"}


def test_a_prompt_outside_the_grammar_is_refused_by_name():
    with pytest.raises(ValueError, match="not a prompt of the compositional grammar: 'a dog'"):
        grammar.metadata("a dog")
    with pytest.raises(ValueError, match="unknown split"):
        grammar.all_prompts("test")
