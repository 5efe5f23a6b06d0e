"""The Wan 2.2 A14B adapters (``wan22_a14b``: a high- and a low-noise expert switched at the
pipeline's ``boundary_ratio``; ``wan22_a14b_i2v``: the same with a condition image) on tiny offline
two-expert pipelines: the conformance suite, diffusers' own two-expert sampling
(WanPipeline, WanImageToVideoPipeline) with an Euler scheduler on flowrl's sigmas, the routing of
each row and its CFG weight against the experts called directly, which expert trains, the memory
plan of both experts, a 2-iteration LoRA run on the shipped recipe and its exports, which
WanPipeline loads into both experts and reproduces, and both experts under FSDP2 on two
processes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from wan_helpers import euler_on_flowrl_grid, image_prompts, ode_frames

from flowrl.errors import FlowrlError
from flowrl.runlog import read_metrics
from flowrl.testing.conformance import CHECK_NAMES, check_adapter

PROMPTS = ("a red cat", "the blue dog on the mat")
# shift 5 with 5 steps: sigmas 1, .952, .882 on the high-noise expert (1000 sigma >= 875), .769, .556 on the low
TINY = dict(dtype="fp32", height=32, width=32, num_frames=5, max_sequence_length=16, flow_shift=5.0)
RECIPE = "recipes/wan22_a14b_lora.toml"
LATENT = (4, 2, 8, 8)  # build_tiny_wan's geometry
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_a14b(tiny_dir):
    from flowrl.testing.tiny_pipelines import build_tiny_wan22_a14b

    return build_tiny_wan22_a14b(tiny_dir / "wan22_a14b")


@pytest.fixture(scope="module")
def make(tiny_a14b):
    from flowrl_plugins.diffusers_models.wan_a14b import Wan22A14BConfig, Wan22A14BModel

    return lambda **kw: Wan22A14BModel(Wan22A14BConfig(**{"path": str(tiny_a14b), **TINY, **kw}))


@pytest.fixture(scope="module")
def guided(make):
    """CFG 4 on the high-noise expert, 3 on the low (the A14B defaults). Do not modify it."""
    return make()


def _euler_on_flowrl_grid(pipe, shift: float = 5.0):
    return euler_on_flowrl_grid(pipe, shift)


def _pipe_frames(pipe, prompts, noise, cfg=(4.0, 3.0), steps=5):
    return pipe(prompt=list(prompts), negative_prompt="", height=32, width=32, num_frames=5,
                num_inference_steps=steps, guidance_scale=cfg[0], guidance_scale_2=cfg[1], latents=noise,
                output_type="pt", max_sequence_length=16).frames


def _ode_frames(model, prompts, noise, steps=5):
    return ode_frames(model, prompts, noise, steps)


def _counting_calls(*modules):
    """Forward hooks counting each module's calls; returns (counts, remove)."""
    counts = [0] * len(modules)
    handles = [m.register_forward_hook(lambda *a, i=i: counts.__setitem__(i, counts[i] + 1))
               for i, m in enumerate(modules)]
    return counts, lambda: [h.remove() for h in handles]


# ---- conformance, the pipeline's own sampling, routing ----------------------------------------


def test_conforms(guided):
    report = check_adapter(guided)
    notes = {r.name: r.message for r in report.results}
    assert [r.name for r in report.results] == list(CHECK_NAMES)
    assert notes["decode"].startswith("clips (5, 3, 32, 32)")


def test_sampling_equals_the_two_expert_wan_pipeline(guided):
    # the boundary, each expert's CFG weight, the shifted schedule and the decode: all at once,
    # against WanPipeline with transformer_2 and boundary_ratio; both experts run in both
    noise = torch.randn(2, *LATENT, generator=torch.Generator().manual_seed(0))
    experts = (guided.pipe.transformer, guided.pipe.transformer_2)
    counts, remove = _counting_calls(*experts)
    ours = _ode_frames(guided, PROMPTS, noise)
    assert counts == [3, 2], counts  # one batch [uncond; cond] per step: 3 steps high, 2 low
    counts[:] = [0, 0]
    ref = _pipe_frames(_euler_on_flowrl_grid(guided.pipe), PROMPTS, noise)
    remove()
    assert counts == [6, 4], counts  # the pipeline runs cond and uncond as two calls
    assert ((ref > 0) & (ref < 1)).float().mean() > 0.3, "the comparison needs unclamped pixels"
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    # the second expert matters: the same run with the first expert at every step differs
    with torch.no_grad():
        alone = _pipe_frames(_euler_on_flowrl_grid(guided.pipe), PROMPTS, noise, cfg=(4.0, 4.0))
    assert (alone - ref).abs().max() > 1e-3


