"""``hpsv3_upstream``: the upstream ``hpsv3`` package as a flowrl reward, to serve over HTTP.

The package pins transformers 4.45.2, so it lives in an environment of its own. Install flowrl
there too (``pip install --no-deps -e /path/to/flowrl pluggy typer rich``) and run::

    flowrl reward serve hpsv3_upstream --set device=cuda:1 --port 8700

then train with ``use = "http"``, ``url = "http://127.0.0.1:8700"`` from the main environment.
``scripts/hpsv3_parity.py`` builds such an environment and exercises exactly this path.
Images are handed to the package as 8-bit PIL images (what it expects); the score is ``mu``,
``sigma`` is the extra ``hpsv3_sigma``.
"""

from __future__ import annotations

import dataclasses

import torch

from flowrl.compat import ensure_torchvision_importable
from flowrl.config import param
from flowrl.errors import MissingDependencyError
from flowrl.interfaces import RewardOutput

from .common import check_images, resolve_device


@dataclasses.dataclass(frozen=True)
class HPSv3UpstreamConfig:
    checkpoint: str = param("", "HPSv3 checkpoint file; empty = the package downloads MizzenAI/HPSv3.", path=True)
    config: str = param("", "The package's YAML config; empty = its own HPSv3_7B.yaml (bf16, Qwen2-VL-7B).")
    device: str = param("auto", "'auto' (CUDA if available, else CPU), 'cpu', 'cuda', 'cuda:N'.")
    batch_size: int = param(8, "Images per call to the package.", min=1)


class HPSv3Upstream:
    """The upstream hpsv3 package (transformers 4.45 env only); serve it with `flowrl reward serve`."""

    Config = HPSv3UpstreamConfig

    def __init__(self, config: HPSv3UpstreamConfig):
        ensure_torchvision_importable()  # the package imports torchvision
        try:
            from hpsv3 import HPSv3RewardInferencer
        except ImportError as exc:
            raise MissingDependencyError(
                f"the 'hpsv3_upstream' reward needs the 'hpsv3' package, which is not importable ({exc})",
                hint="install it in a separate environment (it pins transformers==4.45.2); the working pins "
                "are in scripts/hpsv3_parity.py. In the main environment use the native 'hpsv3' reward, "
                "or 'http' pointed at `flowrl reward serve hpsv3_upstream`",
            ) from exc
        self.name = "hpsv3_upstream"
        self.batch_size = config.batch_size
        self.inferencer = HPSv3RewardInferencer(
            config_path=config.config or None, checkpoint_path=config.checkpoint or None,
            device=str(resolve_device(config.device)),
        )

    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        from PIL import Image

        prompts = list(prompts)
        check_images(images, prompts, self.name)
        pixels = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        outs = []
        with torch.no_grad():
            for start in range(0, len(prompts), self.batch_size):
                pil = [Image.fromarray(a) for a in pixels[start : start + self.batch_size]]
                outs.append(self.inferencer.reward(pil, prompts[start : start + self.batch_size]).float().cpu())
        out = torch.cat(outs)
        return RewardOutput(scores=out[:, 0], extras={"hpsv3_sigma": out[:, 1]})
