"""Built-in plugin: real text-to-image models through diffusers: ``flux``, ``sd3``,
``qwen_image``, ``flux2_klein`` and ``zimage``; text-to-video with ``wan`` (Wan 2.1), ``wan22``
(Wan 2.2 TI2V-5B), ``wan22_a14b`` and ``wan22_a14b_i2v`` (Wan 2.2 A14B, two experts) and ``ltx``
(LTX-Video); image editing with ``flux_kontext`` and ``qwen_image_edit``.

The adapters import diffusers and load weights only when a recipe builds them, so listing
plugins or validating a recipe stays fast and works without the weights. See docs/models.md.
"""

from __future__ import annotations

from flowrl import hookimpl

from .editing import FluxKontextModel, QwenImageEditModel
from .flux import FluxModel
from .flux2 import Flux2KleinModel
from .ltx import LTXModel
from .qwen_image import QwenImageModel
from .sd3 import SD3Model
from .wan import Wan22Model, WanModel
from .wan_a14b import Wan22A14BI2VModel, Wan22A14BModel
from .zimage import ZImageModel


@hookimpl(trylast=True)
def register_models(register):
    register("flux", FluxModel, help="FLUX.1 dev / schnell (diffusers FluxPipeline): embedded guidance, timestep = sigma.")
    register("sd3", SD3Model, help="Stable Diffusion 3 / 3.5 (diffusers): true CFG as the policy, timestep = 1000 sigma.")
    register("qwen_image", QwenImageModel,
             help="Qwen-Image (diffusers QwenImagePipeline): true CFG with norm correction, timestep = sigma.")
    register("flux2_klein", Flux2KleinModel,
             help="FLUX.2 [klein] (diffusers Flux2KleinPipeline): true CFG (base) or none (distilled), timestep = sigma.")
    register("flux_kontext", FluxKontextModel,
             help="FLUX.1 Kontext (diffusers FluxKontextPipeline): image editing, the condition image's tokens appended.")
    register("qwen_image_edit", QwenImageEditModel,
             help="Qwen-Image-Edit (diffusers QwenImageEditPipeline): image editing, condition in the text encoder and "
                  "as appended tokens, true CFG.")
    register("zimage", ZImageModel,
             help="Z-Image / Z-Image-Turbo (diffusers ZImagePipeline): reversed time t = 1 - sigma, negated output.")
    register("wan", WanModel,
             help="Wan 2.1 text-to-video (diffusers WanPipeline): clips [B, F, 3, H, W], true CFG, timestep = 1000 sigma.")
    register("wan22", Wan22Model,
             help="Wan 2.2 TI2V-5B text-to-video (diffusers WanPipeline): 48-channel latents at 1/16, per-token "
                  "timesteps = 1000 sigma, true CFG.")
    register("wan22_a14b", Wan22A14BModel,
             help="Wan 2.2 T2V A14B (diffusers WanPipeline with transformer_2): a high- and a low-noise expert switched "
                  "at boundary_ratio, true CFG per expert, timestep = 1000 sigma.")
    register("wan22_a14b_i2v", Wan22A14BI2VModel,
             help="Wan 2.2 I2V A14B (diffusers WanImageToVideoPipeline with transformer_2): the two experts of "
                  "wan22_a14b, the condition image's latents and mask as extra input channels.")
    register("ltx", LTXModel,
             help="LTX-Video text-to-video (diffusers LTXPipeline): packed video tokens, timestep = 1000 sigma, true CFG, "
                  "the pipeline's dynamic-shift schedule.")
