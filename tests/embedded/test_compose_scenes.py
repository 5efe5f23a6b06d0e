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
            assert geneval.relative_position(geneval.Detection(sub.shape, sub.box, 1.0),
                                             geneval.Detection(ref.shape, ref.box, 1.0)) == {rel}


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
