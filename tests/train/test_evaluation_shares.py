"""A ddp run's evaluation is shared by its processes: each evaluates a contiguous share of the
evaluation's batches (flowrl.train.evaluate.evaluation_share) and the main process gathers the
scores, which are the one process's to the last bit (the batches are the same batches). The
processes are simulated here in one process (the gather replaced); tests/train/
test_engine_distributed.py runs two real ones against one."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import load
from tiny_recipe import write_recipe

from flowrl import distributed
from flowrl.distributed import DistContext
from flowrl.train import evaluate as evaluation
from flowrl.train.evaluate import RunEvaluator, evaluation_share
from flowrl.train.session import Session


@pytest.mark.parametrize("items, batch, world", [(10, 8, 2), (2, 8, 2), (100, 8, 3), (64, 8, 8), (5, 1, 4), (1, 4, 4)])
def test_the_shares_cover_every_batch_once_in_order_the_main_process_first(items, batch, world):
    shares = [evaluation_share(items, batch, rank, world) for rank in range(world)]
    assert [k for share in shares for k in share] == list(range(-(-items // batch)))
    assert len(shares[0]) >= 1 and max(map(len, shares)) - min(map(len, shares)) <= 1
    assert [len(s) for s in shares] == sorted((len(s) for s in shares), reverse=True)  # the extra ones first


class _Outputs:
    def __init__(self, run_dir):
        self.run_dir, self.grids = run_dir, []

    def write_eval_grids(self, iteration, prompts, images, scores, final=False):
        self.grids.append((images, scores))


def test_two_ranks_evaluate_their_shares_and_the_main_process_gets_one_processs_numbers(tmp_path, monkeypatch):
    # 5 prompts x 2 noises = 10 images in batches of 8 (micro-batch 2 x 4): rank 0 the first 8, rank 1 the last 2
    recipe = load(write_recipe(tmp_path), "prompts.num_eval=5", "prompts.eval_seeds=2", "train.micro_batch_size=2",
                  f"run.output_dir={str(tmp_path / 'run')!r}")
    session = Session.open(recipe)
    _, prompts = session.run_prompts()
    alone = _Outputs(tmp_path)
    want = RunEvaluator(session, prompts, DistContext(), alone)(0)
    (want_images, want_scores), = alone.grids

    sent = {}

    def gather(rank):
        def gather_objects(obj, ctx):
            sent[rank] = obj
            other = sent.get(1 - rank, (False, {}, torch.zeros(0, dtype=torch.uint8)))
            return [obj, other] if rank == 0 else [other, obj]
        return gather_objects

    evaluated = []
    run = evaluation.evaluate
    monkeypatch.setattr(evaluation, "evaluate", lambda *a, **k: evaluated.append(list(k["batches"])) or run(*a, **k))
    monkeypatch.setattr(distributed, "gather_objects", gather(1))
    assert RunEvaluator(session, prompts, DistContext(rank=1, world_size=2), _Outputs(tmp_path))(0) == {}
    monkeypatch.setattr(distributed, "gather_objects", gather(0))
    main = _Outputs(tmp_path)
    got = RunEvaluator(session, prompts, DistContext(rank=0, world_size=2), main)(0)
    assert evaluated == [[1], [0]]  # each rank its own batch
    assert all(len(v) == 2 for v in sent[1][1].values()) and all(len(v) == 8 for v in sent[0][1].values())
    assert got == want  # the same floats: the same batches, scored alike
    (images, scores), = main.grids
    assert torch.equal(images, want_images) and all(torch.equal(scores[k], want_scores[k]) for k in want_scores)
