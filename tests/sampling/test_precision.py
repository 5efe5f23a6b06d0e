"""FP8 rollouts (``[sampler].rollout_precision``, :mod:`flowrl.sampling.precision`): the quantised
copy, the two corrections and the refusals. There is no FP8 hardware here, so the quantisation
error is simulated on the CPU with torchao's weight-only FP8 (float8 e4m3 weights, the same
rounding an FP8 rollout's weights get) standing in for the GPU's float8 matmuls."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_recipe import ENGINE, tiny_recipe_data

from flowrl.errors import FlowrlError, RecipeError
from flowrl.recipe import validate
from flowrl.sampling import precision
from flowrl.sampling.kernels import FlowKernel
from flowrl.sampling.rollout import make_kernels, rescore_transition, rollout
from flowrl.sampling.schedules import shifted_sigmas
from flowrl.train.compute import ComputeCounter

REPO = Path(__file__).resolve().parents[2]
torchao = pytest.importorskip("torchao", reason="the dev extra installs torchao (flowrl-diffusion[fp8])")


def weight_only_fp8(module: torch.nn.Module) -> torch.nn.Module:
    """The simulated quantisation: FP8 (e4m3) weights, computed in the module's own precision."""
    from torchao.quantization import Float8WeightOnlyConfig, quantize_

    quantize_(module, Float8WeightOnlyConfig())
    return module


class Velocity(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(13, 64), torch.nn.Tanh(), torch.nn.Linear(64, 12))

    def forward(self, x, sigma):
        return self.net(torch.cat([x.flatten(1), sigma[:, None]], 1)).view_as(x)


def test_the_rollout_copy_is_quantised_and_the_trained_module_is_not():
    trained = Velocity()
    counter = ComputeCounter(trained)
    before = {k: v.clone() for k, v in trained.state_dict().items()}
    copy = precision.copy_for_rollout(trained, weight_only_fp8)
    assert type(copy.net[0].weight).__name__ == "Float8Tensor" and type(trained.net[0].weight) is torch.nn.Parameter
    assert all(torch.equal(before[k], v) for k, v in trained.state_dict().items())
    assert not any(p.requires_grad for p in copy.parameters()) and not copy.training
    x, s = torch.randn(5, 3, 4), torch.full((5,), 0.5)
    with counter.phase("rollout"), torch.no_grad():
        err = (copy(x, s) - trained(x, s)).abs().max()
    assert 0 < err < 0.05  # an FP8 rounding of the weights, not another model
    assert counter.forward["rollout"] == 10  # the copy's forward counted by the trained module's counter


def _rollout(velocity, n=6, steps=8):
    noise = torch.randn(n, 3, 4, generator=torch.Generator().manual_seed(1))
    gens = [torch.Generator().manual_seed(10 + i) for i in range(n)]
    return rollout(lambda x, s: velocity(x, s), noise, shifted_sigmas(steps, 3.0), make_kernels(steps, FlowKernel(0.7)),
                   generators=gens)


def test_rescore_replaces_the_trainable_log_probs_by_the_trained_policys():
    trained = Velocity()
    with torch.no_grad():
        traj = _rollout(precision.copy_for_rollout(trained, weight_only_fp8))  # mu draws the samples
    mu_lp, latents = traj.log_probs.clone(), traj.latents.clone()
    precision.rescore_log_probs(lambda rows: trained, traj, batch_size=4)  # two sub-batches, 4 + 2
    steps = torch.nonzero(traj.trainable).flatten().tolist()
    rows = torch.arange(6)
    with torch.no_grad():
        want = torch.stack([rescore_transition(trained, traj, i, rows).log_prob for i in steps], 1)
    # pi_theta's log-probs of mu's samples (to the rounding of another batch size)
    assert torch.allclose(traj.log_probs[:, steps], want, rtol=1e-6, atol=1e-5)
    assert torch.equal(traj.latents, latents)  # the samples stay mu's
    frozen = ~traj.trainable
    assert torch.equal(traj.log_probs[:, frozen], mu_lp[:, frozen])
    gap = (mu_lp[:, steps] - want).abs().max()
    assert gap > 1e-3  # the quantisation error the correction removes, far above that rounding
    # the importance weight the other correction leaves in the first step's ratio: exp(log pi - log mu)
    weights = torch.exp(want - mu_lp[:, steps])
    assert bool(torch.isfinite(weights).all()) and float((weights - 1).abs().max()) > 0


