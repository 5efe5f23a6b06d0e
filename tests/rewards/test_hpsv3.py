"""hpsv3 (native Qwen2-VL + HPSv3 head) on a tiny random Qwen2-VL built offline.

The checkpoint is written in the official layout (pre-4.52 keys ``model.*``, ``visual.*``,
``lm_head.*``, ``rm_head.*``, embeddings grown by one row for <|Reward|>). The reference is
computed independently with transformers' own Qwen2-VL forward (which scatters the image
embeddings itself), its PIL image processor and a hand-written head. Parity with the upstream
package itself is scripts/hpsv3_parity.py (its own environment; result in docs/rewards.md).
"""

from __future__ import annotations

import pytest
import torch
from reward_helpers import PROMPTS, assert_invariant, fixed_images, to_pil

from flowrl.errors import FlowrlError
from flowrl.rewards import score
from flowrl.plugins import get_registry
from flowrl_plugins.rewards.hpsv3 import REWARD_TOKEN, HPSv3, HPSv3Config, patchify, prompt_template, smart_resize

PIXELS = 56 * 56  # 2 x 2 merged image tokens: small and fast


def to_official_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        if key.startswith("model.language_model."):
            key = "model." + key.removeprefix("model.language_model.")
        elif key.startswith("model.visual."):
            key = "visual." + key.removeprefix("model.visual.")
        out[key] = value.contiguous()
    return out