def test_each_row_goes_to_the_expert_of_its_timestep_with_its_cfg_weight(guided):
    # one batch with rows on both sides of the boundary (a grouped update, NFT's random times)
    # against each expert called directly on its rows, combined with its own CFG weight
    text = guided.encode_prompts(PROMPTS * 2)
    x = torch.randn(4, *LATENT, generator=torch.Generator().manual_seed(2))
    sigma = torch.tensor([0.95, 0.30, 0.875, 0.874])  # high, low, high (on the boundary), low
    with torch.no_grad():
        v = guided.velocity(x, sigma, text)
        for i, (expert, w) in enumerate([(guided.pipe.transformer, 4.0), (guided.pipe.transformer_2, 3.0),
                                         (guided.pipe.transformer, 4.0), (guided.pipe.transformer_2, 3.0)]):
            v_c, v_u = (expert(hidden_states=x[i:i + 1], timestep=sigma[i:i + 1] * 1000.0,
                               encoder_hidden_states=text[key][i:i + 1], return_dict=False)[0]
                        for key in ("prompt_embeds", "negative_prompt_embeds"))
            torch.testing.assert_close(v[i:i + 1], v_u + w * (v_c - v_u), atol=1e-5, rtol=1e-5)


def test_a_one_transformer_pipeline_is_refused(tiny_dir):
    from flowrl.testing.tiny_pipelines import build_tiny_wan
    from flowrl_plugins.diffusers_models.wan_a14b import Wan22A14BConfig, Wan22A14BModel

    path = build_tiny_wan(tiny_dir / "wan_for_a14b")
    with pytest.raises(FlowrlError, match="not a two-expert Wan 2.2 pipeline") as info:
        Wan22A14BModel(Wan22A14BConfig(path=str(path), **TINY))
    assert "model 'wan'" in info.value.hint


# ---- which expert trains -------------------------------------------------------------------


@pytest.mark.parametrize("which, prefixes", [("both", {"transformer", "transformer_2"}), ("high", {"transformer"}),
                                             ("low", {"transformer_2"})])
