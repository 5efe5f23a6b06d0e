"""The CPU attention kernel flowrl gives diffusers' native backend for ring attention
(flowrl.train.cp_attention): its output, log-sum-exp and gradients against attention computed
in float64 by autograd, and a ring's use of it: two halves of the keys and values merged by their
log-sum-exp, and each half's gradients from the merged output, equal attention over all of them;
and the cut of a per-head attention mask to the heads a process holds under Ulysses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flowrl.errors import FlowrlError
from flowrl.train.context_parallel import ring_backend
from flowrl.train.cp_attention import cpu_attention_backward_op, cpu_attention_forward_op

B, S, H, D = 2, 6, 3, 8  # diffusers' layout: [batch, tokens, heads, head dim]


def _qkv(seed=0, s_kv=S):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, S, H, D, generator=g), torch.randn(B, s_kv, H, D, generator=g),
            torch.randn(B, s_kv, H, D, generator=g))


def _reference(q, k, v):
    """softmax(q k^T / sqrt(D)) v and the log-sum-exp of the scaled scores, in float64."""
    scores = torch.einsum("bshd,bthd->bhst", q.double(), k.double()) / D ** 0.5
    out = torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v.double())
    return out, scores.logsumexp(-1).transpose(1, 2)  # [B, S, H]


def test_the_output_and_its_log_sum_exp_are_attentions():
    q, k, v = _qkv()
    out, lse = cpu_attention_forward_op(SimpleNamespace(), q, k, v, return_lse=True, _save_ctx=False)
    ref_out, ref_lse = _reference(q, k, v)
    assert out.shape == (B, S, H, D) and lse.shape == (B, S, H)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    # a smaller scale than the default 1 / sqrt(D)
    out, lse = cpu_attention_forward_op(SimpleNamespace(), q, k, v, scale=0.1, return_lse=True, _save_ctx=False)
    ref_out, ref_lse = _reference(q * (0.1 * D ** 0.5), k, v)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_without_a_log_sum_exp_diffusers_own_kernel_runs():
    # what Ulysses asks for (no log-sum-exp): diffusers' native kernel, forward and backward, so a
    # process that once ran a ring runs every later split as diffusers would
    from diffusers.models import attention_dispatch

    q, k, v = _qkv(5)
    calls = []

    def forward(ctx, *args, **kwargs):
        calls.append("forward")
        return torch.zeros(1)

    def backward(ctx, grad_out, *args):
        calls.append("backward")
        return (grad_out,)

    saved = {n: getattr(attention_dispatch, f"_native_attention_{n}_op") for n in ("forward", "backward")}
    try:
        attention_dispatch._native_attention_forward_op = forward
        attention_dispatch._native_attention_backward_op = backward
        ctx = SimpleNamespace()
        assert torch.equal(cpu_attention_forward_op(ctx, q, k, v), torch.zeros(1))
        assert ctx.flowrl_lse_kernel is False
        grad = torch.ones(1)
        assert cpu_attention_backward_op(ctx, grad) == (grad,)
    finally:
        for n, op in saved.items():
            setattr(attention_dispatch, f"_native_attention_{n}_op", op)
    assert calls == ["forward", "backward"]


def test_the_gradients_are_autograds_of_attention():
    q, k, v = _qkv(1)
    grad_out = torch.randn(B, S, H, D, generator=torch.Generator().manual_seed(2))
    ctx = SimpleNamespace(save_for_backward=lambda *t: setattr(ctx, "saved_tensors", t))
    cpu_attention_forward_op(ctx, q, k, v, return_lse=True)
    grads = cpu_attention_backward_op(ctx, grad_out)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref = torch.autograd.grad(_reference(*leaves)[0], leaves, grad_out.double())
    for got, want in zip(grads, ref):
        assert got.shape == (B, S, H, D)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_a_ring_of_two_halves_merged_by_log_sum_exp_is_whole_attention():
    # what diffusers' ring does with the kernel: each half of the keys and values attended
    # separately, the outputs merged by their log-sum-exp; in the backward each half's gradients
    # from the merged output and log-sum-exp, the query's summed over the halves
    q, k, v = _qkv(3, s_kv=2 * S)
    halves = [(k[:, :S], v[:, :S]), (k[:, S:], v[:, S:])]
    ctx = SimpleNamespace(save_for_backward=lambda *t: setattr(ctx, "saved_tensors", t))
    prev = None
    for i, (kh, vh) in enumerate(halves):
        out, lse = cpu_attention_forward_op(ctx, q, kh, vh, return_lse=True, _save_ctx=i == 0)
        lse = lse.unsqueeze(-1)
        if prev is not None:
            out = prev[0] - torch.sigmoid(lse - prev[1]) * (prev[0] - out)
            lse = prev[1] - torch.nn.functional.logsigmoid(prev[1] - lse)
        prev = (out, lse)
    out, lse = prev[0], prev[1].squeeze(-1)
    ref_out, ref_lse = _reference(q, k, v)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)

    grad_out = torch.randn(B, S, H, D, generator=torch.Generator().manual_seed(4))
    parts = [cpu_attention_backward_op(ctx, grad_out, query=q, key=kh, value=vh, out=out, lse=lse)
             for kh, vh in halves]
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref_q, ref_k, ref_v = torch.autograd.grad(_reference(*leaves)[0], leaves, grad_out.double())
    torch.testing.assert_close((parts[0][0] + parts[1][0]).double(), ref_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([parts[0][1], parts[1][1]], 1).double(), ref_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([parts[0][2], parts[1][2]], 1).double(), ref_v, atol=1e-5, rtol=1e-5)


def test_the_ring_runs_only_with_kernels_that_return_the_log_sum_exp():
    cuda = torch.device("cuda")
    assert ring_backend(cuda, "auto", "half") == "_native_flash"
    assert ring_backend(cuda, "cudnn", "half") == "_native_cudnn"
    with pytest.raises(FlowrlError, match="bf16 or fp16"):
        ring_backend(cuda, "auto", "float32")
    with pytest.raises(FlowrlError, match="'efficient' does not"):
        ring_backend(cuda, "efficient", "half")
    with pytest.raises(FlowrlError, match="not 'mps'"):
        ring_backend(torch.device("mps"), "auto", "half")
    # the ring calls its kernels outside autocast: a float32 model under autocast would hand them
    # float32 queries and keys (normalised in float32) beside bf16 values
    for device in (cuda, torch.device("cpu")):
        with pytest.raises(FlowrlError, match="autocast") as info:
            ring_backend(device, "auto", "autocast")
        assert "fsdp2" in info.value.hint


def test_a_per_head_mask_is_cut_to_the_heads_a_process_attends_with():
    # after Ulysses' all-to-all, process r of a head split of 2 holds heads [2r, 2r + 2) of 4
    from flowrl.train.cp_attention import local_heads_of_mask

    mask = torch.arange(2 * 4 * 1 * 5, dtype=torch.float32).reshape(2, 4, 1, 5)
    config = lambda rank: SimpleNamespace(context_parallel_config=SimpleNamespace(_ulysses_local_rank=rank))  # noqa: E731
    assert torch.equal(local_heads_of_mask(mask, 2, config(1)), mask[:, 2:4])
    assert torch.equal(local_heads_of_mask(mask, 2, config(0)), mask[:, 0:2])
    shared = mask[:, :1]
    assert local_heads_of_mask(shared, 2, config(1)) is shared  # one head axis for all heads
    assert local_heads_of_mask(mask, 4, config(1)) is mask  # no head split
    assert local_heads_of_mask(None, 2, config(1)) is None
