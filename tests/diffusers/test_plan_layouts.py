"""``flowrl plan`` per strategy: FSDP2 (full and hybrid sharding, CPU offload), DDP, 8-bit AdamW
and the CPU reference, each against the arithmetic of the layout it claims (no GPU, no weights).
How close these closed forms come to torch's own memory accounting is benchmarks/memory_plan.py's
job (docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.errors import FlowrlError
from flowrl.memory_plan import PROMPT_CACHE, cpu_bytes, estimate, peak
from flowrl.plugins import get_registry
from flowrl.recipe import load_recipe

FLAGSHIP = "recipes/chunk_grpo_flux.toml"


def _plan(overrides: list[str], world: int, nodes: int = 1, recipe: str = FLAGSHIP):
    registry = get_registry()
    r = load_recipe(recipe, overrides, registry=registry)
    _, mm, lines = estimate(r, registry, world, nodes)
    return mm, {l.item: l for l in lines}, lines


def test_fsdp2_divides_the_trained_state_by_the_processes_and_adds_its_buffers():
    mm, by, lines = _plan([], 8)
    p, n = mm.denoiser_params, 8
    assert by["denoiser weights"].bytes == pytest.approx(4 * p / n)  # fp32 master shards
    assert by["AdamW state (2 moments)"].bytes == pytest.approx(8 * p / n)
    assert by["gradients (sharded)"].bytes == pytest.approx(4 * p / n) and by["gradients (sharded)"].phase == "step"
    assert by["AdamW step temporary"].bytes == pytest.approx(4 * p / n)
    # every backward of a step accumulates into unsharded fp32 gradients (one reduce-scatter per step)
    assert by["gradients (unsharded, accumulating)"].bytes == pytest.approx(4 * p)
    b, r = mm.largest_block_params, mm.outside_block_params
    assert 300e6 < b < 400e6 and r < 100e6  # FLUX.1-dev: a double block, and the root
    assert by["FSDP2 gathered parameters"].bytes == pytest.approx(2 * (r + 3 * b))
    assert by["FSDP2 reduce-scatter buffers"].bytes == pytest.approx(6 * b)
    total, worst = peak(lines)
    assert worst == "update" and total < 80 * 1024**3


def test_hybrid_sharding_shards_within_a_node_only():
    _, full8, _ = _plan([], 8)
    _, hybrid, _ = _plan(["distributed.shard=hybrid"], 16, nodes=2)
    _, full16, _ = _plan([], 16)
    assert hybrid["denoiser weights"].bytes == pytest.approx(full8["denoiser weights"].bytes)
    assert full16["denoiser weights"].bytes == pytest.approx(full8["denoiser weights"].bytes / 2)
    with pytest.raises(FlowrlError, match="evenly"):
        _plan(["distributed.shard=hybrid"], 12, nodes=5)


def test_cpu_offload_moves_the_sharded_state_off_the_gpu():
    _, on_gpu, gpu_lines = _plan([], 8)
    _, by, lines = _plan(["distributed.cpu_offload=true"], 8)
    for item in ("denoiser weights", "AdamW state (2 moments)"):
        assert by[item].phase == "cpu" and by[item].bytes == pytest.approx(on_gpu[item].bytes)
    assert "AdamW step temporary" not in by  # the step runs on the CPU
    # the prompt-embedding cache is in CPU memory with or without the offload
    assert cpu_bytes(lines) == pytest.approx(on_gpu["denoiser weights"].bytes + on_gpu["AdamW state (2 moments)"].bytes
                                             + by[PROMPT_CACHE].bytes)
    assert peak(lines)[0] < peak(gpu_lines)[0]


def test_ddp_replicates_and_8bit_adamw_quarters_the_moments():
    mm, by, _ = _plan(["distributed.strategy=ddp"], 8)
    assert by["denoiser weights"].bytes == pytest.approx(4 * mm.denoiser_params)
    assert by["gradients"].phase == "persistent" and "FSDP2 gathered parameters" not in by
    _, eight, _ = _plan(["distributed.strategy=ddp", "train.optimizer=adamw_8bit"], 8)
    assert eight["AdamW state (2 moments), 8-bit"].bytes == pytest.approx(by["AdamW state (2 moments)"].bytes / 4)


def test_the_kl_reference_is_sharded_like_the_denoiser_or_kept_on_the_cpu():
    kl = ["loss.beta=0.01", "loss.kl=gaussian_exact"]
    mm, by, _ = _plan(kl, 8)
    # in the bf16 compute dtype, as DiffusersAdapter.snapshot_reference keeps it (the fp32 master
    # weights are the trained denoiser's alone; counted in fp32 before, twice what is held)
    assert mm.reference_bytes == 2 and mm.denoiser_bytes == 4
    assert by["reference copy (KL)"].bytes == pytest.approx(2 * mm.denoiser_params / 8)
    assert by["reference copy (KL)"].phase == "persistent"
    _, cpu, _ = _plan(kl + ["train.reference_on_cpu=true"], 8)
    assert cpu["reference copy (KL)"].phase == "cpu"
    # under ddp the copy is taken from the denoiser already on the GPU, then moved to CPU memory:
    # whole on the GPU at start-up (sharded under fsdp2, each block visits alone instead)
    from flowrl.memory_plan import startup_peak

    ddp_mm, ddp, ddp_lines = _plan(kl + ["train.reference_on_cpu=true", "distributed.strategy=ddp"], 8)
    assert ddp["reference copy taken on the GPU"].bytes == pytest.approx(2 * mm.denoiser_params)
    assert ddp["reference copy taken on the GPU"].phase == "start-up"
    assert startup_peak(ddp_lines, ddp_mm) == pytest.approx(
        ddp["denoiser weights"].bytes + 2 * mm.denoiser_params + ddp["CUDA context + allocator slack"].bytes)
    assert "reference copy taken on the GPU" not in cpu and "reference copy taken on the GPU" not in _plan(
        kl + ["distributed.strategy=ddp"], 8)[1]  # on the GPU for good: counted as held


def test_kl_every_keeps_and_counts_the_reference_at_beta_0():
    """[log].kl_every measures the KL to the reference at beta = 0: full fine-tuning then keeps
    the same frozen copy a KL term does, and the plan counts it."""
    mm, by, _ = _plan(["loss.kl=gaussian_exact", "log.kl_every=10"], 8)
    assert by["reference copy (KL)"].bytes == pytest.approx(2 * mm.denoiser_params / 8)
    assert "reference copy (KL)" not in _plan(["loss.kl=gaussian_exact"], 8)[1]


def test_the_ema_shadow_is_counted_in_float32_sharded_like_the_weights_or_on_the_cpu():
    """[ema] keeps a float32 shadow of every trained parameter (flowrl.train.ema): on the device
    (sharded under fsdp2) or in CPU memory; evaluating it sets the trained weights aside."""
    mm, by, lines = _plan(["ema.enabled=true"], 8)
    p = mm.denoiser_params  # full fine-tuning: every parameter is trained
    assert by["EMA weights"].bytes == pytest.approx(4 * p / 8) and by["EMA weights"].phase == "persistent"
    assert "trained weights set aside (EMA evaluation)" not in by
    _, off, off_lines = _plan([], 8)
    assert "EMA weights" not in off and peak(lines)[0] > peak(off_lines)[0]
    _, lora, _ = _plan(["ema.enabled=true", "ema.on_cpu=true", "ema.evaluate=true"], 1,
                       recipe="recipes/chunk_grpo_flux_lora.toml")
    assert lora["EMA weights"].phase == "cpu"
    assert lora["EMA weights"].bytes == pytest.approx(lora["LoRA weights"].bytes)  # fp32 LoRA: the same size
    assert lora["trained weights set aside (EMA evaluation)"].bytes == pytest.approx(lora["LoRA weights"].bytes)


def test_nfts_velocity_kl_reference_is_counted_like_the_kl_terms():
    """DiffusionNFT with ``beta_kl > 0`` runs the engine's frozen reference (NeedsReferencePolicy),
    which the plan did not count: it is a copy of the denoiser like a KL term's, sharded under
    fsdp2, in CPU memory with [train].reference_on_cpu, and absent without a velocity KL or with
    LoRA (the base with the adapter off). A reference that keeps no copy (kl = 'old_policy_k3')
    is not counted either."""
    nft = Path(__file__).resolve().parents[2] / "recipes" / "quickstart_nft.toml"
    mm, by, _ = _plan(["loss.beta_kl=0.01"], 1, recipe=nft)
    assert by["reference copy (KL)"].bytes == pytest.approx(mm.denoiser_params * mm.denoiser_bytes)
    assert by["reference copy (KL)"].phase == "persistent"
    _, sharded, _ = _plan(["loss.beta_kl=0.01", "distributed.strategy=fsdp2"], 2, recipe=nft)
    assert sharded["reference copy (KL)"].bytes == pytest.approx(by["reference copy (KL)"].bytes / 2)
    _, cpu, _ = _plan(["loss.beta_kl=0.01", "train.reference_on_cpu=true"], 1, recipe=nft)
    assert cpu["reference copy (KL)"].phase == "cpu"
    for overrides in ([], ["loss.beta_kl=0.01", "train.finetune=lora"]):
        assert "reference copy (KL)" not in _plan(overrides, 1, recipe=nft)[1]
    assert "reference copy (KL)" not in _plan(["loss.beta=0.01", "loss.kl=old_policy_k3"], 8)[1]


def test_strategy_none_on_several_processes_is_refused():
    with pytest.raises(FlowrlError, match="one process"):
        _plan(["distributed.strategy=none"], 8)


def test_gradient_sync_per_backward_keeps_fsdp2_gradients_sharded():
    """[distributed].gradient_sync: 'step' plans a full-size float32 gradient (4P) during the
    update; 'micro_batch' plans the shard (4P/N) instead; 'auto' takes 'step' where it fits the
    stated GPU memory and 'micro_batch' where it does not (the flagship on 80 and 40 GB)."""
    from flowrl.memory_plan import GB, choose_gradient_sync, estimate, peak
    from flowrl.plugins import get_registry
    from flowrl.recipe import load_recipe

    registry = get_registry()
    flagship = Path(__file__).resolve().parents[2] / "recipes" / "chunk_grpo_flux.toml"

    def plan(sync, memory=None):
        r = load_recipe(flagship, [f"distributed.gradient_sync='{sync}'"], registry=registry)
        _, mm, lines = estimate(r, registry, 8, gpu_memory=memory)
        return {l.item: l.bytes for l in lines if l.phase == "update"}, peak(lines)[0], mm.notes[0]

    step, step_peak, _ = plan("step")
    each, each_peak, note = plan("micro_batch")
    params = 11_901_408_320  # FLUX.1-dev transformer: exact parameter count
    assert step["gradients (unsharded, accumulating)"] == pytest.approx(4 * params, rel=1e-3)
    assert each["gradients (sharded, accumulating)"] == pytest.approx(4 * params / 8, rel=1e-3)
    assert "gradients (unsharded, accumulating)" not in each and "after every backward" in note
    assert each_peak < 40 * GB < step_peak <= 80 * GB
    recipe = load_recipe(flagship, [], registry=registry)
    assert choose_gradient_sync(recipe, registry, 8, gpu_memory=80 * GB)[0] == "step"
    assert choose_gradient_sync(recipe, registry, 8, gpu_memory=40 * GB)[0] == "micro_batch"
    assert choose_gradient_sync(recipe, registry, 8, gpu_memory=None)[0] == "step"  # a CPU: no limit known
    assert plan("auto", 40 * GB)[1] == each_peak and plan("auto", 80 * GB)[1] == step_peak


def test_start_up_and_host_memory_are_planned():
    """fsdp2 places the denoiser a block at a time as it shards it: the start-up peak per GPU
    is the shards plus one whole block, far below the whole float32 model; host memory per node
    counts the CPU copies of the model while it loads (under fsdp2 rank 0's alone, and with a KL
    term the reference's copy; under ddp every process's), and the offloaded state held for the
    whole run."""
    from flowrl.memory_plan import host_lines, startup_peak

    registry = get_registry()
    flagship = Path(__file__).resolve().parents[2] / "recipes" / "chunk_grpo_flux.toml"
    r = load_recipe(flagship, ["loss.beta=0.01"], registry=registry)
    _, mm, lines = estimate(r, registry, 8)
    by = {l.item: l for l in lines}
    whole = mm.denoiser_params * 4
    # the denoiser's float32 blocks visit before the reference's shards exist; the reference's
    # blocks (bf16, the compute dtype) visit on top of them: the larger of the two
    ref_shards = by["reference copy (KL)"].bytes
    assert by["one block placed whole while sharding"].bytes == max(mm.largest_block_params * 4 - ref_shards,
                                                                    mm.largest_block_params * 2)
    for overrides in ([], ["loss.beta=0.01", "train.reference_on_cpu=true"]):  # no reference shards on the GPU
        _, _, other = estimate(load_recipe(flagship, overrides, registry=registry), registry, 8)
        assert {l.item: l.bytes for l in other}["one block placed whole while sharding"] == mm.largest_block_params * 4
    start = startup_peak(lines, mm)
    expected = (by["denoiser weights"].bytes + by["reference copy (KL)"].bytes + by["one block placed whole while sharding"].bytes
                + by["CUDA context + allocator slack"].bytes)  # encoders and the reward are offloaded
    assert start == pytest.approx(expected) and start < whole / 2 < peak(lines)[0]
    host = {l.phase: l for l in host_lines(r, mm, lines, 8)}
    # only rank 0 loads the denoiser and takes the reference's copy: one of each on the node, not
    # one per process (the others receive each block as it is sharded; encoders are offloaded);
    # the copy is made in the bf16 compute dtype, tensor by tensor (flowrl.objectives.kl.frozen_copy)
    ref = mm.denoiser_params * 2
    assert host["loading"].bytes == pytest.approx(whole + ref)
    assert "rank 0 alone loads the denoiser" in host["loading"].note
    frozen = sum(p * b for p, b in mm.frozen.values())
    assert host["held"].bytes == pytest.approx(8 * (frozen + by["reward 'hpsv3'"].bytes + by[PROMPT_CACHE].bytes))
    # two nodes: half the processes, half the held memory on each; rank 0's node still loads one copy
    two_nodes = {l.phase: l.bytes for l in host_lines(r, mm, lines, 8, 2)}
    assert two_nodes["held"] == pytest.approx(host["held"].bytes / 2) and two_nodes["loading"] == pytest.approx(whole + ref)
    # encoders kept on the GPU: every process loads its own before placing them
    r1 = load_recipe(flagship, ["loss.beta=0.01", "model.offload_encoders=false"], registry=registry)
    _, mm1, lines1 = estimate(r1, registry, 8)
    assert {l.phase: l.bytes for l in host_lines(r1, mm1, lines1, 8)}["loading"] == pytest.approx(whole + ref + 8 * frozen)
    # one fsdp2 process loads the model and takes the reference's copy itself
    _, mm2, lines2 = estimate(r, registry, 1)
    assert {l.phase: l.bytes for l in host_lines(r, mm2, lines2, 1)}["loading"] == pytest.approx(whole + ref)
    # without a KL term no reference copy; ddp places the whole model, so no start-up transient
    # line, and every process loads the whole model
    r0 = load_recipe(flagship, ["distributed.strategy='ddp'"], registry=registry)
    _, mm0, lines0 = estimate(r0, registry, 8)
    assert not [l for l in lines0 if l.phase == "start-up"]
    assert {l.phase: l.bytes for l in host_lines(r0, mm0, lines0, 8)}["loading"] == pytest.approx(8 * whole)


def test_grouped_update_forwards_keep_that_many_steps_of_activations():
    """``[train].update_group = 4``: four steps of a chunk in one forward with grad keep four
    times the update's activations; an objective without units (DiffusionNFT) has no steps to group."""
    def update_activations(overrides, recipe=FLAGSHIP):
        return _plan(overrides, 8 if recipe == FLAGSHIP else 1, recipe=recipe)[1]["activations, forward with grad"]

    one, four = update_activations([]), update_activations(["train.update_group=4"])
    assert four.bytes == pytest.approx(4 * one.bytes) and "4 steps per forward" in four.note
    nft = "recipes/quickstart_nft.toml"
    assert update_activations(["train.update_group=4"], nft).bytes == update_activations([], nft).bytes


