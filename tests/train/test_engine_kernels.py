"""Kernel switches of ``[train]``: ``compile``, ``attention_backend``, ``adamw_impl``
(flowrl/train/accel.py). Each switch trains the embedded model; bad values or a device without
the kernel give one FlowrlError naming the field; AdamW implementations agree with the for-loop
one; compile keeps the on-policy check (the rollout's inference graph and the update's training
graph agree to the documented tolerance)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import load, quiet_console
from tiny_recipe import write_recipe

from flowrl.errors import FlowrlError, RecipeError
from flowrl.runlog import read_metrics
from flowrl.train import train
from flowrl.train.accel import attention_backend, check_attention_backend, compile_denoiser
from flowrl.train.optimizer import adamw_options, make_adamw

CPU = torch.device("cpu")


class _Train:
    lr, adam_betas, adam_eps, weight_decay = 1e-2, [0.9, 0.999], 1e-8, 1e-2

    def __init__(self, impl):
        self.adamw_impl = impl


def _steps(impl: str, n: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(7, 5, generator=g)), torch.nn.Parameter(torch.randn(3, generator=g))]
    opt = make_adamw(params, _Train(impl), CPU)
    for i in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 + i))
        opt.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("impl", ["auto", "foreach", "fused"])
def test_adamw_implementations_agree_with_the_for_loop(impl):
    want = _steps("for-loop")
    got = _steps(impl)
    # the same arithmetic, reordered: float32 rounding only (measured max 1.5e-8 on the
    # embedded denoiser's 1.2M parameters, benchmarks/kernels.py)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_adamw_options():
    assert adamw_options("auto", CPU) == {}
    assert adamw_options("fused", CPU) == {"fused": True}
    assert adamw_options("foreach", CPU) == {"foreach": True}
    assert adamw_options("for-loop", CPU) == {"foreach": False, "fused": False}
    assert make_adamw([torch.nn.Parameter(torch.zeros(2))], _Train("fused"), CPU).defaults["fused"] is True


def test_fused_adamw_on_a_device_without_it_names_the_field():
    with pytest.raises(FlowrlError, match=r"adamw_impl = 'fused' is not available on device 'meta'") as exc:
        adamw_options("fused", torch.device("meta"), "r.toml")
    assert exc.value.where == "r.toml: [train].adamw_impl" and "foreach" in exc.value.hint


@pytest.mark.parametrize("name", ["efficient", "cudnn"])
def test_a_gpu_only_attention_backend_on_the_cpu_names_the_field(name):
    with pytest.raises(FlowrlError, match=rf"attention_backend = '{name}' does not exist on device 'cpu'") as exc:
        check_attention_backend(name, CPU, "r.toml")
    assert exc.value.where == "r.toml: [train].attention_backend"
    assert "'math'" in exc.value.hint and "'flash'" in exc.value.hint


@pytest.mark.parametrize("name", ["math", "flash"])
def test_attention_backend_restricts_sdpa_and_gives_the_same_values(name):
    q = torch.randn(2, 3, 16, 8, generator=torch.Generator().manual_seed(1))
    want = F.scaled_dot_product_attention(q, q, q)
    with attention_backend(name, CPU):
        assert torch.backends.cuda.math_sdp_enabled() == (name == "math")
        assert torch.backends.cuda.flash_sdp_enabled() == (name == "flash")
        got = F.scaled_dot_product_attention(q, q, q)
    assert torch.backends.cuda.math_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()  # restored
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_auto_attention_on_cuda_leaves_out_cudnn_and_on_the_cpu_changes_nothing():
    # cuDNN attention faulted on FLUX.1-dev's attention on an H100 (torch 2.11): 'auto' never picks it
    with attention_backend("auto", torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored
    with attention_backend("auto", CPU):
        assert torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()


def test_commands_default_to_auto_attention_outside_the_loop_and_a_named_backend_still_runs():
    # sampling, evaluation and the dynamics profile run outside the loop's context: the process
    # default on CUDA leaves cuDNN attention out too, and `cudnn` named by a recipe is enabled back
    from flowrl.train.accel import default_attention

    try:
        default_attention(CPU)
        assert torch.backends.cuda.cudnn_sdp_enabled()  # the CPU: nothing changes
        default_attention(torch.device("cuda"))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        with attention_backend("cudnn", torch.device("cuda")):
            assert torch.backends.cuda.cudnn_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


def test_compile_off_leaves_the_denoiser_alone():
    class M:
        denoiser = torch.nn.Linear(2, 2)

    assert compile_denoiser(M, "off", CPU) is False
    assert getattr(M.denoiser, "_compiled_call_impl", None) is None


@pytest.mark.parametrize("override, pattern", [
    ("train.compile='fast'", r"compile"),
    ("train.attention_backend='flash2'", r"attention_backend"),
    ("train.adamw_impl='apex'", r"adamw_impl"),
])
def test_bad_values_are_recipe_errors(tmp_path, override, pattern):
    with pytest.raises(RecipeError, match=pattern):
        load(write_recipe(tmp_path), override)


def test_gpu_attention_backend_fails_before_training(tmp_path):
    recipe = load(write_recipe(tmp_path), f"run.output_dir={str(tmp_path / 'run')!r}",
                  "train.attention_backend='efficient'")
    with pytest.raises(FlowrlError, match="attention_backend = 'efficient' does not exist on device 'cpu'"):
        train(recipe, console=quiet_console())
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_switches_train_the_embedded_model(tmp_path):
    """attention 'math' and fused AdamW: one iteration trains and the on-policy check holds (the
    run itself enforces the default tolerance 1e-6; measured 1.2e-7, one float32 ulp near 1: the
    math kernel's sums round by batch shape, rollout batch 8 vs update micro-batch 2)."""
    run_dir = tmp_path / "run"
    recipe = load(write_recipe(tmp_path), f"run.output_dir={str(run_dir)!r}", "train.iterations=1",
                  "train.attention_backend='math'", "train.adamw_impl='fused'")
    train(recipe, console=quiet_console())
    rows = read_metrics(run_dir)
    assert rows[0]["on_policy/max_abs_log_ratio"] <= 1e-6
    assert rows[0]["grad_norm"] > 0


def _train_compiled(tmp_path) -> tuple:
    """One iteration of the tiny recipe with compile = 'default': the run directory and how many
    graphs dynamo compiled (a run whose denoiser was never compiled compiles none)."""
    from torch._dynamo.utils import counters

    run_dir = tmp_path / "run"
    recipe = load(write_recipe(tmp_path), f"run.output_dir={str(run_dir)!r}", "train.iterations=1",
                  "train.updates_per_rollout=1", "train.optimizer_steps_per_update=1", "train.compile='default'")
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    try:
        train(recipe, console=quiet_console())
        graphs = counters["stats"]["unique_graphs"] - before
    finally:
        torch._dynamo.reset()  # later tests in this process start uncompiled
    return run_dir, graphs


def _check_compiled_run(run_dir, graphs: int) -> None:
    from engine_helpers import final_weights

    rows = read_metrics(run_dir)
    assert graphs >= 1, "compile = 'default' compiled no graph: the run trained uncompiled"
    assert rows[0]["on_policy/max_abs_log_ratio"] <= 1e-6
    assert rows[0]["grad_norm"] > 0
    assert not any("_orig_mod" in k for k in final_weights(run_dir))


@pytest.mark.slow
def test_compiled_denoiser_is_traced_and_keeps_the_on_policy_check(tmp_path, monkeypatch):
    """compile = 'default' on the embedded model, with dynamo's ``aot_eager`` backend in place of
    inductor (dynamo traces the denoiser and AOT autograd builds its forward and backward graphs;
    no C++ is generated, which takes minutes on this CPU): the run compiles graphs, the rollout
    (inference graph) and the update (training graph) agree within the default on_policy_tolerance
    1e-6, and the checkpoint has the uncompiled keys. A run once trained uncompiled, silently:
    the FLOP count made the compiled denoiser's first call under FlopCounterMode, after which
    dynamo never compiled it."""
    original = torch.nn.Module.compile

    def compile_without_codegen(self, *args, **kwargs):
        kwargs.pop("mode", None)
        return original(self, *args, backend="aot_eager", **kwargs)

    monkeypatch.setattr(torch.nn.Module, "compile", compile_without_codegen)
    _check_compiled_run(*_train_compiled(tmp_path))


@pytest.mark.slow
def test_compiled_denoiser_keeps_the_on_policy_check(tmp_path):
    """The same with inductor, as a run compiles (minutes of C++ on this CPU): the rollout's and
    the update's compiled graphs agree within the default on_policy_tolerance 1e-6 (the run
    would stop otherwise)."""
    _check_compiled_run(*_train_compiled(tmp_path))


def test_the_docs_example_validates():
    """docs/recipes.md's speed-switch example, as written, is a valid part of a recipe."""
    import re
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")
    from flowrl.recipe import validate

    text = (Path(__file__).resolve().parents[2] / "docs" / "recipes.md").read_text()
    block = re.search(r"```toml\n(\[sampler\]\nbatch_size = 8 .*?)```", text, re.S).group(1)
    recipe = validate({**tomllib.loads(block), "rewards": [{"use": "brightness"}]}, source="docs/recipes.md")
    assert recipe.sampler.overlap_rewards and recipe.sampler.batch_size == 8
    assert (recipe.train.compile, recipe.train.attention_backend, recipe.train.adamw_impl) == ("default", "auto", "fused")


class _BackendSensitiveModel:
    """A velocity that depends on which backend the probe's context named (the probe's own check)."""

    latent_shape = (2, 4)

    def __init__(self, under_cudnn):
        self.under_cudnn, self.backend = under_cudnn, None
        self.denoiser = torch.nn.Linear(2, 2)

    def velocity(self, x, sigma, text):
        return self.under_cudnn(x) if self.backend == "cudnn" else 2 * x


def _probe(monkeypatch, model, name="cudnn"):
    import contextlib

    from flowrl.train import accel

    @contextlib.contextmanager
    def named(name, device, source="<recipe>"):
        model.backend = name
        yield

    monkeypatch.setattr(accel, "attention_backend", named)
    return accel.probe_attention_backend(model, name, CPU, text={}, source="r.toml")


def test_cudnn_is_probed_on_the_model_and_refused_when_it_disagrees_with_math(monkeypatch):
    assert _probe(monkeypatch, _BackendSensitiveModel(lambda x: 2 * x)) == 0.0  # agrees: trains
    with pytest.raises(FlowrlError) as caught:  # non-finite, as cuDNN gave for a tiny FLUX on an H200
        _probe(monkeypatch, _BackendSensitiveModel(lambda x: x * float("inf")))
    assert "disagrees with math attention" in caught.value.message  # on CUDA: memory-efficient attention
    assert caught.value.where == "r.toml: [train].attention_backend"
    with pytest.raises(FlowrlError, match="disagrees"):  # finite but 10% off
        _probe(monkeypatch, _BackendSensitiveModel(lambda x: 2.2 * x))

    def no_kernel(x):
        raise RuntimeError("No available kernel. Aborting execution.")

    with pytest.raises(FlowrlError, match="cannot run this model's attention here: No available kernel"):
        _probe(monkeypatch, _BackendSensitiveModel(no_kernel))


def test_a_named_backend_must_run_the_denoiser_alone_and_auto_or_math_are_not_probed(monkeypatch):
    class NoFlash(_BackendSensitiveModel):
        def velocity(self, x, sigma, text):
            if self.backend == "flash":
                raise RuntimeError("No available kernel. Aborting execution.")
            return 2 * x

    with pytest.raises(FlowrlError) as caught:
        _probe(monkeypatch, NoFlash(lambda x: x), name="flash")
    assert caught.value.where == "r.toml: [train].attention_backend"
    assert "attention_backend = 'flash' cannot run this model's attention here" in caught.value.message
    assert _probe(monkeypatch, _BackendSensitiveModel(lambda x: 2 * x), name="flash") is None  # ran: no deviation kept
    for name in ("auto", "math"):
        model = NoFlash(lambda x: x)
        assert _probe(monkeypatch, model, name=name) is None and model.backend is None  # nothing ran


def test_the_loop_allows_the_named_backend_and_math_for_what_it_cannot_run():
    from flowrl.train.accel import loop_attention

    q, mask = torch.randn(1, 2, 8, 4), torch.zeros(1, 1, 8, 8)
    with loop_attention("flash", CPU):
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
        assert not torch.backends.cuda.cudnn_sdp_enabled() and not torch.backends.cuda.mem_efficient_sdp_enabled()
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask)  # a masked call: math serves it
    with loop_attention("math", CPU):
        assert not torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()


