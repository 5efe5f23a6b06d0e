"""What flowrl gives diffusers' attention under context parallelism (diffusers 0.42,
``diffusers.models.attention_dispatch``), installed by :func:`flowrl.train.context_parallel
.apply_context_parallel` when a run splits its sequences:

- :func:`install_cpu_ring_kernel`: a ring merges its partial attentions by their log-sum-exp, and
  diffusers' native kernel, the one a CPU has, returns none; torch's CPU flash kernel does. Only
  the calls that ask for a log-sum-exp reach it; every other call runs diffusers' own kernel.
- :func:`install_head_sharded_masks`: a mask with a head axis (LTX-Video's text mask, expanded to
  every head) cut to the heads each process holds after Ulysses' all-to-all (diffusers issue 14316).
- :func:`install_ulysses_cross_attention_backward`: Ulysses' backward with the keys' and values'
  gradients shaped by their own sequence length, not the queries' (LTX-Video's cross-attention).

Each replaces a module global or a method of diffusers, is idempotent, and computes what
diffusers computes wherever diffusers was right (self-attention, unmasked or head-shared masks).
"""

from __future__ import annotations

import torch


def install_head_sharded_masks() -> None:
    """Give diffusers' native attention, under Ulysses, the mask of the heads each process attends
    with. A model whose attention mask has a head axis (LTX-Video's text mask, expanded to every
    head) reaches diffusers' Ulysses attention (0.42) with all heads of the mask, while the process
    holds 1 / C of the heads after the all-to-all: the attention then broadcasts to the wrong shape
    and fails (diffusers issue 14316). A mask shared by all heads (a head axis of 1) is passed as
    it is. Idempotent; wraps whichever native kernel is installed."""
    from diffusers.models import attention_dispatch

    kernel = attention_dispatch._native_attention_forward_op
    if getattr(kernel, "flowrl_shards_mask_heads", False):
        return

    def forward_op(ctx, query, key, value, attn_mask=None, *args, _parallel_config=None, **kwargs):
        attn_mask = local_heads_of_mask(attn_mask, query.shape[2], _parallel_config)
        return kernel(ctx, query, key, value, attn_mask, *args, _parallel_config=_parallel_config, **kwargs)

    forward_op.flowrl_shards_mask_heads = True
    attention_dispatch._native_attention_forward_op = forward_op


