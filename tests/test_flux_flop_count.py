"""FLUX.1-dev's model FLOPs by hand (flowrl.train.flux_flops) against what torch's FlopCounterMode
counts (flowrl.train.throughput's count, behind ``speed/mfu``), on diffusers' own blocks at full
width: built on the ``meta`` device, so no memory is allocated and nothing is computed.

What the counter says, at 512 x 512 (1024 image + 512 text tokens), one sample:

- a double block: forward 377,109,872,640; a single block: 376,940,003,328, both exactly the hand
  count (every linear ``2 m n k`` and attention ``4 L^2 D``; norms, rotary, gates: nothing);
- backward with every weight and the block's inputs requiring grad: exactly 2x the forward with the
  math attention (the meta device's), 2x the linears + 2.5x the attention with a fused kernel
  (a GPU's: torch counts its recomputation of QK^T);
- the transformer at 1 double + 1 single block, embedders and final layer included, forward and
  backward, full fine-tuning, and LoRA with gradient checkpointing: exactly the hand count. Full
  depth (19 + 38) is the same sum with more blocks: 21,502,600,151,040 per forward;
- what the run counts (flowrl.train.throughput.count_flops) with gradient checkpointing on,
  diffusers' or flowrl's: ``F_fb`` (``speed/mfu``) is the hand count WITHOUT the recomputed block
  forwards, ``F_fb`` with recompute (``speed/hfu``) the hand count with them.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from flowrl.train import flux_flops as ff

N, M = 1024, 512  # 512 x 512: (512 / 16)^2 image tokens; max_sequence_length text tokens
D = 3072
ATTENTION_FF = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]  # the flux adapter's default


def _flux():
    from flowrl.compat import ensure_torchvision_importable

    ensure_torchvision_importable()  # before diffusers' models, as the model adapters do
    from diffusers.models.transformers import transformer_flux

    return transformer_flux


def _counted(fn) -> tuple[int, dict[str, int]]:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops(), {str(k): v for k, v in counter.get_flop_counts().get("Global", {}).items()}


def _flash(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
    """SDPA through the fused flash-attention op, as a GPU runs it (on meta: its meta kernel), so
    that the counter applies torch's formula for the fused kernels."""
    assert attn_mask is None and not is_causal and not dropout_p
    return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, scale=scale)[0]


@pytest.fixture
def fused_attention(monkeypatch):
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", _flash)


def _block_inputs():
    flux = _flux()
    with torch.device("meta"):
        x = torch.randn(1, N, D, dtype=torch.bfloat16, requires_grad=True)  # inside the network: inputs need grad
        c = torch.randn(1, M, D, dtype=torch.bfloat16, requires_grad=True)
        temb = torch.randn(1, D, dtype=torch.bfloat16, requires_grad=True)
        rope = flux.FluxPosEmbed(10000, [16, 56, 56])(torch.zeros(N + M, 3))
    return x, c, temb, rope


def _blocks():
    flux = _flux()
    with torch.device("meta"):
        double = flux.FluxTransformerBlock(D, 24, 128).to(torch.bfloat16)
        single = flux.FluxSingleTransformerBlock(D, 24, 128).to(torch.bfloat16)
    return double, single


def test_the_hand_count_has_every_linear_of_each_block():
    double, single = _blocks()
    for block, hand in ((double, ff.double_block_linears(N, M, D)), (single, ff.single_block_linears(N, M, D))):
        built = {n: (m.in_features, m.out_features) for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)}
        assert built == {x.name: (x.fan_in, x.fan_out) for x in hand}


