"""One rule for what a reward returns, checked through `flowrl train`.

A reward returns a float tensor of shape exactly [B] (or a RewardOutput of one); anything else
stops training with ONE error naming the reward and what it returned: no traceback, no silent
reshaping of a list or a [B, 1] tensor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_recipe import tiny_recipe

from flowrl import hookimpl
from flowrl.interfaces import RewardOutput
from flowrl.plugins import temporary_plugin
from flowrl.rewards import RewardOutputError, score
from flowrl.runlog import read_metrics


def recipe_text(reward: str) -> str:
    """The tiny recipe, one iteration, scored by ``reward`` alone."""
    return tiny_recipe(run={"name": "contract", "seed": None}, train={"iterations": 1, "micro_batch_size": 4},
                       rewards=[{"use": reward}])

#: name -> (reward function, what the message must say it returned)
BAD = {
    "as_list": (lambda images, prompts: images.mean(dim=(1, 2, 3)).tolist(), "a list of 8 element(s)"),
    "column": (lambda images, prompts: images.mean(dim=(1, 2, 3))[:, None], "of shape [8, 1]"),
    "too_few": (lambda images, prompts: images.mean(dim=(1, 2, 3))[:3], "of shape [3]"),
    "integers": (lambda images, prompts: (images.mean(dim=(1, 2, 3)) > 0.5).long(), "a torch.int64 tensor"),
    "numpy": (lambda images, prompts: images.mean(dim=(1, 2, 3)).numpy(), "numpy.ndarray"),
    "scalar": (lambda images, prompts: images.mean(), "of shape []"),
    "output_of_list": (lambda images, prompts: RewardOutput(scores=[0.0] * len(prompts)), "a list of 8 element(s)"),
}


class BadRewards:
    @hookimpl
    def register_rewards(self, register):
        for name, (fn, _) in BAD.items():
            register(name, fn)
        register("good", lambda images, prompts: images.mean(dim=(1, 2, 3)))


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_reward_of_the_wrong_kind_stops_training_with_one_message(name, tmp_path, flowrl_cli):
    recipe = tmp_path / "r.toml"
    recipe.write_text(recipe_text(name))
    with temporary_plugin(BadRewards(), "bad_rewards"):
        (result,) = flowrl_cli.in_process([["train", recipe, "-o", tmp_path / "run"]])
    code, err = result.returncode, result.flat_err
    assert code == 2, err
    assert "Traceback" not in err and err.count("error:") == 1
    assert f"reward '{name}' returned" in err and BAD[name][1] in err
    assert "a float tensor of shape [8]" in err and "[B, 3, H, W]" in err


def test_a_reward_that_keeps_the_contract_trains(tmp_path, flowrl_cli):
    recipe = tmp_path / "r.toml"
    recipe.write_text(recipe_text("good"))
    with temporary_plugin(BadRewards(), "bad_rewards"):
        (result,) = flowrl_cli.in_process([["train", recipe, "-o", tmp_path / "run"]])
    code, err = result.returncode, result.flat_err
    assert code == 0, err
    row = read_metrics(tmp_path / "run")[0]
    assert 0.0 <= row["reward/good/mean"] <= 1.0


def test_score_accepts_exactly_b_float_scores():
    images = torch.rand(3, 3, 8, 8)

    class Named:
        name = "n"

        def __init__(self, out):
            self.out = out

        def __call__(self, images, prompts, metadata=None):
            return self.out

    for good in (torch.zeros(3), torch.zeros(3, dtype=torch.float64), torch.tensor([float("nan"), 1.0, 2.0]),
                 RewardOutput(scores=torch.ones(3), extras={"x": torch.zeros(3)})):
        out = score(Named(good), images, ["p"] * 3)
        assert out.scores.shape == (3,) and out.scores.dtype == torch.float32
    for bad in (torch.zeros(3, 1), torch.zeros(1, 3), torch.zeros(4), torch.zeros(3, dtype=torch.int32), [0.0] * 3,
                np.zeros(3), None, RewardOutput(scores=torch.ones(3), extras={"x": torch.zeros(2)})):
        with pytest.raises(RewardOutputError, match="reward 'label'"):
            score(Named(bad), images, ["p"] * 3, name="label")
