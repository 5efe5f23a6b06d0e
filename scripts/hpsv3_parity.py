#!/usr/bin/env python3
"""Check flowrl's native ``hpsv3`` reward against the upstream ``hpsv3`` package, offline.

The package pins transformers 4.45.2, so it gets its own virtual environment, which this script
builds. Both sides then score the same images with the same tiny random Qwen2-VL (built offline
by flowrl/testing/tiny_models.py, under transformers 4.45 because a directory saved by
transformers 5 does not load in 4.x) and the same HPSv3-layout checkpoint (written by the
package's own model class), and the script prints the largest differences of mu and sigma.

    .venv/bin/python scripts/hpsv3_parity.py                 # builds /tmp/flowrl-hpsv3-venv once
    .venv/bin/python scripts/hpsv3_parity.py --venv DIR --work DIR

Upstream environment (why each pin; measured on CPU-only Linux, Python 3.11):

- hpsv3 1.0.0 installed with --no-deps: it declares deepspeed (compiles at install), opencv,
  timm and qwen-vl-utils, which its inference path never imports; it does import matplotlib and
  tensorboard without declaring them, and fire (train.py) and pandas.
- transformers==4.45.2 (its pin; its model code needs the pre-4.52 Qwen2-VL layout),
  huggingface_hub<1.0 (transformers 4.x), diffusers<=0.39 (later ones need hub >= 1.23),
  trl==0.11.4 (the last trl that supports transformers 4.45).
- torch and torchvision pinned by constraints/cpu.txt; the registry's torchvision is a CUDA
  build, made importable by flowrl/compat.py, loaded by path.

It also serves the package with ``flowrl reward serve hpsv3_upstream`` inside its environment
(flowrl installed there with --no-deps) and scores the same images through the ``http`` reward
from this one: the whole cross-environment path.

Exit status 0 when the largest mu differences (native and http, relative to max |mu|) are below
--tolerance.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
UPSTREAM_PIP = [
    "transformers==4.45.2", "huggingface_hub<1.0", "diffusers<=0.39", "trl==0.11.4", "accelerate", "peft",
    "datasets", "safetensors", "pillow", "numpy", "pyyaml", "omegaconf", "einops", "pandas", "requests",
    "packaging", "tqdm", "matplotlib", "tensorboard", "fire", "rich", "torch", "torchvision",
]
PROMPTS = [
    "a red circle on a white background",
    "cute chibi anime cartoon fox, smiling wagging tail with a small cartoon heart above sticker",
    "a blue square",
    "an astronaut riding a horse on the moon, oil painting",
]


def _load_by_path(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # keeps it alive: the torchvision shim's definitions die with it
    spec.loader.exec_module(module)
    return module


def _images(size: tuple[int, int], seed: int):
    """Smooth random 8-bit images (smooth so that resizing them is meaningful)."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(len(PROMPTS), 3, 12, 12, generator=g)
    fine = F.interpolate(coarse, size=size, mode="bilinear", align_corners=False)
    noise = 0.05 * torch.randn(fine.shape, generator=g)
    return ((fine + noise).clamp(0, 1) * 255).round().to(torch.uint8)


# ----------------------------------------------------------------------------- environment


def build_venv(venv: Path, log, uv: Path | None = None) -> float:
    """Build the upstream environment with pip, or with ``uv`` given pip's configuration as its
    options (scripts/uv_options.py: the same versions, a fraction of the CPU time)."""
    start = time.time()
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    constraints = venv / "constraints.txt"
    constraints.write_text((REPO / "constraints" / "cpu.txt").read_text())
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if uv is not None:
        uv_options = _load_by_path("uv_options", REPO / "scripts" / "uv_options.py")
        pip = [str(uv), "pip", "install", "-q", "--python", str(py),
               *uv_options.uv_options(uv_options.pip_config(str(py)))]
    steps = [
        pip + ["-U", "pip"],
        pip + ["-c", str(constraints), "--no-deps", "hpsv3==1.0.0"],
        pip + ["-c", str(constraints)] + UPSTREAM_PIP,
        # flowrl itself, without its dependencies (they would upgrade transformers), to run
        # `flowrl reward serve hpsv3_upstream` in this environment.
        pip + ["-c", str(constraints), "--no-deps", "-e", str(REPO)],
        pip + ["-c", str(constraints), "pluggy", "typer", "click"],  # flowrl.cli imports click itself
    ]
    for cmd in steps:
        log(f"$ {' '.join(cmd[2:])}")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"upstream environment failed at: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return time.time() - start


