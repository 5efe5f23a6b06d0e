"""Every model adapter's conformance suite (flowrl.testing.conformance) on the lane's device: each
adapter the CPU tests run the suite on (tests/diffusers/test_conformance.py and the per-model files
tests/diffusers/test_{qwen_image,flux2_klein,zimage,wan,wan22,ltx,editing}.py, the embedded
models in tests/embedded/), on its tiny offline pipeline (flowrl.testing.tiny_pipelines), moved to
the device with ``adapter.to(device)`` as the engine places it.

fp32, with the suite's default tolerances: those are the engine's own for fp32 recipes (the
on-policy check's 1e-6 is ``[train].on_policy_tolerance``'s default), so a check that fails here
on a GPU fails fp32 training runs of that model there too. The adapter gets what ``Session.open``
gives an fp32 denoiser on CUDA (:func:`flowrl.train.accel.exact_float32`: no TF32 convolutions):
without it, on an H200, Wan's on-policy log-ratio reached 4e-6 and the editing models' condition
latents depended on the batch (2e-4). Measured on the 2-core CPU: 35 s for
the 23 tests, pipelines written included; not yet timed on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from flowrl.testing.conformance import CHECK_NAMES, check_adapter
from flowrl.train.accel import exact_float32

pytestmark = pytest.mark.gpu

#: The tiny pipelines' geometry, per registered model (tests/diffusers' TINY settings).
TINY = {
    "flux": dict(dtype="fp32", height=32, width=32, max_sequence_length=16),
    "sd3": dict(dtype="fp32", height=32, width=32, max_sequence_length=16),
    "flux_kontext": dict(dtype="fp32", height=32, width=32, max_sequence_length=16),
    "qwen_image": dict(dtype="fp32", height=32, width=32, max_sequence_length=64),
    "qwen_image_edit": dict(dtype="fp32", height=32, width=32, max_sequence_length=64),
    "flux2_klein": dict(dtype="fp32", height=32, width=32, max_sequence_length=48),
    "zimage": dict(dtype="fp32", height=32, width=32, max_sequence_length=64),
    "wan": dict(dtype="fp32", height=32, width=32, num_frames=5, max_sequence_length=16),
    "wan22": dict(dtype="fp32", height=32, width=32, num_frames=5, max_sequence_length=16),
    "wan22_a14b": dict(dtype="fp32", height=32, width=32, num_frames=5, max_sequence_length=16, flow_shift=5.0),
    "wan22_a14b_i2v": dict(dtype="fp32", height=32, width=32, num_frames=5, max_sequence_length=16, flow_shift=5.0),
    "ltx": dict(dtype="fp32", height=32, width=64, num_frames=9, max_sequence_length=16),
}

#: case -> (registered model name, tiny pipeline or None, config); the configurations the CPU tests check
CASES = {
    "embedded": ("embedded", None, dict(random_init=True)),
    "embedded_video": ("embedded_video", None, dict(random_init=True)),
    "embedded_compose": ("embedded_compose", None, {}),
    "flux": ("flux", "flux", {}),
    "flux_schnell_no_guidance": ("flux", "flux_schnell", dict(guidance=0.0)),
    "sd3_true_cfg": ("sd3", "sd3", {}),
    "sd3_no_cfg": ("sd3", "sd3", dict(cfg_scale=1.0)),
    "flux_kontext": ("flux_kontext", "flux_kontext", {}),
    "qwen_image_true_cfg": ("qwen_image", "qwen_image", {}),
    "qwen_image_no_cfg": ("qwen_image", "qwen_image", dict(cfg_scale=1.0)),
    "qwen_image_edit_cfg": ("qwen_image_edit", "qwen_image_edit", dict(cfg_scale=4.0)),
    "qwen_image_edit_no_cfg": ("qwen_image_edit", "qwen_image_edit", dict(cfg_scale=1.0)),
    "flux2_klein_cfg": ("flux2_klein", "flux2_klein", {}),
    "flux2_klein_distilled": ("flux2_klein", "flux2_klein_distilled", dict(cfg_scale=1.0)),
    "zimage_turbo": ("zimage", "zimage", {}),
    "zimage_cfg": ("zimage", "zimage", dict(cfg_scale=3.0)),
    "wan_cfg": ("wan", "wan", {}),
    "wan_no_cfg": ("wan", "wan", dict(cfg_scale=1.0)),
    "wan22_t2v": ("wan22", "wan22", {}),
    "wan22_i2v": ("wan22", "wan22", dict(image_to_video=True)),
    "wan22_a14b": ("wan22_a14b", "wan22_a14b", {}),
    "wan22_a14b_i2v": ("wan22_a14b_i2v", "wan22_a14b_i2v", dict(cfg_scale=4.0, cfg_scale_2=3.0)),
    "ltx_t2v": ("ltx", "ltx", {}),
    "ltx_i2v": ("ltx", "ltx", dict(image_to_video=True)),
}


def _make(case: str, tiny_pipeline):
    """The case's adapter, built as the engine builds a recipe's model: the registered factory on its
    params (on the CPU; the test moves it)."""
    from flowrl.plugins import get_registry

    model, pipeline, config = CASES[case]
    component = get_registry().get("model", model)
    if pipeline is not None:
        config = {"path": str(tiny_pipeline(pipeline)), **TINY[model], **config}
    return component.factory(component.params(**config))


def test_every_registered_model_has_a_case():
    """A model added to flowrl's registry without a case here fails the lane."""
    from flowrl.plugins import get_registry

    missing = set(get_registry().names("model")) - {model for model, _, _ in CASES.values()}
    assert not missing, f"no GPU conformance case for the registered model(s) {sorted(missing)}"


@pytest.mark.parametrize("case", list(CASES))
def test_adapter_conforms_on_the_lane_device(lane, tiny_pipeline, case):
    adapter = _make(case, tiny_pipeline)
    adapter.to(lane.device)
    exact_float32(lane.device, adapter.denoiser)  # what Session.open does for an fp32 denoiser
    report = check_adapter(adapter)  # raises with every check's line on any failure
    assert [r.name for r in report.results] == list(CHECK_NAMES) and report.passed, report.summary()
    on = {p.device.type for p in adapter.denoiser.parameters()}
    assert on == {lane.device.type}, f"the suite ran on {on}, not {lane.device}"
    if lane.cuda:
        torch.cuda.synchronize(lane.device)
