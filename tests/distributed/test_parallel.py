"""flowrl.train.parallel: strategies, gradient reduction, sharded checkpoints, bf16.

The multi-process checks run ``parallel_worker.py`` in 2 gloo processes forked from the test
process and set up as torchrun sets up its workers (tests/forked_workers.py; never mp.spawn, whose
gloo + FSDP2 teardown aborts in a few percent of runs: the workers end with ``os._exit``), each
launch bounded in time, and read what the workers wrote. One process on the same global batch is
the reference; across process counts gradients are summed in another order, which AdamW amplifies on
near-zero gradients: the weights agree to TOL (measured here: under 1e-7).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from flowrl.distributed import check_launch_environment
from flowrl.errors import FlowrlError, RecipeError
from flowrl.recipe import DistributedConfig, load_recipe
from flowrl.sampling.kernels import CPSKernel, DanceKernel, FlowKernel, gaussian_log_prob
from flowrl.train.parallel import (
    Strategy,
    Topology,
    checkpoint_blocks,
    mesh_layout,
    resolve_strategy,
    transformer_blocks,
)

from bf16_tolerance import bf16_on_policy_tolerance, log_prob_sensitivity  # tests/distributed/bf16_tolerance.py

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("parallel_worker.py")
TOL = 1e-5  # AdamW, lr 1e-2, 2 steps, 2 processes vs 1 (environment of the module docstring)


# ----------------------------------------------------------------------------- the launcher and the recipe


def settings(**kw):
    return DistributedConfig(**kw)


def test_launcher_settings_that_agree_pass():
    check_launch_environment(settings(), {})
    check_launch_environment(settings(), {"ACCELERATE_MIXED_PRECISION": "no"})
    check_launch_environment(settings(mixed_precision="bf16"), {"ACCELERATE_MIXED_PRECISION": "bf16"})
    fsdp = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
            "FSDP_OFFLOAD_PARAMS": "true", "FSDP_ACTIVATION_CHECKPOINTING": "false"}
    check_launch_environment(settings(strategy="fsdp2", cpu_offload=True), fsdp)
    check_launch_environment(settings(strategy="auto"), dict(fsdp, FSDP_OFFLOAD_PARAMS="false"))
    hybrid = dict(fsdp, FSDP_OFFLOAD_PARAMS="false", ACCELERATE_USE_PARALLELISM_CONFIG="true",
                  PARALLELISM_CONFIG_DP_REPLICATE_SIZE="2")
    check_launch_environment(settings(strategy="fsdp2", shard="hybrid"), hybrid)


@pytest.mark.parametrize("config, env, both", [
    ({"strategy": "ddp"}, {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, ("ACCELERATE_USE_FSDP=true", "'ddp'")),
    ({}, {"ACCELERATE_MIXED_PRECISION": "bf16"}, ("=bf16", "mixed_precision = 'no'")),
    ({"mixed_precision": "bf16"}, {"ACCELERATE_MIXED_PRECISION": "no"}, ("=no", "mixed_precision = 'bf16'")),
    ({"strategy": "fsdp2"}, {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "true"},
     ("FSDP_OFFLOAD_PARAMS=true", "cpu_offload = false")),
    ({"strategy": "fsdp2", "activation_checkpointing": True},
     {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_ACTIVATION_CHECKPOINTING": "false"},
     ("FSDP_ACTIVATION_CHECKPOINTING=false", "activation_checkpointing = true")),
    ({"strategy": "fsdp2"}, {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
                             "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2"}, ("DP_REPLICATE_SIZE=2", "shard = 'full'")),
])
def test_a_launcher_setting_that_disagrees_names_both_values(config, env, both):
    with pytest.raises(FlowrlError) as err:
        check_launch_environment(settings(**config), env)
    text = err.value.format()
    assert all(part in text for part in both), text


@pytest.mark.parametrize("env, what", [
    ({"ACCELERATE_USE_DEEPSPEED": "true"}, "DeepSpeed"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, "FSDP2 only"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP"}, "FSDP1 setting"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "false"}, "reshard"),
    ({"ACCELERATE_MIXED_PRECISION": "fp16"}, "bf16 only"),
    ({"ACCELERATE_USE_FSDP": "maybe"}, "neither true nor false"),
])
def test_launcher_settings_flowrl_does_not_implement_are_refused(env, what):
    with pytest.raises(FlowrlError, match=what):
        check_launch_environment(settings(strategy="auto"), env)


def test_sharding_options_need_fsdp2_in_the_recipe():
    qs = REPO / "recipes" / "quickstart_hacking.toml"
    for override in ("distributed.shard='hybrid'", "distributed.cpu_offload=true", "distributed.gradient_sync='micro_batch'",
                     "distributed.gradient_sync='step'"):
        with pytest.raises(RecipeError, match="needs strategy = 'fsdp2'"):
            load_recipe(qs, [override])
    recipe = load_recipe(qs, ["distributed.strategy='fsdp2'", "distributed.shard='hybrid'", "distributed.mixed_precision='bf16'"])
    assert recipe.distributed.shard == "hybrid" and recipe.to_toml_dict()["distributed"]["mixed_precision"] == "bf16"


def test_auto_resolves_from_the_launcher_and_the_process_count():
    assert resolve_strategy(settings(), 1, {}) == "none"
    assert resolve_strategy(settings(), 2, {}) == "ddp"
    assert resolve_strategy(settings(), 2, {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}) == "fsdp2"
    assert resolve_strategy(settings(strategy="fsdp2"), 1, {}) == "fsdp2"
    with pytest.raises(FlowrlError, match="runs one process"):
        resolve_strategy(settings(strategy="none"), 2, {})


def test_mesh_layout():
    assert mesh_layout("full", Topology(0, 8, 4)) == ((8,), ("shard",))
    assert mesh_layout("hybrid", Topology(0, 8, 4)) == ((2, 4), ("replicate", "shard"))
    with pytest.raises(FlowrlError, match="same number of processes on every node"):
        mesh_layout("hybrid", Topology(0, 6, 4))


# ----------------------------------------------------------------------------- blocks


class Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.sub_blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4)])  # inside a block: not a block

    def forward(self, h):
        return h + self.sub_blocks[0](torch.tanh(self.lin(h)))


class Tower(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(4, 4)
        self.transformer_blocks = torch.nn.ModuleList([Inner(), Inner()])
        self.single_transformer_blocks = torch.nn.ModuleList([Inner()])
        self.heads = torch.nn.ModuleList([torch.nn.Linear(4, 4)])  # not named *blocks

    def forward(self, x):
        h = self.embed(x)
        for b in [*self.transformer_blocks, *self.single_transformer_blocks]:
            h = b(h)
        return self.heads[0](h)


def test_blocks_are_found_generically_outermost_first():
    tower = Tower()
    found = transformer_blocks(tower)
    assert [id(b) for b in found] == [id(b) for b in [*tower.transformer_blocks, *tower.single_transformer_blocks]]
    assert transformer_blocks(tower, [tower.transformer_blocks[1]]) == [tower.transformer_blocks[1]]
    with pytest.raises(FlowrlError, match="submodules of its denoiser"):
        transformer_blocks(tower, [torch.nn.Linear(2, 2)])


def test_embedded_flux_blocks_are_found():
    from flowrl_plugins.embedded.network import EmbeddedT2I

    torch.manual_seed(0)
    transformer = EmbeddedT2I().transformer
    names = {id(m): n for n, m in transformer.named_modules()}
    assert [names[id(b)] for b in transformer_blocks(transformer)] == [
        "transformer_blocks.0", "single_transformer_blocks.0", "single_transformer_blocks.1"]


def test_activation_checkpointing_keeps_names_outputs_and_gradients():
    torch.manual_seed(0)
    plain, ckpt = Tower(), Tower()
    ckpt.load_state_dict(plain.state_dict())
    checkpoint_blocks(transformer_blocks(ckpt))
    checkpoint_blocks(transformer_blocks(ckpt))  # twice: once
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in ckpt.named_parameters()]
    x = torch.randn(3, 4)
    plain(x).square().sum().backward()
    ckpt(x).square().sum().backward()
    for p, q in zip(plain.parameters(), ckpt.parameters()):
        assert torch.equal(p.grad, q.grad)
    with torch.no_grad():
        assert torch.equal(plain(x), ckpt(x))


def test_a_copy_of_a_checkpointed_model_runs_its_own_weights():
    """[pipeline]'s rollout copy and FP8 rollouts deep-copy the prepared denoiser: each copied
    block's checkpointed forward must run the copy's weights, not the original's (a closure over
    the original's bound forward made the rollouts follow the weights being trained)."""
    import copy

    torch.manual_seed(0)
    original = Tower()
    checkpoint_blocks(transformer_blocks(original))
    rollout_copy = copy.deepcopy(original)
    x = torch.randn(3, 4)
    with torch.no_grad():
        before = rollout_copy(x)
        for p in original.parameters():
            p.add_(1.0)
        assert torch.equal(rollout_copy(x), before)
        assert not torch.equal(original(x), before)
    rollout_copy(x).square().sum().backward()  # the copy's gradients land on the copy
    assert all(p.grad is not None for p in rollout_copy.parameters())
    assert all(p.grad is None for p in original.parameters())


