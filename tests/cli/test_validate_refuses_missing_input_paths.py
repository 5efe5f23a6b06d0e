"""A component's input file that does not exist (model weights, a reward's model, a profile) is
one message at `flowrl validate` and at `flowrl train`, naming the key and the path: no
traceback, nothing written."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("override, key", [
    ("model.weights=/nonexistent/embedded.safetensors", "[model].weights"),
    ("chunker.profile=/nonexistent/profile.json", "[chunker].profile"),
])
def test_validate_and_train_name_the_missing_path(override, key, tmp_path, flowrl_cli):
    out = tmp_path / "run"
    validate, train = flowrl_cli.in_process([
        ["validate", "recipes/quickstart_dynamics.toml", "--set", override],
        ["train", "recipes/quickstart_dynamics.toml", "--set", override, "--set", f"run.output_dir='{out}'"],
    ])
    for result in (validate, train):
        assert result.returncode == 2, result.stderr
        assert f"{key}: " in result.flat_err and "not found: /nonexistent/" in result.flat_err
        assert "Traceback" not in result.stderr
    assert not out.exists()


def test_a_rewards_missing_model_folder_is_named_with_its_entry(tmp_path, flowrl_cli):
    (result,) = flowrl_cli.in_process([["validate", "recipes/quickstart.toml", "--set",
                                     "rewards.1.model=/nonexistent/clip"]])
    assert result.returncode == 2 and "[[rewards]] #2 (embedded_clip).model" in result.flat_err