# ----------------------------------------------------------------------------- upstream worker


def upstream_worker(work: Path) -> None:
    """Runs inside the upstream environment (transformers 4.45)."""
    _load_by_path("flowrl_compat", REPO / "flowrl" / "compat.py").ensure_torchvision_importable()
    import torch
    import transformers
    import yaml
    from PIL import Image
    from safetensors.torch import save_file

    tiny = _load_by_path("tiny_models", REPO / "flowrl" / "testing" / "tiny_models.py")
    qwen = tiny.build_tiny_qwen2_vl(work / "qwen", seed=0)

    import hpsv3
    from hpsv3.inference import HPSv3RewardInferencer
    from hpsv3.train import create_model_and_processor
    from hpsv3.utils.parser import DataConfig, ModelConfig, PEFTLoraConfig, TrainingConfig, parse_args_with_yaml

    config = yaml.safe_load((Path(hpsv3.__file__).parent / "config" / "HPSv3_7B.yaml").read_text())
    config.update(model_name_or_path=str(qwen), bf16=False, torch_dtype="float32", disable_flash_attn2=True,
                  report_to="none", output_dir=str(work / "out"))
    config.pop("deepspeed", None)
    config_path = work / "HPSv3_tiny.yaml"
    config_path.write_text(yaml.safe_dump(config))

    # A checkpoint in the official layout, written by the package's own model class (its head
    # is randomly initialised; its embeddings resized for <|Reward|>, as in training).
    (data_cfg, train_cfg, model_cfg, lora_cfg), _ = parse_args_with_yaml(
        (DataConfig, TrainingConfig, ModelConfig, PEFTLoraConfig), str(config_path), is_train=False
    )
    torch.manual_seed(1)
    model, _, _ = create_model_and_processor(model_cfg, lora_cfg, train_cfg)
    with torch.no_grad():  # a livelier head than the default init, so differences would show
        for p in model.rm_head.parameters():
            p.mul_(3.0)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(work / "hpsv3_tiny.safetensors"))
    keys = sorted({k.split(".")[0] for k in state})

    inferencer = HPSv3RewardInferencer(config_path=str(config_path), checkpoint_path=str(work / "hpsv3_tiny.safetensors"), device="cpu")
    results = {"transformers": transformers.__version__, "top_level_keys": keys}
    for tag, size in (("448", (448, 448)), ("320x384", (320, 384))):
        images = _images(size, seed=len(tag))
        pil = [Image.fromarray(im.permute(1, 2, 0).numpy()) for im in images]
        with torch.no_grad():
            out = inferencer.reward(pil, PROMPTS).float()
        save_file({"images": images, "out": out.contiguous()}, str(work / f"upstream_{tag}.safetensors"))
        results[tag] = out.tolist()
    (work / "upstream.json").write_text(json.dumps(results, indent=1))


# ----------------------------------------------------------------------------- native side