def test_fp8_rollouts_plan_the_denoisers_copy():
    """``[sampler].rollout_precision = "fp8"``: the rollout's copy of the denoiser, made in the
    stored dtype before it is quantised, is a rollout-phase line of its own."""
    mm, without, _ = _plan([], 1, recipe="recipes/lora_single_gpu_sd3.toml")
    _, with_fp8, _ = _plan(["sampler.rollout_precision='fp8'"], 1, recipe="recipes/lora_single_gpu_sd3.toml")
    assert "FP8 copy of the denoiser" not in without
    line = with_fp8["FP8 copy of the denoiser"]
    assert line.phase == "rollout" and line.bytes == mm.denoiser_params * mm.denoiser_bytes


def test_the_plan_finds_the_largest_update_group_that_fits():
    """``largest_update_group``: the estimate at that group fits the budget and one more step does
    not (below the largest chunk, which caps it); an objective without units has none."""
    from flowrl.memory_plan import largest_update_group

    registry = get_registry()
    r = load_recipe(FLAGSHIP, registry=registry)  # chunks of at most 7 steps
    lines = estimate(r, registry, 8)[2]
    base = peak(lines)[0]
    step = {l.item: l for l in lines}["activations, forward with grad"].bytes
    budget = base + 2.5 * step  # 3 steps fit if the update phase is the peak, 4 do not
    k = largest_update_group(r, lines, budget, registry)
    assert k is not None and 1 <= k < 7
    fit = lambda g: peak(estimate(load_recipe(FLAGSHIP, [f"train.update_group={g}"], registry=registry),  # noqa: E731
                                  registry, 8)[2])[0]
    assert fit(k) <= budget < fit(k + 1)
    assert largest_update_group(r, lines, base * 100, registry) == 7  # the largest chunk caps it
    assert largest_update_group(r, lines, base / 2, registry) is None
    nft = load_recipe("recipes/quickstart_nft.toml", registry=registry)
    assert largest_update_group(nft, estimate(nft, registry, 1)[2], 1e15, registry) is None


def test_docs_distributed_md_states_the_flagships_largest_update_group():
    """docs/distributed.md: "7 for recipes/chunk_grpo_flux.toml with --gpu-memory 80" (its largest chunk)."""
    from flowrl.memory_plan import GB, largest_update_group

    registry = get_registry()
    r = load_recipe(FLAGSHIP, registry=registry)
    assert largest_update_group(r, estimate(r, registry, 8)[2], 80 * GB, registry) == 7
    doc = (Path(__file__).resolve().parents[2] / "docs" / "distributed.md").read_text(encoding="utf-8")
    assert "7 for `recipes/chunk_grpo_flux.toml` with `--gpu-memory 80`" in doc
