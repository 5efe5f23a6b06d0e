"""KL regularisation in the update: the reference policy and the per-step KL pass.

The KL pass back-propagates one transition at a time; its gradient must equal the gradient of
the whole KL term built in one graph (computed here independently, by hand from the kernel's
Gaussian means), and the reference must be the model as it was before any update.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import final_weights, load, quiet_console
from tiny_recipe import write_recipe

from flowrl.chunking import chunk_index
from flowrl.interfaces import select_embeddings
from flowrl.runlog import read_metrics
from flowrl.sampling.rollout import make_kernels, rollout
from flowrl.sampling.schedules import shifted_sigmas
from flowrl.sampling.kernels import FlowKernel
from flowrl.train import train
from flowrl.train.finetune import prepare_trainable
from flowrl.objectives.kl import KLTerm, ReferencePolicy, frozen_copy
from flowrl.objectives.policy_gradient import TransitionScorer
from flowrl_plugins.embedded.plugin import EmbeddedConfig, EmbeddedModel


class _Train:  # the TrainConfig fields prepare_trainable reads
    def __init__(self, finetune):
        self.finetune, self.lora_rank, self.lora_alpha = finetune, 4, 8.0
        self.lora_targets, self.lora_init = [], "default"


def _setup(finetune):
    torch.manual_seed(0)
    model = EmbeddedModel(EmbeddedConfig(random_init=True, seed=3))
    params = prepare_trainable(model, _Train(finetune))
    reference = ReferencePolicy(model)
    prompts = ["a red circle on a blue background"] * 2 + ["a green square on a white background"] * 2
    text = model.encode_prompts(prompts)
    sigmas = shifted_sigmas(5, 3.0)
    kernels = make_kernels(5, FlowKernel(a=0.7))
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    noise = torch.stack([torch.randn(model.latent_shape, generator=g) for g in gens])
    traj = rollout(lambda x, s: model.velocity(x, s, text), noise, sigmas, kernels, generators=gens, prompts=prompts)
    # move the policy away from the reference so the KL and its gradient are not zero
    with torch.no_grad():
        for p in params:
            scale = float(p.std()) if p.numel() > 1 and float(p.std()) > 0 else 1.0  # LoRA B starts at 0
            p.add_(1e-2 * scale * torch.randn_like(p))
    return model, params, reference, text, traj


@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_reference_is_the_model_before_updates(finetune):
    model, params, reference, text, traj = _setup(finetune)
    x, s = traj.latents[:, 1], traj.sigmas[1].expand(4)
    fresh = EmbeddedModel(EmbeddedConfig(random_init=True, seed=3))
    with torch.no_grad():
        base = fresh.velocity(x, s, text)
        now = model.velocity(x, s, text)
    assert (now - base).abs().max() > 1e-4  # the policy moved
    torch.testing.assert_close(reference.velocity(x, s, text), base, rtol=0, atol=1e-5)
    assert not torch.is_grad_enabled() or reference.velocity(x, s, text).requires_grad is False


@pytest.mark.parametrize("kind", ["gaussian_exact", "flow_grpo", "old_policy_k3"])
@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_kl_pass_gradient_equals_one_graph(kind, finetune):
    model, params, reference, text, traj = _setup(finetune)
    sizes = (2, 2)
    mask = torch.tensor([[True, False], [True, True], [False, True], [True, True]])
    idx = torch.arange(4)
    beta, normaliser = 0.3, 4.0

    for p in params:
        p.grad = None
    scorer = TransitionScorer(model, traj, text, reference)
    value, term = KLTerm(scorer, idx, mask, sizes, traj.trainable_log_probs, kind, beta, normaliser).backward()
    lean = [p.grad.clone() for p in params]

    # Independent route: every trained transition in one graph, KL written out by hand.
    for p in params:
        p.grad = None
    trans = mask[:, chunk_index(sizes)]
    per_sample = trans.sum(1).float()
    total, kls = 0.0, []
    for t, i in enumerate(traj.trainable_indices.tolist()):
        b = torch.nonzero(trans[:, t]).flatten()
        x, nxt = traj.latents[b, i], traj.latents[b, i + 1]
        sig, sig_n = float(traj.sigmas[i]), float(traj.sigmas[i + 1])
        g = 0.7 * (sig / (1 - (sig_n if sig == 1.0 else sig))) ** 0.5
        std = g * (sig - sig_n) ** 0.5
        v = model.velocity(x, traj.sigmas[i].expand(len(b)), select_embeddings(text, b))
        x1_hat = x + (1 - sig) * v
        mean = x + (sig_n - sig) * (v + g**2 / (2 * sig) * x1_hat)
        if kind == "old_policy_k3":
            lp = (-(nxt - mean) ** 2 / (2 * std**2) - torch.log(torch.tensor(std)) - 0.5 * torch.log(torch.tensor(2 * torch.pi))).flatten(1).mean(1)
            z = (lp - traj.log_probs[b, i]).double()  # float64: exp(z) - 1 cancels badly for small z
            kl = torch.exp(z) - 1 - z
        else:
            with torch.no_grad():
                v_ref = reference.velocity(x, traj.sigmas[i].expand(len(b)), select_embeddings(text, b))
                mean_ref = x + (sig_n - sig) * (v_ref + g**2 / (2 * sig) * (x + (1 - sig) * v_ref))
            denom = 2 * std**2 if kind == "gaussian_exact" else 2 * g**2
            kl = ((mean - mean_ref) ** 2 / denom).flatten(1).mean(1)
        kls.append(kl.detach())
        total = total + (beta / normaliser) * (kl / per_sample[b]).sum()
    total.backward()
    assert beta * term == pytest.approx(float(total.detach()), rel=1e-5, abs=1e-12)  # the optimised term
    for a, b in zip(lean, [p.grad for p in params]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-9)
    # k3 is ~z^2/2 with z a difference of float32 log-probs: only ~1e-3 relative is meaningful
    rel = 1e-2 if kind == "old_policy_k3" else 1e-5
    assert value == pytest.approx(float(torch.cat(kls).mean()), rel=rel, abs=1e-12)
    if kind != "old_policy_k3":
        assert value > 0 and any(g.abs().max() > 0 for g in lean)


def test_training_with_kl_logs_it_and_starts_at_zero(tmp_path):
    recipe_path = write_recipe(tmp_path)
    recipe = load(recipe_path, f"run.output_dir={str(tmp_path / 'run')!r}", "loss.beta=0.1",
                  "loss.kl='gaussian_exact'", "train.iterations=2", "train.updates_per_rollout=1",
                  "train.optimizer_steps_per_update=1")
    records = read_metrics(train(recipe, console=quiet_console()))
    kls = [r["kl/gaussian_exact"] for r in records if "kl/gaussian_exact" in r]
    assert len(kls) == 2
    assert kls[0] < 1e-10 < kls[1]  # the policy starts at the reference, then moves away


@pytest.mark.parametrize("kind", ["gaussian_exact", "flow_grpo"])
@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_the_measured_kl_is_the_terms_without_any_gradient(kind, finetune):
    """[log].kl_every's measurement (KLTerm.measure) gives the same mean KL as the optimised
    term's pass over the same transitions, and leaves every gradient as it was."""
    model, params, reference, text, traj = _setup(finetune)
    sizes, idx = (2, 2), torch.arange(4)
    mask = torch.tensor([[True, False], [True, True], [False, True], [True, True]])
    scorer = TransitionScorer(model, traj, text, reference)
    for p in params:
        p.grad = None
    value, term = KLTerm(scorer, idx, mask, sizes, traj.trainable_log_probs, kind, 0.0, 4.0).measure()
    assert term == 0.0 and all(p.grad is None for p in params)
    optimised, _ = KLTerm(scorer, idx, mask, sizes, traj.trainable_log_probs, kind, 0.3, 4.0).backward()
    assert value > 0 and value == pytest.approx(optimised, rel=1e-6)