def native(work: Path) -> dict:
    import transformers
    from safetensors.torch import load_file

    from flowrl_plugins.rewards.hpsv3 import HPSv3, HPSv3Config

    reward = HPSv3(HPSv3Config(checkpoint=str(work / "hpsv3_tiny.safetensors"), base_model=str(work / "qwen"),
                               device="cpu", dtype="float32", batch_size=2))
    report = {"native_transformers": transformers.__version__}
    for tag in ("448", "320x384"):
        data = load_file(str(work / f"upstream_{tag}.safetensors"))
        images = data["images"].float() / 255
        out = reward(images, PROMPTS)
        mu_ref, sigma_ref = data["out"][:, 0], data["out"][:, 1]
        report[tag] = {
            "mu_upstream": mu_ref.tolist(),
            "mu_native": out.scores.tolist(),
            "max_abs_diff_mu": float((out.scores - mu_ref).abs().max()),
            "max_abs_diff_sigma": float((out.extras["hpsv3_sigma"] - sigma_ref).abs().max()),
            "mu_spread": float(mu_ref.max() - mu_ref.min()),
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=Path("/tmp/flowrl-hpsv3-venv"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/flowrl-hpsv3-parity"))
    parser.add_argument("--skip-install", action="store_true", help="reuse --venv as it is")
    parser.add_argument("--uv", type=Path, default=None, help="build the environment with this uv binary")
    parser.add_argument("--tolerance", type=float, default=1e-5,
                        help="largest accepted mu difference relative to max |mu| (448x448 images)")
    parser.add_argument("--worker", choices=["upstream"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.worker == "upstream":
        upstream_worker(args.work)
        return

    def log(msg):
        print(msg, flush=True)

    if not args.skip_install:
        log(f"building the upstream environment in {args.venv} ...")
        log(f"  done in {build_venv(args.venv, log, args.uv):.0f} s")
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    # the environment was just built without bytecode: the first of its two interpreters writes it,
    # the second (the reward server) reads it instead of compiling torch and transformers again
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    log("running the upstream package on the tiny model ...")
    proc = subprocess.run([str(args.venv / "bin" / "python"), __file__, "--worker", "upstream", "--work", str(args.work)],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"upstream run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    upstream = json.loads((args.work / "upstream.json").read_text())
    log(f"  upstream: transformers {upstream['transformers']}, checkpoint top-level keys {upstream['top_level_keys']}")
    log("running flowrl's native scorer ...")
    report = native(args.work)
    report["upstream_transformers"] = upstream["transformers"]
    log("serving the upstream package with `flowrl reward serve hpsv3_upstream` and scoring over http ...")
    report["http"] = over_http(args.venv, args.work, env)
    print(json.dumps(report, indent=1))
    scale = max(1.0, max(abs(x) for x in report["448"]["mu_upstream"]))
    diff = report["448"]["max_abs_diff_mu"]
    print(f"max |mu_native - mu_upstream| = {diff:.3g} (relative to max |mu| {diff / scale:.2g}; 448x448, identical inputs); "
          f"{report['320x384']['max_abs_diff_mu']:.3g} (320x384: torch vs PIL bicubic resize; mu spread "
          f"{report['320x384']['mu_spread']:.3g})")
    print(f"max |mu_http - mu_upstream| = {report['http']['max_abs_diff_mu']:.3g} (upstream package behind "
          f"`flowrl reward serve`, float32 images over http)")
    ok = diff / scale < args.tolerance and report["http"]["max_abs_diff_mu"] / scale < args.tolerance
    sys.exit(0 if ok else 1)


def over_http(venv: Path, work: Path, env: dict) -> dict:
    """The upstream package served by `flowrl reward serve` in its env, scored from this one."""
    import threading

    from safetensors.torch import load_file

    from flowrl_plugins.rewards.http import HttpReward, HttpRewardConfig

    cmd = [str(venv / "bin" / "flowrl"), "reward", "serve", "hpsv3_upstream", "--port", "0",
           "--set", f"checkpoint={json.dumps(str(work / 'hpsv3_tiny.safetensors'))}",
           "--set", f"config={json.dumps(str(work / 'HPSv3_tiny.yaml'))}", "--set", "device=cpu"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = []

        def wait_for_url():  # the package prints its own lines to stdout first
            for text in proc.stdout:
                if text.startswith("serving reward"):
                    line.append(text)
                    return

        reader = threading.Thread(target=wait_for_url, daemon=True)
        reader.start()
        reader.join(600)
        if not line:
            proc.kill()
            raise SystemExit(f"the reward server did not start: {proc.stderr.read()[-3000:]}")
        url = line[0].split(" on ", 1)[1].split()[0]
        reward = HttpReward(HttpRewardConfig(url=url, image_dtype="float32", batch_size=2, timeout=600))
        data = load_file(str(work / "upstream_448.safetensors"))
        out = reward(data["images"].float() / 255, PROMPTS)
        return {"server": reward.remote_name, "mu_http": out.scores.tolist(),
                "max_abs_diff_mu": float((out.scores - data["out"][:, 0]).abs().max())}
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