@pytest.mark.parametrize("precision_key, extra, match", [
    ("fp8", {"sampler": {"rollout_precision": "fp8"}, "window": {"use": "random", "size": 2}},
     "the [window] plans per-sample SDE windows"),
    ("fp8", {"sampler": {"rollout_precision": "fp8"}, "loss": {"use": "guard"}}, "reads the rollout's Gaussian means"),
    ("fp8", {"sampler": {"rollout_precision": "fp8"}, "replay": {"size": 1}}, "[replay] trains on kept rollouts"),
    ("train", {"sampler": {"rollout_correction": "importance"}}, "rollout_precision is 'train'"),
])
def test_what_fp8_rollouts_cannot_correct_is_refused(precision_key, extra, match):
    with pytest.raises(RecipeError) as err:
        validate(tiny_recipe_data(ENGINE, **extra))
    assert match in err.value.message


def test_fp8_rollouts_need_a_run_that_computes_in_bf16():
    """FP8 layers take bfloat16 activations: a float32 run (no autocast, a float32 base) is refused
    before anything loads; bf16 mixed precision, or a LoRA on a bf16 base, is not."""
    from flowrl.recipe import load_recipe

    with pytest.raises(RecipeError, match="needs a run that computes in bfloat16") as err:
        validate(tiny_recipe_data(ENGINE, sampler={"rollout_precision": "fp8"}))
    assert "mixed_precision = 'bf16'" in err.value.hint
    validate(tiny_recipe_data(ENGINE, sampler={"rollout_precision": "fp8"}, distributed={"mixed_precision": "bf16"}))
    lora = load_recipe(REPO / "recipes" / "chunk_grpo_flux_lora.toml", ["sampler.rollout_precision='fp8'"])
    assert lora.components["model"].params.dtype == "bf16" and lora.distributed.mixed_precision != "bf16"


def test_the_fp8_copy_quantises_the_base_layers_not_the_lora_matrices():
    """torchao's per-row FP8 takes bfloat16 weights only: a LoRA's float32 matrices (and a float32
    master copy's layers, cast first) would fail its check on the GPU. The copy quantises every
    Linear but the adapters' own, casting float32 ones to bfloat16; it runs under bf16 autocast."""
    from peft import LoraConfig, get_peft_model
    from torchao.quantization import Float8WeightOnlyConfig

    trained = get_peft_model(Velocity(), LoraConfig(r=16, target_modules=["net.0"]))
    assert precision.fp8_layers(trained) == {"base_model.model.net.0.base_layer", "base_model.model.net.2"}
    copy = precision.copy_for_rollout(trained, precision.fp8_quantiser(Float8WeightOnlyConfig()))
    kinds = {n: (type(p).__name__, p.dtype) for n, p in copy.named_parameters()}
    assert kinds["base_model.model.net.0.base_layer.weight"][0] == "Float8Tensor"
    assert kinds["base_model.model.net.2.weight"][0] == "Float8Tensor"
    assert kinds["base_model.model.net.0.lora_A.default.weight"] == ("Parameter", torch.float32)
    assert all(p.dtype == torch.float32 for p in trained.parameters())  # the trained module is untouched
    x, s = torch.randn(5, 3, 4), torch.full((5,), 0.5)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert (copy(x, s).float() - trained(x, s)).abs().max() < 0.05


def test_fp8_rollouts_of_an_already_quantised_base_are_refused():
    from flowrl.recipe import load_recipe

    with pytest.raises(RecipeError, match=r"the model's base is already quantised \(quantize = 'nf4'\)"):
        load_recipe(REPO / "recipes" / "flux2_klein_nf4_24gb.toml", ["sampler.rollout_precision='fp8'"])