def _kl_monitor_run(tmp_path, name, *sets):
    recipe = load(write_recipe(tmp_path), f"run.output_dir={str(tmp_path / name)!r}", "loss.kl='gaussian_exact'",
                  "train.iterations=3", *sets)
    run = train(recipe, console=quiet_console())
    return run, read_metrics(run)


def test_kl_every_logs_the_kl_at_beta_0_and_trains_exactly_as_without(tmp_path):
    """With beta = 0, [log].kl_every = 2 logs kl/<kind> on iterations 0 and 2 only; everything
    the run trains and every other metric is bit for bit the run without it; the measurement
    itself equals the optimised term's KL of a run whose beta is too small to move a weight
    (a second route through the fast and chunk-graph paths); its reference forwards are expected
    work (compute/ratio stays 1) and its policy forwards are counted apart."""
    plain, plain_rows = _kl_monitor_run(tmp_path, "plain")
    watched, rows = _kl_monitor_run(tmp_path, "watched", "log.kl_every=2")
    assert [("kl/gaussian_exact" in r) for r in rows if "loss" in r] == [True, False, True]
    first, last = rows[0]["kl/gaussian_exact"], rows[2]["kl/gaussian_exact"]
    assert 0 <= first < last  # the policy drifts from the reference it started as
    for a, b in zip(plain_rows, rows):
        keys = {k for k in a if not k.startswith(("time/", "compute/"))}
        assert keys == {k for k in b if not k.startswith(("time/", "compute/", "kl/"))}
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    weights, watched_weights = final_weights(plain), final_weights(watched)
    assert weights.keys() == watched_weights.keys() and all(torch.equal(weights[k], watched_weights[k]) for k in weights)
    ref = rows[0]["compute/reference/forward"]
    assert ref > 0 and "compute/reference/forward" not in plain_rows[0]
    assert rows[0]["compute/minimum"] == plain_rows[0]["compute/minimum"] + ref
    assert rows[0]["compute/ratio"] == plain_rows[0]["compute/ratio"] == 1.0
    assert rows[0]["compute/kl_monitor/forward"] == ref and "compute/kl_monitor/forward" not in plain_rows[0]
    assert "compute/reference/forward" not in rows[1]  # not measured in iteration 1
    # its seconds are reported apart, outside the update's and the throughput's
    assert rows[0]["time/kl_monitor"] > 0 and "time/kl_monitor" not in rows[1]
    assert not any("time/kl_monitor" in r for r in plain_rows)

    _, tiny_beta = _kl_monitor_run(tmp_path, "tiny_beta", "loss.beta=1e-30")
    assert tiny_beta[0]["kl/gaussian_exact"] == pytest.approx(first, rel=1e-5, abs=1e-12)


