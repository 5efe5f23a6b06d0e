#!/usr/bin/env python3
"""Check flowrl's ``video_align`` reward against upstream's own inference code, offline.

Upstream's VideoReward code is a repository, not a package (KwaiVGI/VideoAlign: ``inference.py``,
``train_reward.py``, ``vision_process.py``, ...), written for transformers 4.45. This script runs it
from a checkout you give it (``--upstream``; nothing is downloaded) in the environment
``scripts/hpsv3_parity.py`` builds (transformers 4.45.2, trl 0.11.4, peft, torchvision), built
here if absent. There, the tiny VideoReward checkpoint is written by
``flowrl/testing/tiny_models.py`` (a directory saved by transformers 5 does not load in 4.x), with
two settings of the released model put back (``max_frame_pixels`` 200704 and the base processor's
pixel range, which the tiny builder narrows for fast tests) and ``torch_dtype`` float32; upstream's
``VideoVLMRewardInference`` loads it (its strict ``load_state_dict`` into its PEFT model, its config
dataclasses) and scores four clips of 6 frames of 48 x 64 at 8 fps. Then flowrl's reward scores the
same clips here, and the script prints the largest differences of VQ, MQ, TA and overall.

    .venv/bin/python scripts/video_align_parity.py --upstream /path/to/VideoAlign
    .venv/bin/python scripts/video_align_parity.py --upstream DIR --skip-install --venv DIR --work DIR

Two things of upstream's are replaced, and only these: its video decoder (a stand-in ``decord``
module hands upstream the clips' 8-bit frames, losslessly: upstream's own frame sampling and
resizing run on them) and FlashAttention 2, which needs a GPU (SDPA instead).

Exit status 0 when every difference, relative to the largest |overall|, is below --tolerance.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["a red circle moving left on a blue background", "a blue square", "a {braced} prompt", "an empty canvas"]
FPS = 8.0
KEYS = (("vq", "VQ"), ("mq", "MQ"), ("ta", "TA"), ("overall", "Overall"))


def _load_by_path(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # keeps it alive: the torchvision shim's definitions die with it
    spec.loader.exec_module(module)
    return module


def _clips():
    """Four smooth random 8-bit clips ``[4, 6, 3, 48, 64]``."""
    import torch

    g = torch.Generator().manual_seed(0)
    coarse = torch.rand(4 * 6, 3, 6, 6, generator=g)
    fine = torch.nn.functional.interpolate(coarse, size=(48, 64), mode="bilinear", align_corners=False)
    return (fine.view(4, 6, 3, 48, 64) * 255).round().to(torch.uint8)


def _checkpoint(work: Path) -> Path:
    """The tiny checkpoint, with the released model's frame area and base processor pixel range."""
    tiny = _load_by_path("tiny_models", REPO / "flowrl" / "testing" / "tiny_models.py")
    checkpoint = tiny.build_tiny_video_align(work / "checkpoint", pixels=56 * 56)
    settings = json.loads((checkpoint / "model_config.json").read_text())
    settings["data_config"]["max_frame_pixels"] = 200704
    settings["model_config"]["torch_dtype"] = "float32"
    (checkpoint / "model_config.json").write_text(json.dumps(settings, indent=4))
    path = checkpoint / "qwen2-vl" / "preprocessor_config.json"
    pre = json.loads(path.read_text())
    pre["min_pixels"], pre["max_pixels"] = 3136, 12845056  # Qwen2-VL-2B-Instruct's
    if isinstance(pre.get("size"), dict):
        pre["size"] = {"min_pixels": 3136, "max_pixels": 12845056}
    path.write_text(json.dumps(pre, indent=2))
    return checkpoint