@pytest.mark.parametrize("kind", ["double", "single"])
def test_one_block_forward_and_backward_are_the_hand_count(kind, monkeypatch):
    double, single = _blocks()
    block = double if kind == "double" else single
    x, c, temb, rope = _block_inputs()
    hand = ff.double_block_flops(N, M, D) if kind == "double" else ff.single_block_flops(N, M, D)
    assert hand == {"double": 377_109_872_640, "single": 376_940_003_328}[kind]
    linears = sum(x.flops for x in (ff.double_block_linears if kind == "double" else ff.single_block_linears)(N, M, D))
    attention = ff.attention_flops(N + M, D)
    assert linears + attention == hand and attention == 4 * (N + M) ** 2 * D

    def forward():
        with torch.no_grad():
            block(x, c, temb, image_rotary_emb=rope)

    def forward_backward():
        text, image = block(x, c, temb, image_rotary_emb=rope)
        (text.float().sum() + image.float().sum()).backward()

    total, ops = _counted(forward)
    assert total == hand
    assert ops == {"aten.addmm": linears, "aten.bmm": attention}  # meta runs the math SDPA: two bmm

    total, ops = _counted(forward_backward)
    assert total == 3 * hand  # backward = 2 x forward: input and weight gradients, dS and dV, dQ and dK
    assert ops == {"aten.addmm": linears, "aten.mm": 2 * linears, "aten.bmm": 3 * attention}

    # a GPU's fused kernel: torch counts its backward as 5 matmuls of L^2 d (QK^T recomputed), 2.5x
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", _flash)
    total, ops = _counted(forward_backward)
    assert total == 3 * linears + attention + 10 * (N + M) ** 2 * D
    assert ops["aten._scaled_dot_product_flash_attention_backward"] == 5 * attention // 2


def _transformer(layers=(1, 1)):
    from diffusers import FluxTransformer2DModel

    _flux()
    config = {**ff.FLUX1_DEV, "num_layers": layers[0], "num_single_layers": layers[1]}
    with torch.device("meta"):
        model = FluxTransformer2DModel(**config).to(torch.bfloat16)
        inputs = {"hidden_states": torch.randn(1, N, 64, dtype=torch.bfloat16),
                  "encoder_hidden_states": torch.randn(1, M, 4096, dtype=torch.bfloat16),
                  "pooled_projections": torch.randn(1, 768, dtype=torch.bfloat16),
                  "timestep": torch.full((1,), 0.5), "guidance": torch.full((1,), 3.5),
                  "img_ids": torch.zeros(N, 3), "txt_ids": torch.zeros(M, 3), "return_dict": False}
    return model, inputs, config


def test_the_transformer_at_one_block_each_is_the_hand_count(fused_attention):
    model, inputs, config = _transformer()
    built = {n: (m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert built == {x.name: (x.fan_in, x.fan_out) for x in ff.transformer_linears(N, M, config)}

    def forward():
        with torch.no_grad():
            model(**inputs)

    def forward_backward():
        model(**inputs)[0].float().square().mean().backward()

    hand = ff.flux_flops(N, M, config)  # full fine-tuning, fused attention, no checkpointing
    assert _counted(forward)[0] == hand.forward == 767_842_320_384
    assert _counted(forward_backward)[0] == hand.forward_backward == 2_319_222_571_008
    # the linears that read data (x_embedder, context_embedder, the time embedders' linear_1) have
    # no input gradient: the backward is a little under 2x the linears
    linears = sum(x.flops for x in ff.transformer_linears(N, M, config))
    data = sum(x.flops for x in ff.embedder_linears(N, M, config) if x.name.endswith(("embedder", "linear_1")))
    assert hand.forward_backward - hand.forward == 2 * linears - data + 2 * 10 * (N + M) ** 2 * D

    # full depth: the embedders, the final layer and 19 + 38 blocks
    full = ff.forward_flops(N, M)
    assert full == hand.forward + 18 * ff.double_block_flops(N, M) + 37 * ff.single_block_flops(N, M)
    assert full == 21_502_600_151_040


def test_lora_with_gradient_checkpointing_is_the_hand_count(fused_attention):
    """The flux adapter's training setup (recipes/chunk_grpo_flux_lora.toml): a LoRA of rank 64 on
    attention and feed-forward over a frozen base, gradient checkpointing on, a fused attention."""
    pytest.importorskip("peft")
    from peft import LoraConfig, inject_adapter_in_model

    model, inputs, config = _transformer()
    model.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=64, lora_alpha=128, target_modules=ATTENTION_FF), model)
    model.enable_gradient_checkpointing()
    model.train()

    def forward():
        with torch.no_grad():
            model(**inputs)

    def forward_backward():
        model(**inputs)[0].float().square().mean().backward()

    hand = ff.flux_flops(N, M, config, finetune="lora", lora_rank=64, lora_targets=ATTENTION_FF, checkpointing=True)
    assert _counted(forward)[0] == hand.forward == 782_337_835_008
    total, ops = _counted(forward_backward)
    assert total == hand.forward_backward == 2_332_231_729_152
    # the recomputed block forwards are in the count: a flash-attention forward per block twice
    assert ops["aten._scaled_dot_product_flash_attention"] == 2 * 2 * ff.attention_flops(N + M, D)
    without = ff.flux_flops(N, M, config, finetune="lora", lora_rank=64, lora_targets=ATTENTION_FF)
    assert hand.forward_backward - without.forward_backward == ff.blocks_forward_flops(
        N, M, config, lora_rank=64, lora_targets=ATTENTION_FF)


