"""video_align (VideoReward, VideoAlign's Qwen2-VL reward model) on a tiny random checkpoint built
offline in the released layout (flowrl.testing.tiny_models.build_tiny_video_align).

The reference is computed by a second route that shares no code with the reward: frames picked
at indices worked out by hand and resized by torchvision on 8-bit frames (what upstream's
qwen-vl-utils copy does), transformers' own Qwen2-VL processor for the video path (rescale,
normalise, patches, placeholder expansion) called with upstream's arguments, the checkpoint loaded
into a peft-wrapped ``Qwen2VLForConditionalGeneration`` (LoRA applied unmerged, as upstream runs
it), transformers' forward, and upstream's pooling of the reward tokens. Parity with upstream's own
code (transformers 4.45, its checkout) is scripts/video_align_parity.py (result in docs/video.md).
"""

from __future__ import annotations

import json

import pytest
import torch
from reward_helpers import assert_invariant

from flowrl.errors import FlowrlError, MissingDependencyError
from flowrl.plugins import get_registry
from flowrl.rewards import score
from flowrl.runlog import read_metrics
from flowrl_plugins.rewards.video_align import (
    REWARD_TOKENS,
    VideoAlign,
    VideoAlignConfig,
    frame_indices,
    merge_peft_state,
    prompt_template,
)

PIXELS = 56 * 56  # frames of 4 x 4 patches: 4 merged tokens per pair of frames
PROMPTS = ["a red circle moving left on a blue background", "a blue square", "a {braced} prompt", "an empty canvas"]


