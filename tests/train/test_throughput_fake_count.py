"""The FLOP count behind ``speed/mfu`` and ``speed/hfu`` (flowrl/train/throughput.py) runs on fake
tensors: the same three counts as the real forward and forward-and-backward it replaced (computed
here through that old route), but no activation is ever real. On an H200 the real count was a
run's memory peak (Wan 2.1 1.3B LoRA: 74.7 GiB at start-up against 13.1 GiB in training)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from flowrl.train.parallel import checkpoint_blocks
from flowrl.train.throughput import Throughput, count_flops, count_velocity_flops

D, TOKENS, BLOCKS = 16, 5, 3
ACTIVATION = TOKENS * D  # the elements of one sample's hidden state


class Block(nn.Module):
    """``x + b(gelu(a(x)))``: non-reentrant checkpointing's early stop recomputes only ``a``."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.b(nn.functional.gelu(self.a(x)))


class Denoiser(nn.Module):
    """Checkpointed by ``torch.utils.checkpoint`` in its forward (as diffusers' models are), or not."""

    def __init__(self, checkpointing: str | None = None):
        super().__init__()
        self.embed, self.out = nn.Linear(D, D), nn.Linear(D, D)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.checkpointing = checkpointing

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            if self.checkpointing in ("torch", "torch_reentrant") and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.checkpointing == "torch_reentrant")
            else:
                x = block(x)
        return self.out(x)


class Model:
    """An adapter: the velocity of latents ``[B, TOKENS, D]`` from sigma and the text's scale."""

    latent_shape = (TOKENS, D)

    def __init__(self, denoiser: nn.Module):
        self.denoiser = denoiser

    def velocity(self, x, sigma, text):
        return self.denoiser(x + sigma[:, None, None]) * text["scale"]


def _session(model) -> SimpleNamespace:
    return SimpleNamespace(model=model, device=torch.device("cpu"),
                           cache=SimpleNamespace(get=lambda prompts, device: {"scale": torch.full((1,), 2.0)}))


def _model(checkpointing: str | None = None, lora_like: bool = False) -> Model:
    torch.manual_seed(0)
    denoiser = Denoiser(checkpointing)
    if checkpointing == "flowrl":
        checkpoint_blocks(list(denoiser.blocks))
    if lora_like:  # a partial trainable set, as a LoRA's: frozen weights get no weight gradient
        denoiser.requires_grad_(False)
        denoiser.embed.requires_grad_(True)  # reentrant checkpointing wants a block input that needs grad
        for block in denoiser.blocks:
            block.b.requires_grad_(True)
    return Model(denoiser)


def _real_count(session):
    """The count as flowrl made it before: a real forward, then a real forward and backward."""
    model, device = session.model, session.device
    x = torch.zeros((1, *model.latent_shape), device=device)
    sigma = torch.full((1,), 0.5, device=device)
    text = session.cache.get(["p"], device)
    with torch.random.fork_rng(devices=[]), torch.compiler.set_stance("force_eager"):
        counted = count_flops(lambda: model.velocity(x, sigma, text))
    for p in model.denoiser.parameters():
        p.grad = None
    return counted


@pytest.mark.parametrize("lora_like", [False, True])
@pytest.mark.parametrize("checkpointing", [None, "flowrl", "torch", "torch_reentrant"])
def test_the_fake_count_equals_the_real_count(checkpointing, lora_like):
    """All three counts, the forwards that checkpointing recomputes in the backward included: the
    recomputation still runs (on fake tensors) and is still told apart from the model's FLOPs."""
    session = _session(_model(checkpointing, lora_like))
    real = _real_count(session)
    fake = count_velocity_flops(session, "p")
    assert fake == real == count_velocity_flops(session, "p", fake=False)
    if checkpointing in ("torch", "torch_reentrant", "flowrl"):
        assert fake.forward_backward_with_recompute > fake.forward_backward
    else:
        assert fake.forward_backward_with_recompute == fake.forward_backward
    assert all(p.grad is None for p in session.model.denoiser.parameters())