def test_one_process_strategy_steps_like_plain_torch():
    """strategy 'none': accumulate() adds nothing, clip_grad_norm_ equals torch's."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    torch.manual_seed(0)
    a, b = Tower(), Tower()
    b.load_state_dict(a.state_dict())
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    strategy = Strategy(DistributedConfig(strategy="none"), "none", torch.device("cpu"), Topology())
    module = strategy.prepare(b, torch.optim.AdamW(b.parameters(), lr=1e-2))
    x = torch.randn(4, 4)
    for _ in range(2):
        opt_a.zero_grad()
        strategy.zero_grad()
        with strategy.accumulate():
            for i in range(4):
                module(x[i : i + 1]).sum().backward()
        for i in range(4):
            a(x[i : i + 1]).sum().backward()
        assert strategy.clip_grad_norm_(0.1) == pytest.approx(float(torch.nn.utils.clip_grad_norm_(a.parameters(), 0.1)), rel=1e-6)
        opt_a.step()
        strategy.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=1e-7, rtol=0)
    AcceleratorState._reset_state()


# ----------------------------------------------------------------------------- bf16 tolerance


def test_log_prob_sensitivity_matches_the_flow_kernels_closed_form():
    """Flow kernel: c = dt (1 + a^2 / 2), s = a sqrt(sigma / (1 - sigma)) sqrt(sigma - sigma_next)."""
    for a, sig, sig_n in ((0.7, 0.5, 0.4375), (0.3, 0.9, 0.8), (1.0, 0.2, 0.1)):
        c, s = log_prob_sensitivity(FlowKernel(a=a), sig, sig_n)
        assert c == pytest.approx((sig_n - sig) * (1 + a * a / 2), rel=1e-6)
        assert s == pytest.approx(a * math.sqrt(sig / (1 - sig)) * math.sqrt(sig - sig_n), rel=1e-6)


@pytest.mark.parametrize("kernel", [FlowKernel(a=0.7), DanceKernel(eta=0.3), CPSKernel(a=0.7)], ids=repr)
def test_the_bf16_tolerance_bounds_the_exact_log_prob_change(kernel):
    """Second route: the log-prob change computed directly in float64 from a perturbed velocity
    never exceeds the bound, and the bound is not loose by more than the Cauchy-Schwarz step."""
    g = torch.Generator().manual_seed(0)
    sig, sig_n, D = 0.6, 0.55, 3072
    x = torch.randn(1, D, generator=g, dtype=torch.float64)
    v = torch.randn(1, D, generator=g, dtype=torch.float64) * 1.7
    c, s = log_prob_sensitivity(kernel, sig, sig_n)
    mean = kernel.step(v.float(), x.float(), sig, sig_n, next_sample=x.float()).mean.double()
    eps = torch.randn(1, D, generator=g, dtype=torch.float64)
    nxt = mean + s * eps
    for rho in (2.0**-8, 2.0**-4):
        delta = -rho * v.abs() * torch.sign(eps) * torch.sign(torch.tensor(c))  # the worst-aligned direction
        exact = gaussian_log_prob(nxt, mean + c * delta, torch.tensor([s], dtype=torch.float64)) - gaussian_log_prob(
            nxt, mean, torch.tensor([s], dtype=torch.float64))
        bound = bf16_on_policy_tolerance([kernel], torch.tensor([sig, sig_n]), torch.tensor([True]),
                                         velocity_rms=float(v.pow(2).mean().sqrt()), latent_numel=D, rho=rho,
                                         noise_rms=float(eps.pow(2).mean().sqrt()))
        assert abs(float(exact)) <= bound * (1 + 1e-6)
        assert abs(float(exact)) >= 0.5 * bound  # aligned: Cauchy-Schwarz is nearly tight


# ----------------------------------------------------------------------------- 2 processes


def _run(mode: str, out: Path, num_processes: int, timeout: float = 240) -> None:
    """``parallel_worker.py MODE OUT`` in ``num_processes`` processes forked from this one, set up
    as torchrun sets up its workers (tests/forked_workers.py); they share this process's imports."""
    from forked_workers import fork_workers

    import parallel_worker

    def work() -> int:
        for key in list(os.environ):  # what an accelerate launch would have told the strategies
            if key.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")):
                os.environ.pop(key)
        return parallel_worker.main()

    try:
        proc = fork_workers(work, num_processes, timeout=timeout, cwd=REPO, argv=[str(WORKER), mode, str(out)])
    except subprocess.TimeoutExpired:
        pytest.fail(f"{mode} did not finish in {timeout} s")
    if proc.returncode != 0:
        reports = [p.read_text() for p in sorted(out.glob(f"{mode}-rank*.json"))]
        log = (proc.stdout + proc.stderr)[-4000:]
        pytest.fail(f"{mode} exited {proc.returncode}:\n{log}\n{''.join(reports)[-4000:]}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("parallel")
    _run("train", out, 2)
    _run("resume", out, 2)
    _run("single", out, 1, timeout=120)
    ranks = {mode: [json.loads((out / f"{mode}-rank{r}.json").read_text()) for r in range(2 if mode != "single" else 1)]
             for mode in ("train", "resume", "single")}
    return SimpleNamespace(out=out, train=ranks["train"], resume=ranks["resume"],
                           tensors=lambda name: load_file(str(out / f"{name}.safetensors")))


def test_metric_reductions_agree_when_processes_hold_different_metrics(tmp_path):
    """A key only one process has (its evaluation, its phase) is combined over the processes that
    have it, identically on each, instead of handing the backend tensors of different lengths."""
    _run("collectives", tmp_path, 2)
    r0, r1 = (json.loads((tmp_path / f"collectives-rank{r}.json").read_text()) for r in range(2))
    assert r0["ok"] and r1["ok"], (r0.get("error"), r1.get("error"))
    assert r0["reduced"] == r1["reduced"] == {"both": 1.5, "low": 2.0, "high": 3.0, "only_rank0": 5.0}
    assert r0["empty"] == r1["empty"] == {"late": 2.0}
    assert r0["compute"] == r1["compute"]
    assert r0["compute"]["compute/eval/forward"] == 4.0 and r0["compute"]["compute/rollout/forward"] == 20.0
    assert r0["summed"] == r1["summed"] == [2.0, 1.0]


def test_grouped_update_forwards_divide_fsdp2_all_gathers_by_the_group_size(tmp_path):
    """``[train].update_group = 4`` on 2 processes under FSDP2: a unit of 4 steps in one forward
    and one backward instead of four gathers every FSDP2 group's weights a quarter as often, and
    gives the same gradients to float32 rounding."""
    _run("grouped", tmp_path, 2)
    for r in range(2):
        res = json.loads((tmp_path / f"grouped-rank{r}.json").read_text())
        assert res["ok"], res.get("error")
        assert res["forwards"] == {"1": 4, "4": 1}
        # one forward and backward gathers the FSDP2 groups 6 times (a later pass 7): four passes against one
        gathers = res["gathers"]
        assert gathers["4"] > 0 and 4 * gathers["4"] <= gathers["1"] <= 4 * (gathers["4"] + 1), gathers
        assert res["grad_max_diff"] <= 1e-6 * max(1.0, res["grad_max"]), res


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", "fsdp2", "hybrid", "fsdp2_ckpt_offload", "ddp_ckpt", "fsdp2_lora",
                                  "fsdp2_sync_each"])
