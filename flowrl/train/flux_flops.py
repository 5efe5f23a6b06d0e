"""FLUX.1's model FLOPs counted by hand: the check on what :mod:`flowrl.train.throughput` counts.

Pure arithmetic (no torch, no diffusers): every matrix multiplication of diffusers'
``FluxTransformer2DModel`` (``diffusers.models.transformers.transformer_flux``, checked against
diffusers 0.42) for one sample, counted as :class:`torch.utils.flop_counter.FlopCounterMode`
counts them: ``2 m n k`` per ``[m, k] @ [k, n]``; norms, activations, gates, residuals, rotary
embeddings and the sinusoidal timestep features cost nothing (no matmul). Notation: ``N`` image
tokens, ``M`` text tokens, ``L = N + M``, width ``D = heads x head_dim`` (FLUX.1-dev: 24 x 128 =
3072), MLP ratio ``r`` (4), ``C`` latent channels in and out (64), ``J`` text-embedding width
(T5: 4096), ``P`` pooled width (CLIP: 768), 256 sinusoidal timestep channels.

One forward, per sample::

    double block (FluxTransformerBlock), image and text streams side by side
      adaLN modulations  norm1.linear, norm1_context.linear: 2 x 2*D*6D          =  24 D^2
      Q, K, V            to_q/k/v (N rows), add_q/k/v_proj (M rows): 3 x 2*L*D*D =   6 L D^2
      attention          QK^T and AV over the joint sequence: H x 2 x 2*L*L*d    =   4 L^2 D
      out projections    to_out.0 (N rows), to_add_out (M rows): 2*L*D*D         =   2 L D^2
      MLPs               ff, ff_context: D -> rD -> D: 2 x 2*L*D*rD              =  4r L D^2
                                                          total  24 D^2 + (8 + 4r) L D^2 + 4 L^2 D
    single block (FluxSingleTransformerBlock), one stream of L tokens
      adaLN modulation   norm.linear: 2*D*3D                                     =   6 D^2
      Q, K, V            to_q/k/v: 3 x 2*L*D*D                                   =   6 L D^2
      MLP in             proj_mlp: 2*L*D*rD                                      =  2r L D^2
      attention          as above                                                =   4 L^2 D
      out                proj_out over [attention, MLP]: 2*L*(1 + r)D*D          = 2(1+r) L D^2
                                                          total   6 D^2 + (8 + 4r) L D^2 + 4 L^2 D
    embedders  x_embedder 2*N*C*D, context_embedder 2*M*J*D, time_text_embed:
               timestep and guidance 2 x 2*(256*D + D*D), pooled text 2*(P*D + D*D)
    final      norm_out.linear 2*D*2D, proj_out 2*N*D*C
    transformer = embedders + n_double * double + n_single * single + final

At 512 x 512 (N = 1024, M = 512) with FLUX.1-dev's configuration: a double block is
377,109,872,640 FLOPs, a single block 376,940,003,328 (the same per token; the double block's two
adaLN linears cost 18 D^2 more), the embedders 13,352,042,496 (the T5 projection is 12.9e9 of it),
the final layer 440,401,920, the whole transformer 21,502,600,151,040 (21.5 TFLOP) per sample and
forward: 19 double + 38 single blocks are 99.94% of it.

A LoRA of rank ``R`` on a linear ``fan_in -> fan_out`` over ``T`` rows adds ``2*T*fan_in*R``
(A) + ``2*T*R*fan_out`` (B) per forward (peft's scaling and dropout are no matmuls).

Backward, as the counter counts it (:func:`backward_flops`):

- a linear costs its forward again for the input gradient, if its input requires grad, and
  again for the weight gradient, if its weight does. Full fine-tuning: 2x, except the linears
  whose inputs are data (``x_embedder``, ``context_embedder``, the three ``linear_1`` of
  ``time_text_embed``): 1x. LoRA over a frozen base: the base 1x (input gradient only) and the
  adapter 2x where the input requires grad; where it does not, the base 0, the adapter's A 1x
  (weight gradient only) and its B 2x. With LoRA only the block inputs downstream of an adapter require grad: nothing before the
  first double block, no adaLN modulation (they read the time embedding), not ``norm_out``, not
  the first double block's six Q/K/V projections (the first single block's Q/K/V and
  ``proj_mlp`` if there is no double block; this needs LoRA on ``to_q``, ``to_k`` and ``to_v``,
  as both of the FLUX adapter's presets have);
- attention: PyTorch's formula for the fused kernels (flash, memory-efficient and cuDNN SDPA,
  what a GPU runs) is 5 matmuls of ``L^2 d``: 10 L^2 D per block, 2.5x the forward (it counts
  recomputing QK^T); the math SDPA (``bmm``, on the meta device) gives 8 L^2 D (2x); CPU SDPA
  (``_scaled_dot_product_flash_attention_for_cpu``) has no formula at all, so on a CPU the counter
  misses attention in forward and backward (``attention="none"``);
- gradient checkpointing (the FLUX adapter's ``gradient_checkpointing``) runs every block's
  forward once more during backward (:func:`blocks_forward_flops`; in FLUX.1's blocks
  non-reentrant checkpointing's early stop leaves none of it out). FlopCounterMode counts it;
  :func:`backward_flops` adds it with ``checkpointing=True``. That is the hardware count
  (``velocity_forward_backward_with_recompute`` of :mod:`flowrl.train.throughput`, behind
  ``speed/hfu``); the model FLOPs (``velocity_forward_backward``, behind ``speed/mfu``) leave it
  out: ``checkpointing=False``, whether or not the run checkpoints. At 512 x 512 with the LoRA of
  recipes/chunk_grpo_flux_lora.toml (rank 64, attention and feed-forward): ``F_fb``
  46,408,108,867,584 without the recomputation, 68,241,185,046,528 with it (21.8 TFLOP more).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

#: black-forest-labs/FLUX.1-dev, transformer/config.json (the keys that set FLOPs).
FLUX1_DEV = {
    "patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768, "guidance_embeds": True,
}
#: FLUX.1's blocks' MLP width over the model width (fixed in diffusers' code, not in the config).
MLP_RATIO = 4
#: channels of the sinusoidal timestep (and guidance) features fed to ``time_text_embed``.
TIME_CHANNELS = 256

Attention = Literal["fused", "math", "none"]


@dataclass(frozen=True)
class Linear:
    """One ``nn.Linear`` applied to ``rows`` rows per sample: ``2 * rows * fan_in * fan_out`` FLOPs."""

    name: str  # its module path in FluxTransformer2DModel (in a block: relative to the block)
    rows: int
    fan_in: int
    fan_out: int

    @property
    def flops(self) -> int:
        return 2 * self.rows * self.fan_in * self.fan_out


def attention_flops(tokens: int, width: int) -> int:
    """Joint attention of ``tokens`` over ``width = heads x head_dim``: QK^T and AV, ``4 L^2 D``."""
    return 4 * tokens * tokens * width


def double_block_linears(image_tokens: int, text_tokens: int, dim: int = 3072,
                         mlp_ratio: int = MLP_RATIO) -> list[Linear]:
    """The linears of one ``FluxTransformerBlock``, in forward order."""
    n, m, hidden = image_tokens, text_tokens, mlp_ratio * dim
    return [
        Linear("norm1.linear", 1, dim, 6 * dim), Linear("norm1_context.linear", 1, dim, 6 * dim),
        *(Linear(f"attn.to_{x}", n, dim, dim) for x in "qkv"),
        *(Linear(f"attn.add_{x}_proj", m, dim, dim) for x in "qkv"),
        Linear("attn.to_out.0", n, dim, dim), Linear("attn.to_add_out", m, dim, dim),
        Linear("ff.net.0.proj", n, dim, hidden), Linear("ff.net.2", n, hidden, dim),
        Linear("ff_context.net.0.proj", m, dim, hidden), Linear("ff_context.net.2", m, hidden, dim),
    ]


def single_block_linears(image_tokens: int, text_tokens: int, dim: int = 3072,
                         mlp_ratio: int = MLP_RATIO) -> list[Linear]:
    """The linears of one ``FluxSingleTransformerBlock``, in forward order."""
    tokens, hidden = image_tokens + text_tokens, mlp_ratio * dim
    return [
        Linear("norm.linear", 1, dim, 3 * dim), Linear("proj_mlp", tokens, dim, hidden),
        *(Linear(f"attn.to_{x}", tokens, dim, dim) for x in "qkv"),
        Linear("proj_out", tokens, dim + hidden, dim),
    ]


def double_block_flops(image_tokens: int = 1024, text_tokens: int = 512, dim: int = 3072,
                       mlp_ratio: int = MLP_RATIO) -> int:
    """One forward of a double-stream block: ``24 D^2 + (8 + 4r) L D^2 + 4 L^2 D``."""
    linears = double_block_linears(image_tokens, text_tokens, dim, mlp_ratio)
    return sum(x.flops for x in linears) + attention_flops(image_tokens + text_tokens, dim)


def single_block_flops(image_tokens: int = 1024, text_tokens: int = 512, dim: int = 3072,
                       mlp_ratio: int = MLP_RATIO) -> int:
    """One forward of a single-stream block: ``6 D^2 + (8 + 4r) L D^2 + 4 L^2 D``."""
    linears = single_block_linears(image_tokens, text_tokens, dim, mlp_ratio)
    return sum(x.flops for x in linears) + attention_flops(image_tokens + text_tokens, dim)


def _width(config: dict) -> int:
    return int(config["num_attention_heads"]) * int(config["attention_head_dim"])


def embedder_linears(image_tokens: int, text_tokens: int, config: dict = FLUX1_DEV) -> list[Linear]:
    """The linears before the blocks: patches, text, and the time (+ guidance) + pooled embedding."""
    d, p = _width(config), int(config.get("patch_size", 1))
    timed = ["timestep_embedder", *(["guidance_embedder"] if config.get("guidance_embeds") else [])]
    return [
        Linear("x_embedder", image_tokens, int(config["in_channels"]) * p * p, d),
        *(Linear(f"time_text_embed.{e}.linear_{i}", 1, TIME_CHANNELS if i == 1 else d, d)
          for e in timed for i in (1, 2)),
        Linear("time_text_embed.text_embedder.linear_1", 1, int(config["pooled_projection_dim"]), d),
        Linear("time_text_embed.text_embedder.linear_2", 1, d, d),
        Linear("context_embedder", text_tokens, int(config["joint_attention_dim"]), d),
    ]


def final_linears(image_tokens: int, config: dict = FLUX1_DEV) -> list[Linear]:
    """The linears after the blocks: the last adaLN modulation and the projection to latents."""
    d, p = _width(config), int(config.get("patch_size", 1))
    out = int(config.get("out_channels") or config["in_channels"]) * p * p
    return [Linear("norm_out.linear", 1, d, 2 * d), Linear("proj_out", image_tokens, d, out)]


def transformer_linears(image_tokens: int, text_tokens: int, config: dict = FLUX1_DEV) -> list[Linear]:
    """Every linear of ``FluxTransformer2DModel(**config)``, named as ``named_modules`` names them."""
    d = _width(config)
    double = double_block_linears(image_tokens, text_tokens, d)
    single = single_block_linears(image_tokens, text_tokens, d)
    return [
        *embedder_linears(image_tokens, text_tokens, config),
        *(Linear(f"transformer_blocks.{i}.{x.name}", x.rows, x.fan_in, x.fan_out)
          for i in range(int(config["num_layers"])) for x in double),
        *(Linear(f"single_transformer_blocks.{i}.{x.name}", x.rows, x.fan_in, x.fan_out)
          for i in range(int(config["num_single_layers"])) for x in single),
        *final_linears(image_tokens, config),
    ]


def lora_targeted(name: str, targets) -> bool:
    """Whether peft's ``target_modules`` (a list of names) picks the module ``name``: the name
    itself or a suffix after a dot."""
    return any(name == t or name.endswith("." + t) for t in targets)


def _lora_flops(x: Linear, rank: int) -> tuple[int, int]:
    """The forward FLOPs of a LoRA's A (``fan_in -> rank``) and B (``rank -> fan_out``) on ``x``."""
    return 2 * x.rows * x.fan_in * rank, 2 * x.rows * rank * x.fan_out


