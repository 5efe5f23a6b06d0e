"""``speed/mfu`` counts the model's FLOPs, not the forwards that activation checkpointing recomputes
in the backward (flowrl/train/throughput.py): ``F_fb`` (``velocity_forward_backward``) is the same
with checkpointing on or off, and ``velocity_forward_backward_with_recompute`` (behind
``speed/hfu``) is larger by exactly what was recomputed. FLUX.1's blocks against the hand count:
tests/test_flux_flop_count.py."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from flowrl.train.parallel import checkpoint_blocks
from flowrl.train.throughput import Throughput, VelocityFlops, count_flops, count_velocity_flops, velocity_flops

D, TOKENS, BLOCKS = 16, 5, 3


class Block(nn.Module):
    """``x + gelu(b(gelu(a(x))))``: the last GELU keeps its input, ``b``'s output, for the backward,
    so recomputing the block runs all of its forward."""

    def __init__(self, d: int = D):
        super().__init__()
        self.a, self.b = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + nn.functional.gelu(self.b(nn.functional.gelu(self.a(x))))


class ResidualBlock(Block):
    """``x + b(gelu(a(x)))``: nothing keeps ``b``'s output, so non-reentrant checkpointing's early
    stop recomputes the block only up to ``b``'s input (``a`` and the GELU)."""

    def forward(self, x):
        return x + self.b(nn.functional.gelu(self.a(x)))


class Denoiser(nn.Module):
    def __init__(self, block=Block):
        super().__init__()
        self.embed = nn.Linear(D, D)
        self.blocks = nn.ModuleList(block() for _ in range(BLOCKS))
        self.out = nn.Linear(D, D)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _session(denoiser: nn.Module):
    class Model:
        latent_shape = (TOKENS, D)

        def __init__(self):
            self.denoiser = denoiser

        def velocity(self, x, sigma, text):
            return self.denoiser(x)

    return SimpleNamespace(model=Model(), device=torch.device("cpu"),
                           cache=SimpleNamespace(get=lambda prompts, device: {}))


def _denoiser(block=Block) -> nn.Module:
    torch.manual_seed(0)
    return Denoiser(block)


def _blocks_forward(denoiser: nn.Module, part: str = "") -> int:
    """The blocks' forward FLOPs for one sample (of their submodule ``part``, e.g. ``".a"``), from
    FlopCounterMode's per-module counts of a forward, keyed by module path."""
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        denoiser(torch.zeros(1, TOKENS, D))
    pattern = re.compile(rf"\.blocks\.\d+{re.escape(part)}$")
    return sum(sum(ops.values()) for path, ops in counter.get_flop_counts().items() if pattern.search(path))


def test_without_checkpointing_the_two_counts_are_one():
    counted = count_velocity_flops(_session(_denoiser()), "p")
    linears = 2 * TOKENS * D * D * (2 + BLOCKS * 2 * 4)  # embed, out; a and b of each block (4x wide)
    # the input (data) needs no gradient: the first linear's backward is its weight gradient only
    assert counted == VelocityFlops(linears, 3 * linears - 2 * TOKENS * D * D, 3 * linears - 2 * TOKENS * D * D)


def test_checkpointing_changes_the_count_with_recompute_and_not_the_model_count():
    """flowrl's own checkpointing ([distributed].activation_checkpointing, flowrl.train.parallel):
    ``F_fb`` equal with it on and off; the count with recompute larger by the blocks' forward."""
    plain = count_velocity_flops(_session(_denoiser()), "p")
    denoiser = _denoiser()
    checkpoint_blocks(list(denoiser.blocks))
    checkpointed = count_velocity_flops(_session(denoiser), "p")
    blocks = _blocks_forward(denoiser)
    assert blocks == BLOCKS * 2 * 2 * TOKENS * D * 4 * D  # 3 blocks x (a + b), 10,240 FLOPs each
    assert checkpointed.forward == plain.forward
    assert checkpointed.forward_backward == plain.forward_backward == 197_120
    assert checkpointed.forward_backward_with_recompute == plain.forward_backward + blocks == 258_560
    assert velocity_flops(_session(denoiser), "p") == (plain.forward, plain.forward_backward)
    assert all(p.grad is None for p in denoiser.parameters())
    assert all(b.flowrl_checkpointed for b in denoiser.blocks)  # the count leaves the checkpointing on


