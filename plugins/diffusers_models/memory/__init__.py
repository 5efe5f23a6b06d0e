"""Memory facts of the diffusers models for ``flowrl plan``, without loading any weights: one
module per model family, named as its adapter (plugins/diffusers_models/NAME.py has its facts in
plugins/diffusers_models/memory/NAME.py), each holding the family's published architecture
configs, the activation constants measured for it and its adapter's ``*_memory_spec``.

- :mod:`.common`: what they are built from: pipeline configs (local, built-in, hub), parameter
  counts on the ``meta`` device, activation measurement on small replicas, shared components.
- :mod:`.flux` (FLUX.1), :mod:`.sd3` (SD3.x), :mod:`.qwen_image` (Qwen-Image), :mod:`.flux2`
  (FLUX.2 [klein]), :mod:`.zimage` (Z-Image), :mod:`.editing` (FLUX.1 Kontext, Qwen-Image-Edit),
  :mod:`.wan` (Wan 2.1 / 2.2), :mod:`.ltx` (LTX-Video).

benchmarks/memory_plan.py checks these plans against torch's memory accounting on the same
architecture configs, imported from here.
"""

from __future__ import annotations

from . import editing, flux, flux2, ltx, qwen_image, sd3, wan, zimage
from .common import (
    KNOWN,
    BlockConstants,
    count_parameters,
    denoiser_counts,
    linear_shapes,
    pipeline_configs,
    with_quantization,
)
from .editing import kontext_memory_spec, qwen_image_edit_memory_spec
from .flux import flux_memory_spec, measure_flux_constants
from .flux2 import flux2_klein_memory_spec
from .ltx import ltx_memory_spec
from .qwen_image import qwen_image_memory_spec
from .sd3 import measure_sd3_constants, sd3_memory_spec
from .wan import wan_memory_spec, wan_video_tokens
from .zimage import zimage_memory_spec

# Every family's built-in configs, in this order (the order a plan's error lists them in).
KNOWN.update({hub_id: parts for family in (flux, sd3, qwen_image, flux2, zimage, editing, wan, ltx)
              for hub_id, parts in family.PIPELINES.items()})

__all__ = [
    "KNOWN", "BlockConstants", "count_parameters", "denoiser_counts", "flux2_klein_memory_spec", "flux_memory_spec",
    "kontext_memory_spec", "linear_shapes", "ltx_memory_spec", "measure_flux_constants", "measure_sd3_constants",
    "pipeline_configs", "qwen_image_edit_memory_spec", "qwen_image_memory_spec", "sd3_memory_spec",
    "wan_memory_spec", "wan_video_tokens", "with_quantization", "zimage_memory_spec",
]