def test_train_experts_chooses_the_lora_and_the_full_weights_that_train(make, which, prefixes):
    from types import SimpleNamespace

    from flowrl.train.finetune import prepare_trainable

    train = SimpleNamespace(finetune="lora", lora_targets=[], lora_rank=2, lora_alpha=2.0, lora_init="default")
    lora = make(train_experts=which)
    names = [n for n, p in lora.denoiser.named_parameters() if p.requires_grad]
    assert not names
    prepare_trainable(lora, train)
    trained = {n for n, p in lora.denoiser.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert {n.split(".")[0] for n in trained} == prefixes
    assert {n.split(".")[0] for n, _ in lora.denoiser.named_parameters() if "lora_" in n} == prefixes  # none elsewhere
    full = make(train_experts=which)
    prepare_trainable(full, SimpleNamespace(**{**vars(train), "finetune": "full"}))
    trained = {n.split(".")[0] for n, p in full.denoiser.named_parameters() if p.requires_grad}
    frozen = {n.split(".")[0] for n, p in full.denoiser.named_parameters() if not p.requires_grad}
    assert trained == prefixes and frozen == {"transformer", "transformer_2"} - prefixes


def test_the_plan_holds_both_experts_and_counts_the_trained_ones(tiny_a14b):
    from flowrl_plugins.diffusers_models.memory.wan import wan_memory_spec
    from flowrl_plugins.diffusers_models.wan import WanConfig, wan_lora_targets
    from flowrl_plugins.diffusers_models.wan_a14b import Wan22A14BConfig

    def spec(which, **kw):
        return Wan22A14BConfig(train_experts=which, **kw).memory_spec()  # the published configs, built in

    both, high = spec("both"), spec("high")
    one = wan_memory_spec(WanConfig(path="Wan-AI/Wan2.1-T2V-14B-Diffusers"), wan_lora_targets("attention"))
    assert both.denoiser_params == high.denoiser_params == 2 * one.denoiser_params  # both held either way
    assert both.trainable_params == 2 * high.trainable_params == 2 * one.denoiser_params
    assert len(both.lora_shapes) == 2 * len(high.lora_shapes) == 2 * len(one.lora_shapes)
    assert all(n.startswith("transformer.") for n in high.lora_shapes)
    assert both.per_block == one.per_block  # one expert runs per forward: one expert's activations
    # a local pipeline's configs are read from its directory the same way
    tiny = spec("low", path=str(tiny_a14b), **TINY)
    assert tiny.denoiser_params == 2 * tiny.trainable_params
    assert tiny.denoiser_params == 2 * wan_memory_spec(WanConfig(path=str(tiny_a14b), **TINY), ["to_q"]).denoiser_params
    assert tiny.lora_shapes and all(n.startswith("transformer_2.") for n in tiny.lora_shapes)


# ---- the recipe, trained; its export --------------------------------------------------------

_SETS = ["model.height=32", "model.width=32", "model.num_frames=5", "model.max_sequence_length=16",
         "model.dtype=fp32", "model.vae_batch_size=8", "model.gradient_checkpointing=false", "model.flow_shift=5.0",
         "sampler.steps=5", "chunker.sizes=[2, 2]", "selector.fraction=1.0",
         "distributed.num_processes=1", "distributed.strategy=auto", "distributed.mixed_precision=no",
         "train.iterations=2", "train.prompts_per_iteration=1", "train.group_size=2", "train.micro_batch_size=2",
         "train.optimizer_steps_per_update=1", "rewards.0.use=brightness", "log.progress=false", "log.image_every=1",
         "run.device=cpu", "train.lora_rank=4", "train.lora_alpha=8.0", "train.lr=0.05", "train.max_grad_norm=0"]


@pytest.fixture(scope="module")
def lora_run(module_cli, tiny_a14b, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "a14b_lora"
    sets = []
    for item in [f"model.path={tiny_a14b}", *_SETS]:
        sets += ["--set", item]
    code, text = module_cli.merged("train", RECIPE, *sets, "-o", out)
    assert code == 0, text
    return out


def test_recipe_trains_both_experts_two_iterations(lora_run):
    from safetensors.torch import load_file

    from flowrl.recipe import load_recipe

    recipe = load_recipe(RECIPE)
    assert recipe.components["model"].use == "wan22_a14b" and recipe.train.finetune == "lora"
    records = read_metrics(lora_run)
    assert [r["iteration"] for r in records] == [0, 1]
    assert all(r["on_policy/max_abs_log_ratio"] <= 1e-6 for r in records)
    state = load_file(str(lora_run / "checkpoints" / "iter_000002" / "model.safetensors"))
    assert state and all("lora_" in k for k in state)
    for expert in ("transformer.", "transformer_2."):
        moved = [v.abs().max() > 0 for k, v in state.items() if k.startswith(expert) and "lora_B" in k]
        assert moved and any(moved), f"{expert}* LoRA B never moved"


def test_lora_export_loads_into_both_experts_and_reproduces_the_policy(lora_run, tiny_a14b, module_cli, tmp_path):
    from diffusers import WanPipeline

    from flowrl.commands.inference import load_policy, resolve_source
    from flowrl_plugins.diffusers_models.wan_a14b import LORA_FILES

    out = tmp_path / "lora"
    code, text = module_cli.merged("export", lora_run, "-o", out)
    assert code == 0, text
    info = json.loads((out / "flowrl_export.json").read_text())
    assert info["format"] == "diffusers_lora" and info["iteration"] == 2
    assert all((out / name).is_file() for name in LORA_FILES.values())
    noise = torch.randn(1, *LATENT, generator=torch.Generator().manual_seed(5))
    base = _pipe_frames(_euler_on_flowrl_grid(WanPipeline.from_pretrained(tiny_a14b)), PROMPTS[:1], noise)
    # docs/models.md's loading snippet, as written but for the two paths
    doc = (REPO / "docs" / "models.md").read_text(encoding="utf-8")
    section = doc[doc.index("## Video: Wan 2.2 T2V A14B"):].split("\n## ", 1)[0]
    (snippet,) = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert '"Wan-AI/Wan2.2-T2V-A14B-Diffusers"' in snippet and LORA_FILES["transformer_2"] in snippet
    namespace: dict = {}
    exec(snippet.replace('"Wan-AI/Wan2.2-T2V-A14B-Diffusers"', repr(str(tiny_a14b)))
         .replace('"export_dir"', repr(str(out))), namespace)
    tuned = _pipe_frames(_euler_on_flowrl_grid(namespace["pipe"]), PROMPTS[:1], noise)
    assert (tuned - base).abs().max() > 1e-3, "the exported LoRA does not change the pipeline's output"
    # the hub model card's snippet (flowrl export --push-to-hub), the repository being the export
    from flowrl.hub import how_to_load

    card = "\n".join(how_to_load(info, "me/x")[1:-1]).replace('"me/x"', repr(str(out)))
    assert "load_into_transformer_2=True" in card and repr(str(tiny_a14b)) in card.replace('"', "'")
    exec(card, carded := {})
    torch.testing.assert_close(_pipe_frames(_euler_on_flowrl_grid(carded["pipe"]), PROMPTS[:1], noise), tuned,
                               atol=0, rtol=0)
    policy = load_policy(resolve_source(lora_run, None, [], None), "cpu")
    torch.testing.assert_close(tuned, _ode_frames(policy, PROMPTS[:1], noise), atol=1e-5, rtol=0)


# ---- FSDP2: processes whose rows need different experts --------------------------------------

# each process's rows: on rank 0 all on the high-noise expert, on rank 1 all on the low-noise one
RANK_SIGMAS = ([0.95, 0.90], [0.30, 0.60])


def _lora_model(make):
    from types import SimpleNamespace

    from flowrl.train.finetune import prepare_trainable

    torch.manual_seed(7)  # the LoRA's A matrices
    model = make(cfg_scale=1.0, cfg_scale_2=1.0)
    params = prepare_trainable(model, SimpleNamespace(finetune="lora", lora_targets=[], lora_rank=2, lora_alpha=2.0,
                                                      lora_init="gaussian"))
    return model, params


def _rank_inputs(model, rank):
    text = model.encode_prompts(PROMPTS)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2, *LATENT, generator=g)
    target = torch.randn(2, *LATENT, generator=g)
    return x, torch.tensor(RANK_SIGMAS[rank]), text, target


def test_fsdp2_processes_whose_rows_need_different_experts_stay_in_step_and_sum_right(make, tmp_path):
    # Rank 0 needs only the high-noise expert, rank 1 only the low: without the agreement each
    # would gather other blocks than the other and wait forever. Two gloo processes, FSDP2 through
    # the engine's Strategy: a no-grad forward (a rollout) and a forward + backward (an update)
    # equal one process computing both ranks' rows, and the gradients their mean.
    from forked_workers import fork_workers
    from safetensors.torch import load_file, save_file

    from flowrl.recipe import DistributedConfig
    from flowrl.train.parallel import Strategy, Topology, declared_blocks

    def work() -> int:
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        model, params = _lora_model(make)
        strategy = Strategy(DistributedConfig(strategy="fsdp2"), "fsdp2", torch.device("cpu"),
                            Topology(rank=rank, world_size=2, local_world_size=2))
        model.denoiser = strategy.prepare(model.denoiser, torch.optim.SGD(params, lr=0.0), declared_blocks(model))
        x, sigma, text, target = _rank_inputs(model, rank)
        with torch.no_grad():
            rollout = model.velocity(x, sigma, text)
        (model.velocity(x, sigma, text) * target).sum().backward()
        grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                 for n, p in model.denoiser.named_parameters() if p.requires_grad}
        save_file({"rollout": rollout.contiguous()}, str(tmp_path / f"rollout{rank}.safetensors"))
        if rank == 0:
            save_file({n: g.contiguous() for n, g in grads.items()}, str(tmp_path / "grads.safetensors"))
        dist.barrier()
        dist.destroy_process_group()
        return 0

    proc = fork_workers(work, 2, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    model, _ = _lora_model(make)
    loss = 0.0
    for rank in (0, 1):
        x, sigma, text, target = _rank_inputs(model, rank)
        with torch.no_grad():
            torch.testing.assert_close(load_file(str(tmp_path / f"rollout{rank}.safetensors"))["rollout"],
                                       model.velocity(x, sigma, text), atol=1e-6, rtol=1e-5)
        loss = loss + (model.velocity(x, sigma, text) * target).sum() / 2  # FSDP2 averages over the processes
    loss.backward()
    grads = load_file(str(tmp_path / "grads.safetensors"))
    names = {n: p for n, p in model.denoiser.named_parameters() if p.requires_grad}
    assert set(grads) == set(names)
    for expert in ("transformer.", "transformer_2."):  # each expert's gradient comes from one process's rows only
        assert any(names[n].grad.abs().max() > 0 for n in names if n.startswith(expert))
    for n, p in names.items():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-6, rtol=1e-5)