def test_early_stop_off_recomputes_whole_blocks_on_fake_tensors_too():
    session = _session(_model("torch"))
    early = count_velocity_flops(session, "p")
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        assert count_velocity_flops(session, "p") == _real_count(session)
        whole = count_velocity_flops(session, "p")
    assert whole.forward_backward == early.forward_backward
    assert whole.forward_backward_with_recompute > early.forward_backward_with_recompute


def test_the_embedded_model_with_lora_and_diffusers_checkpointing():
    """A real (tiny) diffusers FLUX transformer with peft LoRA, checkpointed by diffusers."""
    pytest.importorskip("peft")
    from flowrl_plugins.embedded.plugin import EmbeddedConfig, EmbeddedModel

    from flowrl.train.finetune import prepare_trainable

    model = EmbeddedModel(EmbeddedConfig(random_init=True))
    prepare_trainable(model, SimpleNamespace(finetune="lora", lora_targets=[], lora_rank=4, lora_alpha=8.0,
                                             lora_init="default"))
    model.denoiser.enable_gradient_checkpointing()
    model.denoiser.train()
    session = SimpleNamespace(model=model, device=torch.device("cpu"),
                              cache=SimpleNamespace(get=lambda prompts, device: model.encode_prompts(prompts)))
    real = _real_count(session)
    assert count_velocity_flops(session, "p") == real
    assert real.forward_backward_with_recompute > real.forward_backward > real.forward > 0
    assert all(p.grad is None for p in model.denoiser.parameters())


def test_the_flux_adapter_keeps_real_constants_and_counts_as_before(tmp_path):
    """The diffusers FLUX adapter (a tiny pipeline, LoRA) makes its ids and guidance once per device
    and keeps them: after the count they are real, and its next forward on real latents is real."""
    pytest.importorskip("peft")
    from flowrl_plugins.diffusers_models.flux import FluxConfig, FluxModel

    from flowrl.testing.tiny_pipelines import build_tiny_flux
    from flowrl.train.finetune import prepare_trainable

    model = FluxModel(FluxConfig(path=str(build_tiny_flux(tmp_path / "flux")), dtype="fp32", height=32, width=32,
                                 max_sequence_length=16))
    prepare_trainable(model, SimpleNamespace(finetune="lora", lora_targets=[], lora_rank=4, lora_alpha=8.0,
                                             lora_init="default"))
    session = SimpleNamespace(model=model, device=torch.device("cpu"),
                              cache=SimpleNamespace(get=lambda prompts, device: model.encode_prompts(prompts)))
    assert count_velocity_flops(session, "p") == _real_count(session)
    assert model._on_device and all(type(t) is torch.Tensor for t in model._on_device.values())
    x = torch.zeros(1, *model.latent_shape)
    with torch.no_grad():
        assert type(model.velocity(x, torch.full((1,), 0.5), model.encode_prompts(["p"]))) is torch.Tensor


class _Recording(TorchDispatchMode):
    """Every operator's outputs: how many were fake, and the real ones that own new memory
    (``(operator, elements)``; not the views of a real input, such as a weight's transpose)."""

    def __init__(self):
        super().__init__()
        self.fake, self.allocated = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        real = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor)]
        storages = {t.untyped_storage().data_ptr() for t in real}
        for t in tree_leaves(out):
            if isinstance(t, FakeTensor):
                self.fake += 1
            elif isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in storages:
                self.allocated.append((str(func), t.numel()))
        return out