def clips(n: int, frames: int = 6, size: tuple[int, int] = (40, 48), seed: int = 0) -> torch.Tensor:
    """Smooth random clips in [0, 1] (smooth, so that resizing them is meaningful)."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(n * frames, 3, 6, 6, generator=g)
    fine = torch.nn.functional.interpolate(coarse, size=size, mode="bilinear", align_corners=False)
    return fine.view(n, frames, 3, *size)


@pytest.fixture(scope="module")
def tiny_va(tmp_path_factory):
    from flowrl.testing.tiny_models import build_tiny_video_align

    return build_tiny_video_align(tmp_path_factory.mktemp("video_align"), seed=0, pixels=PIXELS)


def build(checkpoint, **keys) -> VideoAlign:
    return VideoAlign(VideoAlignConfig(checkpoint=str(checkpoint), min_pixels=PIXELS, device="cpu", **keys))


@pytest.fixture(scope="module")
def reward(tiny_va):
    return build(tiny_va, fps=8.0, batch_size=4)


def reference(checkpoint, videos: torch.Tensor, prompts: list[str], indices: list[int], size: list[int]) -> torch.Tensor:
    """Upstream's route, on other code: [B, 3] raw VQ, MQ, TA."""
    import torchvision.transforms.functional as TF
    from peft import LoraConfig, get_peft_model
    from transformers import (
        AutoTokenizer,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    settings = json.loads((checkpoint / "model_config.json").read_text())
    base = settings["model_config"]["model_name_or_path"]
    tok = AutoTokenizer.from_pretrained(checkpoint / "checkpoint-8" / "tokenizer", padding_side="right")
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(base), tokenizer=tok,
                                 video_processor=Qwen2VLVideoProcessor(min_pixels=PIXELS, max_pixels=PIXELS),
                                 chat_template=tok.chat_template)
    # qwen-vl-utils: 8-bit frames, resized as 8-bit tensors (bicubic, antialiased), then .float()
    frames = [TF.resize((v[indices] * 255).round().to(torch.uint8), size, interpolation=TF.InterpolationMode.BICUBIC,
                        antialias=True).float() for v in videos]
    chats = [[{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": prompt_template().format(text_prompt=p)}]}]
             for p in prompts]
    batch = processor(text=processor.apply_chat_template(chats, tokenize=False, add_generation_prompt=True), videos=frames,
                      padding=True, return_tensors="pt", videos_kwargs={"do_rescale": True, "do_resize": False,
                                                                        "cap_pixels_per_frame": False})
    config = Qwen2VLConfig.from_pretrained(base)
    config.text_config.vocab_size = len(tok)
    model = Qwen2VLForConditionalGeneration(config).eval()
    state = torch.load(checkpoint / "checkpoint-8" / "model.pth", weights_only=True)
    outputs = state["base_model.model.rm_head.weight"].shape[0]
    model.rm_head = torch.nn.Linear(config.text_config.hidden_size, outputs, bias=False)
    peft = settings["peft_lora_config"]
    targets = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
               and not any(e in n for e in peft["lora_namespan_exclude"])]
    model = get_peft_model(model, LoraConfig(target_modules=targets, r=peft["lora_r"], lora_alpha=peft["lora_alpha"],
                                             task_type="CAUSAL_LM"))
    renamed = {k.replace("base_model.model.model.", "base_model.model.model.language_model.", 1)
               .replace("base_model.model.visual.", "base_model.model.model.visual.", 1): v for k, v in state.items()}
    model.load_state_dict(renamed, strict=True)
    model.eval()
    ids = batch["input_ids"]
    L = ids.shape[1]
    with torch.no_grad():
        hidden = model.base_model.model.model(
            input_ids=ids, attention_mask=batch["attention_mask"], pixel_values_videos=batch["pixel_values_videos"],
            video_grid_thw=batch["video_grid_thw"], position_ids=torch.arange(L).view(1, 1, L).expand(3, len(prompts), L),
        ).last_hidden_state
        logits = model.base_model.model.rm_head(hidden)  # [B, L, outputs]
    special = torch.zeros_like(ids, dtype=torch.bool)
    for token_id in tok.convert_tokens_to_ids(list(REWARD_TOKENS)):
        special |= ids == token_id
    pooled = logits[special].view(len(prompts), 3, outputs)  # the tokens in the order they appear
    return pooled[..., 0] if outputs == 1 else pooled.diagonal(dim1=1, dim2=2)


@pytest.mark.slow
def test_matches_an_independent_computation(reward, tiny_va):
    videos = clips(4, frames=6, size=(40, 48))
    out = score(reward, videos, PROMPTS)
    # 6 frames at 8 fps, 2 sampled per second: 1.5, raised to the minimum 4; linspace(0, 5, 4) = 0, 1.67, 3.33, 5
    # 40 x 48 rounds to 28 x 56, under PIXELS: grown by sqrt(3136 / 1920) to 51.1 x 61.3, rounded up to 56 x 84
    raw = reference(tiny_va, videos, PROMPTS, indices=[0, 2, 3, 5], size=[56, 84])
    stats = json.loads((tiny_va / "model_config.json").read_text())["inference_config"]
    expected = {k: (raw[:, i] - stats[f"{k.upper()}_mean"]) / stats[f"{k.upper()}_std"] for i, k in enumerate(("vq", "mq", "ta"))}
    for key, value in expected.items():
        torch.testing.assert_close(out.extras[key], value, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.scores, expected["vq"] + expected["mq"] + expected["ta"], atol=1e-5, rtol=1e-5)
    assert (raw.max(0).values - raw.min(0).values).min() > 1e-3  # the check can tell clips apart


@pytest.mark.slow
def test_a_three_output_head_reads_output_k_at_token_k(tmp_path):
    """Upstream's training script trains a head of 3 outputs (output_dim 3): token k's k-th."""
    from flowrl.testing.tiny_models import build_tiny_video_align

    checkpoint = build_tiny_video_align(tmp_path / "three", seed=1, pixels=PIXELS, output_dim=3)
    videos = clips(2, frames=4, size=(56, 56), seed=6)
    out = build(checkpoint, normalise=False)(videos, PROMPTS[:2])
    raw = reference(checkpoint, videos, PROMPTS[:2], indices=[0, 1, 2, 3], size=[56, 56])
    torch.testing.assert_close(torch.stack([out.extras[k] for k in ("vq", "mq", "ta")], 1), raw, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_batch_size_and_order_invariant(reward):
    assert_invariant(reward, clips(3, frames=4, size=(56, 56), seed=2), PROMPTS[:3])


@pytest.mark.slow
def test_deterministic_across_calls_and_loads(reward, tiny_va):
    """The same clips give the same scores bit for bit on a second call and after a fresh load. A
    load with another batch size agrees to float rounding, as every reward's does
    (test_batch_size_and_order_invariant): with transformers 5.24.0 the backbone's batches of 1 and
    of 2 differ in the last bits (with the version CI installed before, they agreed bit for bit)."""
    videos = clips(2, seed=3)
    first = reward(videos, PROMPTS[:2]).scores
    assert torch.equal(reward(videos, PROMPTS[:2]).scores, first)
    assert torch.equal(build(tiny_va, fps=8.0, batch_size=4)(videos, PROMPTS[:2]).scores, first)
    torch.testing.assert_close(build(tiny_va, fps=8.0, batch_size=1)(videos, PROMPTS[:2]).scores, first,
                               atol=1e-5, rtol=1e-5)


def test_scores_depend_on_the_prompt_and_the_clip(reward):
    videos = torch.stack([torch.zeros(4, 3, 56, 56), torch.ones(4, 3, 56, 56)])  # a black and a white clip
    same_prompt = reward(videos, [PROMPTS[0]] * 2)
    for key in ("vq", "mq", "ta", "overall"):
        assert abs(float(same_prompt.extras[key][0] - same_prompt.extras[key][1])) > 1e-3, key
    same_clip = reward(videos[:1].expand(2, -1, -1, -1, -1), PROMPTS[:2])
    for key in ("ta", "overall"):
        assert abs(float(same_clip.extras[key][0] - same_clip.extras[key][1])) > 1e-3, key
    # the VQ and MQ tokens come before the prompt in the instruction: under causal attention they
    # never see it, so only TA (and the overall sum) depends on the prompt, upstream as here
    for key in ("vq", "mq"):  # (equal up to the float32 rounding of rows padded differently)
        torch.testing.assert_close(same_clip.extras[key][0], same_clip.extras[key][1], atol=1e-6, rtol=1e-6)


def test_the_score_key_picks_a_dimension_and_normalise_off_gives_raw(reward, tiny_va):
    videos = clips(2, seed=5)
    full = reward(videos, PROMPTS[:2])
    stats = json.loads((tiny_va / "model_config.json").read_text())["inference_config"]
    mq = build(tiny_va, fps=8.0, score="mq")(videos, PROMPTS[:2])
    torch.testing.assert_close(mq.scores, full.extras["mq"])
    raw = build(tiny_va, fps=8.0, normalise=False)(videos, PROMPTS[:2])
    torch.testing.assert_close(raw.extras["ta"], full.extras["ta"] * stats["TA_std"] + stats["TA_mean"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(raw.scores, raw.extras["vq"] + raw.extras["mq"] + raw.extras["ta"])


def test_frame_sampling_by_hand():
    # Wan 2.1 at 16 fps, 2 frames per second read: 81 frames -> 10.1 -> 10; 33 -> 4.1 -> 4
    assert frame_indices(81, fps=16, sample_fps=2) == [0, 9, 18, 27, 36, 44, 53, 62, 71, 80]
    assert frame_indices(33, fps=16, sample_fps=2) == [0, 11, 21, 32]
    assert frame_indices(4, fps=16, sample_fps=2) == [0, 1, 2, 3]  # the embedded video model: all 4
    assert frame_indices(3, fps=16, sample_fps=2) == [0, 2]  # at most F, an even number
    # num_frames rounds to even with Python's round, as upstream: 5 -> round(2.5) * 2 = 4, 7 -> round(3.5) * 2 = 8
    assert frame_indices(81, fps=16, sample_fps=2, num_frames=5) == [0, 27, 53, 80]
    assert len(frame_indices(81, fps=16, sample_fps=2, num_frames=7)) == 8
    with pytest.raises(FlowrlError, match="cannot sample"):
        frame_indices(1, fps=16, sample_fps=2)


def test_merging_peft_state_by_hand():
    g = torch.Generator().manual_seed(0)
    w, a, b = torch.randn(4, 3, generator=g), torch.randn(2, 3, generator=g), torch.randn(4, 2, generator=g)
    state = {"base_model.model.model.layers.0.q.base_layer.weight": w, "base_model.model.model.layers.0.q.base_layer.bias": a[0],
             "base_model.model.model.layers.0.q.lora_A.default.weight": a,
             "base_model.model.model.layers.0.q.lora_B.default.weight": b,
             "base_model.model.rm_head.original_module.weight": w, "base_model.model.rm_head.modules_to_save.default.weight": b,
             "base_model.model.visual.x.weight": a}
    merged = merge_peft_state(state, 2.0)
    assert set(merged) == {"model.layers.0.q.weight", "model.layers.0.q.bias", "rm_head.weight", "visual.x.weight"}
    torch.testing.assert_close(merged["model.layers.0.q.weight"], w + 2.0 * b @ a)
    assert torch.equal(merged["rm_head.weight"], b) and torch.equal(merged["model.layers.0.q.bias"], a[0])
    with pytest.raises(FlowrlError, match="unsupported LoRA"):
        merge_peft_state({"m.lora_embedding_A.default": a}, 1.0)


def test_registered_conformant_and_clear_errors(reward, tiny_va, tmp_path):
    from flowrl.testing.components import check_component

    assert get_registry().get("reward", "video_align").params is VideoAlignConfig
    assert check_component("reward", reward) == ["Reward", "ScoresClips"]
    with pytest.raises(FlowrlError, match="scores clips"):
        reward(torch.rand(2, 3, 56, 56), PROMPTS[:2])
    with pytest.raises(FlowrlError, match="holds a reward token"):
        reward(clips(1), ["a cat <|TA_reward|>"])
    with pytest.raises(FlowrlError, match="no model_config.json"):
        build(tmp_path)
    with pytest.raises(FlowrlError, match="no checkpoint-3"):
        build(tiny_va, checkpoint_step=3)
    with pytest.raises(ValueError, match="exclusive"):
        VideoAlignConfig(sample_fps=2.0, num_frames=8)
    with pytest.raises(FlowrlError, match="below min_pixels"):
        VideoAlign(VideoAlignConfig(checkpoint=str(tiny_va), device="cpu"))  # upstream's 100352 floor > the tiny 3136


def test_without_transformers_the_message_names_the_extra(monkeypatch, tiny_va):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(MissingDependencyError) as err:
        build(tiny_va)
    assert 'pip install "flowrl-diffusion[rewards]"' in err.value.format()


def test_a_video_run_trains_on_it(tiny_va, tmp_path):
    """One iteration of the embedded video model (the video quickstart, shrunk) with the tiny
    VideoReward as its reward: clips reach it whole, through the rollout, the update and the
    evaluation."""
    import os
    from pathlib import Path

    from rich.console import Console

    from flowrl.recipe import load_recipe
    from flowrl.train import train

    repo = Path(__file__).resolve().parents[2]
    text = (repo / "recipes" / "quickstart_video.toml").read_text()
    text = text[: text.index("[[rewards]]")].replace(
        'source = "prompts/video_shapes.csv"', f"source = {json.dumps(str(repo / 'recipes' / 'prompts' / 'video_shapes.csv'))}")
    text += (f'[[rewards]]\nuse = "video_align"\ncheckpoint = {json.dumps(str(tiny_va))}\nmin_pixels = {PIXELS}\n'
             f'device = "cpu"\n\n[[rewards]]\nuse = "video_verifier"\nweight = 0.0\n')
    (tmp_path / "tiny_video_align.toml").write_text(text)
    recipe = load_recipe(tmp_path / "tiny_video_align.toml", [
        f"run.output_dir={json.dumps(str(tmp_path / 'run'))}", "train.iterations=1", "train.prompts_per_iteration=1",
        "train.group_size=4", "train.micro_batch_size=4", "sampler.steps=5", "sampler.sde_window=[0,2]", "chunker.size=2",
        "prompts.num_eval=1", "prompts.eval_seeds=2", "log.progress=false", "log.eval_every=1", "log.image_every=1"])
    run_dir = train(recipe, console=Console(file=open(os.devnull, "w")))
    rows = read_metrics(run_dir)
    row = next(r for r in rows if "reward/video_align/mean" in r)
    assert row["on_policy/max_abs_log_ratio"] < 1e-6
    assert row["reward/video_align/std"] > 0  # four clips of a group, four scores
    for key in ("vq", "mq", "ta", "overall"):
        assert f"reward/video_align/{key}/mean" in row
    assert any("eval/video_align/mean" in r and "eval/video_verifier/mean" in r for r in rows)
