"""Context parallelism (flowrl.train.context_parallel): two gloo processes splitting every
sequence train as one process does, with evaluation, images and checkpoints on, and a run stopped
after its first iteration resumes exactly: a tiny Wan (Ulysses, and as a ring), FLUX (as a ring;
Ulysses under FSDP2), LTX-Video (whose text mask and cross-attention need flowrl's repairs of
diffusers' Ulysses attention) and Wan 2.2 A14B's two experts under FSDP2; four processes as 2 x 2;
the refusals, the plan's activations per process, and the LoRA's seeded start that the comparison
relies on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TINY_MODEL
from engine_helpers import assert_records_close, assert_weights_close, load, quiet_console, run_forked_workers

from flowrl.errors import FlowrlError
from flowrl.runlog import read_metrics
from flowrl.train import train
from flowrl.train.checkpoint import latest_checkpoint, read_model_weights

REPO = Path(__file__).resolve().parents[2]
PROMPTS = REPO / "recipes" / "prompts" / "general.txt"
# AdamW turns rounding-level gradient differences (a sum over two processes' token shares in
# another order) into steps of lr: a small lr and a large eps keep them at rounding level
COMMON = ["train.prompts_per_iteration=2", "train.group_size=2", "train.micro_batch_size=2",
          "train.optimizer_steps_per_update=1", "rewards.0.use=brightness", "log.progress=false", "run.device=cpu",
          "model.gradient_checkpointing=false", f"prompts.source={str(PROMPTS)!r}", "log.eval_every=1",
          "prompts.num_eval=2", "prompts.eval_seeds=1", "log.image_every=1", "checkpoint.every=1",
          "train.lr=1e-3", "train.adam_eps=1e-4", "train.max_grad_norm=0", "distributed.num_processes=1"]
CASES = {
    # LoRA on a tiny Wan 2.1: 5 frames of 32 x 32, 2 x 4 x 4 = 32 video tokens per clip, 2 heads
    "wan": ("wan21_1p3b_lora.toml", [*TINY_MODEL, "model.num_frames=5", "train.lora_rank=4", "train.lora_alpha=8.0",
                                     "sampler.steps=5", "chunker.sizes=[2, 2]", "selector.fraction=1.0"]),
    # LoRA on a tiny LTX-Video: 9 frames of 32 x 64, 3 x 2 x 4 = 24 video tokens and 16 text tokens
    # (with their mask), both split
    "ltx": ("ltx_lora.toml", [*TINY_MODEL, "model.width=64", "model.num_frames=9", "train.lora_rank=4",
                              "train.lora_alpha=8.0", "sampler.steps=5", "chunker.sizes=[2, 2]",
                              "selector.fraction=1.0"]),
    # LoRA on both experts of a tiny Wan 2.2 A14B under FSDP2: rows routed per step to the high- or
    # low-noise expert, each expert's sequences split
    "a14b": ("wan22_a14b_lora.toml", [*TINY_MODEL, "model.num_frames=5", "model.flow_shift=5.0",
                                      "train.lora_rank=4", "train.lora_alpha=8.0", "sampler.steps=5",
                                      "chunker.sizes=[2, 2]", "selector.fraction=1.0", "distributed.strategy=fsdp2",
                                      "distributed.mixed_precision=no"]),
    # full fine-tuning of a tiny FLUX.1 under FSDP2: 64 image tokens and 16 text tokens, both split
    "flux": ("chunk_grpo_flux.toml", [*TINY_MODEL, "train.finetune=full", "distributed.strategy=fsdp2",
                                      "distributed.mixed_precision=no", "sampler.steps=5",
                                      "chunker.use=explicit", "chunker.sizes=[2, 2]", "selector.fraction=1.0"]),
}


def _sets(name, path, *extra):
    recipe, sets = CASES[name]
    return REPO / "recipes" / recipe, [f"model.path={path}", *COMMON, *sets, *extra]


def _two(recipe, sets, out, *cli_extra, processes=2, ring=1, group=2):
    """``processes`` processes in groups of ``group`` that split every sequence, ``ring`` of each
    group in a ring."""
    args = [a for s in (*sets, f"distributed.context_parallel={group}", f"distributed.num_processes={processes}",
                        f"distributed.context_parallel_ring={ring}")
            for a in ("--set", s)]
    proc = run_forked_workers(["train", recipe, *args, "-o", out, *cli_extra], processes, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


def _assert_same(a_dir, b_dir):
    rec_a, rec_b = read_metrics(a_dir), read_metrics(b_dir)
    assert [r["iteration"] for r in rec_a] == [r["iteration"] for r in rec_b]
    for a, b in zip(rec_a, rec_b):
        for key in [k for k in a if k.startswith(("compute/", "speed/", "time/")) or k == "world_size"]:
            a.pop(key), b.pop(key, None)
        assert_records_close(a, b, rtol=1e-4, atol=1e-6)
    assert_weights_close(read_model_weights(latest_checkpoint(a_dir)), read_model_weights(latest_checkpoint(b_dir)),
                         atol=1e-6)


@pytest.fixture(scope="module")
def tiny_models(tiny_dir, request):
    """Each tiny pipeline built when a test first asks for it (the default lane needs one)."""
    from flowrl.testing.tiny_pipelines import build_tiny_ltx, build_tiny_wan, build_tiny_wan22_a14b

    builders = {"wan": lambda: build_tiny_wan(tiny_dir / "wan_cp"), "flux": lambda: request.getfixturevalue("tiny_flux"),
                "ltx": lambda: build_tiny_ltx(tiny_dir / "ltx_cp"),
                "a14b": lambda: build_tiny_wan22_a14b(tiny_dir / "a14b_cp")}

    class Built(dict):
        def __missing__(self, name):
            self[name] = builders[name]()
            return self[name]

    return Built()


@pytest.mark.parametrize("name", [
    "wan",
    pytest.param("flux", marks=pytest.mark.slow),  # the default run keeps one of each kind: Wan's
    pytest.param("ltx", marks=pytest.mark.slow),
    pytest.param("a14b", marks=pytest.mark.slow),
])
def test_two_processes_splitting_every_sequence_train_as_one(name, tiny_models, tmp_path):
    recipe, sets = _sets(name, tiny_models[name], "train.iterations=2")
    one, two = tmp_path / "one", tmp_path / "two"
    train(load(recipe, *sets, f"run.output_dir={str(one)!r}"), console=quiet_console())
    _two(recipe, sets, two)
    assert [r["iteration"] for r in read_metrics(two)] == [0, 1, 2]  # 2 iterations and the final evaluation
    state = json.loads((latest_checkpoint(two) / "state.json").read_text())
    assert state["world_size"] == 1  # one data rank: a resume with one process groups samples alike
    assert state.get("processes", 2) == 2  # a sharded checkpoint's shards: both processes wrote
    assert list((two / "images").iterdir())
    _assert_same(two, one)
    # stopped after the first iteration and resumed: the same run
    half = tmp_path / "half"
    _two(recipe, [s if s != "train.iterations=2" else "train.iterations=1" for s in sets], half)
    _two(recipe, sets, half, "--resume", half)
    _assert_same(half, one)


@pytest.mark.parametrize("name", [
    "flux",  # FLUX's joint attention: the text tokens go round the ring too
    pytest.param("wan", marks=pytest.mark.slow),
])
def test_two_processes_in_a_ring_train_as_one(name, tiny_models, tmp_path):
    # ring attention: each process keeps its slice of the tokens inside attention, the keys and
    # values go round the ring and the partial attentions are merged by their log-sum-exp (on a
    # CPU through torch's CPU flash kernel, which returns it)
    recipe, sets = _sets(name, tiny_models[name], "train.iterations=2")
    one, ring = tmp_path / "one", tmp_path / "ring"
    train(load(recipe, *sets, f"run.output_dir={str(one)!r}"), console=quiet_console())
    _two(recipe, sets, ring, ring=2)
    _assert_same(ring, one)


REFERENCE_RECORD = '''
import json
import os

from flowrl.train.context_parallel import parallel_transformers
from flowrl.train.parallel import Strategy

_prepare_frozen = Strategy.prepare_frozen


def prepare_frozen(self, module, on_cpu=False):
    out = _prepare_frozen(self, module, on_cpu=on_cpu)
    split = [t._parallel_config is not None for t in parallel_transformers(out)]
    with open(os.path.join(os.environ["FLOWRL_TEST_RECORD"], f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(split, f)
    return out


Strategy.prepare_frozen = prepare_frozen
'''


@pytest.mark.slow
def test_a_stop_file_stops_both_processes_of_a_context_parallel_group(tiny_models, tmp_path, monkeypatch):
    """One data rank split over two processes: the STOP file, which only the main process reads,
    found at a stop point inside the model calls (here: written by the main process at its 40th
    stop point, in iteration 2 or so, and looked for at once), stops both processes together,
    with the last completed iteration checkpointed. The main process used to stop there alone
    while its partner waited in a split forward until the timeout."""
    from flowrl.train import stopping
    from flowrl.train.checkpoint import checkpoint_iteration

    checks, check = [0], stopping.RunStop.check

    def check_finding_the_file(self, every_process=True, alone=False):  # the forked workers inherit it
        checks[0] += 1
        if self.file is not None and checks[0] == 40:
            self.file.write_text("")
            self._looked = float("-inf")  # looked for at this stop point, not up to a second later
        return check(self, every_process, alone)

    monkeypatch.setattr(stopping.RunStop, "check", check_finding_the_file)
    recipe, sets = _sets("wan", tiny_models["wan"], "train.iterations=50", "checkpoint.every=100")
    out = tmp_path / "stopped"
    args = [a for s in (*sets, "distributed.context_parallel=2", "distributed.num_processes=2") for a in ("--set", s)]
    proc = run_forked_workers(["train", recipe, *args, "-o", out], 2, timeout=120)
    assert proc.returncode == 130, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "STOP found: stopping at the next model call" in proc.stderr
    trained = [r["iteration"] for r in read_metrics(out) if "loss" in r]
    assert trained and trained[-1] < 49 and not (out / "STOP").exists()
    assert checkpoint_iteration(latest_checkpoint(out)) == trained[-1] + 1  # the last completed iteration


@pytest.mark.slow
def test_the_kl_reference_splits_its_sequences_like_the_policy(tiny_models, tmp_path, plugin_site):
    """Full fine-tuning with a KL term keeps a frozen copy of the denoiser: under context
    parallelism it splits every sequence like the policy (before, each process of a group ran the
    whole reference forward), and the run with its KL is the one-process run."""
    import json

    recipe, sets = _sets("flux", tiny_models["flux"], "train.iterations=2", "loss.beta=0.01",
                         "loss.kl='gaussian_exact'")
    one, two, record = tmp_path / "one", tmp_path / "two", tmp_path / "record"
    record.mkdir()
    train(load(recipe, *sets, f"run.output_dir={str(one)!r}"), console=quiet_console())
    site = plugin_site("reference_record_plugin", REFERENCE_RECORD)
    args = [a for s in (*sets, "distributed.context_parallel=2", "distributed.num_processes=2")
            for a in ("--set", s)]
    proc = run_forked_workers(["train", recipe, *args, "-o", two], 2, timeout=400,
                              env={"PYTHONPATH": str(site), "FLOWRL_TEST_RECORD": str(record)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert [json.loads((record / f"rank{r}.json").read_text()) for r in (0, 1)] == [[True], [True]]
    assert any(r.get("kl/gaussian_exact", 0) > 0 for r in read_metrics(two))
    _assert_same(two, one)


@pytest.mark.slow  # four processes on the CI machine's two cores
def test_a_ring_of_two_times_two_head_splits_trains_as_one(tiny_models, tmp_path):
    # one group of four processes: two ring positions, two processes splitting heads in each
    recipe, sets = _sets("flux", tiny_models["flux"], "train.iterations=1")
    one, four = tmp_path / "one", tmp_path / "four"
    train(load(recipe, *sets, f"run.output_dir={str(one)!r}"), console=quiet_console())
    _two(recipe, sets, four, processes=4, ring=2, group=4)
    _assert_same(four, one)


@pytest.mark.slow  # four processes on the CI machine's two cores
def test_two_groups_of_two_processes_train_as_one(tiny_models, tmp_path):
    # a 2 x 2 layout: two data-parallel ranks, each a group of two processes splitting every
    # sequence; the samples, rewards and metrics are gathered over the ranks, the gradients summed
    # in each group and averaged over the ranks
    recipe, sets = _sets("wan", tiny_models["wan"], "train.iterations=2")
    one, four = tmp_path / "one", tmp_path / "four"
    train(load(recipe, *sets, f"run.output_dir={str(one)!r}"), console=quiet_console())
    _two(recipe, sets, four, processes=4)
    assert read_metrics(four)[0]["world_size"] == 2  # data-parallel ranks
    _assert_same(four, one)


# ---- refusals and the plan -------------------------------------------------------------------


def _recipe(*sets):
    from flowrl.recipe import load_recipe

    return load_recipe(REPO / "recipes" / "wan22_a14b_lora.toml", list(sets))


@pytest.mark.parametrize("sets, needle", [
    (["distributed.context_parallel=3"], "num_processes = 8"),
    (["distributed.context_parallel=8", "sampler.rollout_precision=fp8"], "quantised copy"),
    (["distributed.context_parallel=8", "distributed.context_parallel_ring=3"], "use a divisor of 8"),
    (["distributed.context_parallel=8", "distributed.context_parallel_ring=2", "train.attention_backend=math"],
     "log-sum-exp"),
    (["distributed.context_parallel=8", "distributed.context_parallel_ring=2", "distributed.strategy=ddp",
      "distributed.mixed_precision=bf16"], "autocast"),
])
def test_recipes_that_cannot_split_their_sequences_are_refused_before_loading(sets, needle):
    from flowrl.errors import RecipeError

    with pytest.raises(RecipeError, match="context_parallel") as info:
        _recipe(*sets)  # loading cross-checks the recipe
    assert needle in str(info.value) + (info.value.hint or "")


def test_one_process_or_a_model_without_a_plan_is_refused():
    from types import SimpleNamespace

    import torch

    from flowrl.distributed import setup
    from flowrl.train.context_parallel import check_splittable

    with pytest.raises(FlowrlError, match="this run has one"):
        setup(torch.device("cpu"), SimpleNamespace(context_parallel=2, strategy="auto", shard="full",
                                                   cpu_offload=False, mixed_precision="no",
                                                   activation_checkpointing=False))
    with pytest.raises(FlowrlError, match="no diffusers transformer"):
        check_splittable([], 2, {})


def test_heads_and_tokens_must_divide_by_the_degree():
    from types import SimpleNamespace

    from flowrl.train.context_parallel import check_splittable, split_sequences

    wan = SimpleNamespace(config={"num_attention_heads": 40}, _cp_plan={"blocks.0": {}})
    flux = SimpleNamespace(config={"num_attention_heads": 24}, _cp_plan={"": {"encoder_hidden_states": None}})
    check_splittable([wan], 8, split_sequences(wan, 20280, 512))  # Wan's text is not split
    with pytest.raises(FlowrlError, match="40 attention heads"):
        check_splittable([wan], 3, {})
    # a ring splits no heads: 40 heads over a group of 16 as 8 rings x 2 head splits, or as one ring
    check_splittable([wan], 16, {}, ring=8)
    check_splittable([wan], 48, {}, ring=48)
    with pytest.raises(FlowrlError, match="do not split over 3 processes") as info:
        check_splittable([wan], 6, {}, ring=2)
    assert "context_parallel_ring" in info.value.hint
    ltx = SimpleNamespace(config={"num_attention_heads": 32},
                          _cp_plan={"": {"hidden_states": None, "encoder_attention_mask": None}})
    check_splittable([ltx], 2, {})
    with pytest.raises(FlowrlError, match="attends with a mask"):
        check_splittable([ltx], 2, {}, ring=2)
    # Qwen-Image names its text and its mask at its blocks, not at the model's entry
    qwen = SimpleNamespace(config={"num_attention_heads": 24}, _cp_plan={
        "transformer_blocks.0": {"hidden_states": None, "encoder_hidden_states": None},
        "transformer_blocks.*": {"encoder_hidden_states_mask": None}, "proj_out": object()})
    with pytest.raises(FlowrlError, match="encoder_hidden_states_mask"):
        check_splittable([qwen], 2, {}, ring=2)
    assert split_sequences(qwen, 4096, 511) == {"image or video tokens": 4096, "text tokens": 511}
    assert split_sequences(wan, 20280, 511) == {"image or video tokens": 20280}
    assert split_sequences(flux, 4096, 511) == {"image or video tokens": 4096, "text tokens": 511}
    with pytest.raises(FlowrlError, match="511 text tokens"):
        check_splittable([flux], 2, split_sequences(flux, 4096, 511))


def test_the_plan_holds_a_share_of_every_sequence_per_process():
    from flowrl.memory_plan import estimate
    from flowrl.plugins import get_registry

    def update(cp, world):
        recipe = _recipe(f"distributed.context_parallel={cp}", f"distributed.num_processes={world}")
        lines = estimate(recipe, get_registry(), world)[2]
        return next(line.bytes for line in lines if line.item == "activations, forward with grad")

    # the same micro-batch on the same processes, 1/C of its tokens on each
    for cp in (2, 8):
        assert update(cp, cp) == pytest.approx(update(1, cp) / cp, rel=1e-3)


def test_the_lora_starts_alike_in_every_run_of_a_seed(tiny_models):
    # peft draws LoRA's A from torch's global generator, which the engine never seeds: two runs of
    # one recipe started from different LoRAs (found comparing context-parallel runs with one
    # process). prepare_trainable draws it from the run's seed and leaves the global generator alone.
    from types import SimpleNamespace

    import torch
    from flowrl_plugins.diffusers_models.wan import WanConfig, WanModel

    from flowrl.train.finetune import prepare_trainable

    train = SimpleNamespace(finetune="lora", lora_targets=[], lora_rank=2, lora_alpha=2.0, lora_init="default")

    def lora(seed):
        m = WanModel(WanConfig(path=str(tiny_models["wan"]), dtype="fp32", height=32, width=32, num_frames=5,
                               max_sequence_length=16))
        state = torch.random.get_rng_state()
        prepare_trainable(m, train, seed)
        assert torch.equal(torch.random.get_rng_state(), state)
        return {n: p.detach().clone() for n, p in m.denoiser.named_parameters() if "lora_A" in n}

    first = lora(3)
    torch.manual_seed(12345)  # whatever the global generator holds
    again, other = lora(3), lora(4)
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert not all(torch.equal(first[n], other[n]) for n in first)


def test_the_docs_plan_command_fits_what_data_parallelism_does_not(cli):
    # docs/distributed.md, "Context parallelism": its command, as written, and its TOML
    import re
    import shlex
    import tomllib

    doc = (REPO / "docs" / "distributed.md").read_text(encoding="utf-8")
    section = doc[doc.index("## Context parallelism"):].split("\n## ", 1)[0]
    (command,) = re.findall(r"\(`(flowrl plan [^`]+)`\)", section.replace("\n  ", " "))
    argv = shlex.split(command)[1:]
    code, out, err = cli(*argv)
    assert code == 0, err
    assert "fits in 80 GB" in " ".join(out.split())
    code, out, _ = cli(*[a for a in argv if a != "--set" and "context_parallel" not in a][:2], "--set",
                       "model.num_frames=81")
    assert "does not fit in 80 GB" in " ".join(out.split())
    ulysses, ring = re.findall(r"```toml\n(.*?)```", section, flags=re.DOTALL)
    assert tomllib.loads(ulysses)["distributed"] == {"num_processes": 8, "context_parallel": 8, "strategy": "fsdp2"}
    assert tomllib.loads(ring)["distributed"] == {"num_processes": 8, "context_parallel": 8,
                                                   "context_parallel_ring": 2, "strategy": "fsdp2"}
    # the ring block on the same recipe: Wan's 40 heads split 4 ways, the same memory as Ulysses
    code, ring_out, err = cli(*argv, "--set", "distributed.context_parallel_ring=2")
    assert code == 0, err
    assert "fits in 80 GB" in " ".join(ring_out.split())