@pytest.fixture(scope="module")
def tiny_hps(tmp_path_factory):
    """(base model dir, official-layout checkpoint path, new-layout state dict, head state)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    from flowrl.testing.tiny_models import build_tiny_qwen2_vl, tiny_hpsv3_head

    directory = tmp_path_factory.mktemp("hpsv3")
    base = build_tiny_qwen2_vl(directory / "qwen", seed=0, min_pixels=PIXELS, max_pixels=PIXELS)
    # transformers 5 writes the legacy layout to disk; its in-memory names are the 4.52+ ones.
    state = {k: v.clone() for k, v in Qwen2VLForConditionalGeneration.from_pretrained(base).state_dict().items()}
    tok = AutoTokenizer.from_pretrained(base)
    tok.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
    g = torch.Generator().manual_seed(5)
    for key in ("model.language_model.embed_tokens.weight", "lm_head.weight"):
        old = state[key]
        state[key] = torch.cat([old, 0.5 * torch.randn(len(tok) - old.shape[0], old.shape[1], generator=g)])
    head = tiny_hpsv3_head(64, seed=1)
    state.update(head)
    ckpt = directory / "HPSv3.safetensors"
    save_file(to_official_layout(state), str(ckpt))
    return base, ckpt, state, head


@pytest.fixture(scope="module")
def reward(tiny_hps):
    base, ckpt, _, _ = tiny_hps
    return HPSv3(HPSv3Config(checkpoint=str(ckpt), base_model=str(base), pixels=PIXELS, batch_size=4, device="cpu"))


def reference(base, state, head, images, prompts):
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    config = Qwen2VLConfig.from_pretrained(base)
    config.text_config.vocab_size = state["lm_head.weight"].shape[0]
    model = Qwen2VLForConditionalGeneration(config).eval()
    model.load_state_dict({k: v for k, v in state.items() if not k.startswith("rm_head.")})
    tok = AutoTokenizer.from_pretrained(base)
    tok.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
    proc = Qwen2VLImageProcessorPil.from_pretrained(base)
    vis = proc(images=to_pil(images), return_tensors="pt")
    n_tokens = int(vis["image_grid_thw"][0].prod()) // 4
    texts = []
    for p in prompts:
        text = tok.apply_chat_template([{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": prompt_template().format(text_prompt=p)}]}],
            tokenize=False, add_generation_prompt=True)
        texts.append(text.replace("<|image_pad|>", "<|image_pad|>" * n_tokens))
    batch = tok(texts, padding=True, return_tensors="pt")
    L = batch["input_ids"].shape[1]
    with torch.no_grad():
        hidden = model.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], pixel_values=vis["pixel_values"],
            image_grid_thw=vis["image_grid_thw"], position_ids=torch.arange(L).view(1, 1, L).expand(3, len(prompts), L),
        ).last_hidden_state
        at = (batch["input_ids"] == tok.convert_tokens_to_ids(REWARD_TOKEN)).float().argmax(1)
        x = hidden[torch.arange(len(prompts)), at]
        x = torch.relu(x @ head["rm_head.0.weight"].T + head["rm_head.0.bias"])
        x = torch.relu(x @ head["rm_head.3.weight"].T + head["rm_head.3.bias"])
        return x @ head["rm_head.5.weight"].T + head["rm_head.5.bias"]


@pytest.mark.slow
def test_matches_independent_computation(reward, tiny_hps):
    base, _, state, head = tiny_hps
    images = fixed_images(6, size=(56, 56))
    out = score(reward, images, PROMPTS)
    ref = reference(base, state, head, images, PROMPTS)
    torch.testing.assert_close(out.scores, ref[:, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.extras["hpsv3_sigma"], ref[:, 1], atol=1e-5, rtol=1e-5)
    assert (ref[:, 0].max() - ref[:, 0].min()) > 1e-3  # the check can tell images apart


def test_batch_size_and_order_invariant(reward):
    assert_invariant(reward, fixed_images(4, size=(56, 56), seed=2), PROMPTS[:4])


def test_new_layout_and_pt_checkpoints_load_the_same(reward, tiny_hps, tmp_path):
    base, _, state, _ = tiny_hps
    torch.save({"model": dict(state)}, tmp_path / "wrapped.pt")  # 4.52+ key layout, training-style wrapper
    other = HPSv3(HPSv3Config(checkpoint=str(tmp_path / "wrapped.pt"), base_model=str(base), pixels=PIXELS, device="cpu"))
    images = fixed_images(2, size=(40, 64), seed=3)  # resized to the 3136-pixel grid
    torch.testing.assert_close(other(images, PROMPTS[:2]).scores, reward(images, PROMPTS[:2]).scores)


def test_smart_resize_by_hand():
    assert smart_resize(448, 448, 28, 200704, 200704) == (448, 448)
    assert smart_resize(32, 32, 28, 200704, 200704) == (448, 448)  # grown: 32 * 14 = 448
    assert smart_resize(1024, 1024, 28, 200704, 200704) == (448, 448)  # shrunk
    # 320 x 384: rounded 308 x 392 is too small; grown by sqrt(200704 / 122880) = 1.278 and
    # rounded up to multiples of 28: ceil(14.61) * 28 = 420, ceil(17.53) * 28 = 504.
    assert smart_resize(320, 384, 28, 200704, 200704) == (420, 504)


def test_patchify_order_by_hand():
    # 1 channel-less check: a 3 x 28 x 28 image with patch 14, merge 2, temporal 2 -> 4 patches
    # ordered (0,0), (0,1), (1,0), (1,1) inside the one 2 x 2 window; each row is
    # [channel][time][14 x 14 pixels].
    img = torch.arange(3 * 28 * 28, dtype=torch.float32).view(3, 28, 28)
    patches, grid = patchify(img, 14, 2, 2)
    assert grid == [1, 2, 2] and patches.shape == (4, 3 * 2 * 14 * 14)
    for i, (r, c) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        block = img[:, r * 14 : (r + 1) * 14, c * 14 : (c + 1) * 14]
        expected = torch.stack([block, block], dim=1).reshape(-1)
        assert torch.equal(patches[i], expected)


def test_registered_and_clear_errors(tiny_hps, tmp_path):
    from safetensors.torch import save_file

    base, ckpt, state, _ = tiny_hps
    comp = get_registry().get("reward", "hpsv3")
    assert comp.params is HPSv3Config
    bad = dict(to_official_layout({k: v for k, v in state.items() if not k.startswith("rm_head.")}))
    save_file(bad, str(tmp_path / "nohead.safetensors"))
    with pytest.raises(FlowrlError, match="no reward head"):
        HPSv3(HPSv3Config(checkpoint=str(tmp_path / "nohead.safetensors"), base_model=str(base)))
    save_file({"foo.weight": torch.zeros(2)}, str(tmp_path / "odd.safetensors"))
    with pytest.raises(FlowrlError, match="unexpected keys"):
        HPSv3(HPSv3Config(checkpoint=str(tmp_path / "odd.safetensors"), base_model=str(base)))
    with pytest.raises(FlowrlError, match="no HPSv3.safetensors"):
        HPSv3(HPSv3Config(checkpoint=str(tmp_path), base_model=str(base)))


def test_upstream_adapter_without_the_package_names_the_fix():
    import importlib.util

    from flowrl.errors import MissingDependencyError
    from flowrl_plugins.rewards.hpsv3_upstream import HPSv3Upstream, HPSv3UpstreamConfig

    if importlib.util.find_spec("hpsv3") is not None:
        pytest.skip("the upstream package is installed here")
    with pytest.raises(MissingDependencyError, match="separate environment"):
        HPSv3Upstream(HPSv3UpstreamConfig())
