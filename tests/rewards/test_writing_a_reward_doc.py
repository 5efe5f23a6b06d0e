"""docs/rewards.md, "Writing a reward": the example module runs as written, registers its reward,
and the reward scores images through the reward contract with its keyword as a recipe key."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from flowrl.rewards import FunctionReward, score

REPO = Path(__file__).resolve().parents[2]


def test_the_writing_a_reward_example_registers_a_reward_that_scores():
    section = (REPO / "docs" / "rewards.md").read_text(encoding="utf-8").split("## Writing a reward", 1)[1]
    (code,) = re.findall(r"```python\n(.*?)```", section.split("\n## ", 1)[0], re.S)
    namespace: dict = {}
    exec(compile(code, "docs/rewards.md", "exec"), namespace)  # the page's own text
    registered = {}
    namespace["register_rewards"](lambda name, fn, **kwargs: registered.setdefault(name, fn))
    fn = registered["saturation"]
    images = torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    plain = score(FunctionReward(fn, name="saturation"), images, ["a", "b", "c"]).scores
    squared = score(FunctionReward(fn, name="saturation", kwargs={"gamma": 2.0}), images, ["a", "b", "c"]).scores
    assert plain.shape == (3,) and torch.allclose(squared, plain**2)
