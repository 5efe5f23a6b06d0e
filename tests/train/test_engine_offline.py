"""Offline SFT and DPO end to end, selected by a recipe: the tables built offline with
`flowrl sample --tables` (the embedded model's own samples scored by the recipe's verifier: best
image per prompt, and best against worst), then `flowrl train` of each shipped offline recipe for 2
iterations (no rollout, no reward scored for training; the held-out evaluation, its grids, the
metrics, the resolved recipe and the checkpoints as an online run), a run interrupted after
iteration 1 and resumed that repeats the uninterrupted one bit for bit, and 2 processes that equal
1 under ddp and fsdp2."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from engine_helpers import REPO, InterruptAt, assert_records_close, assert_weights_close, load, quiet_console, run_cli

from flowrl.plugins import temporary_plugin
from flowrl.runlog import read_metrics
from flowrl.train import train
from flowrl.train.checkpoint import latest_checkpoint, load_checkpoint, read_model_weights

PROMPTS = ["a red circle on a blue background", "a green square on a white background",
           "a blue triangle on a green background"]
RECIPES = {"sft": "offline_sft.toml", "offline_dpo": "offline_dpo.toml"}
TABLES = {"sft": "best.jsonl", "offline_dpo": "pairs.jsonl"}
SHAPES = str(REPO / "recipes" / "prompts" / "shapes.csv")
# tiny: 4 sampling steps, 2 rows an iteration in micro-batches of 1 (gradients accumulate), 2 held-out prompts
TINY = ["sampler.steps=4", "train.prompts_per_iteration=2", "train.micro_batch_size=1", "prompts.num_eval=2",
        "prompts.eval_seeds=1", "log.eval_every=1", "log.image_every=1", "checkpoint.every=1", "log.progress=false",
        f"prompts.source={SHAPES!r}"]


@pytest.fixture(scope="module")
def sampled(tmp_path_factory, flowrl_cli):
    """The tables `flowrl sample --tables` writes from 4 images of each of 3 prompts."""
    root = tmp_path_factory.mktemp("offline")
    out = root / "sampled"
    argv = ["sample", str(REPO / "recipes" / "offline_dpo.toml"), *[a for p in PROMPTS for a in ("--prompt", p)],
            "--seeds", "4", "--steps", "4", "--no-grid", "--tables", "-o", str(out)]
    (r,) = flowrl_cli.in_process([argv], cwd=root)
    assert r.returncode == 0, r.stderr
    return out


def test_sample_tables_hold_the_best_image_and_the_best_against_the_worst_of_each_prompt(sampled):
    records = [json.loads(line) for line in (sampled / "samples.jsonl").read_text().splitlines()]
    best = [json.loads(line) for line in (sampled / "best.jsonl").read_text().splitlines()]
    pairs = [json.loads(line) for line in (sampled / "pairs.jsonl").read_text().splitlines()]
    assert [b["prompt"] for b in best] == PROMPTS and pairs, pairs
    for row in best:
        mine = [r for r in records if r["prompt"] == row["prompt"]]
        top = max(mine, key=lambda r: r["score"])
        assert row["image"] == top["file"] and row["score"] == top["score"]
    for row in pairs:
        mine = [r["score"] for r in records if r["prompt"] == row["prompt"]]
        assert row["chosen_score"] == max(mine) > row["rejected_score"] == min(mine)


@pytest.mark.parametrize("loss", list(RECIPES))
def test_flowrl_train_runs_each_offline_recipe_without_rollout_or_reward(sampled, flowrl_cli, tmp_path, loss):
    run_dir = tmp_path / "run"
    argv = ["train", str(REPO / "recipes" / RECIPES[loss]), "--set", "train.iterations=2",
            "--set", f"data.path={str(sampled / TABLES[loss])!r}", "--set", f"run.output_dir={str(run_dir)!r}"]
    for s in TINY:
        argv += ["--set", s]
    (r,) = flowrl_cli.in_process([argv], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = read_metrics(run_dir)
    trained = [row for row in rows if not row.get("final")]
    assert [row["iteration"] for row in trained] == [0, 1] and rows[-1]["final"]
    for row in trained:  # no rollout, no reward: the table is the signal
        assert not any(k.startswith(("reward/", "advantage/", "time/rollout", "time/reward")) for k in row), row
        assert "eval/verifier/mean" in row and "eval/embedded_clip/mean" in row  # held out, and the second judge
        assert all(torch.isfinite(torch.tensor(float(row[k]))) for k in ("loss", "grad_norm"))
    assert ("sft/fm_loss" if loss == "sft" else "dpo/margin") in trained[0]
    if loss == "offline_dpo":  # the first step is at the reference: a zero margin, loss softplus(0)
        assert abs(trained[0]["dpo/margin"]) < 1e-6 and abs(trained[0]["dpo/loss"] - 0.6931472) < 1e-5
    assert (run_dir / "recipe.toml").is_file() and latest_checkpoint(run_dir).name == "iter_000002"
    flops = json.loads((run_dir / "run_info.json").read_text())["flops"]  # no rollout; 2 points a row, 2 sides for DPO
    assert flops["rollout_per_iteration"] == 0 and flops["offline_points_per_row"] == (4 if loss == "offline_dpo" else 2)
    assert (run_dir / "images" / "eval" / "iter_000002.png").is_file()  # the final evaluation's grid


@pytest.mark.slow
@pytest.mark.parametrize("loss", list(RECIPES))
def test_an_interrupted_offline_run_resumes_bitwise(sampled, tmp_path, loss):
    recipe = tmp_path / RECIPES[loss]
    shutil.copy(REPO / "recipes" / RECIPES[loss], recipe)
    sets = [*TINY, "train.iterations=3", "log.eval_every=100", "log.image_every=0",
            f"data.path={str(sampled / TABLES[loss])!r}"]
    whole = train(load(recipe, *sets, f"run.output_dir={str(tmp_path / 'whole')!r}"), console=quiet_console())
    parts = tmp_path / "parts"
    tracked = tmp_path / f"tracked_{RECIPES[loss]}"
    tracked.write_text(recipe.read_text() + '\n[[trackers]]\nuse = "interrupt_at"\n')
    with temporary_plugin(InterruptAt(1), name="interrupt-at-1"):
        with pytest.raises(KeyboardInterrupt):
            train(load(tracked, *sets, f"run.output_dir={str(parts)!r}"), console=quiet_console())
    assert latest_checkpoint(parts).name == "iter_000002"
    train(load(recipe, *sets, f"run.output_dir={str(parts)!r}"), resume=parts, console=quiet_console())

    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]  # noqa: E731
    assert strip(read_metrics(parts)) == strip(read_metrics(whole))
    got, want = load_checkpoint(latest_checkpoint(parts))["model"], load_checkpoint(latest_checkpoint(whole))["model"]
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
@pytest.mark.parametrize("loss", list(RECIPES))
def test_two_processes_equal_one(sampled, tmp_path, loss, strategy):
    """Two rows an iteration over 2 processes (one each) give the metrics and the weights of 1
    process training both, with the held-out evaluation, its grids and a checkpoint on. AdamW's
    eps is 1e-4 for a well-conditioned comparison (tiny_recipe.ENGINE's comment)."""
    recipe = REPO / "recipes" / RECIPES[loss]
    sets = [*TINY, "train.iterations=2", "train.lr=1e-3", "train.adam_eps=1e-4", "run.device='cpu'",
            f"data.path={str(sampled / TABLES[loss])!r}"]
    two, one = tmp_path / "two", tmp_path / "one"
    args = [a for s in (*sets, f"distributed.strategy='{strategy}'") for a in ("--set", s)]
    proc = run_cli(["train", str(recipe), *args, "-o", str(two), "--num-processes", "2"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    train(load(recipe, *sets, f"run.output_dir={str(one)!r}"), console=quiet_console())
    rec2, rec1 = read_metrics(two), read_metrics(one)
    assert len(rec2) == len(rec1) == 3 and [r["world_size"] for r in rec2[:-1]] == [2, 2]  # and the final row
    for a, b in zip(rec2, rec1):
        # the rows are split, not repeated: the backwards summed over the processes are 1 process's
        assert a.get("compute/update/backward") == b.get("compute/update/backward")
        for record in (a, b):
            for key in [k for k in record if k.startswith(("compute/", "time/")) or k == "world_size"]:
                record.pop(key)
        assert_records_close(a, b, rtol=1e-4, atol=1e-6)
    assert_weights_close(read_model_weights(latest_checkpoint(two)), read_model_weights(latest_checkpoint(one)),
                         atol=5e-6)


def test_an_offline_iterations_model_flops_are_its_points_not_a_rollout():
    """speed/model_tflops_per_second of an offline run: rows x points x F_fb, plus one reference
    forward a point for DPO; nothing for a rollout it does not draw."""
    import time
    from types import SimpleNamespace

    from flowrl.train.throughput import Throughput

    def measured(points, reference):
        run = SimpleNamespace(points=points, reference=reference, passes=1, samples=8, steps=17, forward=10.0,
                              forward_backward=30.0, forward_backward_with_recompute=40.0, peak=None,
                              started=time.monotonic(), total=4, first=0, NOT_TRAINING=Throughput.NOT_TRAINING)
        out = Throughput.measure(run, {"update": 1e-12}, torch.zeros(8, 1, dtype=torch.bool), [4], 1)
        return out["speed/model_tflops_per_second"]  # TFLOP/s over 1e-12 s of training: the FLOPs themselves

    assert measured(2, False) == pytest.approx(8 * 2 * 30.0)  # SFT, 2 timesteps
    assert measured(4, True) == pytest.approx(8 * 4 * (30.0 + 10.0))  # DPO, 2 sides x 2 timesteps, and the reference