def test_two_processes_equal_one_process_with_the_same_global_batch(runs, name):
    """Two AdamW steps, 8 backwards per step per process, clipped: weights and the global grad
    norms agree with one process that runs the whole batch (torch's clip_grad_norm_)."""
    r = runs.train[0][name]
    assert r["max_diff"] <= TOL, r["max_diff"]
    for step, ref in zip(r["steps"], r["ref_norms"]):
        assert step["norm"] == pytest.approx(ref, rel=1e-5)
    assert runs.train[1][name]["steps"][0]["norm"] == r["steps"][0]["norm"]  # the same on every process


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp2", "fsdp2_ckpt_offload", "fsdp2_lora"])
def test_fsdp2_parameters_really_are_sharded(runs, name):
    """Not DDP in disguise: every parameter a DTensor with Shard(0), half of it per process;
    with LoRA the frozen base is sharded too, and only the LoRA matrices train."""
    shards = runs.train[0][name]["shards"]
    assert shards["all_dtensor"] and shards["placements"] == ["(Shard(dim=0),)"]
    assert shards["local_numel"] * 2 == shards["full_numel"]
    if name == "fsdp2_lora":
        assert shards["frozen_sharded"] == 16 and runs.train[0][name]["trainable"] == 12
    assert runs.train[0]["bf16_fsdp2"]["shards"]["all_dtensor"]  # the embedded FLUX denoiser too