def test_no_activation_is_real_and_the_run_is_left_as_it_was():
    """Forward, backward and the checkpointed recomputation: every tensor of a hidden state's size
    is fake (no memory, no arithmetic); the real ones are the model's own small ones. The run's RNG
    is untouched although the model draws random numbers, and no parameter keeps a gradient."""
    model = _model("torch")
    velocities = []
    plain = model.velocity

    def drawing(x, sigma, text):
        noise = torch.randn(()) * 0 + torch.randn_like(x) * 0  # one real draw, one of a hidden state's size
        velocities.append(v := plain(x + noise, sigma, text))
        return v

    model.velocity = drawing
    rng = torch.get_rng_state()
    with _Recording() as recording:
        count_velocity_flops(_session(model), "p")
    assert torch.equal(torch.get_rng_state(), rng)
    assert len(velocities) == 2 and all(isinstance(v, FakeTensor) for v in velocities)
    assert recording.fake > 50  # the forwards, the backward and the recomputation ran, on fakes
    assert recording.allocated and all(numel < ACTIVATION for _, numel in recording.allocated), recording.allocated
    assert all(p.grad is None for p in model.denoiser.parameters())


def test_what_a_model_keeps_across_calls_stays_real():
    """A tensor a model makes once and keeps (the diffusers adapters' ``_device_constant``, a
    ``lru_cache``d rotary table) is made without the latents, so for real: the next real forward
    can use it."""
    model = _model()
    kept: dict[str, torch.Tensor] = {}
    plain = model.velocity

    def keeping(x, sigma, text):
        if "ids" not in kept:
            kept["ids"] = torch.arange(D, dtype=torch.float32)
        return plain(x + kept["ids"], sigma, text)

    model.velocity = keeping
    counted = count_velocity_flops(_session(model), "p")
    assert counted == _real_count(_session(model))
    assert type(kept["ids"]) is torch.Tensor
    v = model.velocity(torch.ones(1, TOKENS, D), torch.full((1,), 0.5), {"scale": torch.ones(1)})
    assert type(v) is torch.Tensor and torch.isfinite(v).all()


def test_a_model_that_reads_its_activations_is_counted_on_real_tensors(caplog):
    """A value of an activation read into Python cannot be faked: the count falls back to the real
    forward and backward, says so, and is the real count (not zero)."""
    model = _model("flowrl")
    plain = model.velocity

    def branching(x, sigma, text):
        v = plain(x, sigma, text)
        return v * 2 if bool((v.abs().sum() > 1e9)) else v

    model.velocity = branching
    with caplog.at_level(logging.WARNING, logger="flowrl.train.throughput"):
        counted = count_velocity_flops(_session(model), "p")
    assert counted == _real_count(_session(model))
    assert counted.forward > 0 and counted.forward_backward_with_recompute > counted.forward_backward
    assert "could not be counted on fake tensors" in caplog.text
    assert all(p.grad is None for p in model.denoiser.parameters())


def test_an_offline_objective_is_counted_on_the_conditional_velocity_in_the_attention_context():
    """Throughput.__init__ around the count: an offline objective's conditional velocity (the
    adapter's CFG off), the loop's attention backend; the counts are the real ones."""
    model = _model("torch")
    model.uses_cfg = True
    seen = []
    plain = model.velocity

    def recording(x, sigma, text):
        seen.append(model.uses_cfg)
        return plain(x, sigma, text)

    model.velocity = recording
    loss = SimpleNamespace(data_kind="images", sides=1, K=2)
    recipe = SimpleNamespace(sampler=SimpleNamespace(steps=4), source="<test>",
                             train=SimpleNamespace(attention_backend="auto", iterations=3))
    session = _session(model)
    session.recipe, session.components = recipe, SimpleNamespace(loss=loss)
    run = SimpleNamespace(session=session, geometry=SimpleNamespace(samples_per_process=2, updates_per_rollout=1))
    throughput = Throughput(run, "p", 0)
    assert seen == [False, False] and model.uses_cfg
    model.uses_cfg = False
    expected = _real_count(session)
    assert (throughput.forward, throughput.forward_backward, throughput.forward_backward_with_recompute) == expected
    assert throughput.points == 2 and throughput.constants()["flops"]["offline_points_per_row"] == 2