def _blocks(config: dict) -> int:
    return int(config["num_layers"]) + int(config["num_single_layers"])


def _attention(image_tokens: int, text_tokens: int, config: dict, attention: Attention) -> int:
    """Forward attention FLOPs of all blocks (none where the counter does not see it)."""
    if attention == "none":
        return 0
    return _blocks(config) * attention_flops(image_tokens + text_tokens, _width(config))


def forward_flops(image_tokens: int = 1024, text_tokens: int = 512, config: dict = FLUX1_DEV, *,
                  lora_rank: int = 0, lora_targets=(), attention: Attention = "fused") -> int:
    """One forward of the whole transformer for one sample (see the module docstring), with a
    LoRA of ``lora_rank`` on ``lora_targets`` if given. ``attention="none"``: without attention,
    as the counter sees a CPU run."""
    total = 0
    for x in transformer_linears(image_tokens, text_tokens, config):
        total += x.flops
        if lora_rank and lora_targeted(x.name, lora_targets):
            total += sum(_lora_flops(x, lora_rank))
    return total + _attention(image_tokens, text_tokens, config, attention)


def _input_needs_grad(x: Linear, finetune: str, first_block: str) -> bool:
    """Whether the input of linear ``x`` requires grad (see the module docstring); ``first_block``:
    the first block's module path."""
    data = x.name in ("x_embedder", "context_embedder") or (x.name.startswith("time_text_embed.")
                                                            and x.name.endswith("linear_1"))
    if finetune == "full":
        return not data
    modulation = x.name.endswith((".norm1.linear", ".norm1_context.linear", ".norm.linear")) or x.name == "norm_out.linear"
    first_qkv = x.name.startswith(first_block) and x.name.endswith(("to_q", "to_k", "to_v", "_proj", "proj_mlp"))
    return not (data or x.name.startswith("time_text_embed.") or modulation or first_qkv)


