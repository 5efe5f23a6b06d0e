"""Ground-truth scenes hold exactly what the prompt names, apart, with GenEval's relation."""

from __future__ import annotations

import torch

from flowrl import geneval
from flowrl_plugins.embedded.compose import grammar, scenes


def test_scenes_hold_the_prompts_objects_apart_and_in_place():
    g = torch.Generator().manual_seed(0)
    for prompt in grammar.all_prompts():
        meta = grammar.metadata(prompt)
        objects = scenes.scene(prompt, g)
        wanted = sorted((r["class"], r.get("color")) for r in meta["include"] for _ in range(r["count"]))
        got = sorted((o.shape, o.colour if any("color" in r for r in meta["include"]) else None) for o in objects)
        assert got == wanted, prompt
        for i, a in enumerate(objects):
            assert 0 <= a.box[0] and a.box[2] <= scenes.IMAGE_SIZE - 1
            for b in objects[i + 1:]:  # boxes at least GAP apart on one axis
                gap = max(a.box[0] - b.box[2], b.box[0] - a.box[2], a.box[1] - b.box[3], b.box[1] - a.box[3])
                assert gap >= scenes.GAP, (prompt, a, b)
        if meta["tag"] == "position":
            rel = meta["include"][1]["position"][0]
            ref, sub = objects
            found = geneval.relative_position(geneval.Detection(sub.shape, sub.box, 1.0),
                                              geneval.Detection(ref.shape, ref.box, 1.0))
            assert rel in found and len(found) <= 2, (prompt, found)  # diagonal: a second relation


def test_rendering_is_deterministic_for_a_seed():
    prompts = grammar.all_prompts()[:40]
    a = scenes.render_prompts(prompts, torch.Generator().manual_seed(3))
    b = scenes.render_prompts(prompts, torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.shape == (40, 3, 32, 32)


def test_training_batches_draw_every_category_about_equally():
    # by prompt, colour attribution would be 288 of 366 draws and single objects 4
    prompts = grammar.all_prompts("train")
    _, drawn = scenes.sample_batch(prompts, 600, torch.Generator().manual_seed(0))
    counts = {tag: 0 for tag in grammar.TAGS}
    for p in drawn:
        counts[grammar.metadata(p)["tag"]] += 1
    assert all(60 <= n <= 140 for n in counts.values()), counts  # 100 expected each, sd about 9
    assert set(drawn) <= set(prompts)


def test_two_named_objects_are_drawn_in_reading_order():
    """The first named object in the left column, the second in the right, rows drawn independently."""
    g = torch.Generator().manual_seed(1)
    rows = set()
    for prompt in ["a circle and a square", "a red cross and a blue triangle", "a square and a circle"]:
        for _ in range(20):
            first, second = scenes.scene(prompt, g)
            names = [r["class"] for r in grammar.metadata(prompt)["include"]]
            assert [first.shape, second.shape] == names
            assert first.cx < scenes.IMAGE_SIZE / 2 < second.cx
            rows.add((first.cy < scenes.IMAGE_SIZE / 2, second.cy < scenes.IMAGE_SIZE / 2))
    assert len(rows) == 4  # every pair of rows occurs


def test_a_position_prompts_subject_sits_on_the_named_side():
    g = torch.Generator().manual_seed(2)
    half = scenes.IMAGE_SIZE / 2
    for prompt, side in [("a circle left of a square", lambda s, r: s.cx < half < r.cx),
                         ("a circle right of a square", lambda s, r: r.cx < half < s.cx),
                         ("a cross above a triangle", lambda s, r: s.cy < half < r.cy),
                         ("a cross below a triangle", lambda s, r: r.cy < half < s.cy)]:
        diagonal = 0
        for _ in range(20):
            reference, subject = scenes.scene(prompt, g)
            assert side(subject, reference), prompt
            diagonal += (subject.cx < half) != (reference.cx < half) and (subject.cy < half) != (reference.cy < half)
        assert 0 < diagonal < 20  # the other axis is drawn for each object