def test_an_fp32_denoiser_on_cuda_gets_fp32_convolutions_and_nothing_else_changes():
    from flowrl.train.accel import exact_float32

    cuda, before = torch.device("cuda"), torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = True
        assert not exact_float32(CPU, torch.nn.Linear(2, 2)) and torch.backends.cudnn.allow_tf32
        assert not exact_float32(cuda, torch.nn.Linear(2, 2).to(torch.bfloat16)) and torch.backends.cudnn.allow_tf32
        assert not exact_float32(cuda, torch.nn.Linear(2, 2), mixed_precision="bf16") and torch.backends.cudnn.allow_tf32
        # fp32 master weights an adapter computes with in bf16 (its own autocast): not fp32 convolutions
        assert not exact_float32(cuda, torch.nn.Linear(2, 2), compute_dtype=torch.bfloat16)
        assert torch.backends.cudnn.allow_tf32
        assert exact_float32(cuda, torch.nn.Linear(2, 2), compute_dtype=torch.float32) and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cudnn.allow_tf32 = before


def test_a_probe_refused_on_one_process_refuses_on_all(monkeypatch):
    # every process decides together: one that went on would wait for the others in a collective
    from types import SimpleNamespace

    from flowrl.train import accel

    def refuse(model, name, device, text, source="<recipe>"):
        raise FlowrlError("attention_backend = 'flash' cannot run this model's attention here: no kernel",
                          where=f"{source}: [train].attention_backend")

    train = SimpleNamespace(attention_backend="flash", compile="off")
    anyone = SimpleNamespace(process_count=2)  # what the other process said: distributed.any_rank, faked
    monkeypatch.setattr("flowrl.distributed.dist.all_reduce", lambda t, op=None: t.fill_(1.0))
    monkeypatch.setattr(accel, "probe_attention_backend", lambda *a, **k: None)
    with pytest.raises(FlowrlError, match="refused by another process's probe"):  # this one passed, another did not
        accel.prepare_kernels(None, train, CPU, "r.toml", probe_text=lambda: {}, ctx=anyone)
    with accel.prepare_kernels(None, train, CPU, "r.toml", probe_text=lambda: {}, ctx=SimpleNamespace(process_count=1)):
        pass  # alone, and nobody refused: the loop's context
    monkeypatch.setattr(accel, "probe_attention_backend", refuse)
    with pytest.raises(FlowrlError, match="cannot run this model's attention here"):  # its own reason, not another's
        accel.prepare_kernels(None, train, CPU, "r.toml", probe_text=lambda: {}, ctx=anyone)