@pytest.mark.slow
def test_hybrid_sharding_is_a_two_dimensional_mesh(runs):
    """Two 'nodes' of one process each: replicated across nodes, sharded within (1 here)."""
    assert runs.train[0]["hybrid"]["shards"]["placements"] == ["(Replicate(), Shard(dim=0))"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_gradients_are_reduced_once_per_optimizer_step(runs, kind):
    """4, 8 or 16 backwards per step: no gradient collective during them, and the same ones on
    leaving accumulate(): one flat all-reduce (DDP, one bucket), one reduce-scatter per FSDP
    group (3 blocks and the root)."""
    steps = runs.train[0][f"counts_{kind}"]
    assert [s["backwards"] for s in steps] == [4, 8, 16]
    expected = {"ddp": {"allreduce_": 1}, "fsdp2": {"_reduce_scatter_base_": runs.train[0]["counts_fsdp2_groups"]}}[kind]
    for s in steps:
        assert s["grad_collectives_inside"] == 0
        assert s["on_exit"] == expected
        if kind == "ddp":
            assert s["inside"] == {}  # no collective at all in a DDP forward or backward
    for name in ("ddp", "fsdp2", "hybrid", "fsdp2_lora"):  # the training runs too
        assert all(s["grad_collectives_inside"] == 0 for s in runs.train[0][name]["steps"])


@pytest.mark.slow
def test_fsdp2_moves_one_block_at_a_time_to_the_device(runs):
    """Shard before moving: preparing FSDP2 moves each block alone (then shards it), never the
    whole denoiser, so the device holds at most one block's full weights during start-up (a
    whole float32 FLUX.1-dev is 47.6 GB)."""
    placement = runs.train[0]["placement"]
    assert len(placement["moved"]) == placement["blocks"]
    assert max(placement["moved"]) <= placement["largest_block"] < placement["whole"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["received", "received_lora"])
def test_fsdp2_gives_a_process_built_without_weights_rank_0s(runs, name):
    """Only rank 0 loads the weights: process 1 builds the model (and the frozen KL copy of it) on
    the meta device, holding no parameter storage, and FSDP2's preparation fills each block with
    rank 0's weights as it shards it. Gathered, both equal the one-process model bit for bit."""
    r0, r1 = (runs.train[r][name] for r in (0, 1))
    assert r0["held_before"]["net"] > 0 and not r0["held_before"]["meta"]
    assert r1["held_before"] == {"net": 0, "meta": True}
    assert not r0["meta_after"] and not r1["meta_after"]
    assert r0["equal"] and r0["frozen_equal"] and r1["frozen_equal"]


@pytest.mark.slow
def test_fsdp2_gradient_sync_per_micro_batch_reduce_scatters_every_backward(runs):
    """[distributed].gradient_sync = 'micro_batch': each of the 4, 8 or 16 backwards of a step
    reduce-scatters every FSDP group into sharded gradients (no full-size gradient is kept),
    and leaving accumulate() reduces nothing more; the weights equal one process's (the test
    above, 'fsdp2_sync_each')."""
    steps = runs.train[0]["counts_fsdp2_sync_each"]
    groups = runs.train[0]["counts_fsdp2_groups"]
    assert [s["backwards"] for s in steps] == [4, 8, 16]
    for s in steps:
        assert s["inside"].get("_reduce_scatter_base_") == groups * s["backwards"]
        assert s["grad_collectives_on_exit"] == 0


@pytest.mark.slow
def test_a_process_without_samples_keeps_fsdp2_in_lockstep(runs):
    """One process runs its forwards and backwards on 0 samples: gradients still exact."""
    assert runs.train[0]["empty_rank"] <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_bf16_run_passes_its_on_policy_check(runs, kind):
    """bf16 compute (autocast / MixedPrecisionPolicy), fp32 master weights: re-scoring the same
    batch reproduces the rollout's log-probs exactly; sub-batches (as the update re-scores)
    stay within the derived tolerance; the compute really is bf16."""
    for rank in runs.train:
        r = rank[f"bf16_{kind}"]
        assert r["same_batch"] == 0.0
        assert r["sub_batch"] <= r["tolerance"]
        assert r["bf16_vs_fp32_velocity"] > 1e-3  # bf16 rounding is visible against fp32
        assert r["v_dtype"] == "torch.float32" and r["dtypes"] == ["torch.float32"]
        assert r["blocks"] == 3 and math.isfinite(r["norm"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", "fsdp2", "fsdp2_lora"])
def test_sharded_checkpoint_resumes_bitwise(runs, name):
    """Saved after step 1, the processes ended; fresh processes load it and run step 2: equal,
    bit for bit, to the run that was never interrupted."""
    uninterrupted = runs.tensors(f"train-{name}_step2")
    resumed = runs.tensors(f"resume-{name}_step2")
    assert set(resumed) == set(uninterrupted)
    assert all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted)
    saved = runs.tensors(f"train-{name}_step1")
    assert all(torch.equal(saved[k], runs.tensors(f"resume-{name}_loaded")[k]) for k in saved)
    assert runs.resume[0][name]["state"] == {"iteration": 1, "world_size": 2, "strategy": name.split("_")[0], "format": "dcp"}
    files = sorted(p.name for p in (runs.out / f"ckpt_{name}" / "iter_000001" / "sharded").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # each process wrote its part


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", "fsdp2", "fsdp2_lora"])
def test_a_two_process_checkpoint_resumes_in_one_process(runs, name):
    """DCP reshards: loaded exactly; step 2 on the whole batch agrees within TOL; `flowrl
    export`'s offline reader gives the same full tensors."""
    saved = runs.tensors(f"train-{name}_step1")
    for which in ("loaded", "offline"):
        got = runs.tensors(f"single-{name}_{which}")
        assert set(got) == set(saved) and all(torch.equal(saved[k], got[k]) for k in saved)
    two, one = runs.tensors(f"train-{name}_step2"), runs.tensors(f"single-{name}_step2")
    assert max(float((two[k] - one[k]).abs().max()) for k in two) <= TOL


@pytest.mark.slow
def test_an_fsdp2_checkpoint_loads_into_ddp(runs):
    saved, got = runs.tensors("train-fsdp2_step1"), runs.tensors("resume-fsdp2_into_ddp_loaded")
    assert all(torch.equal(saved[k], got[k]) for k in saved)


# ----------------------------------------------------------------------------- docs/distributed.md


DOC = REPO / "docs" / "distributed.md"


def _code_blocks(lang: str) -> list[str]:
    import re

    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)


def _commands() -> list[list[str]]:
    """The page's bash command lines, each without the VAR=value assignments before it."""
    import shlex

    out = []
    for block in _code_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                argv = shlex.split(line)
                while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
                    argv = argv[1:]
                out.append(argv)
    return out


def _accelerate_env(argv: list[str]) -> dict[str, str]:
    """The environment `accelerate launch ARGV` gives its processes (accelerate's own code)."""
    from flowrl.compat import ensure_torchvision_importable

    ensure_torchvision_importable()  # the accelerate CLI imports timm, hence torchvision
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = _validate_launch_command(launch_command_parser().parse_args(argv))[0]
    return {k: v for k, v in prepare_multi_gpu_env(args).items()
            if k.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")) or k not in os.environ}


def _flowrl_recipe(argv: list[str]):
    """The validated recipe of a `flowrl train RECIPE --set ...` (or `flowrl doctor RECIPE ...`)
    command line."""
    args = argv[argv.index("train" if "train" in argv else "doctor") + 1:]
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    return load_recipe(REPO / args[0], sets)


def test_docs_toml_blocks_validate():
    base = tomllib.loads((REPO / "recipes" / "quickstart_hacking.toml").read_text())
    blocks = _code_blocks("toml")
    assert len(blocks) == 4  # the table, hybrid sharding, context parallelism, its ring
    for block in blocks:
        from flowrl.recipe import validate

        recipe = validate({**base, **tomllib.loads(block)}, source=str(DOC))
        assert recipe.distributed.strategy == "fsdp2"


def test_docs_fsdp2_yaml_agrees_with_the_docs_table(tmp_path):
    (yaml,) = _code_blocks("yaml")
    (tmp_path / "fsdp2.yaml").write_text(yaml)
    env = _accelerate_env(["--config_file", str(tmp_path / "fsdp2.yaml"), "-m", "flowrl", "train", "recipe.toml"])
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    table = DistributedConfig(**tomllib.loads(_code_blocks("toml")[0])["distributed"])
    check_launch_environment(table, env)
    with pytest.raises(FlowrlError, match="activation_checkpointing = false"):
        check_launch_environment(DistributedConfig(strategy="fsdp2", mixed_precision="bf16"), env)


def test_docs_command_lines_agree_with_their_recipes():
    """Every launch command of the page (and the doctor command run before one): its recipe and
    --set overrides validate, and for `accelerate launch` the environment accelerate exports
    agrees with the recipe."""
    commands = _commands()
    launchers = {argv[0] for argv in commands}
    assert launchers == {"flowrl", "torchrun", "accelerate"}, launchers
    for argv in commands:
        recipe = _flowrl_recipe(argv)
        if argv[0] == "accelerate":
            check_launch_environment(recipe.distributed, _accelerate_env(argv[2:]))
    two_nodes = [a for a in commands if "--nnodes" in a or ("--num_machines" in a and a[a.index("--num_machines") + 1] == "2")]
    hybrid = [_flowrl_recipe(a).distributed for a in two_nodes]
    assert len(hybrid) == 2 and all(d.shard == "hybrid" and d.strategy == "fsdp2" for d in hybrid)


def test_nested_declared_blocks_are_refused():
    tower = Tower()
    with pytest.raises(FlowrlError, match="none inside another"):
        transformer_blocks(tower, [tower.transformer_blocks[0], tower.transformer_blocks[0].lin])


def test_activation_checkpointing_saves_fewer_tensors():
    """Inside a checkpointed block only its input is kept for the backward."""
    def saved(model):
        count = [0]

        def pack(t):
            count[0] += 1
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.randn(3, 4)).sum()
        return count[0]

    torch.manual_seed(0)
    tower = Tower()
    before = saved(tower)
    checkpoint_blocks(transformer_blocks(tower))
    assert saved(tower) < before


def test_one_process_sharded_and_legacy_checkpoints_round_trip(tmp_path):
    """strategy 'none' without a process group: a DCP checkpoint and a checkpoint in the
    single-process safetensors layout both restore weights and AdamW state exactly."""
    from accelerate.state import AcceleratorState

    from flowrl.train.checkpoint import save_checkpoint
    from flowrl.train.finetune import trainable_state_dict
    from flowrl.train.checkpoint import load_sharded_checkpoint, save_sharded_checkpoint

    def trained():
        AcceleratorState._reset_state()
        torch.manual_seed(0)
        tower = Tower()
        strategy = Strategy(DistributedConfig(strategy="none"), "none", torch.device("cpu"), Topology())
        strategy.prepare(tower, torch.optim.AdamW(tower.parameters(), lr=1e-2))
        return strategy

    a = trained()
    with a.accumulate():
        a.module(torch.randn(2, 4)).sum().backward()
    a.step()
    save_sharded_checkpoint(tmp_path / "dcp", "iter_000001", a, state={"iteration": 1}, recipe_toml="")
    save_checkpoint(tmp_path / "legacy", "iter_000001", model=trainable_state_dict(a.module),
                    optimizer=a.optimizer.state_dict(), state={"iteration": 1}, recipe_toml="")
    for root in ("dcp", "legacy"):
        b = trained()
        state = load_sharded_checkpoint(tmp_path / root / "iter_000001", b)
        assert state["iteration"] == 1
        for p, q in zip(a.module.parameters(), b.module.parameters()):
            assert torch.equal(p, q)
            assert torch.equal(a.optimizer.state[p]["exp_avg_sq"], b.optimizer.state[q]["exp_avg_sq"])
    AcceleratorState._reset_state()