NFT_RECIPE = """
[run]
name = "a14b_nft"
seed = 3
[model]
use = "wan22_a14b"
path = "{path}"
height = 32
width = 32
num_frames = 5
max_sequence_length = 16
dtype = "fp32"
vae_batch_size = 8
flow_shift = 5.0
[sampler]
steps = 5
image_from = "final"
[schedule]
use = "model"
[window]
use = "ode"
[advantage]
use = "group_zscore"
[loss]
use = "nft"
timesteps = 1
[train]
iterations = 2
prompts_per_iteration = 2
group_size = 2
micro_batch_size = 1
finetune = "lora"
lora_rank = 4
lora_alpha = 8.0
# AdamW turns rounding-level gradient differences (sums in another order) into steps of lr: a
# small lr and a large eps keep them at rounding level (tests/train/test_engine_fsdp2.py)
lr = 1e-3
adam_eps = 1e-4
[prompts]
source = "{prompts}"
num_eval = 2
eval_seeds = 1
[log]
progress = false
eval_every = 1
image_every = 1
[checkpoint]
every = 1
[[rewards]]
use = "brightness"
"""


@pytest.mark.slow  # the default run keeps the worker-level test above, which catches the same defect
def test_two_fsdp2_processes_equal_one_with_random_timesteps_per_sample(tiny_a14b, tmp_path):
    # The engine's whole path with both experts sharded: DiffusionNFT draws each sample's training
    # timestep at random (one per sample, micro-batches of one), so the processes' forwards need
    # different experts; rollouts, the update, evaluation, images and sharded checkpoints equal one
    # process. Without the agreement in TwoExperts.forward this run does not hang: the experts'
    # blocks have equal shapes, so gloo pairs one process's gathers of one expert with the other's
    # of the other expert and both compute with mixed shards (measured: nft/positive 1.5522 vs
    # 1.5491 on one process).
    from engine_helpers import assert_records_close, assert_weights_close, load, quiet_console, run_forked_workers

    from flowrl.train import train
    from flowrl.train.checkpoint import latest_checkpoint, read_model_weights

    recipe = tmp_path / "a14b_nft.toml"
    recipe.write_text(NFT_RECIPE.format(path=tiny_a14b, prompts=REPO / "recipes" / "prompts" / "general.txt"))
    two, one = tmp_path / "two", tmp_path / "one"
    args = ["--set", "distributed.num_processes=2", "--set", "distributed.strategy=fsdp2"]
    proc = run_forked_workers(["train", recipe, *args, "-o", two], 2, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    train(load(recipe, f"run.output_dir={str(one)!r}"), console=quiet_console())
    assert (latest_checkpoint(two) / "sharded").is_dir()
    rec2, rec1 = read_metrics(two), read_metrics(one)
    assert [r["iteration"] for r in rec2] == [r["iteration"] for r in rec1] == [0, 1, 2]  # 2 iterations, final eval
    for a, b in zip(rec2, rec1):
        for key in [k for k in a if k.startswith("compute/") or k == "world_size"]:
            a.pop(key), b.pop(key, None)
        assert_records_close(a, b, rtol=1e-4, atol=1e-6)
    assert list((two / "images").iterdir())
    assert_weights_close(read_model_weights(latest_checkpoint(two)), read_model_weights(latest_checkpoint(one)),
                         atol=1e-6)


def test_merged_export_is_a_two_expert_pipeline_with_the_policy(lora_run, tiny_a14b, module_cli, tmp_path):
    from diffusers import WanPipeline

    from flowrl.commands.inference import load_policy, resolve_source

    out = tmp_path / "merged"
    code, text = module_cli.merged("export", lora_run, "--merge", "-o", out)
    assert code == 0, text
    pipe = _euler_on_flowrl_grid(WanPipeline.from_pretrained(out))
    assert pipe.transformer_2 is not None and pipe.config.boundary_ratio == 0.875
    noise = torch.randn(1, *LATENT, generator=torch.Generator().manual_seed(6))
    policy = load_policy(resolve_source(lora_run, None, [], None), "cpu")
    torch.testing.assert_close(_pipe_frames(pipe, PROMPTS[:1], noise), _ode_frames(policy, PROMPTS[:1], noise),
                               atol=1e-5, rtol=0)


# ---- image-to-video (wan22_a14b_i2v) ----------------------------------------------------------


@pytest.fixture(scope="module")
def i2v(tiny_dir):
    """Wan 2.2 I2V A14B-like, CFG 4 on the high-noise expert and 3 on the low. Do not modify it."""
    from flowrl.testing.tiny_pipelines import build_tiny_wan22_a14b
    from flowrl_plugins.diffusers_models.wan_a14b import Wan22A14BI2VConfig, Wan22A14BI2VModel

    path = build_tiny_wan22_a14b(tiny_dir / "wan22_a14b_i2v", image_to_video=True)
    return Wan22A14BI2VModel(Wan22A14BI2VConfig(path=str(path), **TINY, cfg_scale=4.0, cfg_scale_2=3.0))


_image_prompts = image_prompts


def test_image_to_video_conforms(i2v):
    report = check_adapter(i2v)
    notes = {r.name: r.message for r in report.results}
    assert notes["condition"].startswith("condition (32, 32)")


def test_image_to_video_equals_the_two_expert_wan_i2v_pipeline(i2v):
    # WanImageToVideoPipeline without expand_timesteps (Wan2.2-I2V-A14B): [latents, mask, image
    # latents] along the channels, the boundary at 0.9, each expert's CFG weight
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    assert isinstance(i2v.pipe, WanImageToVideoPipeline) and i2v.pipe.config.boundary_ratio == 0.9
    rows, path = _image_prompts(PROMPTS)
    noise = torch.randn(2, *LATENT, generator=torch.Generator().manual_seed(4))
    counts, remove = _counting_calls(i2v.pipe.transformer, i2v.pipe.transformer_2)
    ours = _ode_frames(i2v, rows, noise)
    remove()
    assert counts == [2, 3], counts  # sigmas 1, .952 >= 0.9; .882, .769, .556 below
    pipe = _euler_on_flowrl_grid(i2v.pipe)
    ref = pipe(image=Image.open(path).convert("RGB"), prompt=list(PROMPTS), negative_prompt="", height=32, width=32,
               num_frames=5, num_inference_steps=5, guidance_scale=4.0, guidance_scale_2=3.0, latents=noise,
               output_type="pt", max_sequence_length=16).frames
    assert ((ref > 0) & (ref < 1)).float().mean() > 0.3, "the comparison needs unclamped pixels"
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    other, _ = _image_prompts(PROMPTS, seed=1)
    assert (_ode_frames(i2v, other, noise) - ours).abs().max() > 1e-3, "the image does not condition the clip"


def test_image_to_video_condition_is_the_mask_and_the_encoded_clip(i2v):
    # by hand: the mask's 4 channels are 1 on the first latent frame only; the image latents are
    # the VAE's mode of [image, black frames], normalised with the VAE config's statistics
    from PIL import Image

    rows, path = _image_prompts(PROMPTS[:1])
    cond = i2v.encode_prompts(rows)["condition_latents"]
    assert cond.shape == (1, 4 + 4, *LATENT[1:])
    mask = cond[:, :4]
    assert (mask[:, :, 0] == 1).all() and (mask[:, :, 1:] == 0).all()
    vae = i2v.pipe.vae
    pixels = i2v.pipe.video_processor.preprocess(
        [i2v.pipe.video_processor.resize(Image.open(path).convert("RGB"), 32, 32)],
        height=32, width=32)
    clip = torch.cat([pixels.unsqueeze(2), torch.zeros(1, 3, 4, 32, 32)], dim=2)
    with torch.no_grad():
        z = vae.encode(clip, return_dict=False)[0].mode()
    mean = torch.tensor([0.1, -0.2, 0.3, 0.0]).view(1, 4, 1, 1, 1)
    std = torch.tensor([1.5, 0.8, 1.2, 2.0]).view(1, 4, 1, 1, 1)
    torch.testing.assert_close(cond[:, 4:], (z - mean) / std, atol=1e-6, rtol=1e-6)
