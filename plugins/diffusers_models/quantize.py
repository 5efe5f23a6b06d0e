"""A quantised frozen base for LoRA: bitsandbytes NF4 or int8 weights in the transformer blocks.

``model.quantize = "nf4"`` (4-bit NormalFloat, QLoRA's format) or ``"int8"`` replaces every
``nn.Linear`` inside the transformer's block stacks (the module lists: ``transformer_blocks.N``,
``single_transformer_blocks.N``, ``layers.N``, refiners; together almost all of the weights) with
bitsandbytes' ``Linear4bit`` / ``Linear8bitLt``, quantised from the loaded weights. Embeddings,
norms and the input and output projections stay in ``dtype``. LoRA then attaches on top (peft
wraps bitsandbytes layers) and trains in float32; the quantised base never changes.

Why bitsandbytes: its CPU backend (0.50) runs NF4 and int8 layers, their backward and peft's LoRA
on a CPU, so the same code path that a 24 GB GPU runs is tested in CI; diffusers' own
``BitsAndBytesConfig`` loading refuses to run without a GPU, so flowrl quantises the loaded
transformer itself with bitsandbytes' layers, on the CPU before it moves to the GPU.

``flowrl plan`` counts the quantised bytes from bitsandbytes' own storage: :func:`storage_model`
quantises small layers and fits ``bytes = a * params + b * out_features + c`` to what they hold
(packed weights, absmax statistics, code tables).
"""

from __future__ import annotations

import functools
import re
import warnings

import torch

from flowrl.errors import MissingDependencyError, require

# bitsandbytes' int8 matmul computes in float16 and warns about the cast on every call.
warnings.filterwarnings("ignore", message="MatMul8bitLt: inputs will be cast")

#: Linear layers inside a module list (a transformer block stack) are quantised.
BLOCK_LINEAR = re.compile(r"(^|\.)\d+\.")
QUANTIZE_HELP = (
    "Quantise the frozen transformer blocks' Linear weights with bitsandbytes (flowrl-diffusion[quant]): 'nf4' (4-bit, "
    "QLoRA's format) or 'int8'; 'none' keeps dtype. LoRA only; the LoRA trains in float32 on top."
)


def bitsandbytes(where: str):
    try:
        return require("bitsandbytes", extra="quant", purpose="a quantised base (model.quantize)")
    except MissingDependencyError as exc:
        exc.where = exc.where or where
        raise


def is_block_linear(name: str) -> bool:
    """Whether a Linear with this qualified name sits in a block stack (``...blocks.3.attn.to_q``)."""
    return bool(BLOCK_LINEAR.search(name))


def quantized_linear(linear: torch.nn.Linear, kind: str, compute_dtype: torch.dtype, bnb) -> torch.nn.Module:
    """A bitsandbytes copy of ``linear`` (quantised on the linear's own device)."""
    device = linear.weight.device
    bias = linear.bias is not None
    if kind == "nf4":
        q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=bias, compute_dtype=compute_dtype,
                              quant_type="nf4", device="meta")
        q.weight = bnb.nn.Params4bit(linear.weight.data.detach().clone(), requires_grad=False, quant_type="nf4")
        # On CPUs with AVX512-bf16, bitsandbytes repacks the weight for a bf16 kernel in no-grad eval
        # calls only: rollout and re-scoring would then compute differently. Keep the one path (the
        # one a GPU runs: dequantise, then matmul in compute_dtype).
        q.support_avx512bf16_for_cpu = False
    else:
        q = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=bias, has_fp16_weights=False,
                                device="meta")
        q.weight = bnb.nn.Int8Params(linear.weight.data.detach().clone(), requires_grad=False, has_fp16_weights=False)
    if bias:
        q.bias = torch.nn.Parameter(linear.bias.data.detach().clone(), requires_grad=False)
    return q.to(device)  # bitsandbytes quantises when the layer moves to a device


def quantize_blocks(module: torch.nn.Module, kind: str, compute_dtype: torch.dtype, where: str) -> int:
    """Replace the block stacks' Linear layers of ``module`` in place; returns how many."""
    bnb = bitsandbytes(where)
    targets = [(n, m) for n, m in module.named_modules() if type(m) is torch.nn.Linear and is_block_linear(n)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, quantized_linear(linear, kind, compute_dtype, bnb))
    return len(targets)


def is_quantized(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds non-floating-point (quantised) weights."""
    return any(not p.is_floating_point() for p in module.parameters())


# ------------------------------------------------------------------------------ planning


def layer_bytes(layer: torch.nn.Module) -> int:
    """Bytes a quantised layer holds: its weight storage plus the quantisation state's tensors."""
    seen: set[int] = set()
    total = 0

    def add(t):
        nonlocal total
        if torch.is_tensor(t) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()

    w = layer.weight
    add(w.data)
    state = getattr(w, "quant_state", None)
    while state is not None:  # NF4: absmax, code (and nested statistics)
        for attr in ("absmax", "code", "offset"):
            add(getattr(state, attr, None))
        state = getattr(state, "state2", None)
    add(getattr(w, "SCB", None))  # int8: one scale per output row
    add(getattr(layer.state, "SCB", None) if hasattr(layer, "state") else None)
    return total


@functools.lru_cache(maxsize=4)
def storage_model(kind: str) -> tuple[float, float, float]:
    """``(a, b, c)`` with ``bytes = a * params + b * out_features + c`` for one quantised Linear
    weight, fitted to bitsandbytes' storage of three small layers quantised on the CPU."""
    bnb = bitsandbytes("model.quantize")
    shapes = [(256, 256), (512, 256), (256, 512)]  # (in, out)
    rows, sizes = [], []
    for fan_in, fan_out in shapes:
        g = torch.Generator().manual_seed(0)
        lin = torch.nn.Linear(fan_in, fan_out, bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(fan_out, fan_in, generator=g) * 0.02)
        rows.append([fan_in * fan_out, fan_out, 1.0])
        sizes.append(float(layer_bytes(quantized_linear(lin, kind, torch.float32, bnb))))
    a, b, c = torch.linalg.solve(torch.tensor(rows, dtype=torch.float64), torch.tensor(sizes, dtype=torch.float64))
    return float(a), float(b), float(c)


def quantized_weight_bytes(shapes: dict[str, tuple[int, int]], kind: str) -> tuple[float, int]:
    """``(bytes, params)`` of the block Linear weights in ``shapes`` (``name -> (in, out)``) once quantised."""
    a, b, c = storage_model(kind)
    params, total = 0, 0.0
    for name, (fan_in, fan_out) in shapes.items():
        if is_block_linear(name):
            params += fan_in * fan_out
            total += a * fan_in * fan_out + b * fan_out + c
    return total, params
