"""Offline SFT and DPO end to end: a preference table built offline with `flowrl sample` and the
embedded verifier (best and worst image per prompt), then 2 iterations of each objective from it,
and a resume that repeats the uninterrupted run bitwise."""

from __future__ import annotations

import json

import pytest
import torch

from flowrl.offline import best_worst_rows, load_image, read_offline_rows
from flowrl.train.offline import OfflineTrainer

PROMPTS = ["a red circle on a blue background", "a green square on a white background"]
SIGMAS = torch.linspace(1.0, 0.0, 5)


@pytest.fixture(scope="module")
def tables(tmp_path_factory, flowrl_cli):
    from plugins.embedded.rewards import verifier_score

    root = tmp_path_factory.mktemp("offline")
    out = root / "sampled"
    argv = ["sample", "--model", "embedded", *[a for p in PROMPTS for a in ("--prompt", p)], "--seeds", "4",
            "--steps", "4", "--no-grid", "-o", str(out)]
    (r,) = flowrl_cli.in_process([argv], cwd=root)
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    images = torch.stack([load_image(out / rec["file"]) for rec in records])
    scores = verifier_score(images, [rec["prompt"] for rec in records])
    pairs = best_worst_rows(records, scores.tolist())
    assert pairs, f"every prompt's 4 images scored alike: {scores.tolist()}"
    (out / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in pairs))
    (out / "sft.jsonl").write_text("".join(json.dumps({"prompt": row["prompt"], "image": row["chosen"]}) + "\n"
                                          for row in pairs))
    return out / "pairs.jsonl", out / "sft.jsonl"


def trainer(table, objective):
    from plugins.embedded.plugin import EmbeddedConfig, EmbeddedModel

    model = EmbeddedModel(EmbeddedConfig())
    model.denoiser.requires_grad_(True)
    return OfflineTrainer(model, read_offline_rows(table), objective=objective, sigmas=SIGMAS, batch_size=2,
                          timesteps=2, lr=1e-4, seed=0)


@pytest.mark.parametrize("objective, which", [("dpo", 0), ("sft", 1)])
def test_offline_training_runs_two_iterations_and_resumes_bitwise(tables, objective, which):
    table = tables[which]
    full = trainer(table, objective)
    before = [p.detach().clone() for p in full.params]
    rows = [full.step() for _ in range(2)]
    assert [r["iteration"] for r in rows] == [0, 1]
    assert all(torch.isfinite(torch.tensor(v)) for r in rows for v in r.values())
    assert any(not torch.equal(a, b) for a, b in zip(before, full.params))  # it trained
    if objective == "dpo":  # the first step is at the reference: a zero margin, loss softplus(0)
        assert abs(rows[0]["dpo/margin"]) < 1e-6 and abs(rows[0]["dpo/loss"] - 0.6931472) < 1e-5
    first = trainer(table, objective)
    first.step()
    saved = first.state_dict()
    resumed = trainer(table, objective)
    resumed.load_state_dict(saved)
    assert resumed.step()["iteration"] == 1
    assert all(torch.equal(a, b) for a, b in zip(full.params, resumed.params))


def test_an_objective_refuses_the_other_kind_of_table(tables):
    with pytest.raises(ValueError, match="offline sft trains on a table of images, got one of pairs"):
        trainer(tables[0], "sft")