def test_a_replayed_rollout_is_not_measured_again(tmp_path):
    """[replay] trains kept rollouts again in later iterations: the KL is measured on each
    iteration's own rollout only (no replay/kl/*), and the replayed update trains as without it."""
    sets = ["replay.size=2", "replay.max_staleness=2", "train.optimizer_steps_per_update=1"]
    plain, plain_rows = _kl_monitor_run(tmp_path, "plain", *sets)
    watched, rows = _kl_monitor_run(tmp_path, "watched", *sets, "log.kl_every=1")
    trained = [r for r in rows if "loss" in r]
    assert all("kl/gaussian_exact" in r for r in trained)
    assert any(k.startswith("replay/") for r in trained for k in r), "nothing was replayed"
    assert not any(k.startswith("replay/kl/") for r in rows for k in r)
    weights, watched_weights = final_weights(plain), final_weights(watched)
    assert all(torch.equal(weights[k], watched_weights[k]) for k in weights)


def test_kl_every_must_fall_on_logged_iterations(tmp_path):
    from flowrl.errors import RecipeError

    with pytest.raises(RecipeError, match=r"kl_every = 5 is not a multiple of \[log\].every = 2") as err:
        load(write_recipe(tmp_path), "log.kl_every=5", "log.every=2")
    assert "kl_every = 4" in err.value.hint
    assert load(write_recipe(tmp_path), "log.kl_every=4", "log.every=2").log.kl_every == 4