def backward_flops(image_tokens: int = 1024, text_tokens: int = 512, config: dict = FLUX1_DEV, *,
                   finetune: Literal["full", "lora"] = "full", lora_rank: int = 0, lora_targets=(),
                   attention: Attention = "fused", checkpointing: bool = False) -> int:
    """The backward of one forward of :func:`forward_flops` for one sample, as FlopCounterMode
    counts it (the rules are in the module docstring): ``finetune="full"``: every parameter
    trains; ``"lora"``: only a LoRA of ``lora_rank`` on ``lora_targets`` does. ``attention``: the
    SDPA kernel (``"fused"`` 2.5x its forward, ``"math"`` 2x, ``"none"`` unseen);
    ``checkpointing``: with every block's forward recomputed (hardware FLOPs; the model FLOPs,
    what MFU counts, are those without)."""
    if finetune == "lora":
        if not lora_rank or not all(lora_targeted(f"attn.to_{q}", lora_targets) for q in "qkv"):
            raise ValueError("the hand count of a LoRA backward needs a rank and LoRA on to_q, to_k and to_v")
    elif finetune != "full":
        raise ValueError(f"finetune is 'full' or 'lora', not {finetune!r}")
    first_block = "transformer_blocks.0." if int(config["num_layers"]) else "single_transformer_blocks.0."
    total = 0
    for x in transformer_linears(image_tokens, text_tokens, config):
        grad_in = _input_needs_grad(x, finetune, first_block)
        lora = finetune == "lora" and lora_targeted(x.name, lora_targets)
        if finetune == "full":
            total += x.flops * (2 if grad_in else 1)
        else:
            total += x.flops if grad_in else 0
        if lora:
            a, b = _lora_flops(x, lora_rank)
            total += a * (2 if grad_in else 1) + 2 * b
    per_block = {"fused": 10, "math": 8, "none": 0}[attention]
    tokens, d = image_tokens + text_tokens, _width(config)
    total += _blocks(config) * per_block * tokens * tokens * d
    if checkpointing:
        total += blocks_forward_flops(image_tokens, text_tokens, config, lora_rank=lora_rank if finetune == "lora" else 0,
                                      lora_targets=lora_targets, attention=attention)
    return total