def test_a_device_without_fp8_is_refused_in_one_message():
    with pytest.raises(FlowrlError) as err:
        precision.check_rollout_precision("fp8", torch.device("cpu"), 1, where="r.toml: [sampler].rollout_precision")
    assert err.value.message == "rollout_precision = 'fp8': this run's device is cpu, and FP8 matmuls need a CUDA GPU"
    assert "remove it" in err.value.hint
    precision.check_rollout_precision("train", torch.device("cpu"), 4, where="x")  # nothing to check


@pytest.fixture
def fp8_here(monkeypatch):
    """This CPU as an FP8 machine: the device check passes and the rollout's copy gets the
    simulated quantisation."""
    import flowrl.train.collect as collect

    from torchao.quantization import Float8WeightOnlyConfig

    monkeypatch.setattr(precision, "fp8_support", lambda device: None)
    # the run's own quantiser (its choice of layers, float32 ones cast to bfloat16), with the CPU's FP8
    monkeypatch.setattr(collect, "fp8_quantiser", lambda: precision.fp8_quantiser(Float8WeightOnlyConfig()))


def _train(tmp_path, name, **sampler):
    from engine_helpers import quiet_console
    from tiny_recipe import tiny_recipe, write_recipe

    from flowrl.recipe import load_recipe
    from flowrl.runlog import read_metrics
    from flowrl.train import train

    path = write_recipe(tmp_path / name, tiny_recipe(ENGINE, sampler=sampler, distributed={"mixed_precision": "bf16"},
                                                     train={"iterations": 1, "optimizer_steps_per_update": 1,
                                                            "on_policy_tolerance": 1e-4}))
    recipe = load_recipe(path, [f"run.output_dir={str(tmp_path / name / 'run')!r}", "checkpoint.every=1"])
    run_dir = train(recipe, console=quiet_console())
    from flowrl.train.checkpoint import read_model_weights

    return read_metrics(run_dir)[0], read_model_weights(run_dir / "checkpoints" / "iter_000001")


def test_fp8_rollouts_train_with_either_correction(tmp_path, fp8_here):
    """``rescore``: every trained transition re-scored once (the ``rescore`` phase, inside the
    minimum), the first step exactly on-policy again (the on-policy probe passes). ``importance``: no extra forward, no on-policy probe (its first ratios are the
    importance weights, not 1), the exact off-policy update; both at compute/ratio 1.00. Both
    train different weights from the full-precision run, by the quantisation's small amount."""
    for name in ("full", "rescore", "importance"):
        (tmp_path / name).mkdir()
    full, w_full = _train(tmp_path, "full")
    res, w_res = _train(tmp_path, "rescore", rollout_precision="fp8")
    imp, w_imp = _train(tmp_path, "importance", rollout_precision="fp8", rollout_correction="importance")
    samples, T = 8, 4  # the tiny recipe: 2 prompts x 4, 5 steps with 4 trainable transitions
    assert res["compute/rescore/forward"] == samples * T and res["compute/ratio"] == 1.0
    assert res["on_policy/max_abs_log_ratio"] <= 1e-4
    assert "compute/rescore/forward" not in imp and "on_policy/max_abs_log_ratio" not in imp
    assert imp["compute/ratio"] == 1.0 and full["compute/ratio"] == 1.0
    assert res["compute/rollout/forward"] == imp["compute/rollout/forward"] == full["compute/rollout/forward"]
    for weights in (w_res, w_imp):
        moved = max(float((weights[k] - w_full[k]).abs().max()) for k in w_full)
        assert 0 < moved < 1e-2, moved


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without FP8")
def test_flowrl_validate_refuses_fp8_rollouts_here_in_one_message(validate):
    code, err = validate(REPO / "recipes" / "quickstart_step.toml", "sampler.rollout_precision='fp8'",
                         "distributed.mixed_precision='bf16'")  # a run FP8 suits, on a machine without FP8
    assert code == 2 and err.startswith("error:") and "Traceback" not in err, err
    assert "[sampler].rollout_precision: rollout_precision = 'fp8': this run's device is cpu" in err