def install_ulysses_cross_attention_backward() -> None:
    """Make diffusers' Ulysses attention (0.42) differentiable where the keys are not as long as
    the queries. Its backward sends the keys' and values' gradients back to their processes shaped
    with the queries' sequence length, which is right for self-attention only; LTX-Video's
    cross-attention (video queries, text keys, both split) fails there. The backward below is
    diffusers' own with each gradient reshaped by its own length. Idempotent."""
    from diffusers.models import attention_dispatch

    ulysses = attention_dispatch.TemplatedUlyssesAttention
    if getattr(ulysses.backward, "flowrl_kv_length", False):
        return
    all_to_all = attention_dispatch._all_to_all_single

    def backward(ctx, grad_out, *args):
        config = ctx._parallel_config.context_parallel_config
        world, group = config.ulysses_degree, config._ulysses_mesh.get_group()
        batch, tokens, heads, dim = grad_out.shape
        local_heads = heads // world
        # the output's gradient to the head split, as in the forward
        grad_out = grad_out.reshape(batch, tokens, world, local_heads, dim).permute(2, 1, 0, 3, 4).contiguous()
        grad_out = all_to_all(grad_out, group).flatten(0, 1).permute(1, 0, 2, 3).contiguous()
        grads = ctx.backward_op(ctx, grad_out)[:3]
        # and each input's gradient back to the token split, by its own sequence's length
        back = []
        for grad in grads:
            grad = grad.reshape(batch, world, grad.shape[1] // world, local_heads, dim).permute(1, 3, 0, 2, 4)
            back.append(all_to_all(grad.contiguous(), group).flatten(0, 1).permute(1, 2, 0, 3).contiguous())
        return (*back, *[None] * 9)  # no gradient for the mask, the options and the kernels

    backward.flowrl_kv_length = True
    ulysses.backward = staticmethod(backward)


def local_heads_of_mask(mask: torch.Tensor | None, heads: int, parallel_config) -> torch.Tensor | None:
    """The heads of a ``[B, H, S_q, S_kv]`` mask that this process attends with, ``heads`` of them:
    after Ulysses' all-to-all, process r of the head split holds heads ``[r * heads, (r + 1) * heads)``."""
    if mask is None or mask.ndim != 4 or mask.shape[1] in (1, heads) or parallel_config is None:
        return mask
    rank = parallel_config.context_parallel_config._ulysses_local_rank
    return mask[:, rank * heads:(rank + 1) * heads]


#: diffusers' own native kernels, kept when :func:`install_cpu_ring_kernel` puts flowrl's in their place
_DIFFUSERS_NATIVE: dict[str, object] = {}


def _diffusers_native(kind: str):
    from diffusers.models import attention_dispatch

    return _DIFFUSERS_NATIVE.get(kind) or getattr(attention_dispatch, f"_native_attention_{kind}_op")


def install_cpu_ring_kernel() -> None:
    """Give diffusers' native attention backend, under context parallelism, torch's CPU flash
    kernel where a ring asks for the log-sum-exp it merges by (diffusers' own native kernel
    refuses to). Every other call, Ulysses' among them, still runs diffusers' own kernel, so the
    installation changes nothing for a later run of the same process. Idempotent."""
    from diffusers.models import attention_dispatch

    if attention_dispatch._native_attention_backward_op is cpu_attention_backward_op:
        return
    _DIFFUSERS_NATIVE.update(forward=attention_dispatch._native_attention_forward_op,
                             backward=attention_dispatch._native_attention_backward_op)
    attention_dispatch._native_attention_forward_op = cpu_attention_forward_op
    attention_dispatch._native_attention_backward_op = cpu_attention_backward_op


def cpu_attention_forward_op(ctx, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                             scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False,
                             _save_ctx: bool = True, _parallel_config=None):
    """Attention over ``[B, S, H, D]`` tensors (diffusers' layout). With ``return_lse`` (a ring)
    by torch's CPU flash kernel: the output and the log-sum-exp of each query's scores, ``[B, S,
    H]``; otherwise by diffusers' own native kernel."""
    if not return_lse:
        if _save_ctx:
            ctx.flowrl_lse_kernel = False
        return _diffusers_native("forward")(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale,
                                            enable_gqa, return_lse, _save_ctx=_save_ctx,
                                            _parallel_config=_parallel_config)
    if attn_mask is not None or dropout_p or enable_gqa:
        raise ValueError("the CPU ring kernel takes no attention mask, dropout or grouped heads")
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
    out, lse = out.transpose(1, 2).contiguous(), lse.transpose(1, 2).contiguous()
    if _save_ctx:
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.is_causal, ctx.scale, ctx.flowrl_lse_kernel = is_causal, scale, True
    return out, lse


def cpu_attention_backward_op(ctx, grad_out: torch.Tensor, *args, query: torch.Tensor | None = None,
                              key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                              out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
    """The gradients of :func:`cpu_attention_forward_op` for ``grad_out``. A ring passes each step's
    keys and values and the merged output and log-sum-exp; otherwise the saved ones are used."""
    if not ctx.flowrl_lse_kernel:
        return _diffusers_native("backward")(ctx, grad_out, *args)
    saved = dict(zip(("query", "key", "value", "out", "lse"), ctx.saved_tensors))
    given = {"query": query, "key": key, "value": value, "out": out, "lse": lse}
    # the kernel's layout: [B, H, S, D] and [B, H, S]
    q, k, v, o, logsumexp = (
        (given[n] if given[n] is not None else saved[n]).transpose(1, 2).contiguous()
        for n in ("query", "key", "value", "out", "lse"))
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out.transpose(1, 2).contiguous(), q, k, v, o, logsumexp, 0.0, ctx.is_causal, scale=ctx.scale)
    return tuple(g.transpose(1, 2) for g in grads)