def test_what_early_stop_leaves_out_is_not_subtracted():
    """Where non-reentrant checkpointing stops recomputing early (nothing needs ``b``'s output), the
    count with recompute holds only what ran again; the model count is still the plain one."""
    plain = count_velocity_flops(_session(_denoiser(ResidualBlock)), "p")
    denoiser = _denoiser(ResidualBlock)
    checkpoint_blocks(list(denoiser.blocks))
    checkpointed = count_velocity_flops(_session(denoiser), "p")
    assert checkpointed.forward_backward == plain.forward_backward
    assert checkpointed.forward_backward_with_recompute - plain.forward_backward == _blocks_forward(denoiser, ".a")
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        full = count_velocity_flops(_session(denoiser), "p")
    assert full.forward_backward == plain.forward_backward
    assert full.forward_backward_with_recompute - plain.forward_backward == _blocks_forward(denoiser)


@pytest.mark.parametrize("reentrant", [False, True])
def test_torch_checkpoint_called_directly_reentrant_or_not(reentrant):
    """A model that calls torch.utils.checkpoint itself (as diffusers' ``enable_gradient_checkpointing``
    does) and the reentrant variant (which recomputes inside a backward of its own)."""

    class Checkpointed(Denoiser):
        def forward(self, x):
            x = self.embed(x)
            for block in self.blocks:  # as diffusers' models do: only where autograd records
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant) \
                    if torch.is_grad_enabled() else block(x)
            return self.out(x)

    torch.manual_seed(0)
    denoiser = Checkpointed()
    x = torch.zeros(1, TOKENS, D, requires_grad=True)  # reentrant checkpointing wants an input that needs grad
    plain = count_flops(lambda: Denoiser.forward(denoiser, x))
    counted = count_flops(lambda: denoiser(x))
    assert counted.forward_backward == plain.forward_backward == plain.forward_backward_with_recompute
    assert counted.forward_backward_with_recompute == plain.forward_backward + _blocks_forward(_denoiser())


def test_mfu_from_the_model_count_and_hfu_from_the_count_with_recompute():
    throughput = Throughput.__new__(Throughput)
    throughput.samples, throughput.steps, throughput.passes, throughput.peak = 2, 3, 1, 1.0
    throughput.forward, throughput.forward_backward, throughput.forward_backward_with_recompute = 1e12, 3e12, 4e12
    throughput.total, throughput.first, throughput.started = 4, 0, 0.0
    seconds = {"rollout": 4.0, "update": 6.0, "eval": 100.0}
    out = throughput.measure(seconds, torch.ones(2, 2, dtype=torch.bool), [1, 2], 1)
    # rollout 2 x 3 x F_f = 6e12, update 6 transitions x F_fb = 18e12 (with recompute 24e12), 10 s
    assert out["speed/model_tflops_per_second"] == pytest.approx(2.4)
    assert out["speed/mfu"] == pytest.approx(2.4)
    assert out["speed/hfu"] == pytest.approx(3.0)
    throughput.peak = None
    assert "speed/mfu" not in throughput.measure(seconds, torch.ones(2, 2, dtype=torch.bool), [1, 2], 1)


def test_counting_a_compiled_denoiser_leaves_it_to_compile_on_its_next_call():
    """A compiled denoiser counted first still compiles at its next call: the count runs it
    eagerly. A first call under FlopCounterMode once left dynamo never compiling the module, and
    runs with ``[train].compile`` trained uncompiled, silently. (The backend here records the
    graphs it is given instead of generating code.)"""
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    try:
        denoiser = _denoiser()
        denoiser.compile(backend=recording_backend)
        count_velocity_flops(_session(denoiser), "a prompt")
        assert not graphs, "the FLOP count itself must not compile"
        denoiser(torch.zeros(2, TOKENS, D))
        assert graphs, "the denoiser was not compiled after its FLOPs were counted"
    finally:
        torch._dynamo.reset()
