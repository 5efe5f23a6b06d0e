"""Built-in plugin: real text-to-image models through diffusers: ``flux``, ``sd3``,
``qwen_image``, ``flux2_klein`` and ``zimage``.

The adapters import diffusers and load weights only when a recipe builds them, so listing
plugins or validating a recipe stays fast and works without the weights. See docs/models.md.
"""

from __future__ import annotations

from flowrl import hookimpl

from .flux import FluxConfig
from .flux2 import Flux2KleinConfig
from .qwen_image import QwenImageConfig
from .sd3 import SD3Config
from .zimage import ZImageConfig


def _torchvision_guard() -> None:
    # With `flowrl[clip]` installed on a CPU machine, torchvision may be a CUDA build whose
    # compiled ops fail to load, which breaks diffusers' and transformers' imports; the shim
    # makes it importable and does nothing on a healthy install or without torchvision.
    from flowrl.compat import ensure_torchvision_importable

    ensure_torchvision_importable()


def _flux(config: FluxConfig):
    """FLUX.1 dev / schnell (diffusers FluxPipeline): embedded guidance, timestep = sigma."""
    _torchvision_guard()
    from .flux import FluxModel

    return FluxModel(config)


def _sd3(config: SD3Config):
    """Stable Diffusion 3 / 3.5 (diffusers): true CFG as the policy, timestep = 1000 sigma."""
    _torchvision_guard()
    from .sd3 import SD3Model

    return SD3Model(config)


def _qwen_image(config: QwenImageConfig):
    """Qwen-Image (diffusers QwenImagePipeline): true CFG with norm correction, timestep = sigma."""
    _torchvision_guard()
    from .qwen_image import QwenImageModel

    return QwenImageModel(config)


def _flux2_klein(config: Flux2KleinConfig):
    """FLUX.2 [klein] (diffusers Flux2KleinPipeline): true CFG (base) or none (distilled), timestep = sigma."""
    _torchvision_guard()
    from .flux2 import Flux2KleinModel

    return Flux2KleinModel(config)


def _zimage(config: ZImageConfig):
    """Z-Image / Z-Image-Turbo (diffusers ZImagePipeline): reversed time t = 1 - sigma, negated output."""
    _torchvision_guard()
    from .zimage import ZImageModel

    return ZImageModel(config)


def _flux_memory(config: FluxConfig):
    from .memory import flux_memory_spec

    return flux_memory_spec(config)


def _sd3_memory(config: SD3Config):
    from .memory import sd3_memory_spec

    return sd3_memory_spec(config)


# `flowrl plan` reads these to estimate memory without loading weights.
_flux.memory_spec = _flux_memory
_sd3.memory_spec = _sd3_memory


@hookimpl(trylast=True)
def register_models(register):
    register("flux", _flux, params=FluxConfig)
    register("sd3", _sd3, params=SD3Config)
    register("qwen_image", _qwen_image, params=QwenImageConfig)
    register("flux2_klein", _flux2_klein, params=Flux2KleinConfig)
    register("zimage", _zimage, params=ZImageConfig)