def test_the_docs_kl_every_example_trains_and_logs_the_kl_on_its_iterations(tmp_path):
    """docs/recipes.md's [log].kl_every example, as written, on the training tests' recipe."""
    import re
    import tomllib

    from engine_helpers import REPO
    from tiny_recipe import ENGINE, tiny_recipe

    text = (REPO / "docs" / "recipes.md").read_text()
    block = tomllib.loads(re.search(r"```toml\n(\[loss\]\nuse = \"clipped\"\nbeta = 0\.0\n.*?)```", text, re.S).group(1))
    assert block["log"] == {"kl_every": 5}
    path = write_recipe(tmp_path, tiny_recipe(ENGINE, **block, train={"iterations": 6}))
    rows = read_metrics(train(load(path, f"run.output_dir={str(tmp_path / 'run')!r}"), console=quiet_console()))
    assert [r["iteration"] for r in rows if "kl/gaussian_exact" in r] == [0, 5]


def test_frozen_copy_is_made_in_the_asked_dtype_and_keeps_the_module_as_it_was():
    """The KL reference's copy (flowrl.objectives.kl.frozen_copy): floating-point parameters and
    buffers in the asked dtype (the diffusers adapters' compute dtype), integer ones as they are,
    shared tensors still shared, nothing trainable; the original untouched; a ``meta`` module
    (a process that receives rank 0's weights) copied without storage."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 4))
    net.register_buffer("steps", torch.arange(3))
    net.register_buffer("scale", torch.ones(2))
    net[0].weight.requires_grad_(True)
    ref = frozen_copy(net, torch.bfloat16)
    assert {p.dtype for p in ref.parameters()} == {torch.bfloat16} and ref.scale.dtype == torch.bfloat16
    assert ref.steps.dtype == torch.int64 and torch.equal(ref.steps, net.steps)
    assert torch.equal(ref[0].weight, net[0].weight.detach().to(torch.bfloat16))
    assert not any(p.requires_grad for p in ref.parameters()) and not ref.training
    assert {p.dtype for p in net.parameters()} == {torch.float32} and net[0].weight.requires_grad
    shared = torch.nn.Linear(3, 3)
    tied = torch.nn.ModuleList([shared, shared])
    copied = frozen_copy(tied, torch.bfloat16)
    assert copied[0].weight is copied[1].weight and copied[0].weight is not shared.weight
    same = frozen_copy(net)  # no dtype: as stored (the engine's own copy)
    assert {p.dtype for p in same.parameters()} == {torch.float32}
    with torch.device("meta"):
        empty = torch.nn.Linear(4, 4)
    assert frozen_copy(empty, torch.bfloat16).weight.is_meta


@pytest.mark.parametrize("on_cpu", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_under_bf16_autocast_the_reference_computes_as_the_policy_does(tmp_path, on_cpu):
    """mixed_precision = 'bf16' (none/ddp) runs the policy under autocast; the frozen reference
    must run under it too, or the KL at the first step, where policy and reference are the same
    weights, is the two precisions' difference (it was 7e-6, and trained on). Also with the
    reference kept in CPU memory."""
    from engine_helpers import REPO

    sets = ["loss.beta=0.05", "loss.kl='gaussian_exact'", "distributed.mixed_precision='bf16'",
            "train.on_policy_tolerance=1e-2", "train.iterations=1", "prompts.num_eval=2", "log.image_every=0",
            f"train.reference_on_cpu={str(on_cpu).lower()}", f"run.output_dir={str(tmp_path / 'run')!r}"]
    recipe = load(REPO / "recipes" / "quickstart_step.toml", *sets)
    assert recipe.train.finetune == "full" and recipe.train.optimizer_steps_per_update == 1
    (row,) = [r for r in read_metrics(train(recipe, console=quiet_console())) if "loss" in r]
    assert row["kl/gaussian_exact"] == 0.0