def blocks_forward_flops(image_tokens: int, text_tokens: int, config: dict = FLUX1_DEV, *,
                         lora_rank: int = 0, lora_targets=(), attention: Attention = "fused") -> int:
    """The forward of the blocks alone (what gradient checkpointing recomputes)."""
    total = 0
    for x in transformer_linears(image_tokens, text_tokens, config):
        if x.name.startswith(("transformer_blocks.", "single_transformer_blocks.")):
            total += x.flops
            if lora_rank and lora_targeted(x.name, lora_targets):
                total += sum(_lora_flops(x, lora_rank))
    return total + _attention(image_tokens, text_tokens, config, attention)


class FluxFlops(NamedTuple):
    """Model FLOPs of one velocity evaluation for one sample: forward, and forward + backward."""

    forward: int
    forward_backward: int


def flux_flops(image_tokens: int = 1024, text_tokens: int = 512, config: dict = FLUX1_DEV, *,
               finetune: Literal["full", "lora"] = "full", lora_rank: int = 0, lora_targets=(),
               attention: Attention = "fused", checkpointing: bool = False) -> FluxFlops:
    """``(F_f, F_fb)`` by hand, the pair :func:`flowrl.train.throughput.velocity_flops` counts;
    with ``checkpointing=True`` its ``F_fb`` is the count with the recomputation
    (``VelocityFlops.forward_backward_with_recompute``)."""
    lora = {"lora_rank": lora_rank, "lora_targets": lora_targets} if finetune == "lora" else {}
    forward = forward_flops(image_tokens, text_tokens, config, attention=attention, **lora)
    return FluxFlops(forward, forward + backward_flops(
        image_tokens, text_tokens, config, finetune=finetune, lora_rank=lora_rank, lora_targets=lora_targets,
        attention=attention, checkpointing=checkpointing))
