"""profile.json (flowrl/profile_io.py): round trip, read_l1rel for the weighted selector, and errors."""

import json

import pytest
import torch

from flowrl.dynamics.measure import profile_model
from flowrl.dynamics.profile_file import profile_to_dict, read_l1rel, read_profile, trainable_curve, write_profile
from flowrl.errors import FlowrlError
from flowrl.sampling.schedules import shifted_sigmas
from flowrl.sampling.kernels import FlowKernel


@pytest.fixture
def profile_file(tmp_path, tiny_model):
    n = 6  # image from x0_hat: T = 5 trainable transitions
    res = profile_model(tiny_model, shifted_sigmas(n, 3.0), (FlowKernel(a=0.7),) * n, ["a", "b"],
                        num_seeds=2, num_chunks=2, settings={"steps": n})
    path = write_profile(tmp_path / "sub" / "profile.json", res)
    return path, res


def test_round_trip(profile_file):
    path, res = profile_file
    data = read_profile(path)
    assert data == json.loads(json.dumps(profile_to_dict(res)))
    assert data["positions"] == [0, 1, 2, 3, 4] and data["trainable"][-1] is False
    assert data["proposals"]["l1rel"]["dp"]["snippet"].startswith('[chunker]\nuse = "explicit"')
    assert trainable_curve(data, "x0_change", 5) == [res.curves["x0_change"].mean[i] for i in range(5)]


def test_read_l1rel(profile_file):
    path, res = profile_file
    out = read_l1rel(path, num_transitions=5)
    assert out.dtype == torch.float32 and out.shape == (5,)
    torch.testing.assert_close(out, torch.tensor(res.curves["l1rel"].mean[:5], dtype=torch.float32))


def test_read_l1rel_errors(profile_file, tmp_path):
    path, _ = profile_file
    with pytest.raises(FlowrlError, match="needs a profile") as e:
        read_l1rel("", 5)
    assert e.value.where == "[selector].profile"
    with pytest.raises(FlowrlError, match="not found"):
        read_l1rel(tmp_path / "nope.json", 5)
    with pytest.raises(FlowrlError, match=r"T = 5 .* this run has T = 16"):
        read_l1rel(path, 16)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(FlowrlError, match="not a JSON file"):
        read_l1rel(bad, 5)
    bad.write_text(json.dumps({"format": "flowrl-profile-compare"}))
    with pytest.raises(FlowrlError, match="not a flowrl profile") as e:
        read_l1rel(bad, 5)
    assert "base.json" in e.value.hint
    data = json.loads(path.read_text())
    data["version"] = 99
    bad.write_text(json.dumps(data))
    with pytest.raises(FlowrlError, match="version 99"):
        read_profile(bad)
    data["version"] = 1
    data["curves"]["l1rel"]["mean"] = data["curves"]["l1rel"]["mean"][:3]
    bad.write_text(json.dumps(data))
    with pytest.raises(FlowrlError, match="curves.l1rel.mean"):
        read_profile(bad)


def test_weighted_selector_reads_the_profile(profile_file):
    from flowrl.plugins import get_registry
    from flowrl.selection import chunk_weights_from_l1rel

    path, _ = profile_file
    comp = get_registry().get("selector", "weighted")
    selector = comp.build(comp.params(fraction=0.5, profile=str(path)))
    mask = selector.select(4, (2, 3), [torch.Generator().manual_seed(i) for i in range(4)])
    assert mask.shape == (4, 2) and mask.sum(1).tolist() == [1, 1, 1, 1]
    torch.testing.assert_close(selector.l1rel, read_l1rel(path, 5))
    assert chunk_weights_from_l1rel(selector.l1rel, (2, 3)).shape == (2,)