@pytest.mark.parametrize("checkpointing", ["diffusers", "flowrl"])
def test_the_runs_model_flops_leave_out_what_checkpointing_recomputes(fused_attention, checkpointing):
    """The count behind ``speed/mfu`` and ``speed/hfu`` (flowrl.train.throughput.count_flops) on the
    LoRA setup above, checkpointed by the model (``model.gradient_checkpointing``: diffusers'
    ``enable_gradient_checkpointing``) or by flowrl (``[distributed].activation_checkpointing``:
    flowrl.train.parallel.checkpoint_blocks): the model's ``F_fb`` is the hand count without the
    recomputation, whichever does it; the count with recompute is the hand count with it."""
    pytest.importorskip("peft")
    from peft import LoraConfig, inject_adapter_in_model

    from flowrl.train.parallel import checkpoint_blocks, transformer_blocks
    from flowrl.train.throughput import count_flops

    model, inputs, config = _transformer()
    model.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=64, lora_alpha=128, target_modules=ATTENTION_FF), model)
    if checkpointing == "diffusers":
        model.enable_gradient_checkpointing()
    else:
        blocks = transformer_blocks(model)
        assert len(blocks) == 2
        checkpoint_blocks(blocks)
    model.train()

    counted = count_flops(lambda: model(**inputs)[0])
    lora = {"finetune": "lora", "lora_rank": 64, "lora_targets": ATTENTION_FF}
    model_flops, with_recompute = ff.flux_flops(N, M, config, **lora), ff.flux_flops(N, M, config, checkpointing=True, **lora)
    assert counted.forward == model_flops.forward == with_recompute.forward == 782_337_835_008
    assert counted.forward_backward == model_flops.forward_backward == 1_563_686_338_560
    assert counted.forward_backward_with_recompute == with_recompute.forward_backward == 2_332_231_729_152
    assert counted.forward_backward_with_recompute - counted.forward_backward == ff.blocks_forward_flops(
        N, M, config, lora_rank=64, lora_targets=ATTENTION_FF) == 768_545_390_592


def test_the_hand_count_refuses_what_it_does_not_model():
    with pytest.raises(ValueError, match="to_q"):
        ff.backward_flops(N, M, finetune="lora", lora_rank=64, lora_targets=["ff.net.2"])
    with pytest.raises(ValueError, match="full"):
        ff.backward_flops(N, M, finetune="partial")


def test_the_hand_count_imports_without_diffusers():
    import subprocess
    import sys

    code = "import sys, flowrl.train.flux_flops as f; f.forward_flops(); assert 'diffusers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