def upstream_worker(work: Path, upstream: Path) -> None:
    """Runs inside the upstream environment (transformers 4.45)."""
    import importlib.machinery
    import types

    _load_by_path("flowrl_compat", REPO / "flowrl" / "compat.py").ensure_torchvision_importable()
    import torch
    import transformers

    checkpoint = _checkpoint(work)
    clips = _clips()
    torch.save(clips, work / "clips.pt")
    frames = {f"file:///clip{i}.mp4": clips[i].permute(0, 2, 3, 1).numpy() for i in range(len(clips))}

    class VideoReader:  # a lossless decoder in decord's interface
        def __init__(self, path):
            self.frames = frames[path]

        def __len__(self):
            return len(self.frames)

        def get_avg_fps(self):
            return FPS

        def get_batch(self, index):
            return types.SimpleNamespace(asnumpy=lambda: self.frames[index])

    decord = types.ModuleType("decord")
    decord.__spec__ = importlib.machinery.ModuleSpec("decord", None)
    decord.VideoReader = VideoReader
    sys.modules["decord"] = decord
    os.environ["FORCE_QWENVL_VIDEO_READER"] = "decord"
    sys.path.insert(0, str(upstream))
    import inference

    build = inference.create_model_and_processor

    def with_sdpa(model_config, peft_lora_config, training_args, **kwargs):
        training_args.disable_flash_attn2 = True  # FlashAttention 2 needs a GPU
        return build(model_config, peft_lora_config, training_args, **kwargs)

    inference.create_model_and_processor = with_sdpa
    inferencer = inference.VideoVLMRewardInference(str(checkpoint), device="cpu", dtype=torch.float32)
    with torch.no_grad():
        rewards = inferencer.reward([f"/clip{i}.mp4" for i in range(len(clips))], PROMPTS, use_norm=True)
    (work / "upstream.json").write_text(json.dumps({"transformers": transformers.__version__, "rewards": rewards}))


def native(work: Path) -> dict:
    import torch

    from flowrl_plugins.rewards.video_align import VideoAlign, VideoAlignConfig

    upstream = json.loads((work / "upstream.json").read_text())
    clips = torch.load(work / "clips.pt").float() / 255
    out = VideoAlign(VideoAlignConfig(checkpoint=str(work / "checkpoint"), fps=FPS, device="cpu"))(clips, PROMPTS)
    report = {"upstream_transformers": upstream["transformers"]}
    for key, name in KEYS:
        ref = torch.tensor([r[name] for r in upstream["rewards"]])
        report[key] = {"upstream": ref.tolist(), "native": out.extras[key].tolist(),
                       "max_abs_diff": float((out.extras[key] - ref).abs().max()), "spread": float(ref.max() - ref.min())}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", type=Path, required=True, help="a checkout of github.com/KwaiVGI/VideoAlign")
    parser.add_argument("--venv", type=Path, default=Path("/tmp/flowrl-hpsv3-venv"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/flowrl-video-align-parity"))
    parser.add_argument("--skip-install", action="store_true", help="reuse --venv as it is")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="largest difference allowed, relative to max |overall|")
    parser.add_argument("--worker", choices=["upstream"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.worker == "upstream":
        upstream_worker(args.work, args.upstream)
        return
    if not (args.upstream / "inference.py").is_file():
        raise SystemExit(f"{args.upstream} is not a checkout of KwaiVGI/VideoAlign (no inference.py)")
    if not args.skip_install and not (args.venv / "bin" / "python").exists():
        print(f"building the upstream environment in {args.venv} (scripts/hpsv3_parity.py's) ...", flush=True)
        _load_by_path("hpsv3_parity", REPO / "scripts" / "hpsv3_parity.py").build_venv(args.venv, print)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    print("running upstream's inference code on the tiny checkpoint ...", flush=True)
    proc = subprocess.run([str(args.venv / "bin" / "python"), __file__, "--worker", "upstream", "--work", str(args.work),
                           "--upstream", str(args.upstream.resolve())], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"upstream run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    print("running flowrl's video_align ...", flush=True)
    report = native(args.work)
    print(json.dumps(report, indent=1))
    scale = max(1.0, max(abs(x) for x in report["overall"]["upstream"]))
    worst = max(report[key]["max_abs_diff"] for key, _ in KEYS)
    print("max |native - upstream|: " + ", ".join(f"{k} {report[k]['max_abs_diff']:.2g} (spread {report[k]['spread']:.3g})"
                                                  for k, _ in KEYS) + f"; relative to max |overall| {worst / scale:.2g}")
    sys.exit(0 if worst / scale < args.tolerance else 1)


if __name__ == "__main__":
    main()
